"""Why the R-operator products lose on a GPU (issue 33): one ResNet-20 HVP against the size of the pieces its state is
built and used in, against one gradient and the autograd strategies.

Run by hand, never from the tests::

    python bench/rop_pieces.py --device cuda          # ResNet-20, 1000 synthetic samples, on a GPU
    python bench/rop_pieces.py --samples 100          # a quick CPU run

The objective cuts each chunk's R-operator state into pieces of at most ``_ROP_PIECE_BYTES`` per tensor on the CPU
(4 MiB, chosen so a CPU's freed-memory heap can hold a piece's temporaries) and ``_ROP_PIECE_BYTES_GPU`` on a GPU
(256 MiB), where every piece launches the same few hundred kernels, so small pieces cost launches, not arithmetic.
This script times one product (best of ``--rounds``, after a warm-up) for each piece size in ``--pieces`` (MiB; 0 =
the objective's own choice for the device), plus one gradient over all samples and the ``graph`` and
``double_backward`` strategies, all in float32 on the same model and data, and checks every product against the
first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))

from _workloads import add_device_argument, clock, device_label, to_device, use_device  # noqa: E402
from resnet import workload  # noqa: E402

import sharpness.products._objective as objective_module  # noqa: E402
from sharpness import Objective  # noqa: E402


def best_seconds(fn, rounds: int) -> tuple[float, torch.Tensor]:
    out = fn()  # warm-up: builds the state
    best = float("inf")
    for _ in range(rounds):
        start = clock()
        out = fn()
        best = min(best, clock() - start)
    return best, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1000, help="synthetic 3x32x32 samples (default: 1000)")
    parser.add_argument("--rounds", type=int, default=5, help="timed products per case; the best counts (default 5)")
    parser.add_argument(
        "--pieces",
        default="0,4,16,64,256,4096",
        help="piece sizes in MiB, comma-separated; 0 = the objective's default (default: %(default)s)",
    )
    parser.add_argument("--json", help="also write the figures here")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    use_device(parser, args.device)
    model, X, y = workload(args.samples)
    X, y = to_device(args.device, model, X, y)
    loss = nn.CrossEntropyLoss()
    n = sum(p.numel() for p in model.parameters())
    v = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(X.device)
    print(f"ResNet-20, {args.samples} samples, {n:,} parameters, float32, on {device_label(args.device)}")

    def gradient():
        model.zero_grad(set_to_none=True)
        loss(model(X), y).backward()
        return torch.zeros(())

    g, _ = best_seconds(gradient, args.rounds)
    model.zero_grad(set_to_none=True)
    print(f"  one gradient: {g * 1e3:.1f} ms")
    results: dict = {"device": device_label(args.device), "samples": args.samples, "gradient_s": g, "cases": {}}
    gpu = args.device.type != "cpu"
    which = "_ROP_PIECE_BYTES_GPU" if gpu else "_ROP_PIECE_BYTES"  # the constant the objective reads on this device
    default = getattr(objective_module, which)
    reference = None
    sizes = [int(m) for m in args.pieces.split(",")]
    cases = [(f"rop, pieces {m} MiB" if m else "rop, default pieces", "rop", m) for m in sizes]
    cases += [("graph (autograd)", "graph", 0), ("double_backward", "double_backward", 0)]
    for name, strategy, mib in cases:
        setattr(objective_module, which, mib * 2**20 if mib else default)
        obj = Objective(model, loss, (X, y), dtype=torch.float32, memory_budget=40 * 2**30)
        try:
            t, hv = best_seconds(lambda o=obj, s=strategy: o.hvp(v, s), args.rounds)
        except (RuntimeError, ValueError) as err:  # e.g. out of memory at one piece size
            print(f"  {name:<26} failed: {str(err).splitlines()[0]}")
            continue
        finally:
            setattr(objective_module, which, default)
        reference = hv if reference is None else reference
        err = float((hv - reference).norm() / reference.norm())
        piece = getattr(obj, "_rop_piece", None)
        results["cases"][name] = {"seconds": t, "ratio": t / g, "rel_diff": err, "piece_samples": piece}
        print(
            f"  {name:<26} {t * 1e3:8.1f} ms = {t / g:5.2f}x a gradient  (samples a piece: {piece}, "
            f"vs first: {err:.1e})",
            flush=True,
        )
        del obj
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
