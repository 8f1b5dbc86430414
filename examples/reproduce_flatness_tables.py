"""Reproduce Tables 2-3 of the scale-invariant flatness paper (Rangamani et al., section 3.1), like for like.

The paper trains F1 (MLP 784-300-100-10) and C1 (conv5x5 1->10, pool, conv5x5 10->20, pool,
FC 320-120-84-10) on N=500 random-label samples in R^784 with cross-entropy, computes the spectral
norm sigma of the layer-wise Riemannian Hessian at W and at layer-wise rescaled points T_lambda W,
and reports the relative difference |sigma(W) - sigma(T_lambda W)| / sigma(W) (1.7e-7 and 7.17e-7
for F1, 1.28e-7 and 5.1e-6 for C1). Its Riemannian Hessian is G^-1 H (G the layer-wise metric), which
is the exact one only at a critical point, and its numbers are float32 noise of a power method.

So the comparison here is made like for like, at a critical point:

* The point. Plain cross-entropy on random labels that a network fits has no critical point (its
  infimum lies at infinite weights; F1 trained to a loss below 1e-3 still has a gradient norm of
  about 4.5e-3, where the exact Riemannian Hessian and G^-1 H differ by 0.4%). So the networks are
  trained on the random labels as in the paper (full-batch Adam in float32, with label smoothing 0.1
  so that predictions stay away from one-hot, where float32 cannot resolve the curvature), and the
  loss measured at the trained weights W is the cross-entropy against W's own predictions (soft
  targets ``softmax(f(x_i; W))``, fixed). Every sample's output gradient ``p_i - t_i`` is then 0 and
  W is an exact critical point: the gradient norm (float64) is printed and checked against 1e-8
  (``--grad-tol``). The loss depends on the outputs only, so every rescaling keeps it.
* For each transformation: the paper's number; the same quantity computed the paper's way (float32
  power method on G^-1 H, no projection); our layer-wise measure (Lanczos on the exact Riemannian
  Hessian, projected) in float32 and float64; and the gap between our measure and G^-1 H (float64
  Lanczos), which vanishes at a critical point.
* Checks that can fail: the gradient norm is below ``--grad-tol``; our float64 relative differences
  are below 1e-12; our float32 relative differences are within 4x the float32 noise floor measured in
  this run (the largest relative error of the paper's float32 computation against the float64 value
  of the same number, over the points); the gap is below 1e-6. These can only see a measure that is not
  invariant; a wrong but invariant one (connection terms dropped, the metric scaled by a constant) passes
  them. So, last, the exact reference (:func:`reference_checks`): on tiny F1 and C1 our layer- and
  node-wise top eigenvalues equal a dense float64 Riemannian Hessian built from ``torch.func.hessian``
  and the metrics' closed forms (``sharpness.dense_spectrum``) to 1e-8, at a point that is not critical
  (the random labels) and at the measured one (the own predictions).
* Beside them: the node-wise invariant measure (``metric="node"``) at the same points and under
  random node-wise rescalings, where the layer-wise measure is NOT invariant (shown too), and the
  Euclidean top Hessian eigenvalue, which changes by orders of magnitude.

Each point gets a different random start vector, so agreement is not an artefact of repeating the
same iteration. What limits float32 is rounding near kinks: the rescaled weights rounded to float32
can put a sample on the other side of a ReLU or max-pool kink, where the Hessian is different (column
"kink flips f32"); the noise floor includes this, as the paper's own float32 numbers did.

Results depend on the number of torch threads (reduction order changes the trajectory). The paper
sizes need several minutes of CPU time (C1 is most of it).

Run from the repository root:
    python examples/reproduce_flatness_tables.py                 # paper sizes, several minutes
    python examples/reproduce_flatness_tables.py --quick         # small widths and N, seconds
    python examples/reproduce_flatness_tables.py --json out.json # also write every number as JSON
Exit status 1 when a check fails.
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
from sharpness.io import write_atomic

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

# Columns of the tables: (measure, dtype). "gh" is the paper's G^-1 H (no connection terms, no projection):
# float64 Lanczos for the gap to our measure, float32 power method for the paper's way. The Euclidean
# eigenvalue only shows that it moves by orders of magnitude, so float64 suffices.
COLUMNS: tuple[tuple[str, torch.dtype], ...] = (
    ("layer", torch.float64),
    ("layer", torch.float32),
    ("gh", torch.float64),
    ("gh power", torch.float32),
    ("node", torch.float64),
    ("node", torch.float32),
    ("euclidean", torch.float64),
)

# The checks' tolerances (stated in the output and the JSON).
FLOAT64_TOL = 1e-12  # our float64 relative differences under the rescalings that keep the measure
FLOAT32_FACTOR = 4.0  # our float32 relative differences against the float32 noise floor of this run
GAP_TOL = 1e-6  # |ours - G^-1 H| / ours at the critical point (float64)


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
# Tiny instances of F1 and C1 for the dense float64 reference (a few hundred parameters each; C1 needs 16x16
# inputs for its two conv-pool stages).
REFERENCE_SIZES = {
    "F1": Sizes(side=5, n_samples=24, f1_hidden=(6, 5), c1_channels=(2, 3), c1_hidden=(5, 4)),
    "C1": Sizes(side=16, n_samples=24, f1_hidden=(6, 5), c1_channels=(2, 3), c1_hidden=(5, 4)),
}
REFERENCE_TOL = 1e-8  # top eigenvalues of our measures against the dense reference, relative to the largest
REFERENCE_GAP = 1e-4  # at the random-label point the exact Hessian must differ from G^-1 H at least this much
REFERENCE_K = 3


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
    model: nn.Module, X: Tensor, y: Tensor, loss_fn: nn.Module, steps: int, lr: float, progress: bool | None
) -> dict:
    """Full-batch Adam in float32 for ``steps`` steps (about twice as fast as float64 on CPU; the float32
    weights are exactly representable in float64, where the refinement and every float64 measurement
    start)."""
    model.float().train()
    Xf = X.float()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    # decayed to lr / 1000 at the end, so the last steps settle instead of oscillating around the minimum
    schedule = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=1e-3 ** (1 / max(steps, 1)))
    start = time.perf_counter()
    enabled = sys.stderr.isatty() if progress is None else progress
    value = float("nan")
    with tqdm(total=steps, desc="train (Adam, float32)", disable=not enabled, leave=False) as bar:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(Xf), y)
            value = loss.detach().item()
            loss.backward()
            opt.step()
            schedule.step()
            bar.update(1)
            bar.set_postfix(loss=f"{value:.4e}", refresh=False)
    opt.zero_grad(set_to_none=True)
    model.double().eval()
    return {"adam_steps": steps, "lr": lr, "adam_loss": value, "adam_seconds": time.perf_counter() - start}


def own_targets(model: nn.Module, X: Tensor) -> Tensor:
    """``(N, C)`` class probabilities ``softmax(f(x_i; W))`` of the trained network in float64: as targets of the
    cross-entropy they make ``W`` an exact critical point (every sample's output gradient ``p_i - t_i`` is 0)."""
    with torch.no_grad():
        return torch.softmax(model(X), dim=1)


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


def metric_inverse(obj: sharpness.Objective) -> Tensor:
    """The diagonal of G^-1 of the layer-wise metric at ``obj.params``: ``||w_B||^2`` on every entry of block B."""
    quotient = manifolds.LayerScaleQuotient(obj.params, obj.structure, obj.layout)
    return quotient.egrad2rgrad(torch.ones(obj.layout.size, dtype=obj.dtype))


def gh_lanczos(obj: sharpness.Objective, tol: float, max_iter: int, seed: int) -> dict:
    """Top eigenvalue of the paper's G^-1 H by Lanczos on the symmetric G^-1/2 H G^-1/2 (same spectrum)."""
    root = metric_inverse(obj).sqrt()
    hessian = sharpness.HessianOperator(obj)
    op = sharpness.CallableOperator(lambda z: root * hessian.matvec(root * z), obj.layout.size, obj.dtype)
    started = time.perf_counter()
    res = sharpness.lanczos(op, 1, tol=tol, max_iter=max_iter, generator=torch.Generator().manual_seed(seed))
    return {"value": float(res.eigenvalues[0]), "n_matvec": res.n_matvec, "converged": bool(res.converged),
            "seconds": time.perf_counter() - started}  # fmt: skip


def gh_power(obj: sharpness.Objective, tol: float, max_iter: int, seed: int) -> dict:
    """The paper's way: the power method on G^-1 H itself (not symmetrized, no projection) in ``obj.dtype``,
    ``x <- G^-1 H x / ||G^-1 H x||`` with the estimate ``x^T G^-1 H x``, until it changes by less than ``tol``
    (relative) or ``max_iter`` products."""
    g_inv = metric_inverse(obj)
    x = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(obj.dtype)
    x /= torch.linalg.vector_norm(x)
    started, estimate, converged, iterations = time.perf_counter(), float("nan"), False, 0
    while iterations < max_iter and not converged:
        iterations += 1
        y = g_inv * obj.hvp(x)
        new = float(x @ y)
        x = y / torch.linalg.vector_norm(y)
        converged = abs(new - estimate) <= tol * abs(new)
        estimate = new
    return {"value": estimate, "n_matvec": iterations, "converged": converged, "seconds": time.perf_counter() - started}


def measure_point(model: nn.Module, data: tuple[Tensor, Tensor], loss_fn: nn.Module, kind: str, start_seed: int,
                  args) -> dict[str, dict]:  # fmt: skip
    """Every column's top eigenvalue at one point; the measures of one dtype share one Objective."""
    tols = {torch.float64: args.tol, torch.float32: args.tol32}
    out: dict[str, dict] = {}
    for dtype in (torch.float64, torch.float32):
        # One objective per dtype: its cached products then serve all measures at this point.
        obj = sharpness.Objective(model, loss_fn, data, dtype=dtype)
        for measure, col_dtype in COLUMNS:
            # Under node-wise rescaling the layer-wise quantities are not invariant; float64 shows that.
            if col_dtype != dtype or (kind == "node" and dtype == torch.float32 and measure != "node"):
                continue
            # Measures that move by orders of magnitude need no tight tolerance (saves products).
            loose = measure == "euclidean" or (kind == "node" and measure in ("layer", "gh"))
            tol = args.loose_tol if loose else tols[dtype]
            if measure == "gh":
                out[f"gh {_dtype_name(dtype)}"] = gh_lanczos(obj, tol, args.max_iter, start_seed) | {"tol": tol}
                continue
            if measure == "gh power":
                out[f"gh power {_dtype_name(dtype)}"] = gh_power(obj, args.power_tol, args.power_iter, start_seed) | {
                    "tol": args.power_tol}
                continue
            solver = sharpness.Solver(tol=tol, max_iter=args.max_iter, seed=start_seed)
            res = sharpness.get_measure(measure).sharpness(obj, 1, solver, args.progress)
            out[f"{measure} {_dtype_name(dtype)}"] = {
                "value": res.value,
                "n_matvec": res.n_matvec,
                "converged": res.converged,
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
    trained_on = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    training = train(model, X, y, trained_on, args.adam_steps, args.lr[name], args.progress)
    labels_obj = sharpness.Objective(model, trained_on, (X, y), dtype=torch.float64)
    value, grad = labels_obj.value_and_gradient()
    training |= {"label_loss": float(value), "label_grad_norm": float(torch.linalg.vector_norm(grad)),
                 "accuracy": labels_obj.evaluate()["accuracy"]}  # fmt: skip
    # The measured loss: cross-entropy against the network's own predictions at W, a critical point of it.
    y = own_targets(model, X)
    loss_fn = nn.CrossEntropyLoss()
    value, grad = sharpness.Objective(model, loss_fn, (X, y), dtype=torch.float64).value_and_gradient()
    training |= {"loss": float(value), "grad_norm": float(torch.linalg.vector_norm(grad))}
    node_seeds = list(range(1, args.node_seeds + 1))
    points = rescaled_points(model, name, node_seeds, args.node_scale)
    reference = kink_pattern(model, X)
    for index, point in enumerate(tqdm(points, desc=f"{name} points", disable=not _progress(args), leave=False)):
        point_model = point.pop("model")
        point["kink_flips_f32"] = int((kink_pattern(copy.deepcopy(point_model).float(), X.float()) != reference).sum())
        # A different start vector per point: agreement must not come from repeating one iteration.
        point["measures"] = measure_point(point_model, (X, y), loss_fn, point["kind"], index, args)
    return derive({
        "name": name,
        "description": describe(name, sizes),
        "n_params": sum(p.numel() for p in model.parameters()),
        "n_samples": sizes.n_samples,
        "n_kinks": int(reference.numel()),
        "training": training,
        "points": points,
        "seconds": time.perf_counter() - started,
    })


def derive(result: dict) -> dict:
    """Add to ``result`` (in place; returned) what follows from its measured eigenvalues: per point the gap
    between our measure and G^-1 H, the float32 error of the paper's way and the relative differences to W, and
    the float32 noise floor: how far a float32 computation of this eigenvalue lands from its float64 value, the
    largest over the points where the paper's way applies."""
    points = result["points"]
    for point in points:
        m = point["measures"]
        point["gap"] = relative_difference(m["layer f64"]["value"], m["gh f64"]["value"])
        if "gh power f32" in m:
            point["f32_error"] = relative_difference(m["gh f64"]["value"], m["gh power f32"]["value"])
    base = points[0]["measures"]
    for point in points[1:]:
        point["relative_difference"] = {
            col: relative_difference(base[col]["value"], m["value"]) for col, m in point["measures"].items()
        }
    result["float32_noise_floor"] = max(p["f32_error"] for p in points if "f32_error" in p)
    return result


def _progress(args) -> bool:
    return sys.stderr.isatty() if args.progress is None else args.progress


def checks(result: dict, grad_tol: float) -> list[dict]:
    """The verdicts on one model's numbers: each a dict with ``check``, ``value``, ``bound``, ``passed``."""
    out = [{"model": result["name"], "check": f"gradient norm at W below {grad_tol:g}",
            "value": result["training"]["grad_norm"], "bound": grad_tol}]  # fmt: skip
    floor = result["float32_noise_floor"]
    for p in result["points"]:
        if p["kind"] != "base":
            invariant = "layer" if p["kind"] == "layer" else "node"
            out.append({"model": result["name"], "check": f"{p['label']}: {invariant} f64 relative difference",
                        "value": p["relative_difference"][f"{invariant} f64"], "bound": FLOAT64_TOL})  # fmt: skip
        if p["kind"] == "layer":
            out.append({"model": result["name"], "check": f"{p['label']}: layer f32 relative difference, "
                        f"{FLOAT32_FACTOR:g}x the float32 noise floor {floor:.2e}",
                        "value": p["relative_difference"]["layer f32"], "bound": FLOAT32_FACTOR * floor})  # fmt: skip
        if p["kind"] != "node":
            out.append({"model": result["name"], "check": f"{p['label']}: gap |ours - G^-1 H| / ours (f64)",
                        "value": p["gap"], "bound": GAP_TOL})  # fmt: skip
    for c in out:
        c["passed"] = bool(c["value"] <= c["bound"])  # a NaN fails
    return out


def reference_checks(seed: int = 0, adam_steps: int = 40) -> list[dict]:
    """Our measures on tiny F1 and C1 against a dense float64 Riemannian Hessian (:func:`sharpness.dense_spectrum`).

    Each tiny network is trained as in the run (Adam, label smoothing) and measured twice: on the random labels,
    where W is not a critical point, so the connection terms count (the check that the point tells the exact
    Hessian from the paper's G^-1 H guards against a point where they vanish), and on its own predictions, the
    loss the tables measure. A Hessian that drops a term, scales the metric or projects wrongly fails here, even
    where the invariance checks cannot see it (a wrong but invariant measure)."""
    out = []
    solver = sharpness.Solver(tol=1e-12, max_iter=300, seed=seed)
    for name, sizes in REFERENCE_SIZES.items():
        X, y = make_data(name, sizes, seed)
        torch.manual_seed(seed)
        model = build_model(name, sizes)
        trained_on = nn.CrossEntropyLoss(label_smoothing=0.1)
        train(model, X, y, trained_on, adam_steps, 3e-3, progress=False)
        losses = {"random labels": (trained_on, y), "own predictions": (nn.CrossEntropyLoss(), own_targets(model, X))}
        for where, (loss_fn, targets) in losses.items():
            obj = sharpness.Objective(model, loss_fn, (X, targets), dtype=torch.float64)
            for measure in ("layer", "node"):
                reference = sharpness.dense_spectrum(obj, measure)[:REFERENCE_K]
                ours = sharpness.get_measure(measure).sharpness(obj, REFERENCE_K, solver, False).eigenvalues
                out.append({"model": f"{name} tiny", "check": f"{where}: {measure} top {REFERENCE_K} eigenvalues "
                            "against the dense float64 reference (relative)",
                            "value": float((ours - reference).abs().max() / reference[0].abs()),
                            "bound": REFERENCE_TOL})  # fmt: skip
                if where == "random labels" and measure == "layer":
                    paper = gh_lanczos(obj, 1e-12, 300, seed)["value"]
                    out.append({"model": f"{name} tiny", "check": f"{where}: the paper's G^-1 H differs from the "
                                "reference (the point is not critical), at least",
                                "value": relative_difference(float(reference[0]), paper), "bound": REFERENCE_GAP,
                                "at_least": True})  # fmt: skip
    for c in out:
        c["passed"] = bool(c["value"] >= c["bound"] if c.get("at_least") else c["value"] <= c["bound"])  # NaN fails
    return out


def format_model(result: dict) -> str:
    cols = [f"{m} {_dtype_name(d)}" for m, d in COLUMNS]
    t = result["training"]
    width = max(len(p["label"]) for p in result["points"]) + 2
    lines = [
        f"== {result['name']}: {result['description']}, {result['n_params']:,} parameters, "
        f"N={result['n_samples']} random-label samples ==",
        f"{t['adam_steps']} full-batch Adam steps (lr {t['lr']:g} decayed to {t['lr'] / 1000:g}, float32) in "
        f"{t['adam_seconds']:.1f} s on the random labels: loss {t['label_loss']:.6f}, gradient norm "
        f"{t['label_grad_norm']:.2e}, train accuracy {t['accuracy']:.0%}",
        f"measured loss: cross-entropy against W's own predictions, {t['loss']:.10f}; gradient norm "
        f"{t['grad_norm']:.2e} (float64): W is a critical point",
        "",
        "top eigenvalue at each point [products; * = did not reach its tolerance]; gh = the paper's G^-1 H",
        "point".ljust(width) + "".join(c.rjust(24) for c in cols) + "  kink flips f32",
    ]
    for p in result["points"]:
        cells = []
        for c in cols:
            m = p["measures"].get(c)
            mark = " " if m is None or m["converged"] else "*"
            cell = "-" + " " * 7 if m is None else f"{m['value']:.10e} [{m['n_matvec']:>3}]{mark}"
            cells.append(cell.rjust(24))
        flips = f"{p['kink_flips_f32']}/{result['n_kinks']}"
        lines.append(p["label"].ljust(width) + "".join(cells) + flips.rjust(16))
    lines += [
        "",
        "relative difference |s(W) - s(T W)| / s(W); 'paper' is the paper's published number",
        "transform".ljust(width) + "paper".rjust(10) + "".join(c.rjust(14) for c in cols),
    ]
    for p in result["points"][1:]:
        paper = f"{p['paper']:.2e}" if "paper" in p else "-"
        diffs = "".join(
            (f"{p['relative_difference'][c]:.2e}" if c in p["relative_difference"] else "-").rjust(14) for c in cols
        )
        lines.append(p["label"].ljust(width) + paper.rjust(10) + diffs)
    gaps = ", ".join(f"{p['label']} {p['gap']:.1e}" for p in result["points"] if p["kind"] != "node")
    lines += [
        f"gap |ours - G^-1 H| / ours (float64): {gaps}",
        f"float32 noise floor (largest |paper's way f32 - G^-1 H f64| / G^-1 H f64 over the points): "
        f"{result['float32_noise_floor']:.2e}",
    ]
    return "\n".join(lines)


def format_summary(verdicts: list[dict], wall: float, cpu: float, args) -> str:
    return "\n".join(
        [
            "checks:",
            *(f"  {c['model']} {c['check']}: {c['value']:.2e} {'>=' if c.get('at_least') else '<='} {c['bound']:.2e}  "
              f"{'PASS' if c['passed'] else 'FAIL'}" for c in verdicts),  # fmt: skip
            f"training loss: cross-entropy with label smoothing {args.label_smoothing:g}; measured loss: cross-entropy "
            f"against W's own predictions; Lanczos tol {args.tol:g} (float64), "
            f"{args.tol32:g} (float32), {args.loose_tol:g} (non-invariant cases); power method tol {args.power_tol:g}, "
            f"at most {args.power_iter} products; node-wise rescalings: log-normal factor per hidden unit/channel, "
            f"log-std {args.node_scale:g}",
            f"wall time {wall:.1f} s, CPU time {cpu:.1f} s, torch threads {torch.get_num_threads()}",
        ]
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Reproduce Tables 2-3 of the scale-invariant flatness paper like for like, at a critical "
        "point: relative change of the layer-wise (and node-wise) invariant sharpness under function-preserving "
        "rescalings, the paper's float32 G^-1 H power method beside it, and the Euclidean top Hessian eigenvalue.",
    )
    p.add_argument("--quick", action="store_true", help="small widths and 64 samples (smoke test, seconds)")
    p.add_argument("--models", nargs="+", choices=("F1", "C1"), default=["F1", "C1"], help="networks to run")
    p.add_argument("--json", metavar="PATH", help="write every number to this JSON file")
    p.add_argument("--seed", type=int, default=0, help="seed of the data, labels and initialization")
    p.add_argument("--label-smoothing", type=float, default=0.1,
                   help="label smoothing of the training loss (default 0.1: predictions stay away from one-hot, "
                        "where float32 cannot resolve the curvature)")
    p.add_argument("--adam-steps", type=int, help="full-batch Adam steps on the random labels "
                   "(default 1500, --quick 400)")  # fmt: skip
    p.add_argument("--lr-f1", type=float, default=3e-3, help="Adam's first learning rate for F1 (default 3e-3)")
    p.add_argument("--lr-c1", type=float, default=3e-3, help="Adam's first learning rate for C1 (default 3e-3)")
    p.add_argument("--grad-tol", type=float, default=1e-8, help="gradient norm that makes W a critical point")
    p.add_argument("--tol", type=float, default=1e-10, help="Lanczos relative tolerance in float64")
    p.add_argument("--tol32", type=float, default=1e-5, help="Lanczos relative tolerance in float32")
    p.add_argument("--loose-tol", type=float, default=1e-4,
                   help="Lanczos tolerance where the measure is not invariant (Euclidean; layer-wise under node-wise "
                        "rescaling)")  # fmt: skip
    p.add_argument("--max-iter", type=int, default=150, help="Lanczos iteration cap")
    p.add_argument("--power-tol", type=float, default=1e-7, help="the float32 power method's relative stopping change")
    p.add_argument("--power-iter", type=int, default=500, help="the float32 power method's product cap")
    p.add_argument("--node-seeds", type=int, help="number of random node-wise rescalings (default 3, --quick 1)")
    p.add_argument("--node-scale", type=float, default=1.0, help="log-std of the node-wise rescaling factors")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice, one per core)")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None, help="hide progress bars")
    args = p.parse_args(argv)
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        p.error(f"the folder of --json {args.json} does not exist; create it or choose another path")
    if not 0.0 <= args.label_smoothing < 1.0:
        p.error("--label-smoothing must lie in [0, 1)")
    defaults = {"adam_steps": 400, "node_seeds": 1} if args.quick else {"adam_steps": 1500, "node_seeds": 3}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.lr = {"F1": args.lr_f1, "C1": args.lr_c1}
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run, print the tables (each model's as soon as it is done), optionally write JSON; returns all numbers
    (``payload["passed"]`` says whether every check passed)."""
    args = parse_args(argv)
    sizes = QUICK_SIZES if args.quick else PAPER_SIZES
    if args.threads:
        torch.set_num_threads(args.threads)
    started, cpu_started = time.perf_counter(), time.process_time()
    results = []
    for name in args.models:
        results.append(run_model(name, sizes, args))
        print(format_model(results[-1]) + "\n", flush=True)
    verdicts = [c for r in results for c in checks(r, args.grad_tol)] + reference_checks(args.seed)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    print(format_summary(verdicts, wall, cpu, args), flush=True)
    payload = {
        "example": "reproduce_flatness_tables",
        "settings": {k: v for k, v in vars(args).items() if k != "lr"} | {"sizes": asdict(sizes)},
        "tolerances": {"float64": FLOAT64_TOL, "float32_factor": FLOAT32_FACTOR, "gap": GAP_TOL,
                       "grad_norm": args.grad_tol, "reference": REFERENCE_TOL,
                       "reference_gap": REFERENCE_GAP},  # fmt: skip
        "reference_sizes": {name: asdict(sizes) for name, sizes in REFERENCE_SIZES.items()},
        "paper": {
            name: [{"lambdas": [str(x) for x in lam], "relative_difference": d} for lam, d in rows]
            for name, rows in PAPER_LAMBDAS.items()
        },
        "models": results,
        "checks": verdicts,
        "passed": all(c["passed"] for c in verdicts),
        "wall_seconds": wall,
        "cpu_seconds": cpu,
        "torch_threads": torch.get_num_threads(),
    }
    if args.json:
        write_atomic(args.json, json.dumps(payload, indent=1))
    return payload


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
