"""GPT-NeoX decoders (EleutherAI's Pythia suite, GPT-NeoX-20B) as HuggingFace's ``GPTNeoXForCausalLM`` computes them (no
cache, no dropout, a causal mask), written so that ``torch.fx`` traces them: HuggingFace's own classes do not trace, so
the toolkit cannot read them. The module names and state-dict keys are HuggingFace's, so a checkpoint loads as it is
(`GPTNeoX.from_state_dict`).

Each block reads LayerNorms (with biases) of its input: ``x + attn(input_layernorm(x)) +
mlp(post_attention_layernorm(x))`` where ``use_parallel_residual`` (Pythia's), else ``h = x + attn(input_layernorm(x))``
then ``h + mlp(post_attention_layernorm(h))``. Attention projects queries, keys and values with one fused
``query_key_value`` whose rows hold, head by head, the head's query, key and value features (``(N, T, H, 3 hd)``, cut by
``chunk``), turns the first ``rotary_dims`` features of each head's queries and keys by rotary position embeddings
(``rotate_half`` on them; the rest pass unturned: ``partial_rotary_factor``, Pythia's 0.25) and attends causally with
scale ``hd^-1/2``; ``dense`` projects the heads' outputs. The MLP is ``dense_4h_to_h(gelu(dense_h_to_4h(x)))``. The
logits are ``final_layer_norm``'s output times ``lm_head`` (``embed_out`` in older checkpoints).

State-dict keys (``i`` the block index; ``D`` the width, ``V`` the vocabulary, ``F`` the MLP's)::

    gpt_neox.embed_in.weight (V, D)
    gpt_neox.layers.i.input_layernorm.weight, .bias (D,); gpt_neox.layers.i.post_attention_layernorm.weight, .bias
    gpt_neox.layers.i.attention.query_key_value.weight (3 D, D), .bias; gpt_neox.layers.i.attention.dense.weight (D, D)
    gpt_neox.layers.i.mlp.dense_h_to_4h.weight (F, D), .bias; gpt_neox.layers.i.mlp.dense_4h_to_h.weight (D, F), .bias
    gpt_neox.final_layer_norm.weight, .bias (D,); lm_head.weight (V, D) (or embed_out.weight)

The attention's biases are there exactly where the checkpoint has them (``attention_bias``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sharpness._llama import CausalLM, DecoderBody, Float32Frequencies, Rope, rope, rotary_cos_sin, rotate_half
from sharpness._specs import (
    SpecError,
    check_config_sizes,
    decoder_from_config_spec,
    load_decoder,
    output_head,
    positive_integer,
    positive_number,
)

# transformers' activations a GPT-NeoX, OPT or Phi config may name, as the MLP computes them (gelu_new: tanh GELU)
HF_ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}  # fmt: skip


def config_activation(config: Mapping[str, object], key: str, default: str, family: str) -> str:
    """The MLP's activation a config names under ``key`` (``default`` where it names none), one of `HF_ACTIVATIONS`.

    Raises:
        SpecError: another activation, or a value that is no name.
    """
    activation = config.get(key, default)
    if not isinstance(activation, str) or activation not in HF_ACTIVATIONS:
        raise SpecError(f"the config's {key} is {activation!r}; sharpness.{family} reads {', '.join(HF_ACTIVATIONS)}")
    return activation


def check_decoder_options(dim: int, heads: int, activation: str, eps: float | None = None) -> None:
    """Raises ``ValueError`` (one sentence) unless ``heads`` is a positive integer dividing the width ``dim``, the MLP's
    ``activation`` one of `HF_ACTIVATIONS` and ``eps`` (where given) a positive finite number: what the decoder twins
    (`GPTNeoX`, `Phi`, `OPT`, `GPTJ`) check before building anything."""
    if not positive_integer(heads) or dim % heads:
        raise ValueError(f"dim={dim} is not a multiple of heads={heads}")
    if activation not in HF_ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(HF_ACTIVATIONS)}, got {activation!r}")
    if eps is not None and not positive_number(eps):
        raise ValueError(f"eps={eps} must be a positive finite number")


def partial_rotary(head_dim: int, factor: float, theta: float, scaling: Mapping[str, object] | None,
                   max_positions: int | None, family: str) -> tuple[int, Rope]:  # fmt: skip
    """The rotary embedding of a decoder that turns the first ``int(head_dim * factor)`` features of each head
    (GPT-NeoX's and Phi's ``partial_rotary_factor``): that number and the `Rope`.

    Raises:
        ValueError: a factor outside ``(0, 1]``, an odd or zero number of turned features, a base that is not a
            positive number, or a scaling that depends on the sequence's length (dynamic, LongRoPE).
    """
    if not positive_number(factor) or factor > 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor!r}")
    rotary_dims = int(head_dim * factor)
    if rotary_dims < 2 or rotary_dims % 2:
        raise ValueError(
            f"the rotary embedding turns {rotary_dims} of each head's {head_dim} features "
            f"(partial_rotary_factor={factor}); it must turn a positive even number"
        )
    if not positive_number(theta):
        raise ValueError(f"theta={theta} must be a positive finite number")
    rotary = rope(rotary_dims, theta, scaling, max_positions)
    if rotary.dynamic is not None or rotary.long_inv_freq is not None:
        raise ValueError(f"a rope scaling that depends on the sequence's length (dynamic, longrope) is not "
                         f"supported for {family}")  # fmt: skip
    return rotary_dims, rotary


def partial_rope_settings(config: Mapping[str, object], theta_key: str, factor_key: str,
                          default_factor: float) -> tuple[float, float, dict | None]:  # fmt: skip
    """``(theta, partial_rotary_factor, scaling)`` of a config: its ``rope_parameters`` (a ``rope_scaling`` taken whole
    in its place, as transformers takes it), else the older fields ``theta_key`` and ``factor_key``.

    Raises:
        SpecError: ``rope_parameters`` is no object, or the base or the factor is not a positive number.
    """
    parameters = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(parameters, Mapping):
        raise SpecError(f"the config's rope_parameters must be an object, got {parameters!r}")
    theta = parameters.get("rope_theta", config.get(theta_key, 10000.0))
    factor = parameters.get("partial_rotary_factor", config.get(factor_key, default_factor))
    kind = str(parameters.get("rope_type", parameters.get("type", "default")))
    scaling = None if kind == "default" else {k: v for k, v in parameters.items() if k != "partial_rotary_factor"}
    for name, value in (("rope_theta", theta), ("partial_rotary_factor", factor)):
        if not positive_number(value):
            raise SpecError(f"the config's {name} must be a positive number, got {value!r}")
    return float(theta), float(factor), scaling


def rotate_part(t: Tensor, cos: Tensor, sin: Tensor, rotary_dims: int, head_dim: int) -> Tensor:
    """The first ``rotary_dims`` of the ``head_dim`` features of each head of ``t`` turned by the rotary embedding
    (``rotate_half`` on them), the rest passed as they are (sizes given as numbers: fx traces no branch on a shape)."""
    if rotary_dims == head_dim:
        return t * cos + rotate_half(t) * sin
    turned = t[..., :rotary_dims]
    return torch.cat((turned * cos + rotate_half(turned) * sin, t[..., rotary_dims:]), dim=-1)


def is_neox_buffer(key: str) -> bool:
    """Whether a checkpoint key is a buffer older GPT-NeoX checkpoints saved (the causal mask ``attention.bias``,
    ``attention.masked_bias``, the rotary ``inv_freq``): dropped on loading, the model builds them itself."""
    return re.fullmatch(r"(gpt_neox\.)?layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)",
                        key) is not None  # fmt: skip


class GPTNeoXAttention(Float32Frequencies):
    """Causal self-attention with a head-by-head fused ``query_key_value`` and partial rotary embeddings on
    ``(N, T, D)``."""

    def __init__(self, dim: int, heads: int, rotary_dims: int, rotary: Rope, bias: bool):
        super().__init__()
        self.heads, self.head_dim, self.rotary_dims = heads, dim // heads, rotary_dims
        self.register_buffer("inv_freq", rotary.inv_freq.clone(), persistent=False)  # float32, as HuggingFace's
        self.attention_factor = rotary.attention_factor
        self.query_key_value = nn.Linear(dim, 3 * dim, bias=bias)
        self.dense = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        n, length = x.size(0), x.size(1)
        qkv = self.query_key_value(x).view(n, length, self.heads, 3 * self.head_dim).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        positions = torch.arange(length, dtype=torch.float32, device=x.device)
        cos, sin = rotary_cos_sin(positions, self.inv_freq, self.attention_factor, x.dtype)
        q, k = (rotate_part(t, cos, sin, self.rotary_dims, self.head_dim) for t in (q, k))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(out.transpose(1, 2).reshape(n, length, self.heads * self.head_dim))


class TwoLayerMLP(nn.Module):
    """``second(act(first(x)))`` of two Linear layers with biases under a family's names (``names``: the first's and
    the second's; GPT-NeoX's, Phi's, GPT-J's), ``act`` one of `HF_ACTIVATIONS`."""

    def __init__(self, names: tuple[str, str], dim: int, hidden: int, activation: str):
        super().__init__()
        self._names, self.activation = names, activation
        self.add_module(names[0], nn.Linear(dim, hidden))
        self.add_module(names[1], nn.Linear(hidden, dim))

    def forward(self, x: Tensor) -> Tensor:
        first, second = (getattr(self, name) for name in self._names)
        return second(HF_ACTIVATIONS[self.activation](first(x)))


class GPTNeoXLayer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, eps: float, rotary_dims: int, rotary: Rope, bias: bool,
                 parallel: bool, activation: str):  # fmt: skip
        super().__init__()
        self.parallel = parallel
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(dim, eps=eps), nn.LayerNorm(dim, eps=eps)
        self.attention = GPTNeoXAttention(dim, heads, rotary_dims, rotary, bias)
        self.mlp = TwoLayerMLP(("dense_h_to_4h", "dense_4h_to_h"), dim, hidden, activation)

    def forward(self, x: Tensor) -> Tensor:
        attended = self.attention(self.input_layernorm(x))
        if self.parallel:
            return self.mlp(self.post_attention_layernorm(x)) + attended + x
        h = attended + x
        return self.mlp(self.post_attention_layernorm(h)) + h


class GPTNeoX(CausalLM):
    """A GPT-NeoX decoder with its language-model head, as HuggingFace's ``GPTNeoXForCausalLM`` computes it in eval
    mode (the Pythia suite, GPT-NeoX-20B).

    Args:
        vocab: vocabulary size ``V``.
        dim: width ``D`` (``hidden_size``), a multiple of ``heads``.
        layers: number of blocks (``num_hidden_layers``).
        heads: attention heads per block ``H`` (``num_attention_heads``).
        hidden: the MLP's width (``intermediate_size``); ``None``: ``4 D``.
        eps: the LayerNorms' epsilon (``layer_norm_eps``).
        partial_rotary_factor: the share of each head's features the rotary embedding turns (``rotary_pct``; Pythia's
            0.25): the first ``int(hd * factor)`` of them, an even number.
        theta: the rotary base (``rope_theta``, ``rotary_emb_base``).
        rope_scaling: a ``rope_scaling`` of type ``linear``, ``llama3`` or ``yarn`` (`sharpness.Llama`'s `rope`);
            ``None``: none.
        max_positions: the config's ``max_position_embeddings`` (YaRN reads it).
        parallel: ``use_parallel_residual``: the block adds attention and MLP of the same input (Pythia's).
        bias: whether the attention's projections have biases (``attention_bias``).
        activation: the MLP's (``hidden_act``): ``"gelu"``, ``"gelu_new"`` or ``"gelu_pytorch_tanh"`` (GELU's tanh
            approximation) or ``"relu"``.
        tied: whether ``lm_head`` shares the token table (``tie_word_embeddings``).
        classes_last: logits ``(N, T, V)`` (``True``, as HuggingFace returns them) or ``(N, V, T)`` (what
            ``nn.CrossEntropyLoss`` reads against ``(N, T)`` next-token targets).

    Inputs are token ids ``(N, T)``; any length (the rotary angles are computed for it).
    """

    _kind = "a GPT-NeoX model"

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, hidden: int | None = None, eps: float = 1e-5,
                 partial_rotary_factor: float = 0.25, theta: float = 10000.0,
                 rope_scaling: Mapping[str, object] | None = None, max_positions: int | None = None,
                 parallel: bool = True, bias: bool = True, activation: str = "gelu", tied: bool = False,
                 classes_last: bool = True):  # fmt: skip
        super().__init__()
        check_decoder_options(dim, heads, activation, eps)
        rotary_dims, rotary = partial_rotary(dim // heads, partial_rotary_factor, theta, rope_scaling, max_positions,
                                             "GPT-NeoX")  # fmt: skip
        block = (heads, 4 * dim if hidden is None else hidden, eps, rotary_dims, rotary, bias, parallel, activation)
        self.gpt_neox = DecoderBody(("embed_in", "layers", "final_layer_norm"), nn.Embedding(vocab, dim),
                                    [GPTNeoXLayer(dim, *block) for _ in range(layers)], nn.LayerNorm(dim, eps=eps))
        self._add_head(self.gpt_neox.embed_in, tied, classes_last)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self._laid_out(self.lm_head(self.gpt_neox(input_ids)))

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor], heads: int, eps: float = 1e-5,
                        partial_rotary_factor: float = 0.25, theta: float = 10000.0,
                        rope_scaling: Mapping[str, object] | None = None, max_positions: int | None = None,
                        parallel: bool = True, activation: str = "gelu", tied: bool | None = None,
                        classes_last: bool = True) -> GPTNeoX:  # fmt: skip
        """The model of a GPT-NeoX checkpoint's state dict (``GPTNeoXForCausalLM``'s keys, or ``GPTNeoXModel``'s
        without the ``gpt_neox.`` prefix; older checkpoints' ``embed_out.weight`` is the head, their mask and
        ``inv_freq`` buffers are dropped), its sizes and the attention's biases read off the tensors; ``heads`` and the
        rest are in the checkpoint's ``config.json``, which no shape holds (`from_config` reads them there). ``tied``:
        ``None`` reads it off the tensors (tied where the head is absent or equals the token table).

        Raises:
            ValueError: a key is missing or unknown, a shape does not fit, or ``tied`` contradicts the tensors.
        """
        tensors = {}
        for key, value in state.items():
            if is_neox_buffer(key):
                continue
            key = "lm_head.weight" if key == "embed_out.weight" else key
            tensors[key if key.startswith(("gpt_neox.", "lm_head.")) else f"gpt_neox.{key}"] = value
        table = tensors.get("gpt_neox.embed_in.weight")
        if table is None or table.dim() != 2:
            raise SpecError("the GPT-NeoX state dict has no token table gpt_neox.embed_in.weight (V, D)")
        if not positive_integer(heads):
            raise SpecError(f"heads must be a positive integer, got {heads!r}")
        vocab, dim = table.shape
        layers = len({int(m.group(1)) for k in tensors if (m := re.match(r"gpt_neox\.layers\.(\d+)\.", k))})
        fc = tensors.get("gpt_neox.layers.0.mlp.dense_h_to_4h.weight")
        if fc is None or fc.dim() != 2:
            raise SpecError("the GPT-NeoX state dict has no matrix gpt_neox.layers.0.mlp.dense_h_to_4h.weight")
        bias = "gpt_neox.layers.0.attention.query_key_value.bias" in tensors
        tied, head = output_head(tensors, table, tied)
        build = partial(cls, vocab, dim, layers, heads, fc.shape[0], eps, partial_rotary_factor, theta, rope_scaling,
                        max_positions, parallel, bias, activation, tied, classes_last)  # fmt: skip
        return load_decoder(build, tensors, head, tied, f"GPT-NeoX with {layers} blocks of width {dim}",
                            "gpt_neox.embed_in.weight")

    @classmethod
    def from_config(cls, config: Mapping[str, object], state: Mapping[str, Tensor],
                    classes_last: bool = True) -> GPTNeoX:  # fmt: skip
        """The model of a checkpoint's ``config.json`` (as a dict) and state dict: ``num_attention_heads``,
        ``layer_norm_eps`` (default 1e-5), ``use_parallel_residual`` (default true), ``hidden_act`` (default
        ``gelu``), the rotary embedding's ``rope_parameters`` (``rope_theta``, ``partial_rotary_factor``, a scaling) or
        older files' ``rotary_emb_base`` and ``rotary_pct`` (defaults 10000 and 0.25; a ``rope_scaling`` is taken
        whole in place of ``rope_parameters``, as transformers takes it), ``tie_word_embeddings`` (default false, as
        transformers reads it: a checkpoint without a head is refused) and ``max_position_embeddings``; the sizes the
        config gives (``hidden_size``, ``head_dim``, ``vocab_size``, ``num_hidden_layers``, ``intermediate_size``,
        ``attention_bias``) must be the tensors'.

        Raises:
            ValueError: a field of the wrong kind, another activation, or what `from_state_dict` raises.
        """
        heads, eps = config.get("num_attention_heads"), config.get("layer_norm_eps", 1e-5)
        if not positive_integer(heads) or not positive_number(eps):
            raise SpecError(f"the config's num_attention_heads must be a positive integer and its layer_norm_eps a "
                            f"positive number, got {heads!r} and {eps!r}")  # fmt: skip
        theta, factor, scaling = partial_rope_settings(config, "rotary_emb_base", "rotary_pct", 0.25)
        activation, parallel = config_activation(config, "hidden_act", "gelu", "GPTNeoX"), config.get(
            "use_parallel_residual", True)  # fmt: skip
        tied = config.get("tie_word_embeddings", False)  # GPTNeoXConfig's default: an absent head is refused
        for name, value in (("use_parallel_residual", parallel), ("tie_word_embeddings", tied)):
            if value is not None and not isinstance(value, bool):
                raise SpecError(f"the config's {name} must be true or false, got {value!r}")
        model = cls.from_state_dict(state, heads, float(eps), factor, theta, scaling,
                                    config.get("max_position_embeddings"), parallel, activation, tied,
                                    classes_last)  # fmt: skip
        body, attention = model.gpt_neox, model.gpt_neox.layers[0].attention
        held = {"hidden_size": body.embed_in.embedding_dim, "vocab_size": body.embed_in.num_embeddings,
                "num_hidden_layers": len(body.layers), "head_dim": attention.head_dim,
                "intermediate_size": body.layers[0].mlp.dense_h_to_4h.out_features,
                "attention_bias": attention.query_key_value.bias is not None}  # fmt: skip
        check_config_sizes(config, held)
        return model


def neox_from_spec(spec: str, state: Mapping[str, Tensor]) -> GPTNeoX:
    """The model of a ``neox:config=PATH`` SPEC (`GPTNeoX.from_config`; `sharpness._specs.decoder_from_config_spec`)."""
    held = "its heads, rotary share and residual layout"
    return decoder_from_config_spec(spec, state, "neox", GPTNeoX.from_config, held)
