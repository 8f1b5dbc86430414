"""Data-parallel benchmark (issue 20): one process against two sharing the data, on a ResNet-20 workload.

Run by hand, never from the tests::

    python bench/distributed.py                    # ResNet-20, 4000 synthetic 3x32x32 samples, float32 (minutes)
    python bench/distributed.py --samples 1000     # quicker
    python bench/distributed.py --json out.json

Each configuration starts its processes afresh (``torch.multiprocessing`` spawn, a gloo group on a free port;
NCCL when they run on GPUs), builds the objective of the same model and data with ``distributed=True``, and
times, on every process between barriers: the loss and gradient (one pass), ``--products`` Hessian-vector
products of the ``"auto"`` strategy (the first one builds the products' state, counted apart), and a top-eigenvalue
Lanczos solve of ``--iterations`` steps. Reported per configuration: the seconds of each step (the slowest
process's), the speed-up against one process, and each process's peak memory (resident set; on GPUs the peak
allocated memory). Configurations on the CPU: 1 process with ``--threads`` threads each, 2 processes with
``--threads`` threads each, and 1 process with twice as many (the same cores as two processes). On a machine
with GPUs the same runs on 1 GPU and on up to 2.

The results must agree: the loss, gradient norm and top eigenvalue of every configuration are printed, and
their largest relative difference to one process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import resource
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from resnet import workload  # noqa: E402 - the ResNet-20 workload of bench/resnet.py

from sharpness import Objective, Solver, euclidean_sharpness  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(rank: int, world: int, port: int, options: dict, results) -> None:
    torch.set_num_threads(options["threads"])
    device = torch.device("cuda", rank) if options["gpu"] else torch.device("cpu")
    if options["gpu"]:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if options["gpu"] else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=3600))  # fmt: skip
    dtype = getattr(torch, options["dtype"])

    def sync() -> float:
        if options["gpu"]:
            torch.cuda.synchronize(device)
        dist.barrier()
        return time.perf_counter()

    try:
        model, X, y = workload(options["samples"])
        model = model.to(device, dtype)
        obj = Objective(model, torch.nn.CrossEntropyLoss(), (X.to(dtype), y), memory_budget=options["memory"],
                        chunk_size=options["chunk"], distributed=True)  # fmt: skip
        times = {}
        start = sync()
        loss, gradient = obj.value_and_gradient()
        times["loss and gradient"] = sync() - start
        v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(0), dtype=dtype).to(device)
        start = sync()
        obj.hvp(v)
        times["first product (builds its state)"] = sync() - start
        start = sync()
        for _ in range(options["products"]):
            obj.hvp(v)
        times["product"] = (sync() - start) / options["products"]
        solver = Solver(tol=1e-30, max_iter=options["iterations"])  # a fixed number of steps
        start = sync()
        top = euclidean_sharpness(None, None, None, solver=solver, objective=obj, progress=False)
        times[f"Lanczos, {options['iterations']} steps"] = sync() - start
        peak = (torch.cuda.max_memory_allocated(device) if options["gpu"]
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # fmt: skip
        results.put((rank, {
            "times": times, "peak_bytes": peak, "strategy": obj.hvp_strategy(), "kept": obj._rop_states is not None,
            "loss": float(loss), "gradient_norm": float(gradient.norm()), "top": float(top.value),
            "share": obj.data.n_samples,
        }))  # fmt: skip
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        results.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))
    finally:
        dist.destroy_process_group()


def configuration(world: int, options: dict) -> list[dict]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    processes = [context.Process(target=_run, args=(r, world, port, options, results)) for r in range(world)]
    for p in processes:
        p.start()
    found = dict(results.get() for _ in range(world))
    for p in processes:
        p.join()
    errors = [f"process {r}: {v['error']}" for r, v in found.items() if "error" in v]
    if errors:
        raise SystemExit("; ".join(errors))
    return [found[r] for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--products", type=int, default=3, help="timed products after the first (default 3)")
    parser.add_argument("--iterations", type=int, default=10, help="Lanczos steps (default 10)")
    parser.add_argument("--threads", type=int, default=1, help="threads per process on the CPU (default 1)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--memory-gib", type=float, default=8.0,
                        help="memory budget per process, GiB (default 8: the products' state of 4000 samples "
                             "fits in one process)")  # fmt: skip
    parser.add_argument("--chunk", type=int, default=500, help="samples per chunk (default 500)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    base = {"samples": args.samples, "products": args.products, "iterations": args.iterations, "dtype": args.dtype,
            "memory": int(args.memory_gib * 2**30), "chunk": args.chunk}  # fmt: skip
    runs = [("CPU, 1 process", 1, {**base, "threads": args.threads, "gpu": False}),
            ("CPU, 2 processes", 2, {**base, "threads": args.threads, "gpu": False}),
            (f"CPU, 1 process x {2 * args.threads} threads", 1, {**base, "threads": 2 * args.threads, "gpu": False})]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        runs.append(("1 GPU", 1, {**base, "threads": args.threads, "gpu": True}))
        if gpus >= 2:
            runs.append(("2 GPUs", 2, {**base, "threads": args.threads, "gpu": True}))
    print(f"ResNet-20, {args.samples} samples 3x32x32, {args.dtype}, chunks of {args.chunk}; "
          f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), {gpus} GPU(s); "
          f"torch {torch.__version__}")  # fmt: skip
    report = {"samples": args.samples, "dtype": args.dtype, "cpu_count": os.cpu_count(), "gpus": gpus, "runs": {}}
    baseline = {}
    for label, world, options in runs:
        ranks = configuration(world, options)
        steps = {k: max(r["times"][k] for r in ranks) for k in ranks[0]["times"]}
        key = "gpu" if options["gpu"] else "cpu"
        baseline.setdefault(key, (steps, ranks[0]))
        first_steps, first = baseline[key]
        print(f"\n{label}: shares {[r['share'] for r in ranks]}, products by {ranks[0]['strategy']!r}"
              f"{' (state kept)' if ranks[0]['kept'] else ' (streamed)'}")  # fmt: skip
        for name, seconds in steps.items():
            print(f"  {name:<36} {seconds:8.2f} s   speed-up {first_steps[name] / seconds:5.2f}x")
        print("  peak memory per process: " + ", ".join(f"{r['peak_bytes'] / 2**30:.2f} GiB" for r in ranks))
        agreement = max(abs(ranks[0][q] - first[q]) / abs(first[q]) for q in ("loss", "gradient_norm", "top"))
        print(f"  loss {ranks[0]['loss']:.6g}, |gradient| {ranks[0]['gradient_norm']:.6g}, top eigenvalue "
              f"{ranks[0]['top']:.6g} (largest relative difference to 1 process: {agreement:.1e})")  # fmt: skip
        report["runs"][label] = {"processes": world, **options, "steps": steps, "ranks": ranks, "agreement": agreement}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
