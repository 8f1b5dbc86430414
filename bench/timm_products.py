"""Hessian-vector products on timm's CNNs and Swin transformers, where timm imports: which strategy ``"auto"`` picks,
how far its product is from autograd's (forward over reverse, float64), and the time of one product by ``"auto"``
against the autograd graph (float32, the objective's default). A check and a timing, not a test.

Run by hand, never from the tests (timm is not a dependency; it imports torchvision)::

    python bench/timm_products.py                                  # the default architectures, on the CPU
    python bench/timm_products.py --architectures regnetx_002 --threads 1 --samples 32
    python bench/timm_products.py --device cuda

Each architecture is built by ``timm.create_model`` with 5 classes and no pretrained weights: the CNNs at their own
sizes, ConvNeXt with one block per stage of widths 8-16 and the Swin transformers shrunk to width 16, two stages of two
blocks, windows of 4 (32x32 inputs). Weights are moved off their initialization and BatchNorm statistics drawn, so
every term of the Hessian is present. One line per architecture.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))

from _workloads import add_device_argument, device_label, median_time, use_device  # noqa: E402

from sharpness import Objective  # noqa: E402

SWIN = {"img_size": 32, "window_size": 4, "embed_dim": 16, "depths": (2, 2), "num_heads": (2, 2)}
# Sizes that fit a laptop's memory in float64 (the default ConvNeXt has 28M parameters)
SHRUNK = {
    "convnext_atto": {"depths": (1, 1, 1, 1), "dims": (8, 16, 16, 16)},
    "swin_tiny_patch4_window7_224": SWIN,
    "swin_s3_tiny_224": SWIN,
    "swinv2_tiny_window8_256": SWIN,
}
DEFAULT = ["resnet18", "regnetx_002", "efficientnet_b0", "mobilenetv3_small_050", "densenet121", "convnext_atto",
           "swin_tiny_patch4_window7_224", "swin_s3_tiny_224", "swinv2_tiny_window8_256"]  # fmt: skip


def _model(timm, name: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=5, **SHRUNK.get(name, {})).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    return model.to(device)


def check(timm, name: str, samples: int, rounds: int, device: torch.device) -> str:
    """One line: the strategy, the float64 product's distance from autograd's, and float32 times."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(samples, 3, 32, 32, generator=g), torch.randint(0, 5, (samples,), generator=g)
    loss = nn.CrossEntropyLoss()
    exact = Objective(_model(timm, name, torch.float64, device), loss, (x.double().to(device), y.to(device)),
                      dtype=torch.float64)  # fmt: skip
    v = torch.randn(exact.layout.size, generator=g, dtype=torch.float64).to(device)
    reference = exact.hvp(v, "jvp")
    error = float((exact.hvp(v) - reference).abs().max() / reference.abs().max())
    fast = Objective(_model(timm, name, torch.float32, device), loss, (x.to(device), y.to(device)))
    v32 = v.float()
    fast.hvp(v32)  # warm-up (and the kept state of the R-operator)
    auto, _ = median_time(lambda: fast.hvp(v32), rounds, device)
    graph, _ = median_time(lambda: fast.hvp(v32, "graph"), rounds, device)
    return (f"{name}: {exact.layout.size:,} parameters, auto picks '{exact.hvp_strategy()}', {error:.1e} from "
            f"autograd's (float64); one float32 product {auto * 1e3:.1f} ms, the autograd graph's "
            f"{graph * 1e3:.1f} ms ({graph / auto:.2f}x)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--architectures", nargs="+", metavar="NAME", default=DEFAULT,
                        help="timm architectures (default: %(default)s)")  # fmt: skip
    parser.add_argument("--samples", type=int, default=8, help="images of 32x32 (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="timed products, median (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    use_device(parser, args.device)
    if args.samples < 1 or args.rounds < 1:
        parser.error("--samples and --rounds must be positive")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        import timm  # noqa: PLC0415 (optional: not a dependency)
    except ImportError as exc:
        parser.error(f"timm cannot be imported here ({exc})")
    print(f"timm {timm.__version__}, torch {torch.__version__}, {device_label(args.device)}, "
          f"{torch.get_num_threads()} threads, {args.samples} samples")  # fmt: skip
    for name in args.architectures:
        print(check(timm, name, args.samples, args.rounds, args.device), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
