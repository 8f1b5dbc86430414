"""Where one top-eigenvalue solve spends its time, beyond its Hessian-vector products (issue 33).

Run by hand, never from the tests::

    python bench/profile_solve.py --workload T1 --device cuda   # the built-in ViT on a GPU
    python bench/profile_solve.py --workload F1 --tol 1e-3
    python bench/profile_solve.py --workload T1 --krylov      # what a random start can reach in m products

Builds the workload (``bench/_workloads.py``), runs ``euclidean_sharpness`` once to warm up, times a second solve, then
profiles a third with cProfile (on a GPU the time a function waits for the device counts where the wait happens) and
prints the functions with the largest cumulative time, and the number of products against the solve's time.

``--krylov``: instead, the relative error of the top Ritz value after ``m`` products (Lanczos, full
reorthogonalization, no stopping rule) from each of the five random starts the curvature benchmark draws (seeds 0-4),
against the float64 top eigenvalue: the products any Krylov solver needs from a random start to reach the benchmark's
1e-5, whatever its stopping rule.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _workloads import WORKLOADS, add_device_argument, clock, device_label, make_workload, to_device, use_device  # noqa: E402

from sharpness import Objective, Solver, euclidean_sharpness  # noqa: E402
from sharpness.products import HessianOperator  # noqa: E402
from sharpness.solvers import lanczos  # noqa: E402


def krylov_errors(w, dims: range, seeds: int = 5) -> None:
    """Print the top Ritz value's relative error after each of ``dims`` products, per start (see the docstring)."""
    exact = Objective(w.model, w.loss_fn, (w.X, w.y), dtype=torch.float64)
    ref = float(euclidean_sharpness(None, None, None, 1, solver=Solver(tol=1e-10), progress=False,
                                    objective=exact).value)  # fmt: skip
    op = HessianOperator(Objective(w.model, w.loss_fn, (w.X, w.y)))
    print(f"lambda_max (float64) {ref:.10g}; relative error of the top Ritz value after m products:")
    print("start  " + "  ".join(f"m={m:<7d}" for m in dims))
    for seed in range(seeds):
        errors = []
        for m in dims:
            result = lanczos(op, 1, tol=1e-12, max_iter=m, generator=torch.Generator().manual_seed(seed),
                             progress=False)  # fmt: skip
            errors.append(abs(float(result.eigenvalues[0]) - ref) / ref)
        print(f"{seed:<5d}  " + "  ".join(f"{e:<9.1e}" for e in errors))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=WORKLOADS, default="T1", help="workload (default: %(default)s)")
    parser.add_argument("--tol", type=float, default=2e-3, help="Lanczos tolerance (default: %(default)s)")
    parser.add_argument("--lines", type=int, default=30, help="profile lines to print (default: %(default)s)")
    parser.add_argument("--krylov", action="store_true", help="print the Ritz value's error per Krylov dimension "
                        "from five random starts instead of profiling")  # fmt: skip
    add_device_argument(parser)
    args = parser.parse_args(argv)
    use_device(parser, args.device)
    w = make_workload(args.workload)
    w.X, w.y = to_device(args.device, w.model, w.X, w.y)
    if args.krylov:
        krylov_errors(w, range(3, 10))
        return 0

    def solve():
        solver = Solver("lanczos", args.tol, seed=0)
        return euclidean_sharpness(w.model, w.loss_fn, (w.X, w.y), 1, solver=solver, progress=False)

    solve()
    start = clock(args.device)
    result = solve()
    seconds = clock(args.device) - start
    print(f"{args.workload} on {device_label(args.device)}: one solve {seconds * 1e3:.1f} ms, {result.n_matvec} "
          f"products, lambda_max {float(result.value):.6f}")  # fmt: skip
    profiler = cProfile.Profile()
    profiler.runcall(solve)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.lines)
    print(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
