"""G-space benchmark (issue 4): cost of one G-SGD step against one SGD step, and of building G-space.

Run by hand, never from the tests::

    python bench/gspace.py                  # full run, a few minutes
    python bench/gspace.py --quick          # smoke run
    python bench/gspace.py --json out.json  # also write every figure as JSON
    python bench/gspace.py --device cuda    # on a GPU: steps and our construction there, wall time (GPU waited for)

1. One training step (zero_grad, forward, backward, update) on the thesis's MNIST network shape
   784-64-64-64-64-10 (bias-free ReLU, float32, G-SGD's initialization: skeleton weights 1), random
   data, batch 64, 256 and 1024, with 1 and 2 intra-op threads: SGD on the weights against G-SGD
   three ways: :class:`manifolds.GOptimizer` (gradients by the hand-written inverse chain rule, no
   autograd graph for ``w(v)``), :class:`manifolds.GModel` (fused backward, the default) and
   ``GModel(fused=False)`` (every operation of ``w(v)`` recorded by autograd); also Adam against
   G-Adam (batch 64). Each G-space variant runs in blocks of steps interleaved with blocks of the
   weight-space optimizer, alternating which goes first, one pair at a time (a third variant in the
   rotation would change what the caches hold when a block starts). A block's time is its thread
   CPU time with 1 thread (robust to other processes on a shared machine), its wall time with 2 (the
   process CPU time is printed too). The ratio to SGD is the median over block pairs of a G block's
   time over the adjacent SGD block's (pairs see the same machine load), with its quartiles and the
   ratio of the fastest blocks beside it. Then the phases of one step (zero_grad, forward, backward,
   update; for G-SGD the update is the inverse chain rule, the wrapped optimizer's update of ``v``,
   and writing ``w(v)`` back). Target: G-SGD <= 1.3x SGD at batch 64 (the G-SGD paper reports about
   7 % on GPUs with ResNets, whose per-step compute dwarfs the fixed cost of ``w(v)``).
2. Building G-space (structure discovery, skeleton, index and scale buffers, coordinates) for
   784-h-h-h-h-10 networks, against the thesis's construction, *reimplemented* here only as far as
   needed to time it: Algorithm 1 (skeleton masks), the constant-path-factor matrices of eqs.
   (2.11)-(2.12) (dense products of the masked skeleton matrices) and Algorithm 2 (the forward
   transformation: one Python step per weight entry, over Python lists to be generous). Its
   coordinates are checked against ours. The thesis's cost grows with the number of weights
   (quadratically in the width) at Python-loop speed; ours is vectorized.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import platform
import statistics
import sys
import time

import torch
from _workloads import add_device_argument, clock, device_label, use_device
from torch import nn

from manifolds import GModel, GOptimizer, GSpace, gsgd_init_
from sharpness.cli import mlp

CPU = torch.device("cpu")


def mnist_net(width: int = 64, seed: int = 0) -> nn.Sequential:
    """784-w-w-w-w-10 bias-free ReLU MLP (the thesis's MNIST network for w = 64)."""
    torch.manual_seed(seed)
    return mlp([784, width, width, width, width, 10], bias=False)


def on(device: torch.device, model: nn.Module) -> nn.Module:
    """``model`` itself on the CPU, else a copy of it on ``device``."""
    return model if device.type == "cpu" else copy.deepcopy(model).to(device)


# ------------------------------------------------------------------------------------------------
# 1. step cost


def step_functions(optimizer: str, lr: float, batch: int, device: torch.device = CPU) -> dict:
    """``{label: step()}`` for the weight-space optimizer and its G-space versions on one batch."""
    base = gsgd_init_(mnist_net())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 784, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    loss_fn = nn.CrossEntropyLoss()
    cls = {"SGD": torch.optim.SGD, "Adam": torch.optim.Adam}[optimizer]
    steps = {}

    def make(net, opt):
        def step():
            opt.zero_grad()
            loss_fn(net(x), y).backward()
            opt.step()

        return step

    plain = mnist_net()
    plain.load_state_dict(base.state_dict())
    plain = on(device, plain)
    steps[optimizer] = make(plain, cls(plain.parameters(), lr=lr))
    wrapped = mnist_net()
    wrapped.load_state_dict(base.state_dict())
    wrapped = on(device, wrapped)
    steps[f"G-{optimizer} (GOptimizer)"] = make(wrapped, GOptimizer(wrapped, cls, lr=lr))
    base = on(device, base)
    gmodel = GModel(base)
    steps[f"G-{optimizer} (GModel)"] = make(gmodel, cls(gmodel.parameters(), lr=lr))
    unfused = GModel(base, fused=False)
    steps[f"G-{optimizer} (GModel, fused=False)"] = make(unfused, cls(unfused.parameters(), lr=lr))
    return steps


def phases(batch: int, repeats: int, device: torch.device = CPU) -> dict:
    """Median CPU microseconds of each phase of an SGD step and a GOptimizer G-SGD step, interleaved (on a GPU: wall
    microseconds, the GPU waited for at each mark)."""
    base = gsgd_init_(mnist_net())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)
    x, y = x.to(device), y.to(device)
    loss_fn = nn.CrossEntropyLoss()
    plain, wrapped = mnist_net(), mnist_net()
    plain.load_state_dict(base.state_dict())
    wrapped.load_state_dict(base.state_dict())
    plain, wrapped = on(device, plain), on(device, wrapped)
    tick = time.thread_time if device.type == "cpu" else lambda: clock(device)
    sgd, gsgd = torch.optim.SGD(plain.parameters(), lr=1e-3), GOptimizer(wrapped, torch.optim.SGD, lr=1e-3)
    names = {
        "SGD": ["zero_grad", "forward", "backward", "update"],
        "G-SGD": ["zero_grad", "forward", "backward", "ICR (dL/dv)", "update of v", "w(v) into the model"],
    }
    samples: dict[str, list[list[float]]] = {"SGD": [], "G-SGD": []}
    for it in range(repeats + 10):
        for label, net, opt in (("SGD", plain, sgd), ("G-SGD", wrapped, gsgd)):
            marks = [tick()]
            opt.zero_grad()
            marks.append(tick())
            loss = loss_fn(net(x), y)
            marks.append(tick())
            loss.backward()
            marks.append(tick())
            if label == "SGD":
                opt.step()
            else:  # what GOptimizer.step does, phase by phase
                opt._pull()
                marks.append(tick())
                opt._inner_step()
                marks.append(tick())
                opt._push()
            marks.append(tick())
            if it >= 10:  # warm-up
                samples[label].append([(b - a) * 1e6 for a, b in zip(marks, marks[1:])])
    out = {}
    for label, rows in samples.items():
        medians = [statistics.median(col) for col in zip(*rows)]
        out[label] = dict(zip(names[label], medians))
        print(f"{label:6s} " + ", ".join(f"{k} {v:.0f}us" for k, v in out[label].items()))
    return out


def time_pair(base, step, blocks: int, per_block: int) -> dict:
    """Per-step microseconds of two step functions run in interleaved blocks, alternating which goes first:
    ``{"base" | "step": {"cpu": [...], "wall": [...]}}``, one entry per block.

    Pairs only: a third variant in the rotation would change what the caches hold when each block starts.
    ``cpu`` is the thread's CPU time with one intra-op thread, the process's otherwise.
    """
    cpu_clock = time.thread_time if torch.get_num_threads() == 1 else time.process_time
    for fn in (base, step):  # warm-up (allocator, first-call dispatch)
        for _ in range(10):
            fn()
    times = {label: {"cpu": [], "wall": []} for label in ("base", "step")}
    order = [("base", base), ("step", step)]
    for block in range(blocks):
        for label, fn in order if block % 2 == 0 else order[::-1]:
            cpu, wall = cpu_clock(), clock()
            for _ in range(per_block):
                fn()
            wall = clock() - wall  # the GPU, if one is used, waited for
            times[label]["cpu"].append((cpu_clock() - cpu) / per_block * 1e6)
            times[label]["wall"].append(wall / per_block * 1e6)
    return times


def ratio_row(times: dict, clock: str) -> dict:
    """Step times and the ratio of ``step`` to ``base``: the median over block pairs of their ratio (pairs
    see the same machine load), its quartiles, and the ratio of the fastest blocks."""
    paired = sorted(a / b for a, b in zip(times["step"][clock], times["base"][clock]))
    q25, q50, q75 = (paired[int(q * (len(paired) - 1))] for q in (0.25, 0.5, 0.75))
    return {
        "cpu_median_us": statistics.median(times["step"]["cpu"]),
        "wall_median_us": statistics.median(times["step"]["wall"]),
        "base_cpu_median_us": statistics.median(times["base"]["cpu"]),
        "base_wall_median_us": statistics.median(times["base"]["wall"]),
        "ratio_paired_median": q50,
        "ratio_paired_q25": q25,
        "ratio_paired_q75": q75,
        "ratio_min": min(times["step"][clock]) / min(times["base"][clock]),
    }


def step_costs(threads: list[int], batches: list[int], blocks: int, per_block: int, device: torch.device = CPU) -> dict:
    """Section 1: every (optimizer, threads, batch) configuration, then a summary of the ratios."""
    configs = [("SGD", 1e-3, t, b) for t in threads for b in batches]
    configs += [("Adam", 1e-4, t, batches[0]) for t in threads]
    record: dict = {}
    for optimizer, lr, n_threads, batch in configs:
        torch.set_num_threads(n_threads)
        which = "cpu" if n_threads == 1 and device.type == "cpu" else "wall"
        print(f"\n{optimizer}, batch {batch}, {n_threads} thread(s); ratios on {which} time, pairs with {optimizer}:")
        print(
            f"{'step':34s} {'CPU median':>11s} {'wall median':>12s} {optimizer + ' CPU/wall':>16s}   "
            "ratio: paired median [q25, q75], fastest blocks"
        )
        steps = step_functions(optimizer, lr, batch, device)
        base = steps.pop(optimizer)
        rows = {}
        for label, step in steps.items():
            row = rows[label] = ratio_row(time_pair(base, step, blocks, per_block), which)
            print(
                f"{label:34s} {row['cpu_median_us']:9.0f}us {row['wall_median_us']:10.0f}us "
                f"{row['base_cpu_median_us']:7.0f}/{row['base_wall_median_us']:.0f}us   "
                f"{row['ratio_paired_median']:.2f}x [{row['ratio_paired_q25']:.2f}, {row['ratio_paired_q75']:.2f}], "
                f"{row['ratio_min']:.2f}x"
            )
        record[f"{optimizer}/threads={n_threads}/batch={batch}"] = rows
    torch.set_num_threads(threads[0])
    print("\nsummary: one G-SGD step / one SGD step (paired median; target <= 1.3 at batch 64)")
    print(f"{'threads':>7s} {'batch':>6s} {'GOptimizer':>11s} {'GModel':>8s} {'GModel unfused':>15s}")
    for key, rows in record.items():
        optimizer, n_threads, batch = key.split("/")
        if optimizer != "SGD":
            continue
        ratios = [rows[f"G-SGD ({v})"]["ratio_paired_median"] for v in ("GOptimizer", "GModel", "GModel, fused=False")]
        print(f"{n_threads[8:]:>7s} {batch[6:]:>6s} {ratios[0]:10.2f}x {ratios[1]:7.2f}x {ratios[2]:14.2f}x")
    return record


# ------------------------------------------------------------------------------------------------
# 2. construction cost


def thesis_construction(model: nn.Sequential) -> list[list[list[float]]]:
    """The thesis's G-space construction for a straight MLP, reimplemented to be timed.

    Algorithm 1 (masks; last layer i -> i mod K as in the G-SGD paper), the constant path factors
    ``S_l(r, c) = F_{l-1}(c, c) B_{l+1}(r, r)`` of eqs. (2.11)-(2.12) from dense products of the masked
    skeleton matrices (the last one repeated until square), then Algorithm 2 with the constant path
    factor: one Python step per weight entry. Returns per layer the path value at each edge (NaN on
    skeleton entries), i.e. ``GSpace.to_edges`` layout.
    """
    W = [m.weight.detach().double() for m in model if isinstance(m, nn.Linear)]
    n, h, d = len(W), W[0].shape[0], W[0].shape[1]
    masks = []
    for layer, w in enumerate(W):  # Algorithm 1
        mask = torch.zeros_like(w, dtype=torch.bool)
        if layer > 0:
            cols = torch.arange(w.shape[1])
            mask[cols % w.shape[0], cols] = True
        masks.append(mask)
    skeletal = [w * mask for w, mask in zip(W, masks)]
    skeletal[-1] = skeletal[-1][torch.arange(h) % skeletal[-1].shape[0]]  # repeated until square
    eye = torch.eye(h, dtype=torch.float64)
    forward_products = [eye, eye]  # F_{l}: product of skeleton matrices of layers 2..l (1-based)
    for layer in range(1, n):
        forward_products.append(skeletal[layer] @ forward_products[-1])
    backward_products = [eye] * (n + 1)  # B_{l}: product of layers l..L
    for layer in range(n - 1, 0, -1):
        backward_products[layer] = backward_products[layer + 1] @ skeletal[layer]
    first = W[0].tolist()
    v_j = [first[j][j % d] for j in range(h)]  # free first-layer skeleton weights
    out: list[list[list[float]]] = []
    for layer in range(n):  # Algorithm 2, entry by entry
        f_diag = torch.diagonal(forward_products[layer]).tolist()
        b_diag = torch.diagonal(backward_products[layer + 1]).tolist()
        weights, mask = W[layer].tolist(), masks[layer].tolist()
        rows = []
        for r, row in enumerate(weights):
            values = []
            for c, w in enumerate(row):
                if mask[r][c]:
                    values.append(math.nan)
                elif layer == 0:
                    values.append(w * b_diag[r])  # v_j and v_h: w * w_{s:p}
                else:
                    values.append(w * v_j[c] * f_diag[c] * b_diag[r % len(b_diag)])  # v_i
            rows.append(values)
        out.append(rows)
    return out


def ours(model: nn.Module) -> tuple[GSpace, torch.Tensor]:
    gs = GSpace(model)
    return gs, gs.coordinates().detach()


def time_call(fn, repeats: int, device: torch.device = CPU) -> float:
    """Best process CPU seconds of ``fn`` (on a GPU: wall seconds, the GPU waited for)."""
    now = time.process_time if device.type == "cpu" else lambda: clock(device)
    best = math.inf
    for _ in range(repeats):
        start = now()
        fn()
        best = min(best, now() - start)
    return best


def construction(widths: list[int], thesis_widths: list[int], repeats: int, device: torch.device = CPU) -> dict:
    """Ours on ``device``; the thesis's construction (Python loops over the weights) on the CPU."""
    check = mnist_net(16, seed=3).double()
    gs, v = ours(on(device, check))
    edges = {name: e.cpu() for name, e in gs.to_edges(v, fill=math.nan).items()}
    reference = thesis_construction(check)
    error = 0.0
    for layer, name in enumerate(gs.names):
        ref = torch.tensor(reference[layer], dtype=torch.float64)
        known = ~torch.isnan(ref)
        error = max(error, float(((edges[name][known] - ref[known]).abs() / ref[known].abs()).max()))
    print(f"\nthesis construction vs GSpace on 784-16x4-10: max relative difference of the coordinates {error:.1e}")
    print(f"{'width':>6s} {'weights m':>10s} {'ours [ms]':>10s} {'thesis [ms]':>12s} {'thesis / ours':>14s}")
    rows = []
    for width in widths:
        model = mnist_net(width)
        m = sum(p.numel() for p in model.parameters())
        t_ours = time_call(functools.partial(ours, on(device, model)), repeats, device)
        t_thesis = time_call(lambda model=model: thesis_construction(model), 1) if width in thesis_widths else None
        rows.append({"width": width, "weights": m, "ours_s": t_ours, "thesis_s": t_thesis})
        thesis = (
            f"{t_thesis * 1e3:12.1f} {t_thesis / t_ours:13.1f}x" if t_thesis is not None else f"{'-':>12s} {'-':>14s}"
        )
        print(f"{width:6d} {m:10d} {t_ours * 1e3:10.2f} {thesis}")
    for key in ("ours_s", "thesis_s"):
        pts = [(r["width"], r[key]) for r in rows if r[key] is not None and r["width"] >= 64]
        if len(pts) >= 2:
            slope = math.log(pts[-1][1] / pts[0][1]) / math.log(pts[-1][0] / pts[0][0])
            print(f"growth exponent of {key[:-2]} in the width (from width {pts[0][0]} to {pts[-1][0]}): {slope:.2f}")
    return {"max_rel_difference_vs_thesis": error, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="G-SGD step cost vs SGD, and G-space construction cost.")
    parser.add_argument("--quick", action="store_true", help="smoke run (fewer repeats, widths and sizes)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="intra-op threads (default: 1 2)")
    parser.add_argument(
        "--batch", type=int, nargs="+", default=[64, 256, 1024], help="batch sizes (default: 64 256 1024)"
    )
    parser.add_argument("--json", help="also write the figures to this JSON file")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    use_device(parser, args.device)
    blocks, per_block = (6, 5) if args.quick else (40, 10)
    batches = args.batch[:1] if args.quick else args.batch
    widths = [16, 32, 64, 128] if args.quick else [16, 32, 64, 128, 256, 512, 1024]
    thesis_widths = [16, 32, 64] if args.quick else [16, 32, 64, 128, 256]
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    record: dict = {"torch": torch.__version__, "load_average_before": os.getloadavg()[0]}
    gpu = args.device.type != "cpu"
    if gpu:
        record["device"] = device_label(args.device)
        print(f"device: {record['device']}; every time is wall time, the GPU waited for; the thesis's construction "
              "runs on the CPU")  # fmt: skip
    record["steps"] = step_costs(args.threads, batches, blocks, per_block, args.device)
    torch.set_num_threads(1)
    clock_name = "wall time, the GPU waited for at each phase" if gpu else "thread CPU time"
    print(f"\nphases of one step, batch 64, 1 thread (median {clock_name}):")
    record["phases"] = phases(64, 30 if args.quick else 300, args.device)
    record["construction"] = construction(widths, thesis_widths, 2 if args.quick else 3, args.device)
    record["load_average_after"] = os.getloadavg()[0]
    print(f"\nload average after: {record['load_average_after']:.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(record, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
