"""One Hessian-vector product against one gradient on a timm-like ViT block with attention written by hand (issue 33):
the R-operator's generic rules (activation products, softmax, SDPA, reshapes) against the autograd graph.

Run by hand, never from the tests (CPU time, interleaved rounds, one thread; on a GPU, wall time)::

    flock /tmp/bench.lock python bench/rop_attention.py
    python bench/rop_attention.py --device cuda --forms sdpa gpt2 llama --json out.json

The model: 500 samples of 16 tokens of 4 features, a Linear embedding plus a learned position table, one pre-LayerNorm
block as timm writes it (fused ``qkv`` Linear, ``reshape``/``permute``/``unbind`` into heads, then either
``F.scaled_dot_product_attention`` or ``q @ k^T * scale``, ``softmax``, ``@ v``; ``transpose``/``reshape`` back, a
projection; LayerNorm, a GELU MLP), the token mean, a LayerNorm and a Linear head; width 32, 4 heads, float32. For
reference, the same block with ``nn.MultiheadAttention`` (the R-operator's closed-form attention). And
``sharpness.GPT2`` whole (``--forms gpt2``): vocabulary 512, width 64, 4 heads, 2 blocks, its output layer tied to the
token table, on 128 random sequences of 32 tokens with next-token cross-entropy; ``sharpness.Llama`` whole (``--forms
llama``): the same sizes with grouped-query attention (2 key/value heads for the 4 query heads), rotary embeddings,
RMSNorm and a SwiGLU MLP of 256, untied head; ``sharpness.Bert`` (``--forms bert``): vocabulary 512, width 64, 4 heads,
2 post-LayerNorm blocks, 3 classes, on 128 padded sentence pairs of 32 tokens (ids, token types and attention mask);
``sharpness.HFViT`` (``--forms hfvit``): 32x32 images of 3 channels in 4x4 patches (64 tokens and the class token),
width 64, 4 heads, 2 blocks, 10 classes, 128 images; ``sharpness.TimmViT`` (``--forms timmvit``): the same sizes in
timm's layout (fused ``qkv``, SDPA, LayerScale on both branches); and timm's own ``VisionTransformer``
(``--forms timm``, only where timm imports): ``timm.create_model("vit_tiny_patch16_224", ...)`` at the same sizes
with LayerScale, which ``sharpness.TimmViT`` reads the state dict of.
Prints, per attention form, the CPU time of one gradient and of one product by each strategy (minimum over the
rounds), and their ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))

from _workloads import add_device_argument, clock, device_label, use_device  # noqa: E402

from sharpness import GPT2, Bert, HFViT, Llama, Objective, TimmViT  # noqa: E402


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, form: str):
        super().__init__()
        self.heads, self.hd, self.fused = heads, dim // heads, form == "sdpa"
        self.scale = self.hd**-0.5
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4).unbind(0)
        if self.fused:
            x = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0)
        else:
            attn = (q * self.scale) @ k.transpose(-2, -1)
            x = attn.softmax(dim=-1) @ v
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, form: str):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.mha = form == "mha"
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True) if self.mha else Attention(dim, heads, form)
        self.fc1, self.act, self.fc2 = nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)

    def forward(self, x):
        y = self.norm1(x)
        x = x + (self.attn(y, y, y, need_weights=False)[0] if self.mha else self.attn(y))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class TimmLike(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, tokens: int = 16, features: int = 4, form: str = "sdpa"):
        super().__init__()
        self.embed, self.pos = nn.Linear(features, dim), nn.Parameter(0.02 * torch.randn(tokens, dim))
        self.block, self.norm, self.head = Block(dim, heads, form), nn.LayerNorm(dim, eps=1e-6), nn.Linear(dim, 10)

    def forward(self, x):
        return self.head(self.norm(self.block(self.embed(x) + self.pos).mean(dim=1)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=15)
    forms = {"manual": "q @ k^T, softmax, @ v", "sdpa": "F.scaled_dot_product_attention",
             "mha": "nn.MultiheadAttention (reference)", "gpt2": "sharpness.GPT2, tied output layer",
             "llama": "sharpness.Llama, grouped-query attention", "bert": "sharpness.Bert, padded sentence pairs",
             "hfvit": "sharpness.HFViT, conv patches and a class token",
             "timmvit": "sharpness.TimmViT, timm's layout with LayerScale",
             "timm": "timm's own VisionTransformer (timm.create_model), LayerScale"}  # fmt: skip
    parser.add_argument("--forms", nargs="+", choices=forms, default=list(forms), help="models to time (default: all)")
    parser.add_argument("--json", help="also write the figures here")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    use_device(parser, args.device)
    if "timm" in args.forms:
        try:
            import timm  # noqa: PLC0415 (optional: only this form needs it, and timm needs torchvision)
        except ImportError as exc:
            parser.error(f"--forms timm needs the timm package, which cannot be imported here ({exc})")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    on_cpu = args.device.type == "cpu"  # CPU time of one thread there; on a GPU, wall time once its work is done
    timer = time.process_time if on_cpu else lambda: clock(args.device)
    print(f"device {device_label(args.device)}; {'CPU' if on_cpu else 'wall'} time, minimum of {args.rounds} rounds")
    x, y = torch.randn(args.samples, 16, 4), torch.randint(0, 10, (args.samples,))
    ids = torch.randint(0, 512, (128, 33), generator=torch.Generator().manual_seed(2))
    x, y, ids = x.to(args.device), y.to(args.device), ids.to(args.device)
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(8, 33, (128, 1), generator=g)
    mask = (torch.arange(32) < lengths).long()
    types = ((torch.arange(32) >= lengths // 2) & (mask == 1)).long()
    tokens = torch.stack((torch.randint(1, 512, (128, 32), generator=g) * mask, types, mask), dim=1)
    pairs = tokens.to(args.device), torch.randint(0, 3, (128,), generator=g).to(args.device)
    images = (
        torch.randn(128, 3, 32, 32, generator=g).to(args.device),
        torch.randint(0, 10, (128,), generator=g).to(args.device),
    )
    figures = {}
    for form in args.forms:
        label = forms[form]
        if form in ("gpt2", "llama"):
            if form == "gpt2":
                model = GPT2(vocab=512, positions=32, dim=64, layers=2, heads=4, classes_last=False)
            else:
                model = Llama(vocab=512, dim=64, layers=2, heads=4, kv_heads=2, hidden=256, classes_last=False)
            obj = Objective(model.eval().to(args.device), nn.CrossEntropyLoss(), (ids[:, :-1], ids[:, 1:]))
        elif form == "bert":
            model = Bert(vocab=512, positions=32, dim=64, layers=2, heads=4, classes=3, hidden=256)
            obj = Objective(model.eval().to(args.device), nn.CrossEntropyLoss(), pairs)
        elif form == "hfvit":
            model = HFViT(image=32, patch=4, dim=64, layers=2, heads=4, classes=10, channels=3, hidden=256)
            obj = Objective(model.eval().to(args.device), nn.CrossEntropyLoss(), images)
        elif form == "timmvit":
            model = TimmViT(image=32, patch=4, dim=64, depth=2, heads=4, classes=10, channels=3, layer_scale=True)
            obj = Objective(model.eval().to(args.device), nn.CrossEntropyLoss(), images)
        elif form == "timm":
            model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4, in_chans=3,
                                      num_classes=10, embed_dim=64, depth=2, num_heads=4, init_values=0.1)  # fmt: skip
            obj = Objective(model.eval().to(args.device), nn.CrossEntropyLoss(), images)
        else:
            obj = Objective(TimmLike(form=form).eval().to(args.device), nn.CrossEntropyLoss(), (x, y))
        v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(1)).to(args.device)
        cases = {
            "gradient": obj.gradient,
            "auto": lambda o=obj, v=v: o.hvp(v),
            "graph": lambda o=obj, v=v: o.hvp(v, "graph"),
        }
        for fn in cases.values():  # warm-up: builds the kept state and the gradient graph
            fn()
        best = dict.fromkeys(cases, float("inf"))
        for _ in range(args.rounds):
            for name, fn in cases.items():
                start = timer()
                fn()
                best[name] = min(best[name], timer() - start)
        g = best["gradient"]
        print(f"{label}: auto = {obj.hvp_strategy()!r}; ms: gradient {g * 1e3:.1f}, "
              f"auto {best['auto'] * 1e3:.1f} ({best['auto'] / g:.2f}x), graph {best['graph'] * 1e3:.1f} "
              f"({best['graph'] / g:.2f}x)")  # fmt: skip
        figures[form] = {"strategy": obj.hvp_strategy(), **{f"{k}_ms": t * 1e3 for k, t in best.items()}}
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device_label(args.device), "figures": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
