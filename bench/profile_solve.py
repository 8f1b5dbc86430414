"""Where one top-eigenvalue solve spends its time, beyond its Hessian-vector products (issue 33).

Run by hand, never from the tests::

    python bench/profile_solve.py --workload T1 --device cuda   # the built-in ViT on a GPU
    python bench/profile_solve.py --workload F1 --tol 1e-3

Builds the workload (``bench/_workloads.py``), runs ``euclidean_sharpness`` once to warm up, times a second solve, then
profiles a third with cProfile (on a GPU the time a function waits for the device counts where the wait happens) and
prints the functions with the largest cumulative time, and the number of products against the solve's time.
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

from _workloads import WORKLOADS, add_device_argument, clock, device_label, make_workload, to_device, use_device  # noqa: E402

from sharpness import Solver, euclidean_sharpness  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=WORKLOADS, default="T1", help="workload (default: %(default)s)")
    parser.add_argument("--tol", type=float, default=2e-3, help="Lanczos tolerance (default: %(default)s)")
    parser.add_argument("--lines", type=int, default=30, help="profile lines to print (default: %(default)s)")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    use_device(parser, args.device)
    w = make_workload(args.workload)
    w.X, w.y = to_device(args.device, w.model, w.X, w.y)

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
