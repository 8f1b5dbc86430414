"""Benchmark: 2-D loss-plane evaluation on F1 (MLP 784-300-100-10, 500 synthetic samples) or ResNet-20.

Run by hand (not part of the test suite)::

    pip install --no-deps loss-landscapes   # benchmark-only dependency
    python bench/landscape.py               # 51 x 51 grid; --steps, --threads, --budget-mib to change
    python bench/landscape.py --workload resnet20 --samples 1000 --steps 7 --repeat 1   # points per second
    python bench/landscape.py --device cuda  # on a GPU (loss-landscapes' calls run under ``with torch.device(...)``)

Times, in one run on the same model, data and grid size (points per second, higher is better):

* ``loss-landscapes``: ``loss_landscapes.random_plane(model, Loss(...), distance, steps,
  normalization="filter")`` as its README calls it (autograd on), and once more under
  ``torch.no_grad()``;
* a plain per-point loop: ``functional_call(model, theta + a d1 + b d2, X)`` per grid point under
  ``torch.no_grad()``;
* ``landscape.evaluate_grid(strategy="vmap")``: the whole model vmapped over batches of grid points;
* ``landscape.evaluate_grid()`` (auto: the first-layer fast path for this model);
* ``landscape.evaluate_grid(compile=True)``: the same, one point at a time through a ``torch.compile``d forward
  pass (the compilation counts in its time; ``--methods ...,compiled``).

Every method runs ``--repeat`` times, interleaved, and its best time counts (the machine may be
shared). The script also checks that the fast path's values equal the plain loop's (relative 1e-6),
that our grid contains the center and leaves the model untouched, that loss-landscapes' grid misses
the center and moves the model it is given, and how many grid points a memory budget admits per batch.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from torch.func import functional_call

# This file is named like the package it measures: take its folder off the import path so that
# ``import landscape`` finds the package, and load the shared workloads by file name.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
_spec = importlib.util.spec_from_file_location("_workloads", HERE / "_workloads.py")
_workloads = sys.modules["_workloads"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_workloads)
make_workload = _workloads.make_workload
clock, to_device = _workloads.clock, _workloads.to_device
_spec = importlib.util.spec_from_file_location("_resnet_bench", HERE / "resnet.py")
_resnet_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_resnet_bench)

from landscape import DirectionSpec, Grid, evaluate_grid, grid_axis, loss_plane, random_directions  # noqa: E402
from sharpness import Objective  # noqa: E402
from sharpness.products import retain_freed_memory  # noqa: E402

METHODS = ("ll", "ll-nograd", "loop", "vmap", "auto", "compiled")
OURS = ("auto", "compiled")
LOOP = "plain per-point loop (functional_call, no_grad)"


def _coords(steps: int, span: float) -> tuple[np.ndarray, np.ndarray]:
    axis = grid_axis(-span, span, steps)
    yy, xx = np.meshgrid(axis, axis, indexing="ij")
    return axis, np.stack([xx.ravel(), yy.ravel()], axis=1)


def plain_loop(model, loss_fn, X, y, theta: dict, d1: dict, d2: dict, coords: np.ndarray) -> np.ndarray:
    """The simplest correct evaluator: one functional forward pass per grid point."""
    out = np.empty(len(coords))
    with torch.no_grad():
        for i, (a, b) in enumerate(coords):
            params = {k: theta[k] + float(a) * d1[k] + float(b) * d2[k] for k in theta}
            out[i] = float(loss_fn(functional_call(model, params, (X,)), y))
    return out


def time_loss_landscapes(model, loss_fn, X, y, steps: int, span: float, no_grad: bool) -> tuple[float, dict]:
    """Seconds for ``random_plane`` on a copy of ``model``, and what it did to that copy. loss-landscapes draws its
    directions with ``torch.rand`` on the default device: on a GPU its call runs under ``with torch.device(...)`` of
    the model's, so they are drawn where the model is."""
    import loss_landscapes
    import loss_landscapes.metrics

    victim = copy.deepcopy(model)
    before = torch.cat([p.detach().flatten().clone() for p in victim.parameters()])
    metric = loss_landscapes.metrics.Loss(loss_fn, X, y)
    where = torch.device(X.device) if X.is_cuda else contextlib.nullcontext()
    start = clock()
    if no_grad:
        with torch.no_grad(), where:
            values = loss_landscapes.random_plane(victim, metric, span, steps, normalization="filter")
    else:
        with where:
            values = loss_landscapes.random_plane(victim, metric, span, steps, normalization="filter")
    seconds = clock() - start
    after = torch.cat([p.detach().flatten() for p in victim.parameters()])
    with torch.no_grad():
        center = float(loss_fn(model(X), y))
    facts = {
        "moved_model_by": float((after - before).norm() / before.norm()),
        "grid_contains_center": bool(np.isclose(values, center, rtol=1e-7, atol=0).any()),
        "shape": list(values.shape),
    }
    return seconds, facts


def plane_kinds(model, loss_fn, X, y, steps: int) -> list[dict]:
    """Time ``landscape.loss_plane`` for every kind of plane: directions (and their eigen-solves) and grid."""
    kinds = {
        "random, filter-normalized (straight)": (DirectionSpec("random"), 1.0),
        "invariant-eigen, node metric (straight)": (DirectionSpec("invariant-eigen"), 1.0),
        "invariant-eigen, node metric (geodesic)": (DirectionSpec("invariant-eigen", path="geodesic"), 1.0),
        "G-space, chain roots held": (DirectionSpec("gspace"), 0.5),
    }
    print(f"\nplane kinds, {steps}x{steps} grid (landscape.loss_plane; direction time includes eigen-solves)")
    print(f"{'plane':<42} {'strategy':>12} {'directions s':>13} {'grid s':>7} {'points/s':>9}")
    rows = []
    for name, (spec, span) in kinds.items():
        surface = loss_plane(model, loss_fn, (X, y), spec, grid=Grid(span, steps), progress=False)
        meta = surface.metadata
        row = {"plane": name, "strategy": meta["strategy"], "direction_seconds": meta["direction_seconds"],
               "grid_seconds": meta["grid_seconds"], "points_per_second": steps**2 / meta["grid_seconds"]}  # fmt: skip
        rows.append(row)
        print(f"{name:<42} {row['strategy']:>12} {row['direction_seconds']:13.2f} {row['grid_seconds']:7.2f} "
              f"{row['points_per_second']:9.0f}")  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=51, help="grid points per axis (default 51)")
    parser.add_argument("--span", type=float, default=1.0, help="half-width of the plane (default 1)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds; the best time counts (default 3)")
    parser.add_argument("--budget-mib", type=int, default=256, help="memory budget of the grid (default 256 MiB)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument("--workload", choices=("F1", "resnet20"), default="F1",
                        help="F1 (default) or resnet20: ResNet-20 with BatchNorm on synthetic 3x32x32 data, float32")
    parser.add_argument("--samples", type=int, default=1000, help="samples of the resnet20 workload (default 1000)")
    parser.add_argument("--kinds", type=int, default=0, metavar="STEPS",
                        help="also time every kind of plane loss_plane draws (random, invariant-eigen straight and "
                             "geodesic, G-space) on a STEPS x STEPS grid (e.g. 21; default: skip)")  # fmt: skip
    parser.add_argument("--methods", default=",".join(METHODS[:-1]),
                        help=f"comma-separated subset of {','.join(METHODS)} (default: all but compiled, which needs "
                             "a C++ compiler). Without 'loop', the "
                             "fast path is checked against the plain loop on 9 sampled points")  # fmt: skip
    _workloads.add_device_argument(parser)
    args = parser.parse_args()
    _workloads.use_device(parser, args.device)
    chosen = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(chosen) - set(METHODS))
    if unknown or not set(OURS) & set(chosen):
        parser.error(f"--methods takes names from {','.join(METHODS)} and includes 'auto' or 'compiled'; "
                     f"got {args.methods!r}")  # fmt: skip
    torch.set_num_threads(args.threads)
    # Every tool in this run under the same allocator settings (our objectives apply them on first use).
    print(f"freed memory retained for reuse (glibc): {retain_freed_memory()}", flush=True)

    if args.workload == "F1":
        w = make_workload("F1")
        model, loss_fn, X, y = w.model, w.loss_fn, w.X, w.y
        about = f"F1: {w.description}, {w.n_params:,} parameters, {w.n_samples} samples"
    else:
        model, X, y = _resnet_bench.workload(args.samples)
        loss_fn = torch.nn.CrossEntropyLoss()
        about = (f"ResNet-20 with BatchNorm, {sum(p.numel() for p in model.parameters()):,} parameters, {args.samples} "
                 "samples of 3x32x32")  # fmt: skip
    X, y = to_device(args.device, model, X, y)
    if args.device.type != "cpu":
        about += f"; device {_workloads.device_label(args.device)} (the workload built on the CPU, then moved)"
    n_points = args.steps**2
    obj = Objective(model, loss_fn, (X, y), memory_budget=args.budget_mib * 2**20)
    directions = random_directions(obj.params, 2, seed=0, norm="filter")
    d1, d2 = (obj.layout.unflatten(v) for v in directions.vectors)
    axis, coords = _coords(args.steps, args.span)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    print(f"{about}; grid {args.steps}x{args.steps} "
          f"= {n_points} points; torch {torch.__version__}, {args.threads} thread(s), load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; best of {args.repeat} interleaved rounds")  # fmt: skip

    results: dict[str, object] = {}

    def ll(no_grad: bool):
        def run() -> float:
            seconds, results["ll_facts"] = time_loss_landscapes(model, loss_fn, X, y, args.steps, args.span, no_grad)
            return seconds

        return run

    def loop() -> float:
        start = clock()
        results["reference"] = plain_loop(model, loss_fn, X, y, obj.params, d1, d2, coords)
        return clock() - start

    def ours(key: str, strategy: str, compile: bool = False):
        def run() -> float:
            results[key] = evaluate_grid(
                obj, directions.vectors, coords, strategy=strategy, compile=compile, progress=False
            )
            return results[key].seconds

        return run

    runners = {
        "ll": ("loss-landscapes random_plane (as documented: autograd on)", ll(False)),
        "ll-nograd": ("loss-landscapes random_plane under torch.no_grad()", ll(True)),
        "loop": (LOOP, loop),
        "vmap": ("naive vmap over functional_call", ours("vmap", "vmap")),
        "auto": ("landscape.evaluate_grid (auto)", ours("auto", "auto")),
        "compiled": ("landscape.evaluate_grid (auto, compile=True)", ours("compiled", "auto", compile=True)),
    }
    if {"ll", "ll-nograd"} & set(chosen) and importlib.util.find_spec("loss_landscapes") is None:
        print("loss-landscapes is not installed (pip install --no-deps loss-landscapes); its rows are skipped")
        chosen = [m for m in chosen if not m.startswith("ll")]
    methods = dict(runners[m] for m in METHODS if m in chosen)
    times: dict[str, list[float]] = {name: [] for name in methods}
    for round_ in range(args.repeat):  # interleaved, so a change in machine load hits every method alike
        for name, run in methods.items():
            times[name].append(run())
            print(f"  round {round_ + 1}: {name}: {times[name][-1]:.2f} s", flush=True)

    naive = results.get("vmap")
    best = {name: min(t) for name, t in times.items()}
    ll_name = next((n for n in best if n.startswith("loss-landscapes")), None)
    loop_name = LOOP if LOOP in best else None
    print(f"\n{'method':<62} {'best s':>7} {'points/s':>9} {'vs LL':>6} {'vs loop':>7}")
    for name, seconds in best.items():
        label = name
        if name.startswith("naive"):
            label += f" (batch {naive.batch})"
        if name.startswith("landscape"):
            fast = results["compiled" if "compile=True" in name else "auto"]
            label = f"landscape.evaluate_grid, {fast.strategy}{', compiled' * fast.compiled} (batch {fast.batch})"
        vs_ll = f"{best[ll_name] / seconds:5.2f}x" if ll_name else "  -"
        vs_loop = f"{best[loop_name] / seconds:6.2f}x" if loop_name else "  -"
        print(f"{label:<62} {seconds:7.2f} {n_points / seconds:9.0f} {vs_ll:>6} {vs_loop:>7}")

    if loop_name:
        checked = np.arange(n_points)
        reference = results["reference"]
    else:  # the loop costs as much as loss-landscapes: check the corners, the center and random points instead
        side = args.steps
        corners = [0, side - 1, n_points - side, n_points - 1, n_points // 2]
        rest = np.random.default_rng(0).choice(n_points, size=min(4, n_points), replace=False)
        checked = np.unique(np.concatenate([corners, rest]))
        reference = plain_loop(model, loss_fn, X, y, obj.params, d1, d2, coords[checked])
    center = np.flatnonzero((coords == 0).all(axis=1))
    exact = obj.evaluate()["loss"]
    untouched = all(torch.equal(before[k], p.detach()) for k, p in model.named_parameters())
    rel = 0.0
    for key in (k for k in OURS if k in results):
        fast = results[key]
        diff = float((np.abs(fast.loss[checked] - reference) / np.abs(reference)).max())
        rel = max(rel, diff)
        print(f"\n{key} vs plain loop on {checked.size} of {n_points} points: max relative difference "
              f"{diff:.2e} (float32)")  # fmt: skip
    print(f"ours: grid contains the center: {center.size == 1}; loss there {fast.loss[center[0]]:.8f} vs the "
          f"objective's {exact:.8f}; model parameters untouched: {untouched}")  # fmt: skip
    ll_facts = results.get("ll_facts")
    if ll_facts:
        print(f"loss-landscapes: grid contains the center: {ll_facts['grid_contains_center']}; it moved the model "
              f"it was given by {ll_facts['moved_model_by']:.3f} x ||theta|| (pass deepcopy_model=True to avoid "
              f"that); its random directions are uniform on [0, 1], not Gaussian")  # fmt: skip
    memory = []
    for budget_mib in (8, 64, args.budget_mib):
        obj_b = Objective(model, loss_fn, (X, y), memory_budget=budget_mib * 2**20)
        r = evaluate_grid(obj_b, directions.vectors, coords[: 64 if args.workload == "F1" else 2], progress=False)
        memory.append({"budget_bytes": budget_mib * 2**20, "batch": r.batch, "bytes_per_point": r.bytes_per_point})
        print(f"memory: budget {budget_mib:4d} MiB -> batch {r.batch:2d} points x {r.bytes_per_point / 2**20:.1f} MiB "
              f"estimated per point = {r.batch * r.bytes_per_point / 2**20:.1f} MiB in flight")  # fmt: skip
    kinds = plane_kinds(model, loss_fn, X, y, args.kinds) if args.kinds else []
    if args.json:
        Path(args.json).write_text(json.dumps({
            "plane_kinds": kinds,
            "rows": [{"method": n, "seconds": t, "best_points_per_second": n_points / min(t)}
                     for n, t in times.items()],
            "max_relative_difference": rel, "memory": memory, "loss_landscapes": ll_facts,
            "threads": args.threads, "steps": args.steps, "checked_points": int(checked.size),
            **({"device": str(args.device)} if args.device.type != "cpu" else {}),
        }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
