"""G-space benchmark (issue 4): cost of one G-SGD step against one SGD step, and of building G-space.

Run by hand, never from the tests::

    python bench/gspace.py                  # full run, about a minute
    python bench/gspace.py --quick          # smoke run
    python bench/gspace.py --json out.json  # also write every figure as JSON

1. One training step (zero_grad, forward, backward, update) on the thesis's MNIST network shape
   784-64-64-64-64-10 (bias-free ReLU, float32), batch 64, random data: SGD on the weights against
   G-SGD three ways: :class:`manifolds.GOptimizer` (gradients by the hand-written inverse chain rule,
   no autograd graph for ``w(v)``), :class:`manifolds.GModel` (fused backward, the default) and
   ``GModel(fused=False)`` (every operation of ``w(v)`` recorded by autograd); also Adam against
   G-Adam. Steps are timed interleaved (ABAB...), in blocks; the table gives the median and the
   minimum over blocks of the per-step process CPU time (robust to other processes on a shared
   machine) and wall time. Then the phases of one step (zero_grad, forward, backward, update; for
   G-SGD the update is the inverse chain rule, the wrapped optimizer's update of ``v``, and writing
   ``w(v)`` back). Target: G-SGD <= 1.3x SGD (the G-SGD paper reports about 7 % on GPUs with
   ResNets, whose per-step compute dwarfs the fixed cost of ``w(v)``).
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
import json
import math
import os
import platform
import statistics
import sys
import time

import torch
from torch import nn

from manifolds import GModel, GOptimizer, GSpace
from sharpness._specs import mlp


def mnist_net(width: int = 64, seed: int = 0) -> nn.Sequential:
    """784-w-w-w-w-10 bias-free ReLU MLP (the thesis's MNIST network for w = 64)."""
    torch.manual_seed(seed)
    return mlp([784, width, width, width, width, 10], bias=False)


def gsgd_init(model: nn.Module) -> nn.Module:
    """Skeleton and first-layer chain weights set to 1 (G-SGD's initialization), so no chain nears 0."""
    gs = GSpace(model)
    with torch.no_grad():
        for name, mask in gs.skeleton_masks().items():
            model.get_parameter(name)[mask | gs.predecessor_masks()[name]] = 1.0
    return model


# ------------------------------------------------------------------------------------------------
# 1. step cost


def step_functions(optimizer: str, lr: float, batch: int) -> dict:
    """``{label: step()}`` for the weight-space optimizer and its G-space versions on one batch."""
    base = gsgd_init(mnist_net())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 784, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
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
    steps[optimizer] = make(plain, cls(plain.parameters(), lr=lr))
    wrapped = mnist_net()
    wrapped.load_state_dict(base.state_dict())
    steps[f"G-{optimizer} (GOptimizer)"] = make(wrapped, GOptimizer(wrapped, cls, lr=lr))
    gmodel = GModel(base)
    steps[f"G-{optimizer} (GModel)"] = make(gmodel, cls(gmodel.parameters(), lr=lr))
    unfused = GModel(base, fused=False)
    steps[f"G-{optimizer} (GModel, fused=False)"] = make(unfused, cls(unfused.parameters(), lr=lr))
    return steps


def phases(batch: int, repeats: int) -> dict:
    """Median CPU microseconds of each phase of an SGD step and a GOptimizer G-SGD step, interleaved."""
    base = gsgd_init(mnist_net())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)
    loss_fn = nn.CrossEntropyLoss()
    plain, wrapped = mnist_net(), mnist_net()
    plain.load_state_dict(base.state_dict())
    wrapped.load_state_dict(base.state_dict())
    sgd, gsgd = torch.optim.SGD(plain.parameters(), lr=1e-3), GOptimizer(wrapped, torch.optim.SGD, lr=1e-3)
    names = {
        "SGD": ["zero_grad", "forward", "backward", "update"],
        "G-SGD": ["zero_grad", "forward", "backward", "ICR (dL/dv)", "update of v", "w(v) into the model"],
    }
    samples: dict[str, list[list[float]]] = {"SGD": [], "G-SGD": []}
    for it in range(repeats + 10):
        for label, net, opt in (("SGD", plain, sgd), ("G-SGD", wrapped, gsgd)):
            marks = [time.process_time()]
            opt.zero_grad()
            marks.append(time.process_time())
            loss = loss_fn(net(x), y)
            marks.append(time.process_time())
            loss.backward()
            marks.append(time.process_time())
            if label == "SGD":
                opt.step()
            else:  # what GOptimizer.step does, phase by phase
                opt._pull()
                marks.append(time.process_time())
                opt.optimizer.step()
                marks.append(time.process_time())
                opt._push()
            marks.append(time.process_time())
            if it >= 10:  # warm-up
                samples[label].append([(b - a) * 1e6 for a, b in zip(marks, marks[1:])])
    out = {}
    for label, rows in samples.items():
        medians = [statistics.median(col) for col in zip(*rows)]
        out[label] = dict(zip(names[label], medians))
        print(f"{label:6s} " + ", ".join(f"{k} {v:.0f}us" for k, v in out[label].items()))
    return out


def time_steps(steps: dict, blocks: int, per_block: int) -> dict:
    """Per-step CPU and wall microseconds of interleaved blocks: ``{label: {"cpu": [...], "wall": [...]}}``."""
    for step in steps.values():  # warm-up (allocator, first-call dispatch)
        for _ in range(10):
            step()
    times = {label: {"cpu": [], "wall": []} for label in steps}
    for _ in range(blocks):
        for label, step in steps.items():
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(per_block):
                step()
            times[label]["cpu"].append((time.process_time() - cpu) / per_block * 1e6)
            times[label]["wall"].append((time.perf_counter() - wall) / per_block * 1e6)
    return times


def report_steps(optimizer: str, times: dict) -> dict:
    base = times[optimizer]
    rows = {}
    print(f"\n{'step':34s} {'CPU median':>11s} {'CPU min':>9s} {'wall median':>12s}  ratio (CPU median / min)")
    for label, t in times.items():
        ratio_med = statistics.median(t["cpu"]) / statistics.median(base["cpu"])
        ratio_min = min(t["cpu"]) / min(base["cpu"])
        rows[label] = {
            "cpu_median_us": statistics.median(t["cpu"]),
            "cpu_min_us": min(t["cpu"]),
            "wall_median_us": statistics.median(t["wall"]),
            "ratio_cpu_median": ratio_med,
            "ratio_cpu_min": ratio_min,
        }
        print(
            f"{label:34s} {statistics.median(t['cpu']):9.0f}us {min(t['cpu']):7.0f}us "
            f"{statistics.median(t['wall']):10.0f}us  {ratio_med:.2f}x / {ratio_min:.2f}x"
        )
    return rows


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


def time_call(fn, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def construction(widths: list[int], thesis_widths: list[int], repeats: int) -> dict:
    check = mnist_net(16, seed=3).double()
    gs, v = ours(check)
    edges = gs.to_edges(v, fill=math.nan)
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
        t_ours = time_call(lambda model=model: ours(model), repeats)
        t_thesis = time_call(lambda model=model: thesis_construction(model), 1) if width in thesis_widths else None
        rows.append({"width": width, "weights": m, "ours_s": t_ours, "thesis_s": t_thesis})
        thesis = (
            f"{t_thesis * 1e3:12.1f} {t_thesis / t_ours:13.0f}x" if t_thesis is not None else f"{'-':>12s} {'-':>14s}"
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
    parser.add_argument("--quick", action="store_true", help="smoke run (fewer repeats and widths)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1)")
    parser.add_argument("--batch", type=int, default=64, help="batch size of the step benchmark (default: 64)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    blocks, per_block = (5, 5) if args.quick else (40, 10)
    widths = [16, 32, 64, 128] if args.quick else [16, 32, 64, 128, 256, 512, 1024]
    thesis_widths = [16, 32, 64] if args.quick else [16, 32, 64, 128, 256]
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"{args.threads} thread(s), load average {os.getloadavg()[0]:.1f}"
    )
    record: dict = {"torch": torch.__version__, "threads": args.threads, "load_average": os.getloadavg()[0]}
    for optimizer, lr in (("SGD", 1e-3), ("Adam", 1e-4)):
        times = time_steps(step_functions(optimizer, lr, args.batch), blocks, per_block)
        record[f"step_{optimizer}"] = report_steps(optimizer, times)
    print("\nphases of one step (median process CPU time):")
    record["phases"] = phases(args.batch, 30 if args.quick else 300)
    record["construction"] = construction(widths, thesis_widths, 2 if args.quick else 3)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(record, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
