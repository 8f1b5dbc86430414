"""timm's own vision transformers (``timm.create_model``), where timm imports: the symmetry group the toolkit finds, the
outputs under a random element of it, the symmetry measure and Euclidean sharpness before and after, and one product
against autograd's (double backward). A check of what the tests check on ``tests/timm_like.py`` (timm's layout
without timm), run on timm itself; not a timing.

Run by hand, never from the tests (timm is not a dependency; it imports torchvision)::

    python bench/timm_check.py                  # on the CPU
    python bench/timm_check.py --device cuda

Configurations (tiny, float64: width 16, 2 heads, 2 blocks, 8x8 one-channel images in 2x2 patches, 10 classes, 6
images, parameters moved off the initialization): plain; LayerScale with the tokens' mean; query/key normalization;
both. Prints one line each.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))

from _workloads import add_device_argument, device_label, use_device  # noqa: E402

import manifolds  # noqa: E402
from sharpness import MEASURES, Objective, Solver, euclidean_sharpness  # noqa: E402

CONFIGS = {
    "plain": {},
    "layer scale, avg": {"init_values": 0.5, "global_pool": "avg"},
    "qk_norm": {"qk_norm": True},
    "qk_norm, layer scale": {"qk_norm": True, "init_values": 0.5, "global_pool": "avg"},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_argument(parser)
    args = parser.parse_args(argv)
    use_device(parser, args.device)
    try:
        import timm  # noqa: PLC0415 (optional: not a dependency)
    except ImportError as exc:
        parser.error(f"timm cannot be imported here ({exc})")
    print(f"timm {timm.__version__}, torch {torch.__version__}, {device_label(args.device)}")
    loss = nn.CrossEntropyLoss()
    for name, extra in CONFIGS.items():
        torch.manual_seed(0)
        sizes = dict(img_size=8, patch_size=2, in_chans=1, num_classes=10, embed_dim=16, depth=2, num_heads=2)
        model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **sizes, **extra).double().eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * torch.randn_like(p))
        model = model.to(args.device)
        x = torch.randn(6, 1, 8, 8, dtype=torch.float64).to(args.device)
        y = torch.randint(0, 10, (6,)).to(args.device)
        sym = manifolds.transformer_symmetry(model, x)
        moved = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(0)))
        with torch.no_grad():
            change = float((moved(x) - model(x)).abs().max())
        solver = Solver(tol=1e-12)
        values = [float(MEASURES["symmetry"].sharpness(Objective(m, loss, (x, y), dtype=torch.float64), k=1,
                                                       solver=solver, progress=False).eigenvalues[0])
                  for m in (model, moved)]  # fmt: skip
        euclid = [euclidean_sharpness(m, loss, (x, y), dtype=torch.float64, progress=False).value
                  for m in (model, moved)]  # fmt: skip
        obj = Objective(model, loss, (x, y), dtype=torch.float64)
        v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        reference = obj.hvp(v.to(args.device), "double_backward")  # autograd's product (a dense Hessian: minutes)
        error = float((obj.hvp(v.to(args.device)) - reference).abs().max() / reference.abs().max())
        print(f"{name}: group of dimension {sym.dim}, outputs moved by {change:.1e}; symmetry measure {values[0]:.10g}"
              f" -> {values[1]:.10g} (relative {abs(values[1] / values[0] - 1):.1e}); Euclidean {euclid[0]:.4g} -> "
              f"{euclid[1]:.4g}; product '{obj.hvp_strategy()}' {error:.1e} from autograd's")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
