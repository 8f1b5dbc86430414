"""LLaMA-family decoders as HuggingFace's ``LlamaForCausalLM`` computes them (no cache, no dropout, a causal mask),
written so that ``torch.fx`` traces them: HuggingFace's own classes do not trace, so the toolkit cannot read them.
The module names and state-dict keys are HuggingFace's, so a checkpoint loads as it is (`Llama.from_state_dict`).

Each block is ``x + attn(input_layernorm(x))``, then ``x + mlp(post_attention_layernorm(x))``, both norms RMSNorm with
a weight. Attention projects queries, keys and values (``K`` key/value heads shared by groups of the ``H`` query
heads: grouped-query attention, HuggingFace's ``repeat_kv``), turns each head's queries and keys by rotary position
embeddings (``q cos + rotate_half(q) sin``, angles ``t / theta^(2i / hd)`` computed in float32 as HuggingFace computes
them, scaled as ``rope_scaling`` says: linear, LLaMA 3.1's, dynamic NTK, YaRN or LongRoPE, `rope`), and attends
causally with scale ``hd^-1/2``; Qwen3 first normalizes each head's queries and keys by an RMSNorm with a weight over
the head's features (``q_norm``, ``k_norm``, shared by the heads), OLMo 2 the queries and the keys over all their
features before the heads are split; the MLP is ``down(silu(gate(x)) * up(x))``. The
logits are the final RMSNorm's output times ``lm_head``, which may share the token table (``tie_word_embeddings``).

State-dict keys (``i`` the block index; ``D`` the width, ``V`` the vocabulary, ``hd`` the head size, ``F`` the MLP's)::

    model.embed_tokens.weight (V, D)
    model.layers.i.input_layernorm.weight (D,); model.layers.i.post_attention_layernorm.weight (D,)
    model.layers.i.self_attn.q_proj.weight (H hd, D); k_proj.weight, v_proj.weight (K hd, D); o_proj.weight (D, H hd)
    model.layers.i.self_attn.q_norm.weight, k_norm.weight (hd,) (Qwen3 only), or (H hd,), (K hd,) (OLMo 2 only)
    model.layers.i.self_attn.qkv_proj.weight ((H + 2 K) hd, D); mlp.gate_up_proj.weight (2 F, D) (Phi-3, in place of
        q_proj, k_proj, v_proj and of gate_proj, up_proj)
    model.layers.i.mlp.gate_proj.weight, up_proj.weight (F, D); down_proj.weight (D, F)
    model.norm.weight (D,); lm_head.weight (V, D), absent where it is the token table

OLMo 2's blocks put their norms on the branches' outputs, ``x + post_attention_layernorm(attn(x))`` then ``x +
post_feedforward_layernorm(mlp(x))``: ``post_feedforward_layernorm.weight`` (D,) in place of ``input_layernorm``.
Biases where the checkpoint has them (``attention_bias``, ``mlp_bias``, or Qwen2's query/key/value biases): each
projection has a bias exactly where its ``.bias`` key is present.

Gemma's MLP gates with GELU's tanh approximation (GeGLU), its token embeddings are multiplied by ``sqrt(D)``, and its
RMSNorms multiply by ``1 + w`` for a stored weight ``w``: the model's RMSNorm weights hold the gains ``1 + w`` (the
loaders add the one, `LlamaLayout.norm_offset`), so each norm's scale trade is LLaMA's. Gemma 2's blocks have a norm
before and after each branch, ``x + post_attention_layernorm(attn(input_layernorm(x)))`` then ``x +
post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))`` (``pre_feedforward_layernorm.weight`` (D,) besides),
divide the scores by ``sqrt(query_pre_attn_scalar)``, and cap the scores and the logits softly, ``c tanh(s / c)``.
Gemma 3's text model has Gemma 2's blocks with Qwen3's per-head query/key norms (by ``1 + w`` too), no caps, and its
sliding blocks rotate with a base of their own (``local_theta``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sharpness._specs import (
    SpecError,
    check_config_sizes,
    check_token_ids,
    checkpoint_spec,
    load_decoder,
    output_head,
    positive_integer,
    positive_number,
)

_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": partial(F.gelu, approximate="tanh")}
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")


@dataclass(frozen=True)
class LlamaLayout:
    """How a family's blocks differ from LLaMA's.

    Attributes:
        qk_norm: RMSNorms of the queries and keys (``q_norm``, ``k_norm``): over each head's features (``"head"``,
            Qwen3's, shared by the heads) or over all of them before the heads are split (``"width"``, OLMo 2's);
            ``None``: none.
        post_norms: OLMo 2's blocks, ``x + post_attention_layernorm(attn(x))`` then ``x +
            post_feedforward_layernorm(mlp(x))`` (the norms on the branches' outputs), instead of LLaMA's ``x +
            attn(input_layernorm(x))`` then ``x + mlp(post_attention_layernorm(x))``.
        fused: Phi-3's projections: one ``qkv_proj`` whose rows are the queries', keys' and values' (cut by slices),
            and one ``gate_up_proj`` whose first half of rows is the gate's (cut by ``chunk``).
        sandwich_norms: Gemma 2's blocks, ``x + post_attention_layernorm(attn(input_layernorm(x)))`` then ``x +
            post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))`` (a norm before and after each branch).
        activation: the MLP's gate, ``"silu"`` (LLaMA's SwiGLU) or ``"gelu_tanh"`` (Gemma's GeGLU, GELU's tanh
            approximation, transformers' ``gelu_pytorch_tanh``).
        embed_scale: whether the token embeddings are multiplied by ``sqrt(D)`` (Gemma's, rounded to float32 as
            transformers keeps it).
        norm_offset: what the checkpoint's RMSNorm weights are offset by: Gemma stores ``w`` and multiplies by ``1 +
            w`` (``norm_offset=1``). Only the loaders read it: the model's own RMSNorm weights always hold the gain
            ``w + norm_offset``, so that the norms' scale trade is the plain one (the Hessian is the same: the two
            parameters differ by a constant). Its ``state_dict()`` holds those gains: subtract ``norm_offset`` to
            write a checkpoint transformers reads.
        query_pre_attn_scalar: the scores are ``q k^T / sqrt(query_pre_attn_scalar)`` (Gemma 2's); ``None``: ``/
            sqrt(hd)``.
        attn_softcap: Gemma 2's ``attn_logit_softcapping`` ``c``: the scores become ``c tanh(s / c)`` before the mask
            and softmax; ``None``: none.
        logit_softcap: Gemma 2's ``final_logit_softcapping``, the same on the logits; ``None``: none.
    """

    qk_norm: str | None = None
    post_norms: bool = False
    fused: bool = False
    sandwich_norms: bool = False
    activation: str = "silu"
    embed_scale: bool = False
    norm_offset: float = 0.0
    query_pre_attn_scalar: float | None = None
    attn_softcap: float | None = None
    logit_softcap: float | None = None

    def __post_init__(self):
        if self.qk_norm not in (None, "head", "width"):
            raise ValueError(f"qk_norm must be None, 'head' or 'width', got {self.qk_norm!r}")
        if self.post_norms and self.sandwich_norms:
            raise ValueError("post_norms and sandwich_norms are two different blocks; choose one")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(_ACTIVATIONS)}, got {self.activation!r}")
        if self.norm_offset not in (0.0, 1.0):
            raise ValueError(f"norm_offset must be 0 or 1 (Gemma's 1 + w), got {self.norm_offset!r}")
        for name in ("query_pre_attn_scalar", "attn_softcap", "logit_softcap"):
            value = getattr(self, name)
            if value is not None and not positive_number(value):
                raise ValueError(f"{name} must be a positive finite number or None, got {value!r}")


def is_rotary_buffer(key: str) -> bool:
    """Whether a checkpoint key is the rotary ``inv_freq`` buffer older HuggingFace versions saved: dropped on loading,
    the model computes its angles itself."""
    return re.fullmatch(r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq", key) is not None


_ROPE_KEYS = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def _rope_type(scaling: Mapping[str, object]) -> str:
    """A rope scaling's kind: ``rope_type``, or ``type`` in configs older transformers wrote, as they read it."""
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def rotary_frequencies(head_dim: int, theta: float, scaling: Mapping[str, object] | None = None) -> Tensor:
    """The ``(head_dim / 2,)`` float32 inverse frequencies of the rotary embeddings, as HuggingFace computes them:
    ``theta^(-2i / hd)``, divided by ``factor`` for ``rope_type="linear"``, and for ``"llama3"`` (LLaMA 3.1 and later)
    divided by ``factor`` for wavelengths above ``original_max_position_embeddings / low_freq_factor``, kept below
    ``... / high_freq_factor``, and blended in between.

    Raises:
        ValueError: another ``rope_type`` (`rope` reads ``"dynamic"``, ``"yarn"`` and ``"longrope"``, which depend on
            the sequence's length or scale the attention), or a missing or non-positive parameter.
    """
    kind = _rope_type(scaling or {})
    if kind not in _ROPE_KEYS:
        raise ValueError(f"rope_type {kind!r} is not supported; the supported ones are {', '.join(_ROPE_KEYS)}")
    values = {}
    for key in _ROPE_KEYS[kind]:
        value = (scaling or {}).get(key)
        if not positive_number(value):
            raise ValueError(f"rope_type {kind!r} needs a positive number {key}, got {value!r}")
        values[key] = float(value)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if kind == "linear":
        return inv_freq / values["factor"]
    if kind == "llama3":
        factor, low, high = values["factor"], values["low_freq_factor"], values["high_freq_factor"]
        context = values["original_max_position_embeddings"]
        if high <= low:
            raise ValueError(f"rope_type 'llama3' needs high_freq_factor above low_freq_factor, got {high} and {low}")
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
        smooth = (context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < context / high) * ~(wavelen > context / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


@dataclass(frozen=True)
class Rope:
    """A rotary embedding as HuggingFace's ``LlamaRotaryEmbedding`` computes it for a fresh model (see `rope`):
    ``inv_freq`` the float32 inverse frequencies ``(head_dim / 2,)``; ``long_inv_freq`` those of LongRoPE for sequences
    longer than ``original`` tokens; ``dynamic`` the ``(theta, factor, max_positions)`` of dynamic NTK scaling, whose
    base grows with sequences longer than ``max_positions``; ``attention_factor`` the factor of cos and sin (YaRN's and
    LongRoPE's attention scaling)."""

    inv_freq: Tensor
    long_inv_freq: Tensor | None = None
    original: int = 0
    dynamic: tuple[float, float, int] | None = None
    attention_factor: float = 1.0


def _number(scaling: Mapping[str, object], key: str, default: float | None = None, positive: bool = True) -> float:
    """``scaling[key]`` (or ``default``) as a float: a positive finite number, or with ``positive=False`` any finite
    one; else ``ValueError`` naming the rope type and the key."""
    value = scaling.get(key, default)
    finite = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not (positive_number(value) if positive else finite):
        kind = _rope_type(scaling)
        raise ValueError(f"rope_type {kind!r} needs a {'positive ' if positive else ''}number {key}, got {value!r}")
    return float(value)


def rope(head_dim: int, theta: float, scaling: Mapping[str, object] | None = None,
         max_positions: int | None = None) -> Rope:  # fmt: skip
    """The rotary embedding of a ``rope_scaling`` (or transformers 5's ``rope_parameters``), as transformers 5.24
    computes it: ``default``, ``linear`` and ``llama3`` (`rotary_frequencies`); ``dynamic`` (NTK: for a sequence of
    ``T > max_positions`` tokens the base is ``theta (factor T / max_positions - factor + 1)^(hd / (hd - 2))``, as a
    fresh model computes it on that length); ``yarn`` (frequencies blended between ``theta^(-2i/hd)`` and their
    ``factor``-th by a ramp between ``beta_fast`` and ``beta_slow`` rotations over ``original_max_position_embeddings``,
    cos and sin times the attention factor ``0.1 ln(factor) + 1`` or ``attention_factor``, or the ``mscale`` ratio); and
    ``longrope`` (``short_factor`` or, past ``original_max_position_embeddings`` tokens, ``long_factor`` dividing each
    frequency; cos and sin times ``sqrt(1 + ln(factor) / ln(original))`` or ``attention_factor``). ``max_positions``:
    the config's ``max_position_embeddings``.

    Raises:
        ValueError: another ``rope_type``, a partial rotary factor, or a missing or malformed parameter.
    """
    scaling = scaling or {}
    kind = _rope_type(scaling)
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("a partial_rotary_factor is not supported: sharpness.Llama rotates whole heads")
    if kind in _ROPE_KEYS:
        return Rope(rotary_frequencies(head_dim, theta, scaling))
    if kind not in ("dynamic", "yarn", "longrope"):
        raise ValueError(f"rope_type {kind!r} is not supported; the supported ones are {', '.join(_ROPE_KEYS)}, "
                         "dynamic, yarn and longrope")  # fmt: skip
    if not positive_integer(max_positions):
        raise ValueError(f"rope_type {kind!r} needs the config's max_position_embeddings, got {max_positions!r}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if kind == "dynamic":
        return Rope(rotary_frequencies(head_dim, theta), dynamic=(theta, _number(scaling, "factor"), max_positions))
    original = scaling.get("original_max_position_embeddings", max_positions)
    if not positive_integer(original):
        raise ValueError(f"rope_type {kind!r} needs a positive integer original_max_position_embeddings, got "
                         f"{original!r}")  # fmt: skip
    factor = scaling.get("factor")
    factor = max_positions / original if factor is None else _number(scaling, "factor")
    given = scaling.get("attention_factor")
    if given is not None:
        given = _number(scaling, "attention_factor", positive=False)
    if kind == "longrope":
        factors = {}
        for key in ("short_factor", "long_factor"):
            value = scaling.get(key)
            if not isinstance(value, list) or len(value) != head_dim // 2 or not all(
                    positive_number(v) for v in value):  # fmt: skip
                raise ValueError(f"rope_type 'longrope' needs {key}, {head_dim // 2} positive numbers, got {value!r}")
            factors[key] = 1.0 / (torch.tensor(value, dtype=torch.float32) * theta**exponents)
        if given is None and factor > 1.0 and original == 1:
            raise ValueError("rope_type 'longrope' with an original context of 1 token needs an attention_factor (its "
                             "default divides by log 1)")  # fmt: skip
        if given is None:
            given = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return Rope(factors["short_factor"], factors["long_factor"], original, attention_factor=given)
    if theta <= 1.0:
        raise ValueError(f"rope_type 'yarn' needs rope_theta above 1 (its ramp divides by log theta), got {theta}")
    # transformers reads mscale, mscale_all_dim, beta_fast and beta_slow with `or`: 0 and null take the defaults
    m, m_all, fast, slow = (_number(scaling, key) if scaling.get(key) else None
                            for key in ("mscale", "mscale_all_dim", "beta_fast", "beta_slow"))  # fmt: skip
    fast, slow = fast or 32.0, slow or 1.0

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if given is None:
        given = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)

    def correction(rotations: float) -> float:  # the dimension that turns ``rotations`` times over the context
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction(fast), correction(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high  # transformers' guard against a ramp of zero width
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    positions = theta**exponents
    kept = 1 - ramp  # the share of each frequency extrapolated (kept as it is), the rest interpolated (/ factor)
    inv_freq = 1.0 / (factor * positions) * (1 - kept) + 1.0 / positions * kept
    return Rope(inv_freq, attention_factor=given)


def rotate_half(x: Tensor) -> Tensor:
    """HuggingFace's ``rotate_half``: ``(x1, x2) -> (-x2, x1)`` on the two halves of the last axis."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_cos_sin(positions: Tensor, inv_freq: Tensor, attention_factor: float, dtype: torch.dtype
                   ) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(cos, sin)``, each ``(T, 2 len(inv_freq))`` in ``dtype``, of the float32 angles ``t f`` (positions ``t``,
    float32) as HuggingFace's rotary embeddings compute them, times ``attention_factor`` where it is not one."""
    # float32 products whatever dtype the frequencies were cast to: a product of two float32 values is exact in
    # float64, so rounding it to float32 gives float32's own product
    angles = (positions[:, None] * inv_freq).float()
    angles = torch.cat((angles, angles), dim=-1)
    if attention_factor == 1.0:
        return angles.cos().to(dtype), angles.sin().to(dtype)
    return (angles.cos() * attention_factor).to(dtype), (angles.sin() * attention_factor).to(dtype)


class Float32Frequencies(nn.Module):
    """A module whose ``*inv_freq`` buffers keep their float32 values (as transformers keeps them): casting the model
    to bfloat16 would round them (a logit moved by 1.2 at 600 tokens with YaRN), so they only follow the model across
    devices."""

    def _apply(self, fn, recurse=True):
        kept = {k: b for k, b in self._buffers.items() if k.endswith("inv_freq")}
        super()._apply(fn, recurse)
        for k, b in kept.items():
            self._buffers[k] = b.to(self._buffers[k].device)
        return self


class LlamaAttention(Float32Frequencies):
    """Causal grouped-query self-attention with rotary position embeddings on ``(N, T, D)``."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, rope: Rope, bias: Mapping[str, bool],
                 window: int | None = None, layout: LlamaLayout = LlamaLayout(), eps: float = 1e-6):  # fmt: skip
        """``layout``: the family's query/key norms (with ``eps``) and fused projections."""
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.window = heads, kv_heads, head_dim, window
        self.register_buffer("inv_freq", rope.inv_freq.clone(), persistent=False)  # float32 values, as HuggingFace's
        if rope.long_inv_freq is not None:
            self.register_buffer("long_inv_freq", rope.long_inv_freq.clone(), persistent=False)
        self.original, self.dynamic, self.attention_factor = rope.original, rope.dynamic, rope.attention_factor
        self.fused = layout.fused
        scalar = layout.query_pre_attn_scalar
        self.scale, self.softcap = None if scalar is None else scalar**-0.5, layout.attn_softcap
        if self.fused:
            self.qkv_proj = nn.Linear(dim, (heads + 2 * kv_heads) * head_dim, bias=bias.get("qkv_proj", False))
        else:
            self.q_proj = nn.Linear(dim, heads * head_dim, bias=bias.get("q_proj", False))
            self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=bias.get("k_proj", False))
            self.v_proj = nn.Linear(dim, kv_heads * head_dim, bias=bias.get("v_proj", False))
        self.o_proj = nn.Linear(heads * head_dim, dim, bias=bias.get("o_proj", False))
        qk_norm = self.qk_norm = layout.qk_norm
        if qk_norm is not None:
            q_size, k_size = (head_dim, head_dim) if qk_norm == "head" else (heads * head_dim, kv_heads * head_dim)
            self.q_norm, self.k_norm = nn.RMSNorm(q_size, eps=eps), nn.RMSNorm(k_size, eps=eps)

    def _frequencies(self, positions: Tensor) -> Tensor:
        """The inverse frequencies for a sequence of these positions (float32 ``0 .. T-1``), as a fresh HuggingFace
        model computes them on it: from the sequence's length for dynamic NTK scaling and LongRoPE (tensor arithmetic:
        fx traces no branch on the length)."""
        if self.dynamic is not None:
            theta, factor, most = self.dynamic
            seq = torch.clamp(positions[-1:] + 1, min=most)
            base = theta * ((factor * seq / most) - (factor - 1)) ** (self.head_dim / (self.head_dim - 2))
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=positions.device).float()
            return 1.0 / (base ** (exponents / self.head_dim))
        if self.original:
            return torch.where(positions[-1:] + 1 > self.original, self.long_inv_freq, self.inv_freq)
        return self.inv_freq

    def _heads(self, t: Tensor, n: int, norm: nn.Module | None = None) -> Tensor:
        """``(N, T, n hd)`` -> ``(N, n, T, hd)``, each head's features normalized by ``norm`` on the way (Qwen3's)."""
        t = t.view(t.size(0), t.size(1), n, self.head_dim)
        return (t if norm is None else norm(t)).transpose(1, 2)

    def _repeat(self, t: Tensor) -> Tensor:
        """HuggingFace's ``repeat_kv``: each key/value head read by its group of query heads."""
        b, _, length, hd = t.shape
        groups = self.heads // self.kv_heads
        if groups == 1:
            return t
        return t[:, :, None, :, :].expand(b, self.kv_heads, groups, length, hd).reshape(b, self.heads, length, hd)

    def _seen(self, q: Tensor) -> Tensor:
        """``(T, T)``: which keys each query sees, those before it (within the sliding window where there is one)."""
        token = torch.arange(q.size(2), device=q.device)
        gap = token[:, None] - token[None, :]
        return gap >= 0 if self.window is None else (gap >= 0) & (gap < self.window)

    def _capped(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Gemma 2's attention: the scaled scores ``s`` capped to ``c tanh(s / c)``, then masked and normalized (no
        fused kernel takes the cap)."""
        scores = q @ k.transpose(-2, -1) * (self.head_dim**-0.5 if self.scale is None else self.scale)
        scores = torch.tanh(scores / self.softcap) * self.softcap
        return torch.softmax(scores.masked_fill(~self._seen(q), float("-inf")), dim=-1) @ v

    def forward(self, x: Tensor) -> Tensor:
        if self.fused:  # Phi-3: the rows of one projection, cut as transformers cuts them
            qkv = self.qkv_proj(x)
            queries, keys = self.heads * self.head_dim, self.kv_heads * self.head_dim
            q, k, v = qkv[..., :queries], qkv[..., queries : queries + keys], qkv[..., queries + keys :]
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "width":  # OLMo 2: over all the features, before the heads are split
            q, k = self.q_norm(q), self.k_norm(k)
        q = self._heads(q, self.heads, self.q_norm if self.qk_norm == "head" else None)
        k = self._heads(k, self.kv_heads, self.k_norm if self.qk_norm == "head" else None)
        v = self._heads(v, self.kv_heads)
        # the angles in float32, as HuggingFace's LlamaRotaryEmbedding computes them, then in the activations' dtype
        positions = torch.arange(x.size(1), dtype=torch.float32, device=x.device)
        cos, sin = rotary_cos_sin(positions, self._frequencies(positions), self.attention_factor, x.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        scale = {} if self.scale is None else {"scale": self.scale}
        if self.softcap is not None:
            out = self._capped(q, self._repeat(k), self._repeat(v))
        elif self.window is None:
            out = F.scaled_dot_product_attention(q, self._repeat(k), self._repeat(v), is_causal=True, **scale)
        else:  # Mistral's sliding window: query t sees the keys t - window + 1 .. t
            out = F.scaled_dot_product_attention(q, self._repeat(k), self._repeat(v), attn_mask=self._seen(q), **scale)
        return self.o_proj(out.transpose(1, 2).reshape(x.size(0), x.size(1), self.heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: Mapping[str, bool], fused: bool = False,
                 activation: str = "silu"):  # fmt: skip
        super().__init__()
        self.fused, self.activation = fused, activation
        if fused:  # Phi-3's gate and up projections as one
            self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=bias.get("gate_up_proj", False))
        else:
            self.gate_proj = nn.Linear(dim, hidden, bias=bias.get("gate_proj", False))
            self.up_proj = nn.Linear(dim, hidden, bias=bias.get("up_proj", False))
        self.down_proj = nn.Linear(hidden, dim, bias=bias.get("down_proj", False))

    def forward(self, x: Tensor) -> Tensor:
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(up * _ACTIVATIONS[self.activation](gate))
        return self.down_proj(_ACTIVATIONS[self.activation](self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, hidden: int, eps: float,
                 rope: Rope, bias: Mapping[str, bool], window: int | None, layout: LlamaLayout):  # fmt: skip
        super().__init__()
        self.self_attn = LlamaAttention(dim, heads, kv_heads, head_dim, rope, bias, window, layout, eps)
        self.mlp = LlamaMLP(dim, hidden, bias, layout.fused, layout.activation)
        self.post_norms, self.sandwich_norms = layout.post_norms, layout.sandwich_norms
        if self.post_norms:
            self.post_attention_layernorm = nn.RMSNorm(dim, eps=eps)
            self.post_feedforward_layernorm = nn.RMSNorm(dim, eps=eps)
        elif self.sandwich_norms:
            self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(dim, eps=eps), nn.RMSNorm(dim, eps=eps)
            self.pre_feedforward_layernorm = nn.RMSNorm(dim, eps=eps)
            self.post_feedforward_layernorm = nn.RMSNorm(dim, eps=eps)
        else:
            self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(dim, eps=eps), nn.RMSNorm(dim, eps=eps)

    def forward(self, x: Tensor) -> Tensor:
        if self.post_norms:
            x = x + self.post_attention_layernorm(self.self_attn(x))
            return x + self.post_feedforward_layernorm(self.mlp(x))
        if self.sandwich_norms:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x)))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, kv_heads: int, head_dim: int, hidden: int, eps: float,
                 ropes: Sequence[Rope], bias: Mapping[str, bool], windows: Sequence[int | None], layout: LlamaLayout,
                 padding_idx: int | None):  # fmt: skip
        """``ropes``, ``windows``: each block's rotary embedding and sliding window."""
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        sizes = (dim, heads, kv_heads, head_dim, hidden, eps)
        self.layers = nn.ModuleList(LlamaDecoderLayer(*sizes, rotary, bias, window, layout)
                                    for rotary, window in zip(ropes, windows))  # fmt: skip
        self.norm = nn.RMSNorm(dim, eps=eps)
        # Gemma's sqrt(D), as transformers keeps it: a float32 number (exact in float32 and float64 products)
        self.embed_scale = float(torch.tensor(dim**0.5, dtype=torch.float32)) if layout.embed_scale else None

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class DecoderBody(nn.Module):
    """A decoder's body: its token table, its blocks in turn and a final norm, under the names its family's
    checkpoints give them (``names``: the table's, the blocks' list's and the norm's)."""

    def __init__(self, names: tuple[str, str, str], table: nn.Embedding, blocks: list[nn.Module], norm: nn.Module):
        super().__init__()
        self._names = names
        for name, module in zip(names, (table, nn.ModuleList(blocks), norm)):
            self.add_module(name, module)

    def forward(self, input_ids: Tensor) -> Tensor:
        table, blocks, norm = (getattr(self, name) for name in self._names)
        x = table(input_ids)
        for block in blocks:
            x = block(x)
        return norm(x)


class CausalLM(nn.Module):
    """What the decoders here (`Llama`, `GPTNeoX`, `GPTJ`, `OPT`, `Phi`) share around their blocks: the language-model
    head ``lm_head`` over the vocabulary (sharing the token table where ``tied``), the token ids' check and the logits'
    layout. A subclass builds its blocks, then calls `_add_head`."""

    takes_token_ids = True  # the command lines keep the data's integer X as it is for such a model
    _kind = "a language model"  # the model, as the token check names it

    def _add_head(self, table: nn.Embedding, tied: bool, classes_last: bool, bias: bool = False) -> None:
        self.lm_head = nn.Linear(table.embedding_dim, table.num_embeddings, bias=bias)
        if tied:
            self.lm_head.weight = table.weight
        self.classes_last = classes_last

    def check_tokens(self, input_ids: Tensor) -> None:
        """Raises ``ValueError`` (one sentence) unless ``input_ids`` are ``(N, T)`` integer ids below the vocabulary
        size."""
        check_token_ids(input_ids, self.lm_head.out_features, None, self._kind)  # the table's rows

    def _laid_out(self, logits: Tensor) -> Tensor:
        """``(N, T, V)`` logits as ``classes_last`` asks."""
        return logits if self.classes_last else logits.transpose(1, 2)


class Llama(CausalLM):
    """A LLaMA-family decoder with its language-model head, as HuggingFace's ``LlamaForCausalLM`` computes it in eval
    mode.

    Args:
        vocab: vocabulary size ``V``.
        dim: width ``D`` (``hidden_size``).
        layers: number of blocks (``num_hidden_layers``).
        heads: query heads per block ``H`` (``num_attention_heads``).
        kv_heads: key/value heads ``K`` (``num_key_value_heads``), dividing ``heads``; ``None``: ``heads``.
        hidden: the MLP's width (``intermediate_size``); ``None``: ``4 * dim``.
        head_dim: the head size ``hd``; ``None``: ``dim // heads``.
        eps: the RMSNorms' epsilon (``rms_norm_eps``).
        theta: the rotary base (``rope_theta``).
        rope_scaling: HuggingFace's ``rope_scaling`` (or ``rope_parameters``) for a scaled rotary embedding:
            ``{"rope_type": "linear", "factor": ...}``, LLaMA 3.1's ``"llama3"``, ``"dynamic"``, ``"yarn"`` or
            ``"longrope"`` (`rope`).
        max_positions: the config's ``max_position_embeddings``, which dynamic, YaRN and LongRoPE scalings read.
        sliding_window: Mistral's ``sliding_window``: each query sees itself and the ``sliding_window - 1`` keys
            before it; ``None``: every key before it. A sequence gives each block its own (``None`` where a block
            attends to every key before a query: Qwen2's and Ministral's ``layer_types``).
        tied: whether ``lm_head`` shares the token table (``tie_word_embeddings``).
        bias: the projections (``"q_proj"``, ..., ``"down_proj"``, or Phi-3's ``"qkv_proj"``, ``"gate_up_proj"``) that
            have a bias; a name the layout does not build is refused.
        layout: how the family's blocks differ from LLaMA's ([`LlamaLayout`][sharpness.LlamaLayout]: Qwen3's and
            OLMo 2's query/key norms, OLMo 2's norms on the branches' outputs, Phi-3's fused projections, Gemma's
            GeGLU, scaled embeddings and norm gains, Gemma 2's norms around the branches and soft caps).
        padding_idx: the token whose row of the table is held fixed (``pad_token_id``: HuggingFace builds the table
            with it, so its gradient, and its row of the Hessian, is zero); ``None``: none.
        classes_last: logits ``(N, T, V)`` (``True``, as HuggingFace returns them) or ``(N, V, T)`` (what
            ``nn.CrossEntropyLoss`` reads against ``(N, T)`` next-token targets).
        local_theta: the rotary base of the blocks with a sliding window (Gemma 3's ``rope_local_base_freq``, its
            ``rope_parameters["sliding_attention"]``), ``local_rope_scaling`` their scaling; ``None``: those blocks
            rotate as the others.

    Inputs are token ids ``(N, T)``; any length (the rotary angles are computed for it).
    """

    _kind = "a LLaMA model"

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int | None = None,
                 hidden: int | None = None, head_dim: int | None = None, eps: float = 1e-6, theta: float = 10000.0,
                 tied: bool = False, bias: Mapping[str, bool] | None = None, classes_last: bool = True,
                 rope_scaling: Mapping[str, object] | None = None,
                 sliding_window: int | Sequence[int | None] | None = None,
                 max_positions: int | None = None, layout: LlamaLayout = LlamaLayout(),
                 padding_idx: int | None = None, local_theta: float | None = None,
                 local_rope_scaling: Mapping[str, object] | None = None):  # fmt: skip
        super().__init__()
        kv_heads = heads if kv_heads is None else kv_heads
        head_dim = dim // heads if head_dim is None else head_dim
        if heads < 1 or kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads in equal groups")
        windows = list(sliding_window) if isinstance(sliding_window, Sequence) else [sliding_window] * layers
        if not all(w is None or positive_integer(w) for w in windows):
            raise ValueError(f"sliding_window must be a positive integer, None, or one of those per block, got "
                             f"{sliding_window!r}")  # fmt: skip
        if len(windows) != layers:
            raise ValueError(f"{len(windows)} sliding windows are given for {layers} blocks")
        if head_dim < 2 or head_dim % 2:
            raise ValueError(f"the head size {head_dim} must be even for rotary embeddings")
        if not positive_number(eps) or not positive_number(theta):
            raise ValueError(f"eps={eps} and theta={theta} must be positive finite numbers")
        if local_theta is not None and not positive_number(local_theta):
            raise ValueError(f"local_theta must be a positive finite number or None, got {local_theta!r}")
        if local_theta is None and local_rope_scaling:
            raise ValueError("local_rope_scaling needs local_theta (the sliding blocks' rotary base)")
        unknown = set(bias or {}) - set(_PROJECTIONS)
        if unknown:
            raise ValueError(f"bias names {sorted(unknown)}; the projections are {', '.join(_PROJECTIONS)}")
        built = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"} if layout.fused else set(_PROJECTIONS) - {
            "qkv_proj", "gate_up_proj"}
        if any(bias.get(name) for name in set(bias or {}) - built):
            raise ValueError(f"bias names {sorted(n for n in set(bias) - built if bias[n])} name projections this "
                             f"layout does not build ({', '.join(sorted(built))})")  # fmt: skip
        if padding_idx is not None and (isinstance(padding_idx, bool) or not isinstance(padding_idx, int)
                                        or not -vocab <= padding_idx < vocab):  # fmt: skip
            raise ValueError(f"pad_token_id must be a token id in [-{vocab}, {vocab}) or null, got {padding_idx!r}")
        rotary = rope(head_dim, theta, rope_scaling, max_positions)
        local = rotary if local_theta is None else rope(head_dim, local_theta, local_rope_scaling, max_positions)
        ropes = [rotary if window is None else local for window in windows]
        self.model = LlamaBody(vocab, dim, heads, kv_heads, head_dim, 4 * dim if hidden is None else hidden, eps,
                               ropes, dict(bias or {}), windows, layout, padding_idx)  # fmt: skip
        self._add_head(self.model.embed_tokens, tied, classes_last)
        self.logit_softcap = layout.logit_softcap

    def forward(self, input_ids: Tensor) -> Tensor:
        logits = self.lm_head(self.model(input_ids))
        if self.logit_softcap is not None:  # Gemma 2's cap, c tanh(logits / c)
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return self._laid_out(logits)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor], heads: int, eps: float = 1e-6, theta: float = 10000.0,
                        classes_last: bool = True, rope_scaling: Mapping[str, object] | None = None,
                        tied: bool | None = None,
                        sliding_window: int | Sequence[int | None] | None = None,
                        max_positions: int | None = None, padding_idx: int | None = None,
                        options: Mapping[str, object] | None = None, local_theta: float | None = None,
                        local_rope_scaling: Mapping[str, object] | None = None) -> Llama:  # fmt: skip
        """The model of a LLaMA-family checkpoint's state dict (``LlamaForCausalLM``'s keys, or ``LlamaModel``'s
        without the ``model.`` prefix; old ``rotary_emb.inv_freq`` buffers are dropped), its sizes read off the
        tensors: the head size from ``o_proj``'s columns, the key/value heads from ``k_proj``'s rows (Phi-3's fused
        ``qkv_proj``: from its rows less the queries', with ``gate_up_proj`` in place of ``gate_proj`` and
        ``up_proj``), biases where the checkpoint has them, query/key RMSNorms where it has
        ``self_attn.q_norm.weight`` (over a head's features, Qwen3's, where it has that size, else over all of them,
        OLMo 2's), and OLMo 2's blocks (norms on the branches' outputs) where it has
        ``post_feedforward_layernorm.weight``. ``heads`` (``num_attention_heads``), ``eps`` (``rms_norm_eps``),
        ``theta`` (``rope_theta``) and ``rope_scaling`` are in the checkpoint's ``config.json``, which no shape holds
        (`from_config` reads them there), and so are the sliding windows, ``max_position_embeddings``
        (``max_positions``, which dynamic, YaRN and LongRoPE scalings read) and ``pad_token_id`` (``padding_idx``).
        Gemma 2's blocks (a norm before and after each branch) are read where it has
        ``pre_feedforward_layernorm.weight``; ``options`` holds the [`LlamaLayout`][sharpness.LlamaLayout] fields no
        tensor shows (``activation``, ``embed_scale``, ``norm_offset``, ``query_pre_attn_scalar``, ``attn_softcap``,
        ``logit_softcap``: Gemma's, which `from_config` reads off its config), ``local_theta`` and
        ``local_rope_scaling`` Gemma 3's rotary embedding of the sliding blocks. With ``norm_offset=1`` the RMSNorm
        weights ``w`` are loaded as the gains ``1 + w``, rounded in their dtype (float32 rounds them as transformers
        computes them); a half-precision checkpoint then becomes a float32 model (transformers computes the gains in
        float32 whatever the weights' dtype; half precision would round them).
        ``tied``
        (``tie_word_embeddings``): ``None`` reads it off the tensors, tied where ``lm_head.weight`` is absent or equal
        to the token table.

        Raises:
            ValueError: a key is missing or unknown, a shape does not fit, ``tied`` contradicts the tensors, an
                unsupported ``rope_scaling``, an unknown option, or a norm weight that is not floating-point.
        """
        unknown = set(options or {}) - _OPTIONS
        if unknown:
            raise SpecError(f"unknown layout options {sorted(unknown)}; the options are {', '.join(sorted(_OPTIONS))}")
        tensors = {}
        for key, value in state.items():
            if is_rotary_buffer(key):
                continue
            tensors[key if key.startswith(("model.", "lm_head.")) else f"model.{key}"] = value
        if "model.embed_tokens.weight" not in tensors or tensors["model.embed_tokens.weight"].dim() != 2:
            raise SpecError("the LLaMA state dict has no token table model.embed_tokens.weight (V, D)")
        table = tensors["model.embed_tokens.weight"]
        vocab, dim = table.shape
        layers = len({int(m.group(1)) for k in tensors if (m := re.match(r"model\.layers\.(\d+)\.", k))})
        first = "model.layers.0."
        fused = first + "self_attn.qkv_proj.weight" in tensors
        attention = ("qkv_proj",) if fused else ("q_proj", "k_proj")
        mlp = "gate_up_proj" if fused else "gate_proj"
        for name in (*(f"self_attn.{n}.weight" for n in attention), f"mlp.{mlp}.weight", "self_attn.o_proj.weight"):
            if tensors.get(first + name, torch.empty(0)).dim() != 2:
                raise SpecError(f"the LLaMA state dict has no matrix {first + name}")
        if not positive_integer(heads):
            raise SpecError(f"heads must be a positive integer, got {heads!r}")
        q_rows = tensors[first + "self_attn.o_proj.weight"].shape[1]  # the heads' features, merged
        if not fused and tensors[first + "self_attn.q_proj.weight"].shape[0] == 0:
            raise SpecError("q_proj must have rows (the heads' features)")
        if q_rows == 0:
            raise SpecError("o_proj must have columns (the heads' features)")
        if q_rows % heads:
            raise SpecError(f"the heads' {q_rows} features (o_proj's columns) are not a multiple of heads={heads}")
        head_dim = q_rows // heads
        if fused:  # the queries' rows, then the keys' and the values' alike
            k_rows, odd = divmod(tensors[first + "self_attn.qkv_proj.weight"].shape[0] - q_rows, 2)
            hidden, half = divmod(tensors[first + "mlp.gate_up_proj.weight"].shape[0], 2)
            if odd or k_rows <= 0:
                raise SpecError("qkv_proj must hold the queries' rows (o_proj's columns), then as many rows for the "
                                "keys as for the values")  # fmt: skip
            if half:
                raise SpecError("gate_up_proj must hold the gate's rows, then as many for the up projection")
        else:
            if tensors[first + "self_attn.q_proj.weight"].shape[0] != q_rows:
                raise SpecError(f"q_proj has {tensors[first + 'self_attn.q_proj.weight'].shape[0]} rows, o_proj "
                                f"{q_rows} columns: they must agree (the heads' features)")  # fmt: skip
            k_rows = tensors[first + "self_attn.k_proj.weight"].shape[0]
            hidden = tensors[first + "mlp.gate_proj.weight"].shape[0]
        if k_rows == 0 or k_rows % head_dim:
            raise SpecError(f"the keys have {k_rows} rows, not a positive multiple of the head size {head_dim}")
        bias = {p: any(k.endswith(f".{p}.bias") for k in tensors) for p in _PROJECTIONS}
        norm = tensors.get(first + "self_attn.q_norm.weight")
        sandwich = first + "pre_feedforward_layernorm.weight" in tensors
        post = first + "post_feedforward_layernorm.weight" in tensors and not sandwich
        try:
            layout = LlamaLayout(None if norm is None else "head" if norm.shape == (head_dim,) else "width", post,
                                 fused, sandwich, **(options or {}))  # fmt: skip
        except (TypeError, ValueError) as failure:
            raise SpecError(str(failure)) from None
        if layout.norm_offset:
            if any(t.is_floating_point() and t.dtype not in (torch.float32, torch.float64) for t in tensors.values()):
                # transformers computes Gemma's gains 1 + w in float32 whatever the weights' dtype: a half-precision
                # gain would round, so such a checkpoint becomes a float32 twin (an exact conversion)
                tensors = {k: t.float() if t.is_floating_point() else t for k, t in tensors.items()}
                table = tensors["model.embed_tokens.weight"]
            _add_norm_offset(tensors, layout.norm_offset)
        tied, head = output_head(tensors, table, tied)
        build = partial(cls, vocab, dim, layers, heads, k_rows // head_dim, hidden, head_dim, eps, theta, tied, bias,
                        classes_last, rope_scaling, sliding_window, max_positions, layout, padding_idx,
                        local_theta, local_rope_scaling)  # fmt: skip
        return load_decoder(build, tensors, head, tied, f"LLaMA with {layers} blocks", "model.embed_tokens.weight")

    @classmethod
    def from_config(cls, config: Mapping[str, object], state: Mapping[str, Tensor], classes_last: bool = True) -> Llama:
        """The model of a checkpoint's ``config.json`` (as a dict) and state dict: ``num_attention_heads``,
        ``rms_norm_eps`` (default 1e-6), ``rope_theta`` and ``rope_scaling`` (or transformers 5's
        ``rope_parameters``), ``tie_word_embeddings`` (default: read off the tensors), ``hidden_act`` (``silu``; for
        ``model_type`` ``"gemma"`` and ``"gemma2"`` GELU's tanh approximation, with Gemma's scaled embeddings, ``1 +
        w`` norms, and Gemma 2's ``query_pre_attn_scalar`` and soft caps, `LlamaLayout`),
        ``pad_token_id`` (the token table's fixed row, as transformers builds the table) and
        the sliding windows as transformers reads them: Mistral's ``sliding_window`` on every block, Qwen2's where
        ``use_sliding_window`` is true, on the blocks from ``max_window_layers`` on, and per block by ``layer_types``
        (Qwen2, Ministral); ``LlamaForCausalLM`` reads none.

        Raises:
            ValueError: a field missing or of the wrong kind, another activation, bidirectional attention, a
                ``partial_rotary_factor`` below one, sizes (``num_key_value_heads``, ``head_dim``, ``hidden_size``,
                ``vocab_size``, ``num_hidden_layers``, ``intermediate_size``) other than the tensors hold, or what
                `from_state_dict` raises.
        """
        heads = config.get("num_attention_heads")
        if not positive_integer(heads):
            raise SpecError(f"the config's num_attention_heads must be a positive integer, got {heads!r}")
        kind = config.get("model_type")
        if kind not in _GEMMA and (str(kind).startswith("gemma") or "hidden_activation" in config):
            # another Gemma (Gemma 3's multimodal config, Gemma 3n, 4), or a config with Gemma's activation key that
            # does not say it is one: read as LLaMA's, its activation, gains and embeddings would be wrong
            raise SpecError(f"the config's model_type is {kind!r}: sharpness.Llama reads Gemma's model types "
                            f"{', '.join(_GEMMA)} (Gemma 3's text config, not its multimodal one)")  # fmt: skip
        options = _gemma_options(config) if kind in _GEMMA else None
        if options is None and config.get("hidden_act", "silu") != "silu":
            raise SpecError(f"the config's hidden_act is {config['hidden_act']!r}; a LLaMA MLP gates with silu")
        local = None
        if config.get("model_type") == "gemma3_text":
            parameters, local = _gemma3_rope_parameters(config)
        else:
            parameters = config.get("rope_parameters") or {}
            if not isinstance(parameters, Mapping):
                raise SpecError(f"the config's rope_parameters must be an object, got {parameters!r}")
            if config.get("rope_scaling"):  # transformers takes it whole, in place of rope_parameters
                parameters = config["rope_scaling"]
                if not isinstance(parameters, Mapping):
                    raise SpecError(f"the config's rope_scaling must be an object, got {parameters!r}")
        theta, scaling = _rope_settings(config, parameters)
        local_theta, local_scaling = (None, None) if local is None else _rope_settings(config, local)
        eps = config.get("rms_norm_eps", 1e-6)
        tied = config.get("tie_word_embeddings")
        if not positive_number(eps):
            raise SpecError(f"the config's rms_norm_eps must be a positive number, got {eps!r}")
        if tied is not None and not isinstance(tied, bool):
            raise SpecError(f"the config's tie_word_embeddings must be true or false, got {tied!r}")
        windows = _config_windows(config)
        if local is not None and windows is None and "sliding_attention" in (
                config.get("layer_types") or ["sliding_attention"]):  # fmt: skip
            raise SpecError("the config has sliding blocks without a sliding_window; sharpness.Llama gives Gemma 3's "
                            "local rotary base to the blocks with a window")  # fmt: skip
        model = cls.from_state_dict(state, heads, float(eps), theta, classes_last, scaling, tied, windows,
                                    config.get("max_position_embeddings"),
                                    config.get("pad_token_id", 0 if kind in _GEMMA else None), options,
                                    local_theta, local_scaling)  # fmt: skip
        body, attention = model.model, model.model.layers[0].self_attn
        mlp = body.layers[0].mlp
        held = {"num_key_value_heads": attention.kv_heads, "head_dim": attention.head_dim,
                "hidden_size": body.embed_tokens.embedding_dim, "vocab_size": body.embed_tokens.num_embeddings,
                "num_hidden_layers": len(body.layers),
                "intermediate_size": mlp.down_proj.in_features}  # fmt: skip
        check_config_sizes(config, held, f" (with num_attention_heads={heads})")
        return model


def _rope_settings(config: Mapping[str, object], parameters: Mapping[str, object]) -> tuple[float, dict | None]:
    """``(theta, rope_scaling)`` of one set of rope parameters as transformers reads them, ``rope_scaling`` ``None`` for
    the default rope type.

    Raises:
        SpecError: a non-positive ``rope_theta``, a ``partial_rotary_factor`` below one, or a scaling that is not an
            object.
    """
    theta = parameters.get("rope_theta", config.get("rope_theta", 10000.0))
    # Phi-3 rotates a share of each head (transformers reads it from the rope parameters, or the config's top level as
    # older files save it); a default rope type would drop it below, so it is refused here
    partial = parameters.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial is not None and partial != 1.0:
        raise SpecError(f"the config's partial_rotary_factor is {partial!r}: sharpness.Llama rotates whole heads")
    if not positive_number(theta):
        raise SpecError(f"the config's rope_theta must be a positive number, got {theta!r}")
    if _rope_type(parameters) == "default":
        return float(theta), None
    scaling = dict(parameters)
    if _rope_type(scaling) in ("llama3", "yarn", "longrope"):
        # the original context as transformers reads it: a top-level original_max_position_embeddings first (Phi-3
        # saves it there), then the scaling's own, then the model's max_position_embeddings (LlamaConfig's default 2048)
        scaling["original_max_position_embeddings"] = config.get(
            "original_max_position_embeddings",
            scaling.get("original_max_position_embeddings", config.get("max_position_embeddings", 2048)))
    return float(theta), scaling


def _gemma3_rope_parameters(config: Mapping[str, object]) -> tuple[dict, dict]:
    """Gemma 3's rope parameters of its full and its sliding blocks, as ``Gemma3TextConfig`` reads them: transformers
    5's ``rope_parameters`` keyed by ``full_attention`` and ``sliding_attention``, or older files' ``rope_theta``
    (default 1e6), ``rope_local_base_freq`` (1e4) and ``rope_scaling`` (the full blocks').

    Raises:
        SpecError: rope parameters that are not objects, or keyed otherwise.
    """
    given = config.get("rope_parameters") or {}
    if not isinstance(given, Mapping) or set(given) - {"full_attention", "sliding_attention"}:
        raise SpecError(f"the config's rope_parameters must be an object keyed by full_attention and "
                        f"sliding_attention (Gemma 3's), got {given!r}")  # fmt: skip
    sides = []
    for kind, key, default in (("full_attention", "rope_theta", 1e6), ("sliding_attention", "rope_local_base_freq",
                                                                         1e4)):  # fmt: skip
        side = given.get(kind) or {}
        if not isinstance(side, Mapping):
            raise SpecError(f"the config's rope_parameters[{kind!r}] must be an object, got {side!r}")
        side = dict(side)
        side.setdefault("rope_theta", config.get(key, default))
        sides.append(side)
    scaling = config.get("rope_scaling")
    if scaling:
        if not isinstance(scaling, Mapping):
            raise SpecError(f"the config's rope_scaling must be an object, got {scaling!r}")
        sides[0].update(scaling)
    return sides[0], sides[1]


_OPTIONS = {"activation", "embed_scale", "norm_offset", "query_pre_attn_scalar", "attn_softcap", "logit_softcap"}
_NORM_WEIGHT = re.compile(r"model\.norm\.weight|model\.layers\.\d+\.(input_layernorm|post_attention_layernorm|"
                          r"pre_feedforward_layernorm|post_feedforward_layernorm|self_attn\.[qk]_norm)\.weight")


def _add_norm_offset(tensors: dict[str, Tensor], offset: float) -> None:
    """Gemma's RMSNorm weights ``w`` (the norms multiply by ``offset + w``) replaced by the gains ``offset + w`` in
    place, rounded in their dtype (float32 rounds them as transformers computes them, float64 finer).

    Raises:
        SpecError: a norm weight that is not floating-point.
    """
    for key in [k for k in tensors if _NORM_WEIGHT.fullmatch(k)]:
        w = tensors[key]
        if not w.is_floating_point():
            raise SpecError(f"the norm weight {key} must be floating-point, got {w.dtype}")
        tensors[key] = w + offset


_GEMMA = ("gemma", "gemma2", "gemma3_text")


def _gemma_options(config: Mapping[str, object]) -> dict[str, object]:
    """The layout options of a Gemma, Gemma 2 or Gemma 3 (text) config as transformers reads them: GELU's tanh
    approximation (``hidden_act`` for Gemma, whose legacy ``"gelu"`` transformers reads as it, ``hidden_activation``
    for the others), embeddings times ``sqrt(D)``, norms by ``1 + w``, and for Gemma 2 and 3 ``query_pre_attn_scalar``
    (default 256) and the soft caps (Gemma 2's defaults 50 on the scores and 30 on the logits, Gemma 3's none).

    Raises:
        SpecError: another activation, bidirectional attention, or a scalar or cap that is not a positive number.
    """
    kind = config.get("model_type")
    key = "hidden_act" if kind == "gemma" else "hidden_activation"
    activation = config.get(key, "gelu_pytorch_tanh")
    if activation not in ("gelu_pytorch_tanh", *(("gelu",) if kind == "gemma" else ())):
        raise SpecError(f"the config's {key} is {activation!r}; sharpness.Llama reads Gemma's gelu_pytorch_tanh")
    if config.get("use_bidirectional_attention"):
        raise SpecError("the config's use_bidirectional_attention is true: sharpness.Llama attends causally")
    options: dict[str, object] = {"activation": "gelu_tanh", "embed_scale": True, "norm_offset": 1.0}
    if kind == "gemma":
        return options
    defaults = {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0 if kind == "gemma2" else None,
                "final_logit_softcapping": 30.0 if kind == "gemma2" else None}  # fmt: skip
    for option, name in (("query_pre_attn_scalar", "query_pre_attn_scalar"), ("attn_softcap", "attn_logit_softcapping"),
                         ("logit_softcap", "final_logit_softcapping")):  # fmt: skip
        value = config.get(name, defaults[name])
        if value is not None and not positive_number(value):
            raise SpecError(f"the config's {name} must be a positive number or null, got {value!r}")
        options[option] = None if value is None else float(value)
    return options


def _config_windows(config: Mapping[str, object]) -> int | list[int | None] | None:
    """The sliding windows of a config as transformers' classes read them: none for ``LlamaForCausalLM``, Mistral's and
    Phi-3's ``sliding_window`` on every block (``MistralForCausalLM`` reads no ``layer_types``), and for the others
    (Qwen2, Ministral, Qwen3, Gemma 2) the window on the blocks whose ``layer_types`` entry is ``"sliding_attention"``
    (without ``layer_types``: Gemma 2's even blocks, 0, 2, ..., Gemma 3's all but every ``sliding_window_pattern``-th,
    default 6); none for Gemma; Qwen's
    classes have one only where ``use_sliding_window`` is true, and without ``layer_types`` on the blocks from
    ``max_window_layers`` on.
    A config without ``sliding_window`` has their default, 4096 tokens.

    Raises:
        SpecError: a window, flag or ``layer_types`` of the wrong kind, or ``layer_types`` not one per block.
    """
    kind = config.get("model_type")
    if kind in ("llama", "gemma"):
        return None
    defaults = ("mistral", "ministral", "qwen2", "qwen3", "gemma2", "gemma3_text")  # configs with a default window
    window = config.get("sliding_window", 4096 if kind in defaults else None)
    qwen = kind in ("qwen2", "qwen3") or (kind is None and "use_sliding_window" in config)  # Mistral's read no flag
    if qwen:
        use = config.get("use_sliding_window", False)
        if not isinstance(use, bool):
            raise SpecError(f"the config's use_sliding_window must be true or false, got {use!r}")
        window = window if use else None
    if window is None:
        return None
    if not positive_integer(window):
        raise SpecError(f"the config's sliding_window must be a positive integer or null, got {window!r}")
    kinds, layers = config.get("layer_types"), config.get("num_hidden_layers")
    if kind in ("gemma2", "gemma3_text") and kinds is None:
        # the configs' default: every block but each pattern-th slides (Gemma 2: 2, the even blocks; Gemma 3: 6)
        pattern = 2 if kind == "gemma2" else config.get("sliding_window_pattern", 6)
        if not positive_integer(layers) or not positive_integer(pattern):
            raise SpecError(f"the config's num_hidden_layers and sliding_window_pattern must be positive integers, got "
                            f"{layers!r} and {pattern!r}")  # fmt: skip
        kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if kind == "mistral" or (kinds is None and not qwen):
        return window
    if kinds is None:  # Qwen2's default: full attention below max_window_layers
        first = config.get("max_window_layers", 28)
        if not positive_integer(layers) or not isinstance(first, int) or isinstance(first, bool):
            raise SpecError(f"the config's num_hidden_layers and max_window_layers must be integers, got {layers!r} "
                            f"and {first!r}")  # fmt: skip
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if not isinstance(kinds, list) or not all(k in ("sliding_attention", "full_attention") for k in kinds):
        raise SpecError(f"the config's layer_types must list 'sliding_attention' or 'full_attention' per block, got "
                        f"{kinds!r}")  # fmt: skip
    if layers is not None and len(kinds) != layers:
        raise SpecError(f"the config's layer_types has {len(kinds)} entries for its {layers} blocks "
                        "(num_hidden_layers)")  # fmt: skip
    return [window if k == "sliding_attention" else None for k in kinds]


def llama_from_spec(spec: str, state: Mapping[str, Tensor]) -> Llama:
    """The model of a ``llama:config=PATH`` (the checkpoint's ``config.json``) or ``llama:heads=H[,eps=E,theta=T]``
    SPEC from its checkpoint's ``state`` (sizes read off the tensors), its logits ``(N, V, T)`` for
    ``nn.CrossEntropyLoss`` against next-token targets.

    Raises:
        SpecError: an unknown or malformed option, neither ``config`` nor ``heads``, an unreadable config, or a state
            dict that does not fit.
    """
    options, config = checkpoint_spec(spec, "llama")
    if config is None and any(k.endswith("pre_feedforward_layernorm.weight") for k in state):
        raise SpecError(f"model spec {spec!r}: the checkpoint has Gemma 2's or 3's blocks, whose activation, norm "
                        "gains and caps only its config.json says: give it, llama:config=PATH")  # fmt: skip
    if config is not None:
        try:
            return Llama.from_config(config, state, classes_last=False)
        except ValueError as failure:
            raise SpecError(f"model spec {spec!r}: {failure}") from None
    if set(options) - {"heads", "eps", "theta"} or "heads" not in options:
        raise SpecError(f"model spec {spec!r}: give the checkpoint's config.json (llama:config=PATH) or its number of "
                        "query heads (num_attention_heads), e.g. llama:heads=32; the other options are eps "
                        "(rms_norm_eps) and theta (rope_theta)")  # fmt: skip
    try:
        heads, eps, theta = int(options["heads"]), float(options.get("eps", 1e-6)), float(options.get("theta", 1e4))
    except ValueError:
        raise SpecError(f"model spec {spec!r}: heads is a positive integer, eps and theta numbers") from None
    if heads < 1 or not positive_number(eps) or not positive_number(theta):
        raise SpecError(f"model spec {spec!r}: heads is a positive integer, eps and theta positive finite numbers")
    return Llama.from_state_dict(state, heads, eps, theta, classes_last=False)
