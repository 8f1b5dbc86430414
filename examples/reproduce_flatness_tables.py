"""Reproduce Tables 2-3 of the scale-invariant flatness paper (Rangamani et al., section 3.1).

The paper trains F1 (MLP 784-300-100-10) and C1 (conv5x5 1->10, pool, conv5x5 10->20, pool,
FC 320-120-84-10) on N=500 random-label samples in R^784 with cross-entropy, computes the spectral
norm sigma of the layer-wise Riemannian Hessian at W and at layer-wise rescaled points T_lambda W,
and reports the relative difference |sigma(W) - sigma(T_lambda W)| / sigma(W) (1.7e-7 and 7.17e-7
for F1, 1.28e-7 and 5.1e-6 for C1). This script does the same with Lanczos in float64 (and, for
comparison, float32), and adds
  * the node-wise invariant measure (``metric="node"``) at the same points and under random
    node-wise rescalings, where the layer-wise measure is NOT invariant (shown too), and
  * the Euclidean top Hessian eigenvalue at the same points, which changes by orders of magnitude.

Each point gets a different random Lanczos start vector, so agreement is not an artefact of
repeating the same iteration. In float64 both invariant measures agree to ~1e-14 (the paper's
1e-7..5e-6 are float32-level numbers).

What this is not, yet: a like-for-like comparison. The check below compares our float64 differences
with the paper's float32 ones, so it cannot fail for any sound float64 implementation. And the trained
point is not a critical point (the gradient norm is printed; about 4.5e-3 at the paper sizes), where our
exact Riemannian Hessian and the paper's G^-1 H differ by construction (by 0.39% on F1 here): the
numbers are comparable as relative differences under rescaling, not as eigenvalues.

float32: a factor like 1/3000 is harmless by itself (floating point has the same relative precision
at every magnitude, the scaled weights stay far from under- and overflow, and in whitened
coordinates the Riemannian Hessian is the same matrix). What limits float32 is (a) the softmax
cross-entropy near zero loss, whose curvature lives in 1 - p(label), resolved by float32 only to
~6e-8 absolute (so float32 and float64 differ by ~1e-5 at W itself), and (b) kinks: the rescaled
weights rounded to float32 can put a sample on the other side of a ReLU or max-pool kink, where the
Hessian is different (column "kink flips f32"; the rows with a flip show ~3e-5).

Training is float32 full-batch Adam to loss < 1e-3; results depend on the number of torch threads
(reduction order changes the trajectory). A default run needs about 210 s of CPU time with
--threads 1 (C1 is most of it); on a machine busy with other jobs use --threads 1, since two
threads that wait for each other then cost several times more.

Run from the repository root:
    python examples/reproduce_flatness_tables.py                 # paper sizes, a few minutes
    python examples/reproduce_flatness_tables.py --quick         # small widths and N, a few seconds
    python examples/reproduce_flatness_tables.py --json out.json # also write every number as JSON
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from fractions import Fraction

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from tqdm.auto import tqdm

import manifolds
import sharpness

N_CLASSES = 10

# The paper's Tables 2 and 3: layer multipliers (product 1) and the relative differences it reports.
PAPER_LAMBDAS: dict[str, list[tuple[tuple[Fraction, ...], float]]] = {
    "F1": [
        ((Fraction(5), Fraction(4), Fraction(1, 20)), 1.7e-7),
        ((Fraction(100), Fraction(30), Fraction(1, 3000)), 7.17e-7),
    ],
    "C1": [
        ((Fraction(5), Fraction(4), Fraction(3), Fraction(2), Fraction(1, 120)), 1.28e-7),
        ((Fraction(50), Fraction(24), Fraction(30), Fraction(1, 6), Fraction(1, 6000)), 5.1e-6),
    ],
}

# Columns of the tables: (measure, dtype). The Euclidean eigenvalue is only needed to show that it
# moves by orders of magnitude, so float64 suffices.
COLUMNS: tuple[tuple[str, torch.dtype], ...] = (
    ("layer", torch.float64),
    ("layer", torch.float32),
    ("node", torch.float64),
    ("node", torch.float32),
    ("euclidean", torch.float64),
)


@dataclass(frozen=True)
class Sizes:
    """Widths and data size of one run (the paper's, or a small one for smoke tests)."""

    side: int  # inputs are side x side images (flattened for F1)
    n_samples: int
    f1_hidden: tuple[int, int]
    c1_channels: tuple[int, int]
    c1_hidden: tuple[int, int]


PAPER_SIZES = Sizes(side=28, n_samples=500, f1_hidden=(300, 100), c1_channels=(10, 20), c1_hidden=(120, 84))
QUICK_SIZES = Sizes(side=20, n_samples=64, f1_hidden=(24, 16), c1_channels=(3, 4), c1_hidden=(16, 12))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.").replace("float", "f")


def build_model(name: str, sizes: Sizes) -> nn.Sequential:
    """F1 (MLP with biases) or C1 (the paper's LeNet-like CNN) at the given sizes."""
    if name == "F1":
        h1, h2 = sizes.f1_hidden
        return nn.Sequential(
            nn.Linear(sizes.side**2, h1), nn.ReLU(), nn.Linear(h1, h2), nn.ReLU(), nn.Linear(h2, N_CLASSES)
        )
    c1, c2 = sizes.c1_channels
    h1, h2 = sizes.c1_hidden
    flat = ((sizes.side - 4) // 2 - 4) // 2  # two (conv 5x5, maxpool 2) stages
    return nn.Sequential(
        nn.Conv2d(1, c1, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(c2 * flat * flat, h1),
        nn.ReLU(),
        nn.Linear(h1, h2),
        nn.ReLU(),
        nn.Linear(h2, N_CLASSES),
    )


def describe(name: str, sizes: Sizes) -> str:
    if name == "F1":
        return f"MLP {sizes.side**2}-{sizes.f1_hidden[0]}-{sizes.f1_hidden[1]}-{N_CLASSES} with biases"
    c1, c2 = sizes.c1_channels
    return (
        f"CNN conv5x5 1->{c1}, pool, conv5x5 {c1}->{c2}, pool, FC "
        f"{sizes.c1_hidden[0]}-{sizes.c1_hidden[1]}-{N_CLASSES} on {sizes.side}x{sizes.side}"
    )


def make_data(name: str, sizes: Sizes, seed: int) -> tuple[Tensor, Tensor]:
    """Gaussian inputs and uniformly random labels in 10 classes (the paper's synthetic set), float64."""
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(sizes.n_samples, sizes.side**2, generator=gen, dtype=torch.float64)
    y = torch.randint(0, N_CLASSES, (sizes.n_samples,), generator=gen)
    return (X if name == "F1" else X.reshape(-1, 1, sizes.side, sizes.side)), y


def train(
    model: nn.Module, X: Tensor, y: Tensor, target_loss: float, max_steps: int, lr: float, progress: bool | None
) -> dict:
    """Full-batch Adam in float32 until the loss is below ``target_loss`` or ``max_steps`` are spent.

    float32 because it is about twice as fast on CPU; the trained float32 weights are exactly
    representable in float64, where all measurements start (float32 ones cast the same weights back).
    """
    model.float().train()
    Xf = X.float()
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    start = time.perf_counter()
    steps = 0
    enabled = sys.stderr.isatty() if progress is None else progress
    with tqdm(total=max_steps, desc="train", disable=not enabled, leave=False) as bar:
        while steps < max_steps:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(Xf), y)
            value = loss.detach().item()
            if value < target_loss:
                break
            loss.backward()
            opt.step()
            steps += 1
            bar.update(1)
            bar.set_postfix(loss=f"{value:.2e}", refresh=False)
    opt.zero_grad(set_to_none=True)
    model.double().eval()
    return {"steps": steps, "lr": lr, "target_loss": target_loss, "seconds": time.perf_counter() - start}


def rescaled_points(model: nn.Module, name: str, node_seeds: list[int], node_scale: float) -> list[dict]:
    """W, the paper's layer-wise rescalings T_lambda W, and random node-wise rescalings of W."""
    structure = manifolds.analyze(model)
    points = [{"label": "W", "kind": "base", "model": model}]
    for lambdas, paper in PAPER_LAMBDAS[name]:
        factors = manifolds.layer_factors(structure, [float(lam) for lam in lambdas])
        points.append(
            {
                "label": "lambda=(" + ", ".join(str(lam) for lam in lambdas) + ")",
                "kind": "layer",
                "lambdas": [str(lam) for lam in lambdas],
                "paper": paper,
                "model": manifolds.rescale_model(model, factors),
            }
        )
    for seed in node_seeds:
        gen = torch.Generator().manual_seed(seed)
        points.append(
            {
                "label": f"node-wise, seed {seed}",
                "kind": "node",
                "seed": seed,
                "scale": node_scale,
                "model": manifolds.random_rescale(model, kind="node", scale=node_scale, generator=gen),
            }
        )
    return points


def measure_point(model: nn.Module, data: tuple[Tensor, Tensor], kind: str, start_seed: int, args) -> dict[str, dict]:
    """Every column's top eigenvalue at one point; the measures of one dtype share one Objective."""
    loss_fn = nn.CrossEntropyLoss()
    tols = {torch.float64: args.tol, torch.float32: args.tol32}
    out: dict[str, dict] = {}
    for dtype in (torch.float64, torch.float32):
        # One objective per dtype: its cached gradient graph then serves all measures at this point.
        obj = sharpness.Objective(model, loss_fn, data, dtype=dtype)
        for measure, col_dtype in COLUMNS:
            # The layer-wise measure is not invariant under node-wise rescaling; float64 shows that.
            if col_dtype != dtype or (kind == "node" and (measure, dtype) == ("layer", torch.float32)):
                continue
            # Measures that move by orders of magnitude need no tight tolerance (saves products).
            loose = measure == "euclidean" or (kind == "node" and measure == "layer")
            tol = args.loose_tol if loose else tols[dtype]
            solver = sharpness.Solver(tol=tol, max_iter=args.max_iter, seed=start_seed)
            res = sharpness.get_measure(measure).sharpness(obj, 1, solver, args.progress)
            out[f"{measure} {_dtype_name(dtype)}"] = {
                "value": res.value,
                "n_matvec": res.n_matvec,
                "converged": res.converged,
                "residual": float(res.residuals[0]),
                "tol": tol,
                "seconds": res.seconds,
            }
        obj.release_graph()
    return out


def kink_pattern(model: nn.Module, X: Tensor) -> Tensor:
    """Which side of every kink each sample is on: ReLU signs and max-pool winners (flat tensor).

    A positive rescaling keeps all of them in exact arithmetic; where a float32 evaluation gets one
    wrong, it sits on another smooth piece of the loss, with another Hessian.
    """
    parts: list[Tensor] = []

    def relu_hook(_module, _inputs, out):
        parts.append((out > 0).flatten(1).long())

    def pool_hook(module, inputs, _out):
        _, index = F.max_pool2d(
            inputs[0], module.kernel_size, module.stride, module.padding, module.dilation, module.ceil_mode, True
        )
        parts.append(index.flatten(1))

    hooks = [m.register_forward_hook(relu_hook) for m in model.modules() if isinstance(m, nn.ReLU)]
    hooks += [m.register_forward_hook(pool_hook) for m in model.modules() if isinstance(m, nn.MaxPool2d)]
    try:
        with torch.no_grad():
            model(X)
    finally:
        for h in hooks:
            h.remove()
    return torch.cat(parts, dim=1).flatten()


def relative_difference(base: float, other: float) -> float:
    return abs(base - other) / abs(base)


def run_model(name: str, sizes: Sizes, args) -> dict:
    started = time.perf_counter()
    X, y = make_data(name, sizes, args.seed)
    torch.manual_seed(args.seed)
    model = build_model(name, sizes)
    training = train(model, X, y, args.target_loss, args.max_steps, args.lr[name], args.progress)
    obj = sharpness.Objective(model, nn.CrossEntropyLoss(), (X, y), dtype=torch.float64)
    value, grad = obj.value_and_gradient()
    training.update(
        loss=float(value), grad_norm=float(torch.linalg.vector_norm(grad)), accuracy=obj.evaluate()["accuracy"]
    )
    node_seeds = list(range(1, args.node_seeds + 1))
    points = rescaled_points(model, name, node_seeds, args.node_scale)
    reference = kink_pattern(model, X)
    for index, point in enumerate(points):
        point_model = point.pop("model")
        point["kink_flips_f32"] = int((kink_pattern(copy.deepcopy(point_model).float(), X.float()) != reference).sum())
        # A different start vector per point: agreement must not come from repeating one iteration.
        point["measures"] = measure_point(point_model, (X, y), point["kind"], index, args)
    base = points[0]["measures"]
    for point in points[1:]:
        point["relative_difference"] = {
            col: relative_difference(base[col]["value"], m["value"]) for col, m in point["measures"].items()
        }
    return {
        "name": name,
        "description": describe(name, sizes),
        "n_params": sum(p.numel() for p in model.parameters()),
        "n_samples": sizes.n_samples,
        "n_kinks": int(reference.numel()),
        "training": training,
        "points": points,
        "seconds": time.perf_counter() - started,
    }


def _checks(result: dict) -> list[dict]:
    """float64 layer-wise relative differences must be below the paper's numbers."""
    return [
        {
            "model": result["name"],
            "transform": p["label"],
            "ours": p["relative_difference"]["layer f64"],
            "paper": p["paper"],
            "passed": p["relative_difference"]["layer f64"] < p["paper"],
        }
        for p in result["points"]
        if p["kind"] == "layer"
    ]


def format_model(result: dict) -> str:
    cols = [f"{m} {_dtype_name(d)}" for m, d in COLUMNS]
    t = result["training"]
    width = max(len(p["label"]) for p in result["points"]) + 2
    lines = [
        f"== {result['name']}: {result['description']}, {result['n_params']:,} parameters, "
        f"N={result['n_samples']} random-label samples ==",
        f"trained {t['steps']} full-batch Adam steps (lr {t['lr']:g}, float32) in {t['seconds']:.1f} s; "
        f"float64 loss {t['loss']:.3e}, ||grad|| {t['grad_norm']:.3e}, train accuracy {t['accuracy']:.0%}",
        "",
        "top eigenvalue at each point [Hessian-vector products; * = Lanczos did not reach tol]",
        "point".ljust(width) + "".join(c.rjust(24) for c in cols) + "  kink flips f32",
    ]
    for p in result["points"]:
        cells = []
        for c in cols:
            m = p["measures"].get(c)
            cell = (
                "-" + " " * 7
                if m is None
                else f"{m['value']:.10e} [{m['n_matvec']:>3}]{' ' if m['converged'] else '*'}"
            )
            cells.append(cell.rjust(24))
        flips = f"{p['kink_flips_f32']}/{result['n_kinks']}"
        lines.append(p["label"].ljust(width) + "".join(cells) + flips.rjust(16))
    base = result["points"][0]["measures"]
    accuracy = ", ".join(
        f"{m} {relative_difference(base[f'{m} f64']['value'], base[f'{m} f32']['value']):.1e}"
        for m in ("layer", "node")
    )
    lines.append(f"float32 vs float64 at W (relative): {accuracy}")
    lines += [
        "",
        "relative difference |s(W) - s(T W)| / s(W)   (paper: layer-wise, float64 here must be smaller)",
        "transform".ljust(width) + "paper".rjust(10) + "".join(c.rjust(14) for c in cols),
    ]
    for p in result["points"][1:]:
        paper = f"{p['paper']:.2e}" if "paper" in p else "-"
        diffs = "".join(
            (f"{p['relative_difference'][c]:.2e}" if c in p["relative_difference"] else "-").rjust(14) for c in cols
        )
        lines.append(p["label"].ljust(width) + paper.rjust(10) + diffs)
    return "\n".join(lines)


def format_summary(checks: list[dict], wall: float, cpu: float, args) -> str:
    return "\n".join(
        [
            "check: float64 layer-wise relative difference below the paper's number (float32-level; a sanity check, "
            "not a like-for-like comparison)",
            *(
                f"  {c['model']} {c['transform']}: {c['ours']:.2e} < {c['paper']:.2e}  "
                f"{'PASS' if c['passed'] else 'FAIL'}"
                for c in checks
            ),
            f"Lanczos tol {args.tol:g} (float64), {args.tol32:g} (float32), {args.loose_tol:g} (non-invariant cases); "
            f"node-wise rescalings: log-normal factor per hidden unit/channel, log-std {args.node_scale:g}",
            f"wall time {wall:.1f} s, CPU time {cpu:.1f} s, torch threads {torch.get_num_threads()}",
        ]
    )


def write_json(path: str, payload: dict) -> None:
    """Write through a temporary file so a failed run never leaves half a file."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as fh:
            json.dump(payload, fh, indent=2)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Reproduce Tables 2-3 of the scale-invariant flatness paper: relative change of the "
        "layer-wise (and node-wise) invariant sharpness under function-preserving rescalings, beside the "
        "Euclidean top Hessian eigenvalue.",
    )
    p.add_argument("--quick", action="store_true", help="small widths and 64 samples (smoke test, seconds)")
    p.add_argument("--models", nargs="+", choices=("F1", "C1"), default=["F1", "C1"], help="networks to run")
    p.add_argument("--json", metavar="PATH", help="write every number to this JSON file")
    p.add_argument("--seed", type=int, default=0, help="seed of the data, labels and initialization")
    p.add_argument("--target-loss", type=float, default=1e-3, help="train until the loss is below this")
    p.add_argument("--max-steps", type=int, help="training step budget (default 2000, --quick 100)")
    p.add_argument("--lr-f1", type=float, help="Adam learning rate for F1 (default 1e-3, --quick 1e-2)")
    p.add_argument("--lr-c1", type=float, help="Adam learning rate for C1 (default 3e-3, --quick 1e-2)")
    p.add_argument("--tol", type=float, default=1e-10, help="Lanczos relative tolerance in float64")
    p.add_argument("--tol32", type=float, default=1e-5, help="Lanczos relative tolerance in float32")
    p.add_argument(
        "--loose-tol",
        type=float,
        default=1e-4,
        help="Lanczos tolerance where the measure is not invariant (Euclidean; layer-wise under node-wise rescaling)",
    )
    p.add_argument("--max-iter", type=int, default=150, help="Lanczos iteration cap")
    p.add_argument("--node-seeds", type=int, help="number of random node-wise rescalings (default 3, --quick 1)")
    p.add_argument("--node-scale", type=float, default=1.0, help="log-std of the node-wise rescaling factors")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice, one per core)")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None, help="hide progress bars")
    args = p.parse_args(argv)
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        p.error(f"the folder of --json {args.json} does not exist; create it or choose another path")
    # --quick only has to exercise every code path, so it trains briefly with a larger step.
    defaults = (
        {"max_steps": 100, "lr_f1": 1e-2, "lr_c1": 1e-2, "node_seeds": 1}
        if args.quick
        else {"max_steps": 2000, "lr_f1": 1e-3, "lr_c1": 3e-3, "node_seeds": 3}
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.lr = {"F1": args.lr_f1, "C1": args.lr_c1}
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run, print the tables (each model's as soon as it is done), optionally write JSON; returns all numbers."""
    args = parse_args(argv)
    sizes = QUICK_SIZES if args.quick else PAPER_SIZES
    if args.threads:
        torch.set_num_threads(args.threads)
    started, cpu_started = time.perf_counter(), time.process_time()
    results = []
    for name in args.models:
        results.append(run_model(name, sizes, args))
        print(format_model(results[-1]) + "\n", flush=True)
    checks = [c for r in results for c in _checks(r)]
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    print(format_summary(checks, wall, cpu, args), flush=True)
    payload = {
        "settings": {k: v for k, v in vars(args).items() if k != "lr"} | {"sizes": asdict(sizes)},
        "paper": {
            name: [{"lambdas": [str(x) for x in lam], "relative_difference": d} for lam, d in rows]
            for name, rows in PAPER_LAMBDAS.items()
        },
        "models": results,
        "checks": checks,
        "wall_seconds": wall,
        "cpu_seconds": cpu,
    }
    if args.json:
        write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
