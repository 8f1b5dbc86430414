"""Cost of one metric-driven Riemannian Hessian-vector product (``manifolds.MetricQuotient``: the connection by
``torch.func`` JVPs/VJP of the metric function) against one Euclidean HVP and the closed-form quotients.

Run by hand, never from the tests::

    python bench/connection.py                  # float64 and float32, layer and node metrics
    python bench/connection.py --threads 2 --repeats 30
    python bench/connection.py --device cuda    # on a GPU: wall time, the GPU waited for

Workload: ReLU MLP 784-128-64-10 with biases (109,386 parameters) on the 500 Gaussian samples of
``bench/_workloads.make_data("F1")`` with random labels, cross-entropy, after 20 full-batch Adam steps (a
non-critical point, so the connection terms are not zero). Rows, per dtype and metric, timed round-robin after a
warm-up, minimum over ``--repeats`` rounds of
the process CPU time (one thread by default, so a machine shared with other jobs does not inflate it):

- ``euclidean``: ``Objective.hvp(v)`` (the product every solver uses);
- ``closed``: ``H xi`` plus the closed-form Levi-Civita terms of ``LayerScaleQuotient`` / ``NodeScaleQuotient``;
- ``metric``: ``H xi`` plus ``MetricQuotient.connection_hessian`` (two JVPs and one VJP of the metric);
- ``metric whitened``: one application of ``MetricQuotient.whitened_hessian`` (what Lanczos applies:
  whitening, horizontal projection in and out, solve; the connection as the point's fixed linear map,
  ``MetricQuotient.connection_operator``: two backward passes through graphs recorded once, and the metric's
  derivative along the gradient).
"""

from __future__ import annotations

import argparse
import time

import torch
from _workloads import add_device_argument, clock, device_label, make_data, to_device, use_device
from torch import nn

from manifolds import LayerScaleQuotient, MetricQuotient, NodeScaleQuotient, analyze, layer_metric, node_metric
from sharpness import Objective


def workload(dtype: torch.dtype) -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    X, y = make_data("F1", 500)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(20):
        opt.zero_grad(set_to_none=True)
        loss_fn(model(X), y).backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    return model.to(dtype).eval(), loss_fn, X.to(dtype), y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    add_device_argument(parser)
    args = parser.parse_args()
    use_device(parser, args.device)
    torch.set_num_threads(args.threads)
    if args.device.type == "cpu":
        print(f"torch {torch.__version__}, {args.threads} thread(s), CPU time, minimum of {args.repeats} rounds")
    else:
        print(f"torch {torch.__version__}, {device_label(args.device)}, wall time (the GPU waited for), minimum of "
              f"{args.repeats} rounds")  # fmt: skip
    for dtype in (torch.float64, torch.float32):
        model, loss_fn, X, y = workload(dtype)
        X, y = to_device(args.device, model, X, y)
        obj = Objective(model, loss_fn, (X, y))
        w, g = obj.layout.flatten(obj.params), obj.gradient()
        structure = analyze(model)
        print(f"\n{str(dtype).removeprefix('torch.')}: n = {w.numel():,}, loss {float(obj.value()):.4f}")
        for name, closed_cls, metric in (("layer", LayerScaleQuotient, layer_metric(obj.layout)),
                                         ("node", NodeScaleQuotient, node_metric())):
            closed = closed_cls(obj.params, structure, obj.layout)
            ours = MetricQuotient(metric, w, vertical=closed.vertical_basis().T)
            best, agree = time_products(obj, g, closed, ours, args.repeats)
            base = best["euclidean"]
            row = ", ".join(f"{k} {v * 1e3:.2f} ms ({v / base:.2f}x)" for k, v in best.items())
            print(f"  {name}: {row}; metric vs closed-form relative difference {agree:.1e}")


def time_products(obj: Objective, g: torch.Tensor, closed, ours: MetricQuotient, repeats: int):
    """Minimum CPU seconds of each product (round-robin; on a GPU wall seconds, the GPU waited for), and the relative
    difference metric vs closed form."""
    now = time.process_time if g.device.type == "cpu" else clock
    xi = torch.randn(g.numel(), generator=torch.Generator().manual_seed(1)).to(g.device, g.dtype)
    xi = closed.proj_horizontal(xi)
    rgrad = ours.egrad2rgrad(g)
    whitened = ours.whitened_hessian(g, obj.hvp)
    cases = {
        "euclidean": lambda: obj.hvp(xi),
        "closed": lambda: closed.connection_hessian(g, obj.hvp(xi), xi),
        "metric": lambda: ours.connection_hessian(g, obj.hvp(xi), xi, rgrad),
        "metric whitened": lambda: whitened(closed.whiten(xi)),
    }
    agree = float((cases["metric"]() - cases["closed"]()).norm() / cases["closed"]().norm())
    best = dict.fromkeys(cases, float("inf"))
    for round_ in range(repeats + 1):  # round 0 warms up and is not counted
        for key, fn in cases.items():
            start = now()
            fn()
            if round_:
                best[key] = min(best[key], now() - start)
    return best, agree

if __name__ == "__main__":
    main()
