"""``python -m landscape``: toy figures, loss planes and loss lines from the command line.

Bad input (a missing checkpoint, an unknown option value, a non-positive step count ...) gets one
sentence on stderr and exit code 2, before any output file is written; outputs are written
atomically, so an interrupted run leaves no half-written file.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

from landscape._directions import NORMALIZATIONS
from landscape._settings import PATHS, DirectionSpec, Grid
from landscape._surfaces import METRIC_NAMES
from sharpness import MEASURES
from sharpness.cli import (
    OneLineParser,
    add_model_arguments,
    add_quiet_argument,
    check_outputs,
    command_inputs,
    launched_processes,
    load_problem,
    memory_budget,
    run_command,
    start_objective,
)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def _file_stem(text: str) -> str:
    """A file name without folders: outputs go into ``--out`` only."""
    if not text or text in (".", "..") or "/" in text or "\\" in text or "\0" in text:
        raise argparse.ArgumentTypeError(f"must be a file name without folders, got {text!r}")
    return text


def _formats(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", nargs="+", default=["png"], choices=("png", "pdf", "svg"),
                        help="figure formats (default: png); an interactive .html is always written")  # fmt: skip
    parser.add_argument("--html-js", default="directory", choices=("directory", "inline", "cdn"),
                        help="where the .html pages get plotly.js: directory (default: one plotly.min.js that "
                             "the pages share, written once into the folder that holds --out when that is the "
                             "current folder or inside it, so runs side by side share it, else into --out; works "
                             "offline, keep the folders together), inline (in every page, about 4.7 MB each) or "
                             "cdn (from the internet)")  # fmt: skip


def _grid_arguments(parser: argparse.ArgumentParser, name: str | None, name_help: str) -> None:
    """``--span``, ``--seed``, ``--memory-mib``, ``--log``, ``--name``, ``--out``, ``--format``, ``--compile``,
    ``--quiet``:
    shared by every command that evaluates a grid around a checkpoint."""
    parser.add_argument("--span", type=_positive_float, default=1.0,
                        help="grid half-width in direction units (default 1)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the directions (default 0)")
    parser.add_argument("--memory-mib", type=_positive_int, default=None,
                        help="memory budget for activations, in MiB per process (default: 2048 on the CPU, half "
                             "the free memory of a GPU)")  # fmt: skip
    scale = parser.add_mutually_exclusive_group()
    scale.add_argument("--log", action="store_true",
                       help="logarithmic loss scale in the figures (default: logarithmic where the losses span "
                            "more than two decades, linear otherwise)")  # fmt: skip
    scale.add_argument("--linear", action="store_true", help="linear loss scale in the figures")
    parser.add_argument("--name", type=_file_stem, default=name,
                        help=f"file name stem of the outputs (default: {name_help})")  # fmt: skip
    parser.add_argument("--out", required=True, help="output folder (created if missing)")
    _formats(parser)
    parser.add_argument("--compile", action="store_true",
                        help="compile each grid point's forward pass with torch.compile (needs a C++ compiler on "
                             "the CPU): the first point takes seconds to tens of seconds more, the others less; "
                             "worth it on large grids of convolutional or residual networks")  # fmt: skip
    add_quiet_argument(parser)


def _problem_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--checkpoint``, ``--data``, ``--loss``, ``--dtype``: defined once, by ``python -m sharpness``."""
    # A grid evaluates thousands of points: landscapes default to float32 (the curvature CLI to float64).
    add_model_arguments(parser, default_dtype="float32")


def _model_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """The arguments of ``plane`` and ``line`` (``command``), which differ only in what ``line`` adds."""
    _problem_arguments(parser)
    parser.add_argument("--directions", default="random", choices=("random", "eigen", "invariant-eigen", "gspace"),
                        help="random Gaussian directions (default), top Euclidean Hessian eigenvectors, top "
                             "Riemannian Hessian eigenvectors (see --metric and --path), or random directions in "
                             "G-space: the plane w(v + a d1 + b d2) in basis-path coordinates v, the same for every "
                             "rescaling of the network (chains of Linear/Conv layers and ReLU-like activations "
                             "only)")  # fmt: skip
    parser.add_argument("--norm", choices=NORMALIZATIONS,
                        help="normalization of random directions: per output row/filter (Li et al. 2018, default), "
                             "per tensor (layer), per entry by |theta| (element: rescaling-invariant planes), or "
                             "none; G-space directions: per coordinate (element, default), per coordinate block "
                             "(layer) or none")  # fmt: skip
    parser.add_argument("--bias", default="zero", choices=("zero", "keep"),
                        help="random directions in 1-D tensors (biases): zero them (default) or keep them, "
                             "normalized as a whole")  # fmt: skip
    parser.add_argument("--roots", default="fixed", choices=("fixed", "free"),
                        help="G-space directions only: hold the chain-root coordinates (one per hidden unit's "
                             "predecessor chain, setting the chain value by which w(v) divides) at the model's "
                             "values (fixed, default: no chain value changes, no singular line at any span), or "
                             "move them too (free: the loss spikes where a chain value crosses 0; the array "
                             "'crossed' counts the crossings)")  # fmt: skip
    metrics = [name for name, m in MEASURES.items() if m.tangent_eigenvectors and m.invariant_under]
    parser.add_argument("--metric", default="node", choices=metrics,
                        help="quotient metric of invariant-eigen directions (default: node): node and layer are "
                             "invariant under positive rescalings only (ReLU units, layer scales: ReLU, residual and "
                             "BatchNorm networks), symmetry for any network whose symmetry group is found, under all "
                             "of it (transformers: attention heads' GL factors, normalization scales, ReLU units); "
                             "the output records what the directions are invariant under on the network")  # fmt: skip
    parser.add_argument("--path", default="straight", choices=PATHS,
                        help="how invariant-eigen directions are followed: straight lines theta + a ξ1 + b ξ2 "
                             "(default; the first-order retraction) or geodesics Exp_theta(a ξ1 + b ξ2) of the "
                             "quotient metric (node, layer: exact exponential map; symmetry: the geodesic equation "
                             "integrated by RK4, steps and error estimate in the caption; either way the surface of "
                             "a transformed copy of the network is the same)")  # fmt: skip
    with_to = ", or 41 with --to" if command == "line" else ""
    parser.add_argument("--steps", type=_positive_int,
                        help=f"grid points per axis (default 51{with_to}; the grid always contains the "
                             "model itself)")  # fmt: skip
    _grid_arguments(parser, name=None, name_help=command)


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m landscape", description="Loss landscapes of neural networks: the "
                             "thesis's toy ReLU networks, and lines and planes around checkpoints (MLPs, CNNs, "
                             "ResNets, transformers).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    toy = sub.add_parser(
        "toy", help="the thesis's toy networks (Figs. 1.5, 1.6, 4.9) and their G-space charts",
        description="Draw a toy figure of the thesis: 1.5 (networks a and b), 1.6 (invariant lines and gradient "
        "arrows), 4.9 (fixed-weight planes, reading (a): w1 set to each value), gspace-1.5 and gspace-4.9 (the "
        "same networks in G-space). Writes a figure, an interactive HTML and one .npz (+ .json) per surface.",
    )  # fmt: skip
    toy.add_argument("--figure", required=True, choices=("1.5", "1.6", "4.9", "gspace-1.5", "gspace-4.9"),
                     help="which figure (see the description above)")  # fmt: skip
    toy.add_argument("--fixed", type=float, nargs="+",
                     help="values w1 > 0 of the fixed weight (4.9 and gspace-4.9 only; default 1 6 10)")  # fmt: skip
    toy.add_argument("--source", choices=("text", "code"),
                     help="for 1.5, 1.6, 4.9 and gspace-4.9: 'code' draws what the thesis's plotting code draws, "
                          "on its windows and grids (1.5: [-10, 10] and sin(w1 w2) on [0, 10]^2; 1.6: the lines "
                          "w1 w2 = 2 pi k and arrows -grad(0.1 w1 w2) on a grid of spacing 2 over [0, 10]^2; 4.9: "
                          "sin(w1 + w2) and sin(0.3 w3 (w1 + w2)) on [0, 10]^2), 'text' the text's definitions, "
                          "with the choices it leaves open stated in the caption; default code")  # fmt: skip
    toy.add_argument("--steps", type=_positive_int,
                     help="grid points per axis (default: the thesis code's 200 with --source code, 201 with "
                          "--source text)")  # fmt: skip
    toy.add_argument("--out", required=True, help="output folder (created if missing)")
    _formats(toy)
    toy.add_argument("--quiet", action="store_true", help="print nothing")
    plane = sub.add_parser(
        "plane", help="loss on a plane around a checkpoint",
        description="Whole-data-set loss and accuracy on the plane theta + a d1 + b d2 around a checkpoint (with "
        "--path geodesic: Exp_theta(a d1 + b d2); with --directions gspace: w(v + a d1 + b d2) in G-space). Writes "
        "NAME.npz + NAME.json (redraw without recomputing), NAME.png (contour + 3D) and NAME.html (interactive).",
    )  # fmt: skip
    _model_arguments(plane, "plane")
    line = sub.add_parser(
        "line", help="loss along a line, or along the segment to a second checkpoint",
        description="Whole-data-set loss and accuracy along theta + t d: one direction as for 'plane', or with --to "
        "the segment to a second checkpoint (t = 0: --checkpoint, t = 1: --to; default range -0.5 to 1.5).",
    )  # fmt: skip
    _model_arguments(line, "line")
    line.add_argument("--to", help="second checkpoint: draw the segment from --checkpoint to it")
    line.add_argument("--range", nargs=2, type=float, metavar=("LO", "HI"),
                      help="coordinate range (default: -span to span, or -0.5 to 1.5 with --to)")  # fmt: skip
    fixed = sub.add_parser(
        "fixed", help="loss planes in the free weights under different fixed-weight values",
        description="For each value b, the whole-data-set loss on a random plane in the free-weight subspace around "
        "(a) the checkpoint with every fixed weight set to b (the function changes) or (b) the checkpoint rescaled "
        "function-preservingly so every fixed weight is +-b (same function, another gauge). Writes NAME.png (one "
        "panel per value, shared color scale), NAME.html and NAME_bVALUE.npz + .json per value (array 'fixed').",
    )  # fmt: skip
    _fixed_arguments(fixed)
    demo = sub.add_parser(
        "demo", help="the built-in demo: sharpness and loss surfaces of small- vs full-batch minima on digits",
        description="The built-in demo (no download): scikit-learn digits, MLP 64-128-128-10, SGD + momentum with "
        "batch 32 and with the full batch until the same training loss; every measure on both minima, invariance "
        "checks, the Euclidean measure gamed by a rescaling, loss-surface planes along the top Euclidean and "
        "invariant eigenvectors; writes report.md, report.json, two figures, the surface grids (.npz) and both "
        "checkpoints. Exit code 1 if a measure that claims invariance changed. --model vit trains the built-in vision "
        "transformer with Adam instead; measures that do not apply to it are listed as skipped, with the reason.",
    )  # fmt: skip
    demo.add_argument("--out", default="demo-out", help="output folder (default: demo-out)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    demo.add_argument("--threshold", type=_positive_float, default=1e-2, help="training-loss threshold (default: 0.01)")
    add_quiet_argument(demo)
    demo.add_argument("--model", default="mlp:64-128-128-10",
                      help="model trained: mlp:64-...-10 (SGD + momentum) or vit[:KEY=VALUE,...] (Adam), e.g. vit or "
                           "vit:attn=hand (default: mlp:64-128-128-10)")  # fmt: skip
    return parser


def _demo(args: argparse.Namespace) -> int:
    from landscape._demo import run_demo

    start = time.perf_counter()
    summary = run_demo(args.out, seed=args.seed, threshold=args.threshold, progress=False if args.quiet else None,
                       model=args.model)  # fmt: skip
    with open(os.path.join(args.out, "report.md")) as fh:
        print(fh.read())
    print(f"written to {args.out}/ in {time.perf_counter() - start:.0f} s")
    return 0 if summary["invariance"]["passed"] else 1


def _fixed_arguments(parser: argparse.ArgumentParser) -> None:
    _problem_arguments(parser)
    parser.add_argument("--values", type=float, nargs="+", default=[0.5, 1.0, 2.0],
                        help="fixed-weight values b > 0 (default 0.5 1 2)")  # fmt: skip
    parser.add_argument(
        "--reading",
        default="a",
        choices=("a", "b"),
        help="a: set the fixed weights to b (default); b: rescale the network so they are +-b",
    )
    parser.add_argument("--selection", default="diagonal", choices=("diagonal", "hungarian"),
                        help="which weight of each hidden unit is fixed (default: diagonal)")  # fmt: skip
    parser.add_argument("--norm", default="filter", choices=NORMALIZATIONS,
                        help="normalization of the random directions (default: filter)")  # fmt: skip
    parser.add_argument(
        "--bias",
        default="zero",
        choices=("zero", "keep"),
        help="random directions in 1-D tensors (biases): zero them (default) or keep them",
    )
    parser.add_argument("--steps", type=_positive_int, default=31, help="grid points per axis (default 31)")
    _grid_arguments(parser, name="fixed", name_help="fixed")


def _fixed(args: argparse.Namespace) -> int:
    import numpy as np

    from landscape._fixed_planes import _check_values, fixed_weight_planes
    from landscape._plot_mpl import save_figure, surface_figure
    from landscape._plot_plotly import plotly_figure, write_html

    values = _check_values(args.values)
    _distinct_names("--values", values)
    spec = DirectionSpec(norm=args.norm, bias=args.bias, seed=args.seed)
    grid = Grid(span=args.span, steps=args.steps, compile=args.compile)
    grid.require_memory(2)
    budget = memory_budget(args.memory_mib)
    _check_files(args, [args.name], [f"{args.name}_b{b:g}" for b in values])
    model, loss_fn, data, _, dtype = _load(args)
    start = time.perf_counter()
    objective = start_objective(args, model, loss_fn, data, dtype=dtype, memory_budget=budget)
    surfaces = fixed_weight_planes(
        None, None, None, values, reading=args.reading, selection=args.selection, directions=spec, grid=grid,
        objective=objective, progress=False if args.quiet else None,
    )  # fmt: skip
    total = time.perf_counter() - start
    if not objective.comm.is_main:  # process 0 draws and writes
        return 0
    surfaces = [
        s.replace(
            metadata={
                **s.metadata,
                "model": args.model,
                "checkpoint": args.checkpoint,
                "data": args.data,
                "loss_function": type(loss_fn).__name__,
                "total_seconds": total,
            }
        )  # fmt: skip
        for s in surfaces
    ]
    what = ("reading (a): fixed weights set to b, the function changes with b" if args.reading == "a" else
            "reading (b): the same network rescaled so every fixed weight is ±b, only the gauge differs")  # fmt: skip
    title = f"Loss in the free weights, {what}"
    source = _provenance(args, loss_fn)
    plane = surfaces[0].metadata["plane"]
    after = ("the fixed weights set to each value as in Jestädt (2025), thesis Fig. 4.9" if args.reading == "a" else
             "the function-preserving reparametrization to fixed weights ±b of Jestädt (2025), thesis section 6.3.1")
    caption = (f"{source}; plane of {plane} in the free weights ({args.selection} selection of the fixed weights); "
               f"{after}")  # fmt: skip
    spread = max(float(np.nanmax(np.abs(s.loss - surfaces[0].loss))) for s in surfaces)
    if len(surfaces) > 1 and spread <= 1e-5 * float(np.nanmax(np.abs(surfaces[0].loss))):
        caption += (f"\nThe panels agree to rounding (largest difference {spread:.2g})"
                    + (": from ±b to ±b′ is a layer-wise rescaling, and planes of "
                       f"{args.norm}-normalized directions do not change under it (try --norm none)"
                       if args.reading == "b" and args.norm != "none" else "."))  # fmt: skip
    log = _log_mode(args, surfaces)
    fig = surface_figure(surfaces, kinds=("contour", "surface"), log=log, mark_center=True, title=title,
                         panel_titles=[f"b = {b:g}" for b in values], caption=caption)  # fmt: skip
    html = plotly_figure(surfaces, title=f"{title} ({source})", log=log)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for b, s in zip(values, surfaces):
        paths += s.save(out / f"{args.name}_b{b:g}")
    paths += save_figure(fig, out / args.name, args.format, title=title, description=caption)
    paths += write_html(html, out / f"{args.name}.html", args.html_js, meta={"title": title, "caption": caption},
                        shared_folder=shared_js_folder(args))  # fmt: skip
    if not args.quiet:
        for b, s in zip(values, surfaces):
            print(f"b = {b:g}: center loss {s.metadata['center_loss']:.6g}")
        print("\n".join(str(p) for p in paths))
    return 0


def _provenance(args: argparse.Namespace, loss_fn) -> str:
    """Model, checkpoint, data and loss in one phrase, for captions and file metadata."""
    return (f"model {args.model} ({Path(args.checkpoint).name}), data {args.data}, "
            f"loss {type(loss_fn).__name__} ({args.dtype})")  # fmt: skip


def _log_mode(args: argparse.Namespace, surfaces) -> bool:
    """``--log``, ``--linear`` or, by default, logarithmic where the losses span more than two decades."""
    from landscape._surface import resolve_log

    return resolve_log(True if args.log else False if args.linear else "auto", surfaces)


def _reproduces(spec: DirectionSpec, line: bool, segment: bool) -> str:
    """Which published kind of figure a plane or line is, for its caption and metadata."""
    if segment:
        return "linear interpolation between two checkpoints (Goodfellow et al. 2015)"
    if spec.kind_name == "gspace":
        return "random plane in G-space (basis-path) coordinates (Meng et al. 2019, G-SGD)"
    if spec.kind_name == "invariant-eigen":
        metric = ("layer-wise quotient metric of Rangamani et al. 2021" if spec.metric == "layer" else
                  f"{METRIC_NAMES['symmetry']} (da Silva et al. 2025's transformer symmetries)"
                  if spec.metric == "symmetry" else
                  f"{spec.metric}-wise quotient metric (generalizing Rangamani et al. 2021)")  # fmt: skip
        return f"{'line' if line else 'plane'} of the top Riemannian Hessian eigenvectors, {metric}"
    if spec.kind_name == "eigen":
        return f"{'line' if line else 'plane'} of the top Euclidean Hessian eigenvectors"
    if line:
        return "random line" + (" (Rangamani et al. 2021, Fig. 2)" if spec.normalization == "layer" else "")
    return "random plane" + (" (Li et al. 2018)" if spec.normalization == "filter" else "")


def _toy(args: argparse.Namespace) -> int:
    from landscape._toy_figures import toy_figure
    from landscape._toys import FIG_4_9_FIXED, check_source, window_4_9

    if args.fixed is not None and args.figure not in ("4.9", "gspace-4.9"):
        raise ValueError(f"--fixed applies to figures 4.9 and gspace-4.9 only, not {args.figure}")
    if args.steps is not None and args.steps < 3:
        raise ValueError(f"--steps must be at least 3 for a toy surface, got {args.steps}")
    source = check_source(args.figure, args.source)
    fixed = FIG_4_9_FIXED if args.fixed is None else _check_toy_fixed(args.fixed, window_4_9(source)[1])
    _check_js(args)
    paths = toy_figure(args.figure, args.out, fixed=fixed, formats=args.format, steps=args.steps, source=source,
                       html_js=args.html_js, shared_folder=shared_js_folder(args))  # fmt: skip
    if not args.quiet:
        print("\n".join(str(p) for p in paths))
    return 0


def _check_out(text: str) -> None:
    """Refuse an ``--out`` that cannot become the output folder, before any computation.

    It must be a folder or not exist yet; if it does not exist, its nearest existing ancestor must be a
    writable folder (``mkdir(parents=True)`` creates the rest).
    """
    out = Path(text)
    if out.is_symlink() and not out.exists():
        raise ValueError(f"--out {text} is a broken symbolic link, not a folder")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {text} exists and is not a folder")
    ancestor = out.absolute()
    while not (ancestor.exists() or ancestor.is_symlink()):
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"--out {text} cannot be created: {ancestor} is not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"--out {text} cannot be written: no write permission in {ancestor}")


def _check_toy_fixed(values: list[float], lim_hi: float) -> tuple[float, ...]:
    """The toy Fig. 4.9 values of ``w1``: positive (the figure's weights are positive), finite (also
    ``w1`` times the window's upper end, the G-space chart's ``v1`` range), and distinct file names."""
    out = tuple(float(v) for v in values)
    for v in out:
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"--fixed values must be positive finite numbers (Fig. 4.9 uses positive weights), "
                             f"got {v:g}")  # fmt: skip
        if not math.isfinite(v * lim_hi):
            raise ValueError(f"--fixed value {v:g} is too large: w1 * {lim_hi:g} overflows")
    _distinct_names("--fixed", out)
    return out


def _distinct_names(flag: str, values: tuple[float, ...]) -> None:
    """Refuse values that are equal to 6 significant digits (``f"{v:g}"``), which name the files and panels."""
    seen: dict[str, float] = {}
    for v in values:
        if f"{v:g}" in seen:
            raise ValueError(f"{flag} {seen[f'{v:g}']!r} and {v!r} are equal to 6 significant digits, "
                             "which name the files and panels; give distinct values")  # fmt: skip
        seen[f"{v:g}"] = v


def shared_js_folder(args: argparse.Namespace) -> Path | None:
    """With ``--html-js directory``, the folder that holds ``--out``, whose one ``plotly.min.js`` the pages of every
    run written side by side share (``--out fixed-a`` and ``--out fixed-b``): only when that folder is the current
    one or inside it, so nothing is written above where the user works (``None``: the script goes into ``--out``)."""
    if args.html_js != "directory":
        return None
    out, here = Path(args.out).absolute(), Path.cwd()
    parent = Path(os.path.normpath(out)).parent
    if Path(os.path.normpath(out)) == here or not (parent == here or here in parent.parents):
        return None
    return parent


def _check_js(args: argparse.Namespace) -> None:
    """Refuse, before any computation, a ``plotly.min.js`` of the user's own where the pages would get theirs."""
    from landscape._plot_plotly import plotly_js_path  # plotly is imported once there is a page to write

    if args.html_js == "directory":
        plotly_js_path(args.out, shared_js_folder(args))


def _check_files(args: argparse.Namespace, figures: list[str], surfaces: list[str]) -> None:
    """Refuse, before any computation, output files under ``--out`` that would replace an input or cannot be
    written (``figures``: stems of the figures and the HTML, ``surfaces``: stems of ``.npz`` + ``.json``)."""
    _check_js(args)
    out = Path(args.out)
    names = [f"{stem}.{ext}" for stem in figures for ext in (*args.format, "html")]
    names += [f"{stem}.{ext}" for stem in surfaces for ext in ("npz", "json")]
    check_outputs([("the output", out / name) for name in names], command_inputs(args), new_folder=True)


def _load(args: argparse.Namespace):
    """Model, loss, data and (for --to) the second parameter set, all validated before any output."""
    import torch

    from sharpness.cli import load_model

    model, loss_fn, (X, y) = load_problem(args)  # the loader of python -m sharpness
    try:
        with torch.no_grad():
            model(X[:1])
    except RuntimeError as exc:
        raise ValueError(
            f"samples of shape {tuple(X.shape[1:])} from {args.data} do not fit the model {args.model} "
            f"({str(exc).splitlines()[0]}); check --data and --model"
        ) from None
    target = None
    dtype = getattr(torch, args.dtype)
    if getattr(args, "to", None):  # built in --dtype before loading, as the model (no detour through float32)
        target = load_model(args.model, args.to, args.dtype)
    return model, loss_fn, (X, y), target, dtype


def _real(args: argparse.Namespace) -> int:
    from landscape._plot_mpl import _wrap, line_figure, save_figure, surface_figure
    from landscape._plot_plotly import plotly_figure, write_html
    from landscape._surfaces import loss_line, loss_plane

    if args.command == "line" and args.range is not None and not args.range[0] < args.range[1]:
        raise ValueError(f"--range needs LO < HI, got {args.range[0]} {args.range[1]}")
    if args.command == "line" and args.to and (args.directions != "random" or args.path != "straight"):
        raise ValueError("--to draws the straight segment between two checkpoints; leave out --directions and --path")
    if args.roots != "fixed" and args.directions != "gspace":
        raise ValueError(f"--roots {args.roots} applies to --directions gspace only")
    spec = DirectionSpec(args.directions, args.norm, args.bias, args.metric, args.path, args.roots, args.seed)
    grid = Grid(span=args.span, steps=args.steps or (41 if getattr(args, "to", None) else 51), compile=args.compile)
    grid.require_memory(2 if args.command == "plane" else 1)
    budget = memory_budget(args.memory_mib)

    _check_files(args, [args.name or args.command], [args.name or args.command])
    model, loss_fn, data, target, dtype = _load(args)
    objective = start_objective(args, model, loss_fn, data, dtype=dtype, memory_budget=budget)
    progress = False if args.quiet else None
    start = time.perf_counter()
    if args.command == "plane":
        surface = loss_plane(None, None, None, spec, grid=grid, objective=objective, progress=progress)
    else:
        lim = tuple(args.range) if args.range else None
        if target is not None:
            spec = DirectionSpec()  # the segment: its direction is the difference of the two checkpoints
        surface = loss_line(None, None, None, spec, to=target, lim=lim, grid=grid, objective=objective,
                            progress=progress)  # fmt: skip
    if not objective.comm.is_main:  # process 0 draws and writes
        return 0
    surface = surface.replace(
        metadata={
            **surface.metadata, "model": args.model, "checkpoint": args.checkpoint, "data": args.data,
            "to": getattr(args, "to", None), "loss_function": type(loss_fn).__name__,
            "total_seconds": time.perf_counter() - start,
        }
    )  # fmt: skip
    name = args.name or args.command
    source = _provenance(args, loss_fn)
    title = surface.title[0].upper() + surface.title[1:]
    caption = f"{source}; {_reproduces(spec, surface.is_line, target is not None)}"
    if surface.metadata.get("path") == "geodesic":
        caption += f"; path: {surface.metadata['path_detail']}"
    log = _log_mode(args, [surface])
    if surface.is_line:
        marks = [] if target is None else [(0.0, Path(args.checkpoint).name), (1.0, Path(args.to).name)]
        if log and not args.log:
            caption += "; logarithmic loss axis: the loss spans more than two decades on this range"
        fig = line_figure([surface], log=log, title=_wrap(title, 56), marks=marks, caption=caption)
    else:
        fig = surface_figure([surface], kinds=("contour", "surface"), log=log, mark_center=True,
                             title=_wrap(title, 88), caption=caption)  # fmt: skip
    html = plotly_figure([surface], title=f"{title} ({source})", log=log)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = list(surface.save(out / name))
    paths += save_figure(fig, out / name, args.format, title=title, description=caption)
    paths += write_html(html, out / f"{name}.html", args.html_js, meta={"title": title, "caption": caption},
                        shared_folder=shared_js_folder(args))  # fmt: skip
    if not args.quiet:
        meta = surface.metadata
        print(f"center loss {meta['center_loss']:.6g}; {meta['n_points']} points in {meta['grid_seconds']:.2f} s "
              f"({meta['points_per_second']:.0f} points/s, {meta['strategy']}, path: {meta['path']})")  # fmt: skip
        if meta.get("crossed_points"):
            print(f"{meta['crossed_points']} points lie beyond a singularity of the G-space map (array 'crossed')")
        print("\n".join(str(p) for p in paths))
    return 0


def _checked(command):
    """``command`` after the checks every command shares, before any computation: a bad ``--out`` must not
    cost a whole grid."""

    def run(args: argparse.Namespace) -> int:
        if launched_processes() > 1 and args.command in ("toy", "demo"):
            raise ValueError(f"the {args.command} command has no data set to share between processes; run it "
                             "without torchrun")  # fmt: skip
        _check_out(args.out)
        return command(args)

    return run


def main(argv: list[str] | None = None) -> int:
    def parse_and_run(argv: list[str] | None) -> int:
        args = _parser().parse_args(argv)
        return _checked({"fixed": _fixed, "toy": _toy, "demo": _demo}.get(args.command, _real))(args)

    return run_command(parse_and_run, argv)
