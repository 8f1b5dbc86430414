"""What the horizontal projection costs (issue 33): factoring the symmetry's Gram matrix, one projection, and an
invariant solve against a Euclidean one, on VGG11-bn (V1 in ``_workloads.py``) and ResNet-20.

Run by hand, never from the tests::

    python bench/projection.py                          # V1 and ResNet-20 on the CPU, 2 images 32x32 (minutes)
    python bench/projection.py --models resnet20 --device cuda
    python bench/projection.py --section projection     # factor + projections only, no solves
    python bench/projection.py --symmetry               # also the symmetry quotient on the built-in ViT (T1)
    python bench/projection.py --models --symmetry --threads 1 --rounds 3   # T1 only, CPU time of one thread

Section "projection", per model (float32, eval mode): the node-wise quotient at the point (exact zeros, e.g. V1's
zero-initialised biases, are left out of its tangent space and of ``J``), with the seconds of: building the Gram
matrix's structure and factoring it (the first solve), one projection of a parameter vector afterwards (median of
``--rounds``), one gradient and one Hessian-vector product (the objective's ``"auto"`` strategy), for scale.

Section "solve": ``measure_sharpness`` with the Euclidean and the node-wise measure, the same solver (``--method``,
``--tol``, ``--max-iter``: by default an iteration budget the tolerance does not reach first, so both do the same
number of products) and the same float32 objective; the median of ``--rounds`` solves, node-wise / Euclidean (target
<= 1.5x). The node-wise solve includes everything it adds: the gradient, the quotient, the factor, the projections.
Each measure first runs one untimed solve of one iteration (what a process pays once: imports, kernels, tracing).
On the CPU the process CPU time of each solve is reported too (median of the rounds), and the ratio is taken of it:
on a machine shared with other jobs it is far steadier than the wall time (``--threads 1`` makes it the work done).

``--symmetry``: the symmetry quotient (`manifolds.SymmetryQuotient`) on T1 (per-head GL factors, LayerNorm scales,
ReLU units): seconds to build its Gram matrix (probes) and factor it, and per projection; and the symmetry measure's
solve against the Euclidean one there.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))

from _workloads import (  # noqa: E402
    add_device_argument,
    clock,
    device_label,
    make_workload,
    median_time,
    to_device,
    use_device,
    vgg_workload,
)

from manifolds import NodeScaleQuotient, SymmetryQuotient, transformer_symmetry  # noqa: E402
from sharpness import Objective, Solver, measure_sharpness  # noqa: E402
from sharpness.products import HessianOperator  # noqa: E402

MODELS = ("vgg11_bn", "resnet20")


def build(name: str, samples: int, size: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    if name == "vgg11_bn":
        return vgg_workload(samples, size)
    from resnet import workload  # noqa: PLC0415 (bench/resnet.py: ResNet-20 off its initialisation)

    return workload(samples)


def projection_section(model, X, y, device, rounds: int) -> dict[str, float]:
    objective = Objective(model, nn.CrossEntropyLoss(), (X, y), dtype=torch.float32)
    start = clock(device)
    quotient = NodeScaleQuotient(objective.params, objective.structure, objective.layout)
    built = clock(device) - start
    symmetry = quotient.symmetry
    start = clock(device)
    symmetry._solve(torch.zeros(1, symmetry.dim, dtype=torch.float64, device=device))  # builds and factors
    factored = clock(device) - start
    v = torch.randn(objective.layout.size, generator=torch.Generator().manual_seed(0)).to(device)
    project, _ = median_time(lambda: quotient.whitened_projection(v), rounds, device)
    gradient, _ = median_time(objective.gradient, rounds, device)
    hvp = HessianOperator(objective).matvec
    hvp(v)  # the first product builds what the others share
    product, _ = median_time(lambda: hvp(v), rounds, device)
    zeros = int((objective.layout.flatten(objective.params) == 0).sum())
    print(f"  {objective.layout.size:,} parameters ({zeros:,} exactly zero), group of dimension {symmetry.dim:,}")
    print(f"  quotient built {built:.2f} s; Gram structure + factor {factored:.2f} s; one projection {project:.3f} s; "
          f"one gradient {gradient:.3f} s; one HVP {product:.3f} s")  # fmt: skip
    return {"build": built, "factor": factored, "projection": project, "gradient": gradient, "hvp": product}


def solve_section(model, X, y, solver: Solver, rounds: int, device, measures=("euclidean", "node")) -> dict:
    def run(measure, solver=solver):
        objective = Objective(model, nn.CrossEntropyLoss(), (X, y), dtype=torch.float32)
        return measure_sharpness(model, nn.CrossEntropyLoss(), (X, y), measure, solver=solver, objective=objective,
                                 progress=False)  # fmt: skip

    for measure in measures:  # warm-up: what the first solve of a process pays once (imports, kernels, tracing)
        run(measure, Solver(solver.method, solver.tol, 1, seed=0))
    results = {}
    cpu = torch.device(device).type == "cpu"
    for measure in measures:
        walls, cpus = [], []
        for _ in range(rounds):
            started = time.process_time()
            seconds, result = median_time(lambda measure=measure: run(measure), 1, device)
            walls.append(seconds)
            cpus.append(time.process_time() - started)
        seconds = statistics.median(cpus if cpu else walls)
        results[measure] = seconds
        spent = f"CPU {seconds:8.2f} s (wall {statistics.median(walls):.2f} s)" if cpu else f"{seconds:8.2f} s"
        print(f"  {measure:<10} {spent}, {result.n_matvec} products, top eigenvalue {float(result.value):.6g}")
    base = results[measures[0]]
    for measure in measures[1:]:
        ratio = results[measure] / base
        print(f"  {measure} / {measures[0]}: {ratio:.2f}x (target <= 1.5x): {'met' if ratio <= 1.5 else 'MISSED'}")
    return results


def symmetry_section(device, rounds: int, solver: Solver) -> None:
    w = make_workload("T1")
    w.X, w.y = to_device(device, w.model, w.X, w.y)
    params = {k: p.detach() for k, p in w.model.named_parameters()}
    symmetry = transformer_symmetry(w.model, w.X[:2])
    start = clock(device)
    quotient = SymmetryQuotient(symmetry, params)
    built = clock(device) - start
    v = torch.randn(quotient.layout.size, generator=torch.Generator().manual_seed(0), dtype=quotient.point.dtype)
    v = v.to(device)
    project, _ = median_time(lambda: quotient.whitened_projection(v), rounds, device)
    print(f"T1 symmetry quotient: {quotient.layout.size:,} parameters, group of dimension {symmetry.dim} "
          f"({len(symmetry.factors)} factors), Gram matrix ({quotient.gram_probes} probes) built and factored in "
          f"{built:.3f} s, one projection {project * 1e3:.2f} ms")  # fmt: skip
    solve_section(w.model, w.X, w.y, solver, rounds, device, ("euclidean", "symmetry"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", choices=MODELS, default=list(MODELS),
                        help="workloads (default: all; none with --symmetry: T1 only)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--section", choices=("all", "projection", "solve"), default="all")
    parser.add_argument("--samples", type=int, default=2, help="images (default: %(default)s)")
    parser.add_argument("--size", type=int, default=32, help="V1's image side (default: %(default)s)")
    parser.add_argument("--method", default="low-memory-lanczos",
                        help="solver (default: %(default)s: three parameter vectors, V1 has 133M parameters)")
    parser.add_argument("--tol", type=float, default=1e-8, help="solver tolerance (default: %(default)s)")
    parser.add_argument("--max-iter", type=int, default=12, help="iteration budget (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=1, help="repetitions, median reported (default: %(default)s)")
    parser.add_argument("--symmetry", action="store_true", help="also the symmetry quotient on T1")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    use_device(parser, args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{device_label(args.device)}, {torch.get_num_threads()} threads, {os.cpu_count()} cores "
          f"({platform.processor() or platform.machine()}), load average {load}")  # fmt: skip
    solver = Solver(args.method, args.tol, args.max_iter, seed=0)
    for name in args.models:
        model, X, y = build(name, args.samples, args.size)
        X, y = to_device(args.device, model, X, y)
        print(f"{name}: {args.samples} images, float32")
        if args.section in ("all", "projection"):
            projection_section(model, X, y, args.device, args.rounds)
        if args.section in ("all", "solve"):
            solve_section(model, X, y, solver, args.rounds, args.device)
        del model, X, y
    if args.symmetry:
        symmetry_section(args.device, args.rounds, solver)
    print(f"load average after: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
