"""Vision transformers as timm's ``VisionTransformer`` computes them (eval mode), built from a timm checkpoint's
tensors so that no timm is needed: timm imports torchvision, which CPU-only machines may lack. The state-dict keys are
timm's (``i`` the block index; ``D`` the width, ``C`` the channels, ``p`` the patch side, ``P`` the patches, ``S`` the
prefix tokens, ``F`` the MLP's width, ``K`` the classes)::

    patch_embed.proj.weight (D, C, p, p), .bias (D,); pos_embed (1, P + S, D), or (1, P, D) where the prefix tokens
    have no position (timm's no_embed_class: DeiT III); cls_token (1, 1, D); reg_token (1, R, D) (registers);
    dist_token (1, 1, D) and head_dist.weight, .bias (DeiT's distilled models)
    blocks.i.norm1.weight, .bias; blocks.i.attn.qkv.weight (3D, D), .bias (3D,) where the model has one;
    blocks.i.attn.q_norm.weight (hd,), .bias, blocks.i.attn.k_norm.weight, .bias (qk_norm, where the model has it);
    blocks.i.attn.proj.weight (D, D), .bias; blocks.i.ls1.gamma (D,) (LayerScale, where the model has it);
    blocks.i.norm2.weight, .bias; blocks.i.mlp.fc1.weight (F, D), .bias; blocks.i.mlp.fc2.weight (D, F), .bias;
    blocks.i.ls2.gamma; norm.weight, .bias (the class token's classifier) or fc_norm.weight, .bias (the tokens' mean);
    head.weight (K, D), .bias (K,)

Each block is pre-LayerNorm (``x + ls1(proj(attn(norm1(x))))``, then ``x + ls2(fc2(act(fc1(norm2(x)))))``); attention
cuts the fused ``qkv`` projection into heads, normalizes each head's query and key (a LayerNorm over the head's
features, shared by the heads, where the model has ``qk_norm``), and attends over all tokens with scale ``hd^-1/2``
(``F.scaled_dot_product_attention``). The classifier reads the final LayerNorm's state of the class token
(``pool="token"``), the mean of the patch tokens (``pool="avg"``), each through ``norm`` and/or ``fc_norm`` as the
checkpoint has them, or attention pooling (``pool="map"``, SigLIP's: ``attn_pool.latent`` (1, 1, D), ``attn_pool.q``,
``.kv`` (2D, D), ``.proj``, ``.norm``, ``.mlp.fc1``, ``.fc2``, reading the tokens after the prefix once ``norm`` has,
as timm's default ``pool_include_prefix=False`` does). timm's ``pool_include_prefix=True`` and its ``"prr"`` pooling
have the keys of these models and are not modelled. The keys do not say which pooling
a model uses (timm's ``global_pool``), so ``pool`` is always given; timm's max pooling is not modelled (its keys are an
average-pooled model's). A distilled model averages its two heads, on the class and the distillation token, as timm's
does in eval mode. Other layouts are refused (a key the model does not have).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sharpness._hfvit import ViTMLP, check_images, check_vit_options
from sharpness._specs import SpecError, checkpoint_spec, load_fitting, positive_integer, positive_number

POOLS = ("token", "avg", "map")


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, qkv_bias: bool, qk_norm: bool, eps: float):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=qkv_bias), nn.Linear(dim, dim)
        norm = (lambda: nn.LayerNorm(dim // heads, eps=eps)) if qk_norm else nn.Identity
        self.q_norm, self.k_norm = norm(), norm()

    def forward(self, x: Tensor) -> Tensor:
        n, tokens, dim = x.shape
        q, k, v = self.qkv(x).reshape(n, tokens, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, tokens, dim))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, eps: float, act: str, qkv_bias: bool, layer_scale: bool,
                 qk_norm: bool):  # fmt: skip
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=eps), nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, heads, qkv_bias, qk_norm, eps)
        self.mlp = ViTMLP(dim, hidden, act)  # timm's keys: fc1, fc2
        self.ls1 = LayerScale(dim) if layer_scale else nn.Identity()
        self.ls2 = LayerScale(dim) if layer_scale else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.mlp(self.norm2(x)))


class AttentionPool(nn.Module):
    """timm's ``AttentionPoolLatent`` (``global_pool="map"``, SigLIP's models): a learned latent query ``latent``
    ``(1, L, D)`` projected by ``q`` attends to the tokens (keys and values by one fused ``kv``), then ``proj`` and a
    residual MLP after ``norm``; pooled over the ``L`` latents by the first (timm's ``pool_type="token"``). ``q`` and
    ``kv`` have biases whatever the blocks' ``qkv_bias`` (timm's ``VisionTransformer`` builds the pool so)."""

    def __init__(self, dim: int, heads: int, hidden: int, eps: float, act: str, latents: int = 1):
        super().__init__()
        self.heads = heads
        self.latent = nn.Parameter(torch.zeros(1, latents, dim))
        self.q, self.kv = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim)
        self.proj, self.norm, self.mlp = nn.Linear(dim, dim), nn.LayerNorm(dim, eps=eps), ViTMLP(dim, hidden, act)

    def forward(self, x: Tensor) -> Tensor:
        n, tokens, dim = x.shape
        latents, hd = self.latent.shape[1], dim // self.heads
        q = self.q(self.latent.expand(n, -1, -1)).reshape(n, latents, self.heads, hd).transpose(1, 2)
        k, v = self.kv(x).reshape(n, tokens, 2, self.heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
        x = self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, latents, dim))
        return (x + self.mlp(self.norm(x)))[:, 0]


class TimmViT(nn.Module):
    """A vision transformer with its classifier, as timm's ``VisionTransformer`` computes it in eval mode, under
    timm's state-dict keys (see the module's docstring).

    Args:
        image: the image's side ``H = W``, at least ``patch``.
        patch: the patches' side ``p``.
        dim: width ``D`` (``embed_dim``), a multiple of ``heads``.
        depth: number of blocks.
        heads: attention heads per block (``num_heads``).
        classes: the classifier's outputs ``K`` (``num_classes``).
        channels: the image's channels ``C`` (``in_chans``).
        hidden: the MLP's width; ``None``: ``4 * dim`` (``mlp_ratio=4``).
        eps: the LayerNorms' epsilon (timm's 1e-6).
        act: the MLP's activation: ``"gelu"`` (timm's ``nn.GELU``), ``"gelu_pytorch_tanh"``, ``"relu"``...
        qkv_bias: whether the fused query/key/value projection has a bias.
        layer_scale: whether the blocks scale their branches by ``ls1.gamma``, ``ls2.gamma`` (``init_values``).
        pool: ``"token"`` (the class token's state), ``"avg"`` (the mean of the tokens after the prefix) or
            ``"map"`` (attention pooling by a learned latent query, `AttentionPool`, SigLIP's).
        final_norm: whether a LayerNorm ``norm`` follows the blocks; ``None``: for ``pool="token"``.
        fc_norm: whether a LayerNorm ``fc_norm`` follows the pooling; ``None``: for ``pool="avg"`` (timm's "gap"
            models pool the mean after ``norm``, without ``fc_norm``).
        class_token: whether a class token leads the tokens.
        registers: register tokens after it (``reg_tokens``).
        distilled: DeiT's distillation token and second head.
        embed_prefix: whether the position table covers the prefix tokens too (timm's ``not no_embed_class``).
        qk_norm: whether each head's query and key pass a LayerNorm over the head's features (``q_norm``,
            ``k_norm``, with ``eps``) before the product.

    Inputs are images ``(N, C, image, image)`` (`check_inputs`); outputs are logits ``(N, K)``.
    """

    def __init__(self, image: int, patch: int, dim: int, depth: int, heads: int, classes: int = 1000,
                 channels: int = 3, hidden: int | None = None, eps: float = 1e-6, act: str = "gelu",
                 qkv_bias: bool = True, layer_scale: bool = False, pool: str = "token", class_token: bool = True,
                 registers: int = 0, distilled: bool = False, embed_prefix: bool = True, final_norm: bool | None = None,
                 fc_norm: bool | None = None, qk_norm: bool = False):  # fmt: skip
        super().__init__()
        check_vit_options(image, patch, dim, heads, eps, act, "act")
        if pool not in POOLS or (pool == "token" and not class_token) or (distilled and not class_token) or (
                pool == "map" and distilled):  # fmt: skip
            raise ValueError(f"pool={pool!r} must be one of {', '.join(POOLS)}; 'token' and distilled need the class "
                             "token")  # fmt: skip
        self.image, self.pool, self.distilled = image, pool, distilled
        self.prefix = int(class_token) + int(distilled) + registers
        self.embed_prefix = embed_prefix
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(channels, dim, kernel_size=patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if class_token else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, dim)) if distilled else None
        self.reg_token = nn.Parameter(torch.zeros(1, registers, dim)) if registers else None
        positions = (image // patch) ** 2 + (self.prefix if embed_prefix else 0)
        self.pos_embed = nn.Parameter(torch.zeros(1, positions, dim))
        self.blocks = nn.Sequential(*(Block(dim, heads, 4 * dim if hidden is None else hidden, eps, act, qkv_bias,
                                            layer_scale, qk_norm) for _ in range(depth)))  # fmt: skip
        final_norm, fc_norm = (
            pool == "token" if final_norm is None else final_norm,
            pool == "avg" if fc_norm is None else fc_norm,
        )
        self.norm = nn.LayerNorm(dim, eps=eps) if final_norm else nn.Identity()
        self.fc_norm = nn.LayerNorm(dim, eps=eps) if fc_norm else nn.Identity()
        if pool == "map":
            self.attn_pool = AttentionPool(dim, heads, 4 * dim if hidden is None else hidden, eps, act)
        self.head = nn.Linear(dim, classes)
        self.head_dist = nn.Linear(dim, classes) if distilled else None

    def check_inputs(self, images: Tensor) -> None:
        """Raises ``ValueError`` (one sentence) unless ``images`` are ``(N, C, image, image)`` with the model's
        channels (other sizes whose patch grid has as many patches would run, and mean something else)."""
        check_images(images, self.patch_embed.proj.in_channels, self.image)

    def forward(self, images: Tensor) -> Tensor:
        x = self.patch_embed.proj(images).flatten(2).transpose(1, 2)
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.dist_token, self.reg_token)
                  if t is not None]  # fmt: skip
        x = torch.cat([*prefix, x], dim=1) + self.pos_embed if self.embed_prefix else (
            torch.cat([*prefix, x + self.pos_embed], dim=1))  # fmt: skip
        x = self.norm(self.blocks(x))
        if self.distilled:  # eval mode: the mean of the two heads
            return (self.head(x[:, 0]) + self.head_dist(x[:, 1])) / 2
        if self.pool == "map":  # the tokens after the prefix, as timm pools them (its pool_include_prefix=False)
            x = self.attn_pool(x[:, self.prefix :])
        else:
            x = x[:, 0] if self.pool == "token" else x[:, self.prefix :].mean(dim=1)
        return self.head(self.fc_norm(x))

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor], heads: int, pool: str, eps: float = 1e-6,
                        act: str = "gelu") -> TimmViT:  # fmt: skip
        """The model of a timm ``VisionTransformer`` checkpoint's state dict, its sizes and options read off the
        tensors (square images: the side from the number of patches; ``norm`` and ``fc_norm`` where the keys have
        them); ``heads`` (``num_heads``), ``pool`` (``"token"``, ``"avg"`` or ``"map"``: timm's ``global_pool``),
        ``eps`` and ``act`` are in the model's definition, which no shape holds.

        Raises:
            SpecError: a key is missing or unknown, a shape does not fit, or ``heads`` does not divide the width.
        """
        for key, dims in (("patch_embed.proj.weight", 4), ("pos_embed", 3), ("head.weight", 2)):
            if state.get(key, torch.empty(0)).dim() != dims:
                raise SpecError(f"the timm ViT state dict has no {dims}-axis tensor {key} (a VisionTransformer "
                                "checkpoint with its classifier has one)")  # fmt: skip
        for key in ("cls_token", "dist_token", "reg_token"):
            if key in state and state[key].dim() != 3:
                raise SpecError(f"the timm ViT state dict's {key} has shape {tuple(state[key].shape)}, not (1, k, "
                                "width)")  # fmt: skip
        if pool not in POOLS:
            raise SpecError(f"give pool={' or pool='.join(POOLS)}: a timm checkpoint's keys do not say how its "
                            "classifier pools the tokens (global_pool: the class token, the mean of the patch tokens, "
                            "or attention pooling; timm's max pooling is not modelled)")  # fmt: skip
        if (pool == "map") != ("attn_pool.latent" in state):
            raise SpecError("pool='map' reads the attention pooling's keys (attn_pool.latent ...), which only a model "
                            "pooling by attention has" + (" (this one has them)" if pool != "map" else ""))
        if "attn_pool.latent" in state and tuple(state["attn_pool.latent"].shape[:2]) != (1, 1):
            raise SpecError(f"attn_pool.latent has shape {tuple(state['attn_pool.latent'].shape)}: TimmViT reads one "
                            "latent query, (1, 1, width)")  # fmt: skip
        dim, channels, patch, other = state["patch_embed.proj.weight"].shape
        registers = state["reg_token"].shape[1] if "reg_token" in state else 0
        prefix = int("cls_token" in state) + int("dist_token" in state) + registers
        positions = state["pos_embed"].shape[1]
        # the table covers the prefix tokens too, or the patches alone (no_embed_class): whichever leaves a square grid
        readings = [c for c in ((True, False) if prefix else (True,)) if _square(positions - (prefix if c else 0))]
        if patch != other or len(readings) != 1:
            raise SpecError("the timm ViT state dict's patches are not square, or its positions are not one square "
                            f"grid (with or without the {prefix} prefix token(s)): TimmViT takes square images"
                            + (", and both readings fit here" if len(readings) == 2 else ""))  # fmt: skip
        embed_prefix = readings[0]
        side = math.isqrt(positions - (prefix if embed_prefix else 0))
        depth = len({int(m.group(1)) for k in state if (m := re.match(r"blocks\.(\d+)\.", k))})
        fc1 = state.get("blocks.0.mlp.fc1.weight", torch.empty(0))
        if not positive_integer(heads):
            raise SpecError(f"heads must be a positive integer, got {heads!r}")
        try:
            model = cls(side * patch, patch, dim, depth, heads, state["head.weight"].shape[0], channels,
                        fc1.shape[0] if fc1.dim() == 2 else 4 * dim, eps, act, "blocks.0.attn.qkv.bias" in state,
                        "blocks.0.ls1.gamma" in state, pool, "cls_token" in state, registers, "dist_token" in state,
                        embed_prefix, "norm.weight" in state, "fc_norm.weight" in state,
                        "blocks.0.attn.q_norm.weight" in state)  # fmt: skip
        except ValueError as failure:
            raise SpecError(str(failure)) from None
        return load_fitting(
            model, state, f"timm ViT with {depth} blocks of width {dim}", set(), "patch_embed.proj.weight"
        )


def _square(n: int) -> bool:
    return n > 0 and math.isqrt(n) ** 2 == n


def timmvit_from_spec(spec: str, state: Mapping[str, Tensor]) -> TimmViT:
    """The model of a ``timmvit:heads=H,pool=P[,eps=E,act=A]`` SPEC from its checkpoint's ``state``.

    Raises:
        SpecError: an unknown or malformed option, no ``heads``, or a state dict that does not fit.
    """
    options, config = checkpoint_spec(spec, "timmvit")
    if config is not None or set(options) - {"heads", "eps", "act", "pool"} or not {"heads", "pool"} <= set(options):
        raise SpecError(f"model spec {spec!r}: give the model's number of heads (num_heads) and how it pools the "
                        "tokens (global_pool: token, avg or map), e.g. timmvit:heads=6,pool=token for a ViT-S; the "
                        "other options are eps (default 1e-6) and act (default gelu)")  # fmt: skip
    try:
        heads, eps = int(options["heads"]), float(options.get("eps", 1e-6))
    except ValueError:
        raise SpecError(f"model spec {spec!r}: heads is a positive integer and eps a number") from None
    if heads < 1 or not positive_number(eps):
        raise SpecError(f"model spec {spec!r}: heads is a positive integer and eps a positive finite number")
    try:
        return TimmViT.from_state_dict(state, heads, options.get("pool"), eps, options.get("act", "gelu"))
    except ValueError as failure:
        raise SpecError(f"model spec {spec!r}: {failure}") from None


__all__ = ["TimmViT", "timmvit_from_spec"]
