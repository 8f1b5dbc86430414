"""OPT decoders (Meta's Open Pre-trained Transformers, OPT-125m to OPT-66b) as HuggingFace's ``OPTForCausalLM`` computes
them (no cache, no dropout, a causal mask, sequences without padding), written so that ``torch.fx`` traces them:
HuggingFace's own classes do not trace, so the toolkit cannot read them. The module names and state-dict keys are
HuggingFace's, so a checkpoint loads as it is (`OPT.from_state_dict`).

The token table (width ``P``, ``word_embed_proj_dim``) is projected in to the blocks' width ``D`` by ``project_in``
where the two differ (OPT-350m's), and a learned position table adds row ``t + 2`` at position ``t`` (OPT reserves
its first two rows). Each block is, with ``do_layer_norm_before`` (OPT-125m and the larger ones),
``h = x + attn(self_attn_layer_norm(x))`` then ``h + fc2(act(fc1(final_layer_norm(h))))``, and otherwise (OPT-350m's)
``h = self_attn_layer_norm(x + attn(x))`` then ``final_layer_norm(h + fc2(act(fc1(h))))``. Attention scales the
queries by ``hd^-1/2`` after ``q_proj`` and attends causally. The blocks' output passes the decoder's
``final_layer_norm`` (before-norm layouts only, unless ``_remove_final_layer_norm``) and ``project_out``, then
``lm_head``, tied to the token table in every OPT checkpoint.

State-dict keys (``i`` the block index; ``V`` the vocabulary, ``F`` the MLP's width, ``M`` the positions)::

    model.decoder.embed_tokens.weight (V, P); model.decoder.embed_positions.weight (M + 2, D)
    model.decoder.project_in.weight (D, P), model.decoder.project_out.weight (P, D)   (where P != D)
    model.decoder.layers.i.self_attn.{q,k,v,out}_proj.weight (D, D), .bias
    model.decoder.layers.i.self_attn_layer_norm.weight, .bias (D,); model.decoder.layers.i.final_layer_norm.weight, ...
    model.decoder.layers.i.fc1.weight (F, D), .bias; model.decoder.layers.i.fc2.weight (D, F), .bias
    model.decoder.final_layer_norm.weight, .bias (D,); lm_head.weight (V, P)   (absent where tied)

Biases are there exactly where the checkpoint has them (``enable_bias``), and so are the LayerNorms' affine parameters
(``layer_norm_elementwise_affine``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sharpness._llama import CausalLM
from sharpness._neox import HF_ACTIVATIONS, check_decoder_options, config_activation
from sharpness._specs import (
    SpecError,
    check_config_sizes,
    check_token_ids,
    decoder_from_config_spec,
    load_decoder,
    output_head,
    positive_integer,
)

_OFFSET = 2  # rows of the position table before position 0's


class OPTAttention(nn.Module):
    """Causal self-attention on ``(N, T, D)``, the queries scaled by ``hd^-1/2`` after their projection."""

    def __init__(self, dim: int, heads: int, bias: bool):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.scaling = self.head_dim**-0.5
        self.k_proj, self.v_proj = nn.Linear(dim, dim, bias=bias), nn.Linear(dim, dim, bias=bias)
        self.q_proj, self.out_proj = nn.Linear(dim, dim, bias=bias), nn.Linear(dim, dim, bias=bias)

    def _heads(self, t: Tensor) -> Tensor:
        return t.view(t.size(0), t.size(1), self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self._heads(self.q_proj(x) * self.scaling), self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
        return self.out_proj(out.transpose(1, 2).reshape(x.size(0), x.size(1), self.heads * self.head_dim))


class OPTDecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, bias: bool, before: bool, affine: bool, activation: str):
        super().__init__()
        self.before, self.activation = before, activation
        self.self_attn = OPTAttention(dim, heads, bias)
        self.self_attn_layer_norm = nn.LayerNorm(dim, elementwise_affine=affine)
        self.fc1, self.fc2 = nn.Linear(dim, hidden, bias=bias), nn.Linear(hidden, dim, bias=bias)
        self.final_layer_norm = nn.LayerNorm(dim, elementwise_affine=affine)

    def _mlp(self, x: Tensor) -> Tensor:
        return self.fc2(HF_ACTIVATIONS[self.activation](self.fc1(x)))

    def forward(self, x: Tensor) -> Tensor:
        if self.before:
            h = x + self.self_attn(self.self_attn_layer_norm(x))
            return h + self._mlp(self.final_layer_norm(h))
        h = self.self_attn_layer_norm(x + self.self_attn(x))
        return self.final_layer_norm(h + self._mlp(h))


class OPTDecoder(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, hidden: int, positions: int, embed_dim: int,
                 bias: bool, before: bool, final_norm: bool, affine: bool, activation: str,
                 padding_idx: int | None):  # fmt: skip
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, embed_dim, padding_idx)
        self.embed_positions = nn.Embedding(positions + _OFFSET, dim)
        self.project_in = nn.Linear(embed_dim, dim, bias=False) if embed_dim != dim else None
        self.layers = nn.ModuleList(
            OPTDecoderLayer(dim, heads, hidden, bias, before, affine, activation) for _ in range(layers)
        )
        self.final_layer_norm = nn.LayerNorm(dim, elementwise_affine=affine) if final_norm else None
        self.project_out = nn.Linear(dim, embed_dim, bias=False) if embed_dim != dim else None

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(torch.arange(_OFFSET, input_ids.size(1) + _OFFSET, device=input_ids.device))
        for layer in self.layers:
            x = layer(x)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        return x if self.project_out is None else self.project_out(x)


class OPTModel(nn.Module):
    def __init__(self, *decoder):
        super().__init__()
        self.decoder = OPTDecoder(*decoder)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.decoder(input_ids)


class OPT(CausalLM):
    """An OPT decoder with its language-model head, as HuggingFace's ``OPTForCausalLM`` computes it in eval mode on
    sequences without padding.

    Args:
        vocab: vocabulary size ``V``.
        dim: the blocks' width ``D`` (``hidden_size``), a multiple of ``heads``.
        layers: number of blocks (``num_hidden_layers``).
        heads: attention heads per block (``num_attention_heads``).
        hidden: the MLP's width (``ffn_dim``); ``None``: ``4 D``.
        positions: the longest sequence (``max_position_embeddings``): the position table has ``positions + 2`` rows.
        embed_dim: the token table's width (``word_embed_proj_dim``); ``None``: ``dim``. Where it differs,
            ``project_in`` and ``project_out`` map between the two (OPT-350m's).
        before: ``do_layer_norm_before``: LayerNorms before the branches (OPT-125m and the larger ones), else after
            the residual sums (OPT-350m's).
        final_norm: whether the decoder ends with a LayerNorm (``None``: exactly where ``before``; ``False`` for a
            config's ``_remove_final_layer_norm``).
        bias: whether the projections and the MLP have biases (``enable_bias``).
        affine: whether the LayerNorms have their weights and biases (``layer_norm_elementwise_affine``).
        activation: the MLP's (``activation_function``): ``"relu"``, ``"gelu"``, ``"gelu_new"`` or
            ``"gelu_pytorch_tanh"``.
        padding_idx: the token whose row of the table is held fixed (``pad_token_id``: HuggingFace builds the table
            with it, so its gradient, and its row of the Hessian, is zero); ``None``: none.
        tied: whether ``lm_head`` shares the token table (``tie_word_embeddings``).
        classes_last: logits ``(N, T, V)`` (``True``, as HuggingFace returns them) or ``(N, V, T)`` (what
            ``nn.CrossEntropyLoss`` reads against ``(N, T)`` next-token targets).

    Inputs are token ids ``(N, T)``, ``T`` at most ``positions``.
    """

    _kind = "an OPT model"

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, hidden: int | None = None,
                 positions: int = 2048, embed_dim: int | None = None, before: bool = True,
                 final_norm: bool | None = None, bias: bool = True, affine: bool = True, activation: str = "relu",
                 padding_idx: int | None = 1, tied: bool = True, classes_last: bool = True):  # fmt: skip
        super().__init__()
        check_decoder_options(dim, heads, activation)
        if not positive_integer(positions):
            raise ValueError(f"positions must be a positive integer, got {positions!r}")
        if padding_idx is not None and (isinstance(padding_idx, bool) or not isinstance(padding_idx, int)
                                        or not -vocab <= padding_idx < vocab):  # fmt: skip
            raise ValueError(f"pad_token_id must be a token id in [-{vocab}, {vocab}) or null, got {padding_idx!r}")
        final_norm = before if final_norm is None else final_norm
        self.positions = positions
        self.model = OPTModel(vocab, dim, layers, heads, 4 * dim if hidden is None else hidden, positions,
                              dim if embed_dim is None else embed_dim, bias, before, final_norm, affine, activation,
                              padding_idx)  # fmt: skip
        self._add_head(self.model.decoder.embed_tokens, tied, classes_last)

    def check_tokens(self, input_ids: Tensor) -> None:
        """Raises ``ValueError`` (one sentence) unless ``input_ids`` are ``(N, T)`` integer ids below the vocabulary
        size, ``T`` at most the position table's."""
        check_token_ids(input_ids, self.lm_head.out_features, self.positions, self._kind)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self._laid_out(self.lm_head(self.model(input_ids)))

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor], heads: int, before: bool = True,
                        final_norm: bool | None = None, activation: str = "relu", padding_idx: int | None = 1,
                        tied: bool | None = None, classes_last: bool = True) -> OPT:  # fmt: skip
        """The model of an OPT checkpoint's state dict (``OPTForCausalLM``'s keys, or ``OPTModel``'s without the
        ``model.`` prefix, or ``OPTDecoder``'s without ``model.decoder.``), its sizes, biases, affine LayerNorms and
        projections read off the tensors; ``heads`` and the rest are in the checkpoint's ``config.json``, which no shape
        holds (`from_config` reads them there). ``tied``: ``None`` reads it off the tensors (tied where the head is
        absent or equals the token table). A decoder without a final LayerNorm ignores a checkpoint's tensors of one,
        as transformers does; where the LayerNorms have no parameters, ``final_norm`` must be given (no tensor shows
        it).

        Raises:
            ValueError: a key is missing or unknown, a shape does not fit, or ``tied`` contradicts the tensors.
        """
        tensors = {}
        for key, value in state.items():
            if not key.startswith(("model.", "lm_head.")):
                key = f"model.{key}" if key.startswith("decoder.") else f"model.decoder.{key}"
            tensors[key] = value
        prefix = "model.decoder."
        table, places = tensors.get(f"{prefix}embed_tokens.weight"), tensors.get(f"{prefix}embed_positions.weight")
        if table is None or table.dim() != 2 or places is None or places.dim() != 2:
            raise SpecError("the OPT state dict has no token table model.decoder.embed_tokens.weight (V, P) or "
                            "position table model.decoder.embed_positions.weight (M + 2, D)")  # fmt: skip
        if places.shape[0] <= _OFFSET:
            raise SpecError(f"the position table has {places.shape[0]} rows; OPT's has 2 before its positions'")
        if not positive_integer(heads):
            raise SpecError(f"heads must be a positive integer, got {heads!r}")
        (vocab, embed_dim), dim = table.shape, places.shape[1]
        layers = len({int(m.group(1)) for k in tensors if (m := re.match(r"model\.decoder\.layers\.(\d+)\.", k))})
        fc = tensors.get(f"{prefix}layers.0.fc1.weight")
        if fc is None or fc.dim() != 2:
            raise SpecError("the OPT state dict has no matrix model.decoder.layers.0.fc1.weight")
        bias = f"{prefix}layers.0.fc1.bias" in tensors
        affine = f"{prefix}layers.0.self_attn_layer_norm.weight" in tensors
        if final_norm is None and not affine:
            raise SpecError("the checkpoint's LayerNorms have no parameters, so no tensor shows whether the decoder "
                            "ends with one; pass final_norm (from_config reads it off do_layer_norm_before and "
                            "_remove_final_layer_norm)")  # fmt: skip
        if not (before if final_norm is None else final_norm):  # not built: transformers ignores its tensors too
            tensors = {k: v for k, v in tensors.items() if not k.startswith(f"{prefix}final_layer_norm.")}
        tied, head = output_head(tensors, table, tied)
        build = partial(cls, vocab, dim, layers, heads, fc.shape[0], places.shape[0] - _OFFSET, embed_dim, before,
                        final_norm, bias, affine, activation, padding_idx, tied, classes_last)  # fmt: skip
        return load_decoder(build, tensors, head, tied, f"OPT with {layers} blocks of width {dim}",
                            f"{prefix}embed_tokens.weight")

    @classmethod
    def from_config(cls, config: Mapping[str, object], state: Mapping[str, Tensor], classes_last: bool = True) -> OPT:
        """The model of a checkpoint's ``config.json`` (as a dict) and state dict: ``num_attention_heads``,
        ``do_layer_norm_before`` (default true), ``_remove_final_layer_norm`` (default false),
        ``activation_function`` (default ``relu``), ``pad_token_id`` (default 1) and ``tie_word_embeddings`` (default
        true); the sizes the config gives (``hidden_size``, ``word_embed_proj_dim``, ``vocab_size``,
        ``num_hidden_layers``, ``ffn_dim``, ``max_position_embeddings``, ``enable_bias``,
        ``layer_norm_elementwise_affine``) must be the tensors'.

        Raises:
            ValueError: a field of the wrong kind, another activation, or what `from_state_dict` raises.
        """
        heads = config.get("num_attention_heads")
        if not positive_integer(heads):
            raise SpecError(f"the config's num_attention_heads must be a positive integer, got {heads!r}")
        defaults = {"do_layer_norm_before": True, "_remove_final_layer_norm": False, "tie_word_embeddings": True}
        flags = {name: config.get(name, default) for name, default in defaults.items()}
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise SpecError(f"the config's {name} must be true or false, got {value!r}")
        activation = config_activation(config, "activation_function", "relu", "OPT")
        before = flags["do_layer_norm_before"]
        model = cls.from_state_dict(state, heads, before, before and not flags["_remove_final_layer_norm"],
                                    activation, config.get("pad_token_id", 1), flags["tie_word_embeddings"],
                                    classes_last)  # fmt: skip
        decoder, layer = model.model.decoder, model.model.decoder.layers[0]
        held = {"hidden_size": decoder.embed_positions.embedding_dim, "vocab_size": decoder.embed_tokens.num_embeddings,
                "word_embed_proj_dim": decoder.embed_tokens.embedding_dim, "num_hidden_layers": len(decoder.layers),
                "ffn_dim": layer.fc1.out_features, "max_position_embeddings": model.positions,
                "enable_bias": layer.fc1.bias is not None,
                "layer_norm_elementwise_affine": layer.final_layer_norm.weight is not None}  # fmt: skip
        check_config_sizes(config, held)
        return model


def opt_from_spec(spec: str, state: Mapping[str, Tensor]) -> OPT:
    """The model of a ``opt:config=PATH`` SPEC (`OPT.from_config`; `sharpness._specs.decoder_from_config_spec`)."""
    return decoder_from_config_spec(spec, state, "opt", OPT.from_config, "its heads and LayerNorm layout")
