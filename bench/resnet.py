"""ResNet-20 benchmark (issue 17): what the node-wise invariant measure costs on a BatchNorm ResNet.

Run by hand, never from the tests::

    python bench/resnet.py                # ResNet-20 on 1000 synthetic 3x32x32 samples (minutes on 2 cores)
    python bench/resnet.py --samples 250  # a quicker run
    python bench/resnet.py --json out.json
    python bench/resnet.py --section hvp  # one HVP against one gradient only (a few minutes)
    python bench/resnet.py --device cuda  # on a GPU (the workload is built on the CPU, then moved)

Section "measures" times, in one process and on the same float32 model and data (eval mode, cross-entropy over the whole
set): our Euclidean top eigenvalue, our node-wise (rescaling-invariant) top eigenvalue, and PyHessian's
top eigenvalue (``pip install --no-deps pyhessian``; skipped with a note when missing). Each solve runs
``--rounds`` times and the median is reported. Target: node-wise <= 1.3x our Euclidean measure.
The node-wise operator is ``diag(w) H diag(w) + diag(w g)`` projected off the model's exact rescaling
group (448 free channel scales on ResNet-20), so its extra cost over the Euclidean one is one gradient,
the projection, and whatever the spectrum changes in the number of Lanczos steps.

Section "hvp" (issue 22) times, at 1 and 2 threads (``--hvp-threads``), one gradient (``loss.backward()`` over
all samples at once) against one Hessian-vector product of the objective's ``"auto"`` strategy: with the data
in memory (a memory budget of ``--memory-gib``, so that what the products share is kept across them) and
streamed in 5 chunks (memory budget of one byte: each chunk's state is recomputed per product); then the same
with the autograd strategies "auto" picked for this model before the R-operator covered graphs ("graph" in
memory, "double_backward" streamed; ``--no-autograd`` skips them). Every case runs ``--hvp-rounds`` times,
interleaved with its gradients, and the best time counts. Targets: in memory <= 1.3x a gradient, streamed
<= 3x.

Section "memory" (issue 22) measures, each in a fresh process after the model and data are built and one forward
pass has run, the peak resident memory (the kernel's high-water mark, reset just before the operation, minus the
resident size then) of one gradient (``loss.backward()`` over all samples at once) and of top-eigenvalue solves:
the default ``lanczos`` under the objective's default memory budget (2 GiB on CPU: the products' state is kept
only where it fits) and ``low-memory-lanczos`` streaming the data in chunks of ``--memory-chunk`` with nothing
cached, Euclidean and node-wise. Target: the low-memory solves at most 2x one gradient.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))  # after the packages: bench/landscape.py loads this file

from _memory import budget_of, measure, module_gradient, run_probe  # noqa: E402
from _workloads import add_device_argument, clock, device_label, median_time, to_device, use_device  # noqa: E402

from manifolds import analyze  # noqa: E402
from sharpness import Objective, Solver, measure_sharpness  # noqa: E402
from sharpness.cli import resnet  # noqa: E402
from sharpness.products import retain_freed_memory  # noqa: E402


def workload(samples: int, seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = resnet(20)
    with torch.no_grad():  # off initialisation, with BatchNorm statistics of the data
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(samples, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (samples,), generator=g)
    model.train()
    with torch.no_grad():
        model(X[:256])  # running statistics from the data, then evaluated in eval mode
    return model.eval(), X, y


def _best_of(cases: dict, rounds: int) -> tuple[dict[str, float], dict[str, float], dict, float]:
    """Best wall and CPU seconds (of the process: all its threads) per case over ``rounds`` interleaved rounds,
    after one warm-up call each (its results and seconds are returned too). On a machine shared with other
    jobs the CPU time is the steadier figure: waiting for a core does not count."""
    start = clock()
    first = {name: fn() for name, fn in cases.items()}
    setup = clock() - start
    best, cpu = dict.fromkeys(cases, float("inf")), dict.fromkeys(cases, float("inf"))
    for _ in range(rounds):
        for name, fn in cases.items():
            t0, c0 = clock(), time.process_time()
            fn()
            best[name] = min(best[name], clock() - t0)
            cpu[name] = min(cpu[name], time.process_time() - c0)
    return best, cpu, first, setup


def hvp_section(model: nn.Module, X: torch.Tensor, y: torch.Tensor, threads: list[int], rounds: int,
                memory_gib: float, autograd: bool) -> dict:
    """Best-of-``rounds`` seconds of one gradient and one HVP (in memory, streamed in 5 chunks) per thread count:
    the ``"auto"`` strategy, and (``autograd``) the autograd strategies it picked for this model before the
    R-operator covered graphs ("graph" in memory, "double_backward" streamed), each set timed against its own
    interleaved gradients."""
    loss = nn.CrossEntropyLoss()
    budget, chunk = int(memory_gib * 2**30), -(-len(X) // 5)
    v = torch.randn(sum(p.numel() for p in model.parameters()), generator=torch.Generator().manual_seed(1)).to(X.device)

    def gradient():
        model.zero_grad(set_to_none=True)
        loss(model(X), y).backward()

    out: dict[str, dict] = {}
    for n in threads:
        torch.set_num_threads(n)
        row: dict[str, dict] = {}
        kinds = {"auto": (None, None)}
        if autograd:
            kinds["autograd"] = ("graph", "double_backward")
        for kind, (mem_strategy, stream_strategy) in kinds.items():
            in_memory = Objective(model, loss, (X, y), dtype=torch.float32, memory_budget=budget)
            streamed = Objective(model, loss, (X, y), dtype=torch.float32, chunk_size=chunk, memory_budget=1)
            mem_strategy = mem_strategy or in_memory.hvp_strategy()
            stream_strategy = stream_strategy or streamed.hvp_strategy()
            cases = {"gradient": gradient, "in memory": lambda o=in_memory, s=mem_strategy: o.hvp(v, s),
                     "streamed": lambda o=streamed, s=stream_strategy: o.hvp(v, s)}  # fmt: skip
            best, cpu, first, setup = _best_of(cases, rounds)
            error = float((first["streamed"] - first["in memory"]).norm() / first["in memory"].norm())
            g, gc = best["gradient"], cpu["gradient"]
            row[kind] = {"seconds": best, "cpu_seconds": cpu, "warm_up_seconds": setup,
                         "streamed_vs_in_memory": error,
                         "strategy": {"in memory": mem_strategy, "streamed": stream_strategy},
                         "ratio": {"in memory": best["in memory"] / g, "streamed": best["streamed"] / g},
                         "cpu_ratio": {k: cpu[k] / gc for k in ("in memory", "streamed")}}  # fmt: skip
            print(f"\n{n} thread(s), {kind}, load average {os.getloadavg()[0]:.1f}: gradient {g:.3f} s "
                  f"(CPU {gc:.3f} s); HVP in memory ({mem_strategy}) {best['in memory']:.3f} s = "
                  f"{best['in memory'] / g:.2f}x, CPU {cpu['in memory'] / gc:.2f}x (target <= 1.3x); streamed in 5 "
                  f"chunks ({stream_strategy}) {best['streamed']:.3f} s = {best['streamed'] / g:.2f}x, CPU "
                  f"{cpu['streamed'] / gc:.2f}x (target <= 3x); streamed vs in memory: relative difference "
                  f"{error:.1e}; warm-up {setup:.1f} s", flush=True)  # fmt: skip
            del in_memory, streamed, first
        out[str(n)] = row
    model.zero_grad(set_to_none=True)
    return out


def memory_probe(spec: dict) -> dict:
    """Runs in the child: build the workload, warm up, measure one operation's peak resident memory."""
    torch.set_num_threads(spec["threads"])
    retain_freed_memory()  # as in the parent and in any use of our objectives on the CPU
    device = torch.device(spec.get("device", "cpu"))
    model, X, y = workload(spec["samples"])
    X, y = to_device(device, model, X, y)
    loss = nn.CrossEntropyLoss()
    with torch.no_grad():
        model(X[: spec.get("chunk_size") or len(X)])  # warm-up forward

    if spec["op"] == "gradient":
        op = module_gradient(model, loss, X, y)
    else:

        def op():
            objective = Objective(model, loss, (X, y), dtype=torch.float32, chunk_size=spec.get("chunk_size"),
                                  **budget_of(spec))  # fmt: skip
            solver = Solver(spec["method"], spec["tol"], seed=0)
            return measure_sharpness(None, None, None, spec["measure"], solver=solver, objective=objective,
                                     progress=False)  # fmt: skip

    # RSS only: the torch allocator's trace of a multi-minute solve holds millions of events.
    return measure(op, lambda: model.zero_grad(set_to_none=True), rounds=("first",), torch_peak=False,
                   device=spec.get("device"))  # fmt: skip


def memory_section(samples: int, threads: int, tol: float, chunk: int, device: torch.device) -> dict:
    """Peak resident memory of one gradient and of the eigen-solves, each in a fresh process (see the docstring); on
    a GPU their peak GPU allocation (``torch.cuda.max_memory_allocated`` above the allocation before, reset first)."""
    gpu = device.type == "cuda"
    base = {"samples": samples, "threads": threads, **({"device": str(device)} if gpu else {})}
    solve = {"op": "solve", "tol": tol}
    streamed = {"method": "low-memory-lanczos", "chunk_size": chunk, "memory_budget": 1}  # nothing cached
    probes = {
        "gradient (loss.backward, all samples)": {"op": "gradient"},
        "euclidean, lanczos (default settings)": {**solve, "measure": "euclidean", "method": "lanczos"},
        f"euclidean, low-memory-lanczos streaming x{chunk}": {**solve, "measure": "euclidean", **streamed},
        f"node, low-memory-lanczos streaming x{chunk}": {**solve, "measure": "node", **streamed},
    }
    out: dict[str, dict] = {}
    what = "peak GPU memory allocated (torch.cuda.max_memory_allocated)" if gpu else "peak resident memory"
    print(f"\n{what}, each operation in a fresh process ({threads} thread(s), tol {tol:g}):")
    for name, spec in probes.items():
        start = time.perf_counter()
        out[name] = run_probe(__file__, {**base, **spec}) | {"spec": spec}
        out[name]["seconds"] = time.perf_counter() - start
        ratio = out[name]["rss_first_bytes"] / out["gradient (loss.backward, all samples)"]["rss_first_bytes"]
        out[name]["ratio"] = ratio
        target = f" (target <= 2x): {'met' if ratio <= 2 else 'MISSED'}" if "low-memory" in name else ""
        print(f"  {name:<48} {out[name]['rss_first_bytes'] / 2**20:9.1f} MiB  {ratio:5.2f}x a gradient{target}"
              f"  [{out[name]['seconds']:.0f} s, {'peak' if gpu else 'RSS'} mark "
              f"{'reset' if out[name]['rss_precise'] else 'coarse'}]",
              flush=True)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1000, help="synthetic 3x32x32 samples (default: 1000)")
    parser.add_argument("--rounds", type=int, default=1, help="solves per implementation; the median is shown")
    parser.add_argument("--tol", type=float, default=1e-3, help="relative tolerance of every solver (default: 1e-3)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--section", choices=("all", "measures", "hvp", "memory"), default="all",
                        help="what to time (memory runs only when named)")  # fmt: skip
    parser.add_argument("--memory-chunk", type=int, default=50,
                        help="memory section: chunk size of the streamed low-memory solves (default: 50)")
    add_device_argument(parser)
    parser.add_argument("--memory-probe", help=argparse.SUPPRESS)
    parser.add_argument("--hvp-threads", default="1,2", help="thread counts of the hvp section (default: 1,2)")
    parser.add_argument("--hvp-rounds", type=int, default=3, help="rounds of the hvp section (best counts)")
    parser.add_argument("--no-autograd", action="store_true",
                        help="hvp section: skip the autograd strategies (graph, double_backward) for comparison")
    parser.add_argument("--memory-gib", type=float, default=10.0,
                        help="memory budget of the in-memory HVP (default: 10 GiB)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.memory_probe:
        print(json.dumps(memory_probe(json.loads(args.memory_probe))))
        return 0
    use_device(parser, args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.type != "cpu":
        print(f"device: {device_label(args.device)} (the workload built on the CPU, then moved)", flush=True)
    if args.section == "memory":
        print(f"freed memory retained for reuse (glibc): {retain_freed_memory()}", flush=True)
        print(f"ResNet-20 with BatchNorm, {args.samples} synthetic 3x32x32 samples, float32, "
              f"{platform.processor() or platform.machine()}, torch {torch.__version__}")  # fmt: skip
        figures = {"samples": args.samples, "memory": memory_section(args.samples, torch.get_num_threads(),
                                                                     args.tol, args.memory_chunk,
                                                                     args.device)}  # fmt: skip
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=2))
        return 0
    model, X, y = workload(args.samples)
    X, y = to_device(args.device, model, X, y)
    # Every tool in this run under the same allocator settings (our objectives apply them on first use).
    print(f"freed memory retained for reuse (glibc): {retain_freed_memory()}", flush=True)
    figures: dict = {"samples": args.samples}
    if args.device.type != "cpu":
        figures["device"] = device_label(args.device)
    if args.section in ("all", "hvp"):
        print(f"ResNet-20 with BatchNorm, {args.samples} synthetic 3x32x32 samples, float32, "
              f"{platform.processor() or platform.machine()}, torch {torch.__version__}")  # fmt: skip
        threads = [int(t) for t in args.hvp_threads.split(",")]
        figures["hvp"] = hvp_section(model, X, y, threads, args.hvp_rounds, args.memory_gib, not args.no_autograd)
        if args.threads:
            torch.set_num_threads(args.threads)
    if args.section == "hvp":
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=2))
        return 0
    loss = nn.CrossEntropyLoss()
    n_params = sum(p.numel() for p in model.parameters())
    group = analyze(model, example_input=X[:2]).group
    print(f"ResNet-20 with BatchNorm: {n_params} parameters, rescaling group of dimension {group.dim}")
    print(f"data: {args.samples} synthetic 3x32x32 samples, float32, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}")  # fmt: skip
    solver = Solver(tol=args.tol)
    results: dict[str, dict] = {}

    def ours(metric: str):
        objective = Objective(model, loss, (X, y), dtype=torch.float32)
        return measure_sharpness(model, loss, (X, y), metric, solver=solver, objective=objective, progress=False)

    for metric in ("euclidean", "node"):
        seconds, res = median_time(lambda metric=metric: ours(metric), args.rounds)
        results[metric] = {"seconds": seconds, "value": float(res.value), "n_hvp": res.n_matvec}
    try:
        from pyhessian import hessian
    except ImportError:
        print("PyHessian not installed (pip install --no-deps pyhessian): skipped")
    else:

        def pyhessian_top():
            h = hessian(model, loss, data=(X, y), cuda=X.is_cuda)
            values, _ = h.eigenvalues(maxIter=200, tol=args.tol, top_n=1)
            return values[0]

        seconds, value = median_time(pyhessian_top, args.rounds)
        results["pyhessian"] = {"seconds": seconds, "value": float(value), "n_hvp": None}

    print(f"\n  {'measure':<22} {'top eigenvalue':>15} {'HVPs':>6} {'seconds':>9} {'/ ours euclidean':>17}")
    base = results["euclidean"]["seconds"]
    labels = {"euclidean": "ours, Euclidean", "node": "ours, node-wise", "pyhessian": "PyHessian, Euclidean"}
    for name, r in results.items():
        hvps = "-" if r["n_hvp"] is None else str(r["n_hvp"])
        print(f"  {labels[name]:<22} {r['value']:>15.6g} {hvps:>6} {r['seconds']:>9.2f} {r['seconds'] / base:>16.2f}x")
    ratio = results["node"]["seconds"] / base
    print(f"\nnode-wise / Euclidean time: {ratio:.2f}x (target <= 1.3x): {'met' if ratio <= 1.3 else 'MISSED'}")
    if "pyhessian" in results:
        print(f"ours Euclidean / PyHessian time: {base / results['pyhessian']['seconds']:.2f}x")
    if args.json:
        figures.update({"tol": args.tol, "results": results})
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
