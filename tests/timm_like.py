"""A vision transformer laid out as timm 1.0's ``VisionTransformer`` (its module names, state-dict keys and forward),
for tests: timm imports torchvision, which has no CPU build here, so the tests cannot import timm itself.
``tests/data/make_timm_vit_tiny.py`` records real timm's logits for `test_timm_layout` to compare against.

What timm's layout brings that the other transformers of the tests lack: ``nn.Identity`` placeholders for the layers a
configuration leaves out (``q_norm``, ``k_norm``, the attention's ``norm``, ``ls1``/``ls2`` without LayerScale,
``norm_pre``, ``fc_norm``, ``drop_path``), ``nn.Dropout(0.0)`` everywhere, a forward with arguments beyond the
input (``attn_mask=None, is_causal=False``) that the blocks and ``F.scaled_dot_product_attention`` are passed, a
fused ``qkv`` projection cut by ``reshape``/``permute``/``unbind``, and LayerScale (``x * gamma``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PatchEmbed(nn.Module):
    def __init__(self, channels: int, patch: int, dim: int):
        super().__init__()
        self.proj = nn.Conv2d(channels, dim, kernel_size=patch, stride=patch)
        self.norm = nn.Identity()

    def forward(self, x):
        return self.norm(self.proj(x).flatten(2).transpose(1, 2))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, qkv_bias: bool, qk_norm: bool = False):
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        if qk_norm:
            self.q_norm, self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6), nn.LayerNorm(self.head_dim, eps=1e-6)
        else:
            self.q_norm, self.k_norm = nn.Identity(), nn.Identity()
        self.attn_drop = nn.Dropout(0.0)
        self.norm = nn.Identity()
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x, attn_mask=None, is_causal=False):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal)
        x = self.norm(x.transpose(1, 2).reshape(B, N, C))
        return self.proj_drop(self.proj(x))


class LayerScale(nn.Module):
    def __init__(self, dim: int, init_values: float):
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        return x * self.gamma


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.act, self.drop1 = nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(0.0)
        self.norm, self.fc2, self.drop2 = nn.Identity(), nn.Linear(hidden, dim), nn.Dropout(0.0)

    def forward(self, x):
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1(x))))))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, qkv_bias: bool, init_values: float | None,
                 qk_norm: bool = False):  # fmt: skip
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads, qkv_bias, qk_norm)
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path1 = nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, hidden)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path2 = nn.Identity()

    def forward(self, x, attn_mask=None, is_causal=False):
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal)))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class VisionTransformer(nn.Module):
    """timm's ``VisionTransformer(img_size=image, patch_size=patch, in_chans=channels, num_classes=classes,
    embed_dim=dim, depth=depth, num_heads=heads, qkv_bias=qkv_bias, init_values=init_values,
    global_pool=global_pool)`` in eval mode: a class token, positions for it and the patches, pre-LayerNorm blocks,
    the final LayerNorm (``global_pool="token"``: the class token's state) or the tokens' mean and ``fc_norm``
    (``"avg"``), then the head."""

    def __init__(self, image: int = 8, patch: int = 2, channels: int = 1, classes: int = 10, dim: int = 16,
                 depth: int = 2, heads: int = 2, qkv_bias: bool = True, init_values: float | None = None,
                 global_pool: str = "token", qk_norm: bool = False):  # fmt: skip
        super().__init__()
        self.global_pool = global_pool
        self.patch_embed = PatchEmbed(channels, patch, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, (image // patch) ** 2 + 1, dim))
        self.pos_drop, self.patch_drop, self.norm_pre = nn.Dropout(0.0), nn.Identity(), nn.Identity()
        self.blocks = nn.Sequential(*(Block(dim, heads, 4 * dim, qkv_bias, init_values, qk_norm) for _ in range(depth)))
        avg = global_pool == "avg"
        self.norm = nn.Identity() if avg else nn.LayerNorm(dim, eps=1e-6)
        self.fc_norm = nn.LayerNorm(dim, eps=1e-6) if avg else nn.Identity()
        self.head_drop = nn.Dropout(0.0)
        self.head = nn.Linear(dim, classes)

    def forward_features(self, x, attn_mask=None, is_causal=False):
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.norm_pre(self.patch_drop(self.pos_drop(x + self.pos_embed)))
        if attn_mask is not None or is_causal:
            for blk in self.blocks:
                x = blk(x, attn_mask=attn_mask, is_causal=is_causal)
        else:
            x = self.blocks(x)
        return self.norm(x)

    def forward_head(self, x):
        x = x[:, 1:].mean(dim=1) if self.global_pool == "avg" else x[:, 0]
        return self.head(self.head_drop(self.fc_norm(x)))

    def forward(self, x, attn_mask=None, is_causal=False):
        return self.forward_head(self.forward_features(x, attn_mask=attn_mask, is_causal=is_causal))
