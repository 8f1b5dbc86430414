"""timm's own vision transformers (``timm.create_model``), where timm imports: the symmetry group the toolkit finds, the
outputs under a random element of it, the symmetry measure and Euclidean sharpness before and after, and one product
against autograd's (double backward), and the symmetry measure after shifts of the key bias (which no output reads) and
of the value bias against the output bias (which keeps the function).
A check of what the tests check on ``tests/timm_like.py`` (timm's layout without timm), run on timm itself; not a
timing.

Run by hand, never from the tests (timm is not a dependency; it imports torchvision)::

    python bench/timm_check.py                  # on the CPU
    python bench/timm_check.py --device cuda

Configurations (tiny, float64: width 16, 2 heads, 2 blocks, 8x8 one-channel images in 2x2 patches, 10 classes, 6
images, parameters moved off the initialization): plain; LayerScale with the tokens' mean; query/key normalization;
both. Prints one line each. ``--architectures NAME ...``: any timm architectures instead, shrunk where they take the
sizes (the survey recorded in docs/performance.md).
"""

from __future__ import annotations

import argparse
import copy
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


def check(model: nn.Module, x: torch.Tensor, y: torch.Tensor, label: str) -> str:
    """One line: the group of ``model``, outputs and the symmetry measure under a random element of it, Euclidean
    sharpness before and after, one product against autograd's."""
    loss = nn.CrossEntropyLoss()
    sym = manifolds.transformer_symmetry(model, x)
    moved = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(0)))
    with torch.no_grad():
        out = model(x)
        change = float((moved(x) - out).abs().max() / out.abs().max())
    solver = Solver(tol=1e-12)
    shifted = _biases_shifted(model)
    values = [float(MEASURES["symmetry"].sharpness(Objective(m, loss, (x, y), dtype=torch.float64), k=1,
                                                   solver=solver, progress=False).eigenvalues[0])
              for m in (model, moved, *([shifted] if shifted is not None else []))]  # fmt: skip
    key = "no qkv bias" if shifted is None else f"key and value biases shifted {abs(values[2] / values[0] - 1):.1e}"
    euclid = [euclidean_sharpness(m, loss, (x, y), dtype=torch.float64, progress=False).value
              for m in (model, moved)]  # fmt: skip
    obj = Objective(model, loss, (x, y), dtype=torch.float64)
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(x.device)
    reference = obj.hvp(v, "double_backward")  # autograd's product (a dense Hessian: minutes)
    error = float((obj.hvp(v) - reference).abs().max() / reference.abs().max())
    return (f"{label}: {obj.layout.size:,} parameters, group of dimension {sym.dim} ({len(sym.factors)} factors), "
            f"outputs moved by {change:.1e} (relative); symmetry measure {values[0]:.10g} -> {values[1]:.10g} "
            f"(relative {abs(values[1] / values[0] - 1):.1e}; {key}); Euclidean {euclid[0]:.4g} -> {euclid[1]:.4g}; "
            f"product '{obj.hvp_strategy()}' {error:.1e} from autograd's")  # fmt: skip


def _biases_shifted(model: nn.Module) -> nn.Module | None:
    """A copy with the key rows of every fused ``qkv`` bias moved by ``N(0, 1)``, and its value rows by ``u = N(0, 1)``
    with ``-W_proj u`` added to the output projection's bias: the same function (the softmax ignores the first, the
    weights' rows sum to one for the second); ``None`` where there are no such biases."""
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    attentions = [m for m in twin.modules() if isinstance(getattr(m, "qkv", None), nn.Linear)
                  and m.qkv.bias is not None and isinstance(getattr(m, "proj", None), nn.Linear)]  # fmt: skip
    with torch.no_grad():
        for m in attentions:
            width = m.qkv.bias.shape[0] // 3
            m.qkv.bias[width : 2 * width] += torch.randn(width, generator=g).to(m.qkv.bias)
            if m.proj.bias is not None:
                u = torch.randn(width, generator=g).to(m.qkv.bias)
                m.qkv.bias[2 * width :] += u
                m.proj.bias -= m.proj.weight @ u
    return twin if attentions else None


def _perturbed(model: nn.Module, scale: float, device: torch.device) -> nn.Module:
    model = model.double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model.to(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--architectures", nargs="+", metavar="NAME",
                        help="instead: these timm architectures, shrunk where they take the sizes (16x16 RGB "
                             "images in 4x4 patches, width 24, 2 blocks, 2 heads, 5 classes; their defaults "
                             "otherwise)")  # fmt: skip
    add_device_argument(parser)
    args = parser.parse_args(argv)
    use_device(parser, args.device)
    try:
        import timm  # noqa: PLC0415 (optional: not a dependency)
    except ImportError as exc:
        parser.error(f"timm cannot be imported here ({exc})")
    print(f"timm {timm.__version__}, torch {torch.__version__}, {device_label(args.device)}")
    if args.architectures:
        for name in args.architectures:
            torch.manual_seed(0)
            try:
                model = timm.create_model(name, pretrained=False, num_classes=5, img_size=16, patch_size=4,
                                          embed_dim=24, depth=2, num_heads=2)  # fmt: skip
            except TypeError:  # an architecture without those options
                model = timm.create_model(name, pretrained=False, num_classes=5, img_size=16)
            model = _perturbed(model, 0.1, args.device)
            x = torch.randn(3, 3, 16, 16, dtype=torch.float64).to(args.device)
            print(check(model, x, torch.randint(0, 5, (3,)).to(args.device), name), flush=True)
        return 0
    for name, extra in CONFIGS.items():
        torch.manual_seed(0)
        sizes = dict(img_size=8, patch_size=2, in_chans=1, num_classes=10, embed_dim=16, depth=2, num_heads=2)
        model = _perturbed(timm.create_model("vit_tiny_patch16_224", pretrained=False, **sizes, **extra), 0.3,
                           args.device)  # fmt: skip
        x = torch.randn(6, 1, 8, 8, dtype=torch.float64).to(args.device)
        print(check(model, x, torch.randint(0, 10, (6,)).to(args.device), name), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
