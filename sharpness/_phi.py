"""Phi decoders (Microsoft's phi-1, phi-1.5 and phi-2) as HuggingFace's ``PhiForCausalLM`` computes them (no cache, no
dropout, a causal mask), written so that ``torch.fx`` traces them: HuggingFace's own classes do not trace, so the
toolkit cannot read them. The module names and state-dict keys are HuggingFace's, so a checkpoint loads as it is
(`Phi.from_state_dict`).

Each block reads one LayerNorm (with a bias) of its input and adds attention and the MLP side by side:
``x + attn(h) + mlp(h)``, ``h = input_layernorm(x)``. Attention projects queries, keys and values (with biases; fewer
key/value heads than query heads where the checkpoint has them, each read by its group of query heads), normalizes each
head's queries and keys by LayerNorms where ``qk_layernorm``, turns the first ``int(hd * partial_rotary_factor)``
features of each head's queries and keys by rotary position embeddings (``rotate_half`` on them; phi-2 turns 32 of
80) and attends causally with scale ``hd^-1/2``; ``dense`` projects the heads' outputs. The MLP is
``fc2(act(fc1(h)))``. The logits are ``final_layernorm``'s output times ``lm_head``, which has a bias.

State-dict keys (``i`` the block index; ``D`` the width, ``V`` the vocabulary, ``F`` the MLP's, ``K`` the key/value
heads' features)::

    model.embed_tokens.weight (V, D)
    model.layers.i.input_layernorm.weight, .bias (D,)
    model.layers.i.self_attn.q_proj.weight (D, D), .bias; .k_proj, .v_proj (K, D), .bias; .dense (D, D), .bias
    model.layers.i.self_attn.q_layernorm.weight, .bias, .k_layernorm.weight, .bias (hd,)   (where qk_layernorm)
    model.layers.i.mlp.fc1.weight (F, D), .bias; model.layers.i.mlp.fc2.weight (D, F), .bias
    model.final_layernorm.weight, .bias (D,); lm_head.weight (V, D) (absent where tied), lm_head.bias (V,)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sharpness._llama import CausalLM, DecoderBody, Float32Frequencies, Rope, rotary_cos_sin
from sharpness._neox import (
    TwoLayerMLP,
    check_decoder_options,
    config_activation,
    partial_rope_settings,
    partial_rotary,
    rotate_part,
)
from sharpness._specs import (
    SpecError,
    check_config_sizes,
    decoder_from_config_spec,
    load_decoder,
    output_head,
    positive_integer,
    positive_number,
)


class PhiAttention(Float32Frequencies):
    """Causal grouped-query self-attention with partial rotary embeddings (and per-head query/key LayerNorms where
    ``qk_layernorm``) on ``(N, T, D)``."""

    def __init__(self, dim: int, heads: int, kv_heads: int, rotary_dims: int, rotary: Rope, qk_layernorm: bool,
                 eps: float):  # fmt: skip
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.rotary_dims = heads, kv_heads, dim // heads, rotary_dims
        self.register_buffer("inv_freq", rotary.inv_freq.clone(), persistent=False)  # float32, as HuggingFace's
        self.attention_factor = rotary.attention_factor
        self.q_proj = nn.Linear(dim, heads * self.head_dim)
        self.k_proj = nn.Linear(dim, kv_heads * self.head_dim)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim)
        self.dense = nn.Linear(heads * self.head_dim, dim)
        self.qk_layernorm = qk_layernorm
        if qk_layernorm:
            self.q_layernorm = nn.LayerNorm(self.head_dim, eps=eps)
            self.k_layernorm = nn.LayerNorm(self.head_dim, eps=eps)

    def _heads(self, t: Tensor, n: int) -> Tensor:
        """``(N, T, n hd)`` -> ``(N, n, T, hd)``."""
        return t.view(t.size(0), t.size(1), n, self.head_dim).transpose(1, 2)

    def _repeat(self, t: Tensor) -> Tensor:
        """HuggingFace's ``repeat_kv``: each key/value head read by its group of query heads."""
        groups = self.heads // self.kv_heads
        if groups == 1:
            return t
        b, _, length, hd = t.shape
        return t[:, :, None, :, :].expand(b, self.kv_heads, groups, length, hd).reshape(b, self.heads, length, hd)

    def forward(self, x: Tensor) -> Tensor:
        q, k = self._heads(self.q_proj(x), self.heads), self._heads(self.k_proj(x), self.kv_heads)
        v = self._heads(self.v_proj(x), self.kv_heads)
        if self.qk_layernorm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        positions = torch.arange(x.size(1), dtype=torch.float32, device=x.device)
        cos, sin = rotary_cos_sin(positions, self.inv_freq, self.attention_factor, x.dtype)
        q, k = (rotate_part(t, cos, sin, self.rotary_dims, self.head_dim) for t in (q, k))
        out = F.scaled_dot_product_attention(q, self._repeat(k), self._repeat(v), is_causal=True)
        return self.dense(out.transpose(1, 2).reshape(x.size(0), x.size(1), self.heads * self.head_dim))


class PhiDecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int, eps: float, rotary_dims: int, rotary: Rope,
                 qk_layernorm: bool, activation: str):  # fmt: skip
        super().__init__()
        self.self_attn = PhiAttention(dim, heads, kv_heads, rotary_dims, rotary, qk_layernorm, eps)
        self.mlp = TwoLayerMLP(("fc1", "fc2"), dim, hidden, activation)
        self.input_layernorm = nn.LayerNorm(dim, eps=eps)

    def forward(self, x: Tensor) -> Tensor:
        h = self.input_layernorm(x)
        return self.self_attn(h) + self.mlp(h) + x


class Phi(CausalLM):
    """A Phi decoder with its language-model head, as HuggingFace's ``PhiForCausalLM`` computes it in eval mode (phi-1,
    phi-1.5, phi-2).

    Args:
        vocab: vocabulary size ``V``.
        dim: width ``D`` (``hidden_size``), a multiple of ``heads``.
        layers: number of blocks (``num_hidden_layers``).
        heads: query heads per block ``H`` (``num_attention_heads``).
        kv_heads: key/value heads (``num_key_value_heads``), dividing ``heads``; ``None``: ``heads``.
        hidden: the MLP's width (``intermediate_size``); ``None``: ``4 D``.
        eps: the LayerNorms' epsilon (``layer_norm_eps``).
        partial_rotary_factor: the share of each head's features the rotary embedding turns (phi-2's 0.4): the first
            ``int(hd * factor)`` of them, an even number.
        theta: the rotary base (``rope_theta``).
        rope_scaling: a ``rope_scaling`` of type ``linear``, ``llama3`` or ``yarn`` (`sharpness.Llama`'s `rope`);
            ``None``: none.
        max_positions: the config's ``max_position_embeddings`` (YaRN reads it).
        qk_layernorm: whether each head's queries and keys pass a LayerNorm (``qk_layernorm``).
        activation: the MLP's (``hidden_act``): ``"gelu_new"`` or ``"gelu_pytorch_tanh"`` (GELU's tanh approximation),
            ``"gelu"`` or ``"relu"``.
        tied: whether ``lm_head``'s weight is the token table (``tie_word_embeddings``); its bias is its own.
        classes_last: logits ``(N, T, V)`` (``True``, as HuggingFace returns them) or ``(N, V, T)`` (what
            ``nn.CrossEntropyLoss`` reads against ``(N, T)`` next-token targets).

    Inputs are token ids ``(N, T)``; any length (the rotary angles are computed for it).
    """

    _kind = "a Phi model"

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int | None = None,
                 hidden: int | None = None, eps: float = 1e-5, partial_rotary_factor: float = 0.5,
                 theta: float = 10000.0, rope_scaling: Mapping[str, object] | None = None,
                 max_positions: int | None = None, qk_layernorm: bool = False, activation: str = "gelu_new",
                 tied: bool = False, classes_last: bool = True):  # fmt: skip
        super().__init__()
        kv_heads = heads if kv_heads is None else kv_heads
        check_decoder_options(dim, heads, activation, eps)
        if not positive_integer(kv_heads) or heads % kv_heads:
            raise ValueError(f"kv_heads={kv_heads} does not divide heads={heads}")
        rotary_dims, rotary = partial_rotary(dim // heads, partial_rotary_factor, theta, rope_scaling, max_positions,
                                             "Phi")  # fmt: skip
        block = (heads, kv_heads, 4 * dim if hidden is None else hidden, eps, rotary_dims, rotary, qk_layernorm,
                 activation)  # fmt: skip
        self.model = DecoderBody(("embed_tokens", "layers", "final_layernorm"), nn.Embedding(vocab, dim),
                                 [PhiDecoderLayer(dim, *block) for _ in range(layers)], nn.LayerNorm(dim, eps=eps))
        self._add_head(self.model.embed_tokens, tied, classes_last, bias=True)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self._laid_out(self.lm_head(self.model(input_ids)))

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor], heads: int, eps: float = 1e-5,
                        partial_rotary_factor: float = 0.5, theta: float = 10000.0,
                        rope_scaling: Mapping[str, object] | None = None, max_positions: int | None = None,
                        activation: str = "gelu_new", tied: bool | None = None,
                        classes_last: bool = True) -> Phi:  # fmt: skip
        """The model of a Phi checkpoint's state dict (``PhiForCausalLM``'s keys, or ``PhiModel``'s without the
        ``model.`` prefix), its sizes, key/value heads and query/key LayerNorms read off the tensors; ``heads`` and the
        rest are in the checkpoint's ``config.json``, which no shape holds (`from_config` reads them there). ``tied``:
        ``None`` reads it off the tensors (tied where the head's weight is absent or equals the token table).

        Raises:
            ValueError: a key is missing or unknown, a shape does not fit, or ``tied`` contradicts the tensors.
        """
        tensors = {k if k.startswith(("model.", "lm_head.")) else f"model.{k}": v for k, v in state.items()}
        table = tensors.get("model.embed_tokens.weight")
        if table is None or table.dim() != 2:
            raise SpecError("the Phi state dict has no token table model.embed_tokens.weight (V, D)")
        if not positive_integer(heads):
            raise SpecError(f"heads must be a positive integer, got {heads!r}")
        vocab, dim = table.shape
        layers = len({int(m.group(1)) for k in tensors if (m := re.match(r"model\.layers\.(\d+)\.", k))})
        fc, keys = tensors.get("model.layers.0.mlp.fc1.weight"), tensors.get("model.layers.0.self_attn.k_proj.weight")
        if fc is None or fc.dim() != 2 or keys is None or keys.dim() != 2:
            raise SpecError("the Phi state dict has no matrices model.layers.0.mlp.fc1.weight and "
                            "model.layers.0.self_attn.k_proj.weight")  # fmt: skip
        if dim % heads or keys.shape[0] % (dim // heads):
            raise SpecError(f"the key projection's {keys.shape[0]} rows are no whole number of heads of "
                            f"{dim} / {heads} features")  # fmt: skip
        qk_layernorm = "model.layers.0.self_attn.q_layernorm.weight" in tensors
        tied, head = output_head(tensors, table, tied)
        build = partial(cls, vocab, dim, layers, heads, keys.shape[0] // (dim // heads), fc.shape[0], eps,
                        partial_rotary_factor, theta, rope_scaling, max_positions, qk_layernorm, activation, tied,
                        classes_last)  # fmt: skip
        return load_decoder(build, tensors, head, tied, f"Phi with {layers} blocks of width {dim}",
                            "model.embed_tokens.weight")

    @classmethod
    def from_config(cls, config: Mapping[str, object], state: Mapping[str, Tensor], classes_last: bool = True) -> Phi:
        """The model of a checkpoint's ``config.json`` (as a dict) and state dict: ``num_attention_heads``,
        ``layer_norm_eps`` (default 1e-5), ``hidden_act`` (default ``gelu_new``), the rotary embedding's
        ``rope_parameters`` (``rope_theta``, ``partial_rotary_factor``, a scaling) or older files' ``rope_theta`` and
        ``partial_rotary_factor`` (defaults 10000 and 0.5; a ``rope_scaling`` is taken whole in place of
        ``rope_parameters``, as transformers takes it), ``tie_word_embeddings`` (default false) and
        ``max_position_embeddings``; the sizes the config gives (``hidden_size``, ``head_dim``, ``vocab_size``,
        ``num_hidden_layers``, ``num_key_value_heads``, ``intermediate_size``, ``qk_layernorm``) must be the
        tensors'.

        Raises:
            ValueError: a field of the wrong kind, another activation, or what `from_state_dict` raises.
        """
        heads, eps = config.get("num_attention_heads"), config.get("layer_norm_eps", 1e-5)
        if not positive_integer(heads) or not positive_number(eps):
            raise SpecError(f"the config's num_attention_heads must be a positive integer and its layer_norm_eps a "
                            f"positive number, got {heads!r} and {eps!r}")  # fmt: skip
        theta, factor, scaling = partial_rope_settings(config, "rope_theta", "partial_rotary_factor", 0.5)
        activation = config_activation(config, "hidden_act", "gelu_new", "Phi")
        tied = config.get("tie_word_embeddings", False)
        if not isinstance(tied, bool):
            raise SpecError(f"the config's tie_word_embeddings must be true or false, got {tied!r}")
        model = cls.from_state_dict(state, heads, float(eps), factor, theta, scaling,
                                    config.get("max_position_embeddings"), activation, tied, classes_last)  # fmt: skip
        body, attention = model.model, model.model.layers[0].self_attn
        check_config_sizes(config, {"hidden_size": body.embed_tokens.embedding_dim, "head_dim": attention.head_dim,
                                    "vocab_size": body.embed_tokens.num_embeddings,
                                    "num_hidden_layers": len(body.layers), "num_key_value_heads": attention.kv_heads,
                                    "intermediate_size": body.layers[0].mlp.fc1.out_features,
                                    "qk_layernorm": attention.qk_layernorm})  # fmt: skip
        return model


def phi_from_spec(spec: str, state: Mapping[str, Tensor]) -> Phi:
    """The model of a ``phi:config=PATH`` SPEC (`Phi.from_config`; `sharpness._specs.decoder_from_config_spec`)."""
    return decoder_from_config_spec(spec, state, "phi", Phi.from_config, "its heads and rotary share")
