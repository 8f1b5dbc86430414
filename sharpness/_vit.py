"""A small vision transformer for 8x8 one-channel images (scikit-learn's digits), built in for the command line.

``ViT`` splits each 8x8 image into 2x2 patches (16 tokens of 4 pixels, row-major over the patch grid),
embeds them with one Linear, adds a learned positional embedding, runs ``depth`` transformer blocks, averages
the tokens (no class token), and classifies with a final LayerNorm and a Linear. Inputs are ``(N, 64)``
(``--data digits``: flattened images) or ``(N, 1, 8, 8)``; outputs are ``(N, classes)`` logits.

Each block is pre-LayerNorm (``x + attn(ln1(x))``, then ``x + fc2(act(fc1(ln2(x))))``) or post-LayerNorm
(``ln1(x + attn(x))``, then ``ln2(x + fc2(act(fc1(x))))``). Attention is ``nn.MultiheadAttention``
(``attn=mha``) or written by hand (``attn=hand``): separate query, key, value and output Linears, split
into heads by ``unflatten``/``transpose`` and joined by ``F.scaled_dot_product_attention``. Separate (not
fused) projections keep every head's query/key and value/output ``GL(head size)`` symmetry visible to
[`manifolds.transformer_symmetry`][manifolds.transformer_symmetry].

State-dict keys (``i`` the block index; shapes for ``dim=D``, ``mlp=F``, ``classes=C``)::

    embed.weight (D, 4), embed.bias (D,), pos (16, D)
    blocks.i.ln1.weight, blocks.i.ln1.bias, blocks.i.ln2.weight, blocks.i.ln2.bias (D,)
    attn=mha:  blocks.i.attn.in_proj_weight (3D, D), blocks.i.attn.in_proj_bias (3D,),
               blocks.i.attn.out_proj.weight (D, D), blocks.i.attn.out_proj.bias (D,)
    attn=hand: blocks.i.attn.{q,k,v,o}.weight (D, D), blocks.i.attn.{q,k,v,o}.bias (D,)
    blocks.i.fc1.weight (F, D), blocks.i.fc1.bias (F,), blocks.i.fc2.weight (D, F), blocks.i.fc2.bias (D,)
    norm.weight, norm.bias (D,), head.weight (C, D), head.bias (C,)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sharpness._specs import SpecError, _parse_options

IMAGE, PATCH = 8, 2
TOKENS, PATCH_PIXELS = (IMAGE // PATCH) ** 2, PATCH * PATCH
NORMS, ACTIVATIONS, ATTENTIONS = ("pre", "post"), ("relu", "gelu"), ("mha", "hand")


class HandAttention(nn.Module):
    """Multi-head self-attention with separate q/k/v/o Linears and ``F.scaled_dot_product_attention``;
    ``(N, T, D)`` in and out, head ``h`` owning features ``h*hd:(h+1)*hd`` of q, k and v."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def _split(self, t: Tensor) -> Tensor:
        return t.unflatten(-1, (self.heads, -1)).transpose(1, 2)  # (N, T, D) -> (N, heads, T, hd)

    def forward(self, x: Tensor) -> Tensor:
        a = F.scaled_dot_product_attention(self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x)))
        return self.o(a.transpose(1, 2).flatten(2))


class Block(nn.Module):
    """One transformer block, pre- or post-LayerNorm (see the module docstring)."""

    def __init__(self, dim: int, heads: int, hidden: int, norm: str, act: str, attn: str):
        super().__init__()
        self.pre = norm == "pre"
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True) if attn == "mha" else HandAttention(dim, heads)
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act = nn.ReLU() if act == "relu" else nn.GELU()

    def _attend(self, x: Tensor) -> Tensor:
        if isinstance(self.attn, nn.MultiheadAttention):
            return self.attn(x, x, x, need_weights=False)[0]
        return self.attn(x)

    def forward(self, x: Tensor) -> Tensor:
        if self.pre:
            x = x + self._attend(self.ln1(x))
            return x + self.fc2(self.act(self.fc1(self.ln2(x))))
        x = self.ln1(x + self._attend(x))
        return self.ln2(x + self.fc2(self.act(self.fc1(x))))


class ViT(nn.Module):
    """The vision transformer of the module docstring: ``(N, 64)`` or ``(N, 1, 8, 8)`` in, ``(N, classes)`` out.

    Args:
        dim: embedding width ``D`` (a multiple of ``heads``).
        heads: attention heads, each of size ``dim / heads``.
        depth: number of transformer blocks.
        mlp: hidden width of each block's MLP (default ``2 * dim``).
        norm: ``"pre"`` or ``"post"`` LayerNorm blocks.
        act: the MLP's activation, ``"relu"`` (its units keep their rescaling symmetry) or ``"gelu"``.
        attn: ``"mha"`` (``nn.MultiheadAttention``) or ``"hand"`` (q/k/v/o Linears and SDPA).
        classes: number of outputs.

    Raises:
        ValueError: a size is not positive, ``dim`` is not a multiple of ``heads``, or a choice is unknown.
    """

    def __init__(
        self,
        dim: int = 16,
        heads: int = 2,
        depth: int = 1,
        mlp: int | None = None,
        norm: str = "pre",
        act: str = "relu",
        attn: str = "mha",
        classes: int = 10,
    ):
        super().__init__()
        if min(dim, heads, depth, classes) < 1 or (mlp is not None and mlp < 1):
            raise ValueError("dim, heads, depth, mlp and classes must be positive")
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads}): each head gets dim / heads features")
        for name, value, choices in (("norm", norm, NORMS), ("act", act, ACTIVATIONS), ("attn", attn, ATTENTIONS)):
            if value not in choices:
                raise ValueError(f"{name} must be {' or '.join(choices)}, got {value!r}")
        self.embed = nn.Linear(PATCH_PIXELS, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(TOKENS, dim))
        self.blocks = nn.Sequential(*(Block(dim, heads, mlp or 2 * dim, norm, act, attn) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        # (N, 64) or (N, 1, 8, 8) -> (N, 4, 2, 4, 2): patch row, pixel row, patch column, pixel column
        p = x.flatten(1).unflatten(1, (IMAGE // PATCH, PATCH, IMAGE // PATCH, PATCH))
        tokens = p.permute(0, 1, 3, 2, 4).flatten(3).flatten(1, 2)  # (N, 16, 4), patches row-major
        h = self.blocks(self.embed(tokens) + self.pos)
        return self.head(self.norm(h.mean(dim=1)))


_INTEGERS = ("dim", "heads", "depth", "mlp", "classes")
_CHOICES = {"norm": NORMS, "act": ACTIVATIONS, "attn": ATTENTIONS}


def vit_from_spec(spec: str) -> ViT:
    """The model of a ``vit[:KEY=VALUE,...]`` SPEC, e.g. ``vit``, ``vit:dim=32,heads=4,depth=2,attn=hand``.

    Keys: ``dim``, ``heads``, ``depth``, ``mlp``, ``classes`` (positive integers) and ``norm`` (pre, post),
    ``act`` (relu, gelu), ``attn`` (mha, hand); see `ViT`.

    Raises:
        SpecError: an unknown key, a value that is not a positive integer or not one of the choices, or
            ``dim`` not a multiple of ``heads``; one sentence naming it.
    """
    options = _parse_options(spec[len("vit:") :] if spec.startswith("vit:") else "", spec)
    unknown = set(options) - {*_INTEGERS, *_CHOICES}
    if unknown:
        raise SpecError(
            f"model spec {spec!r}: unknown option(s) {', '.join(sorted(unknown))}; "
            f"use {', '.join((*_INTEGERS, *_CHOICES))}, e.g. vit:dim=32,heads=4"
        )
    values: dict[str, object] = {}
    for key, text in options.items():
        if key in _CHOICES:
            if text not in _CHOICES[key]:
                raise SpecError(f"model spec {spec!r}: {key} is {' or '.join(_CHOICES[key])}, not {text!r}")
            values[key] = text
            continue
        try:
            values[key] = int(text)
        except ValueError:
            values[key] = 0
        if values[key] < 1:
            raise SpecError(f"model spec {spec!r}: {key} must be a positive integer, not {text!r}")
    try:
        return ViT(**values)
    except ValueError as err:
        raise SpecError(f"model spec {spec!r}: {err}") from None
