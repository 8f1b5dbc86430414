"""GPT-J decoders (EleutherAI's GPT-J-6B; CodeGen's blocks) as HuggingFace's ``GPTJForCausalLM`` computes them (no
cache, no dropout, a causal mask), written so that ``torch.fx`` traces them: HuggingFace's own classes do not trace, so
the toolkit cannot read them. The module names and state-dict keys are HuggingFace's, so a checkpoint loads as it is
(`GPTJ.from_state_dict`).

Each block reads one LayerNorm (with a bias) of its input and adds attention and the MLP side by side:
``x + attn(h) + mlp(h)``, ``h = ln_1(x)``. Attention projects queries, keys and values without biases, turns the first
``rotary_dim`` features of each head's queries and keys by rotary position embeddings on interleaved pairs (features
``2i`` and ``2i + 1`` turn together at frequency ``i``: ``rotate_every_two``; GPT-J-6B turns 64 of 256), and attends
causally with scale ``hd^-1/2``; ``out_proj`` projects the heads' outputs, without a bias. The MLP is
``fc_out(act(fc_in(h)))``. The logits are ``ln_f``'s output times ``lm_head``, which has a bias.

State-dict keys (``i`` the block index; ``D`` the width, ``V`` the vocabulary, ``F`` the MLP's)::

    transformer.wte.weight (V, D)
    transformer.h.i.ln_1.weight, .bias (D,); transformer.h.i.attn.{q,k,v,out}_proj.weight (D, D)
    transformer.h.i.mlp.fc_in.weight (F, D), .bias; transformer.h.i.mlp.fc_out.weight (D, F), .bias
    transformer.ln_f.weight, .bias (D,); lm_head.weight (V, D), lm_head.bias (V,)

Older checkpoints' causal-mask buffers (``attn.bias``, ``attn.masked_bias``) are dropped on loading.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sharpness._llama import CausalLM, DecoderBody, Float32Frequencies
from sharpness._neox import TwoLayerMLP, check_decoder_options, config_activation
from sharpness._specs import (
    SpecError,
    check_config_sizes,
    check_token_ids,
    decoder_from_config_spec,
    load_decoder,
    output_head,
    positive_integer,
    positive_number,
)


def is_gptj_buffer(key: str) -> bool:
    """Whether a checkpoint key is a buffer older GPT-J checkpoints saved (the causal mask ``attn.bias`` and
    ``attn.masked_bias``): dropped on loading, the model builds no such buffer."""
    return re.fullmatch(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)", key) is not None


def rotate_every_two(x: Tensor) -> Tensor:
    """Each interleaved pair ``(x_2i, x_2i+1)`` of the last axis to ``(-x_2i+1, x_2i)``."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


class GPTJAttention(Float32Frequencies):
    """Causal self-attention on ``(N, T, D)`` with rotary embeddings on interleaved pairs of the first ``rotary_dim``
    features of each head."""

    def __init__(self, dim: int, heads: int, rotary_dim: int):
        super().__init__()
        self.heads, self.head_dim, self.rotary_dim = heads, dim // heads, rotary_dim
        # float32, as HuggingFace's table of sines and cosines
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
        self.register_buffer("inv_freq", 1.0 / (10000**exponents), persistent=False)
        self.k_proj, self.v_proj = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.q_proj, self.out_proj = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)

    def _turned(self, t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        r = self.rotary_dim
        if r == self.head_dim:
            return t * cos + rotate_every_two(t) * sin
        turned = t[..., :r]
        return torch.cat((turned * cos + rotate_every_two(turned) * sin, t[..., r:]), dim=-1)

    def forward(self, x: Tensor) -> Tensor:
        n, length = x.size(0), x.size(1)
        q, k, v = (p(x).view(n, length, self.heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # fmt: skip
        angles = torch.arange(length, dtype=torch.float32, device=x.device)[:, None] * self.inv_freq
        # each angle for its pair of features, in the activations' dtype (HuggingFace's table is float32)
        cos = torch.repeat_interleave(torch.cos(angles), 2, dim=-1).to(x.dtype)
        sin = torch.repeat_interleave(torch.sin(angles), 2, dim=-1).to(x.dtype)
        q, k = self._turned(q, cos, sin), self._turned(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(out.transpose(1, 2).reshape(n, length, self.heads * self.head_dim))


class GPTJBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, eps: float, rotary_dim: int, activation: str):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=eps)
        self.attn = GPTJAttention(dim, heads, rotary_dim)
        self.mlp = TwoLayerMLP(("fc_in", "fc_out"), dim, hidden, activation)

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln_1(x)
        return self.attn(h) + self.mlp(h) + x


class GPTJ(CausalLM):
    """A GPT-J decoder with its language-model head, as HuggingFace's ``GPTJForCausalLM`` computes it in eval mode.

    Args:
        vocab: vocabulary size ``V``.
        dim: width ``D`` (``n_embd``), a multiple of ``heads``.
        layers: number of blocks (``n_layer``).
        heads: attention heads per block (``n_head``).
        rotary_dim: the features of each head the rotary embedding turns, in interleaved pairs (``rotary_dim``; an
            even number up to the head size; ``None``: all of them).
        hidden: the MLP's width (``n_inner``); ``None``: ``4 D``.
        eps: the LayerNorms' epsilon (``layer_norm_epsilon``).
        positions: the longest sequence (``n_positions``: the rows of HuggingFace's table of angles).
        activation: the MLP's (``activation_function``): ``"gelu_new"`` or ``"gelu_pytorch_tanh"`` (GELU's tanh
            approximation), ``"gelu"`` or ``"relu"``.
        tied: whether ``lm_head``'s weight is the token table (``tie_word_embeddings``); its bias is its own.
        classes_last: logits ``(N, T, V)`` (``True``, as HuggingFace returns them) or ``(N, V, T)`` (what
            ``nn.CrossEntropyLoss`` reads against ``(N, T)`` next-token targets).

    Inputs are token ids ``(N, T)``, ``T`` at most ``positions``.
    """

    _kind = "a GPT-J model"

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, rotary_dim: int | None = 64,
                 hidden: int | None = None, eps: float = 1e-5, positions: int = 2048, activation: str = "gelu_new",
                 tied: bool = False, classes_last: bool = True):  # fmt: skip
        super().__init__()
        check_decoder_options(dim, heads, activation)
        head_dim = dim // heads
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not positive_integer(rotary_dim) or rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim must be a positive even number up to the head size {head_dim}, "
                             f"got {rotary_dim!r}")  # fmt: skip
        if not positive_number(eps) or not positive_integer(positions):
            raise ValueError(f"eps={eps} must be a positive number and positions={positions!r} a positive integer")
        self.positions = positions
        block = (heads, 4 * dim if hidden is None else hidden, eps, rotary_dim, activation)
        self.transformer = DecoderBody(("wte", "h", "ln_f"), nn.Embedding(vocab, dim),
                                       [GPTJBlock(dim, *block) for _ in range(layers)], nn.LayerNorm(dim, eps=eps))
        self._add_head(self.transformer.wte, tied, classes_last, bias=True)

    def check_tokens(self, input_ids: Tensor) -> None:
        """Raises ``ValueError`` (one sentence) unless ``input_ids`` are ``(N, T)`` integer ids below the vocabulary
        size, ``T`` at most ``positions``."""
        check_token_ids(input_ids, self.lm_head.out_features, self.positions, self._kind)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self._laid_out(self.lm_head(self.transformer(input_ids)))

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor], heads: int, rotary_dim: int | None = 64, eps: float = 1e-5,
                        positions: int = 2048, activation: str = "gelu_new", tied: bool | None = None,
                        classes_last: bool = True) -> GPTJ:  # fmt: skip
        """The model of a GPT-J checkpoint's state dict (``GPTJForCausalLM``'s keys, or ``GPTJModel``'s without the
        ``transformer.`` prefix; older checkpoints' mask buffers dropped), its sizes read off the tensors; ``heads``,
        ``rotary_dim`` and the rest are in the checkpoint's ``config.json``, which no shape holds (`from_config` reads
        them there). ``tied``: ``None`` reads it off the tensors (tied where the head's weight is absent or equals the
        token table).

        Raises:
            ValueError: a key is missing or unknown, a shape does not fit, or ``tied`` contradicts the tensors.
        """
        tensors = {k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}": v
                   for k, v in state.items() if not is_gptj_buffer(k)}  # fmt: skip
        table = tensors.get("transformer.wte.weight")
        if table is None or table.dim() != 2:
            raise SpecError("the GPT-J state dict has no token table transformer.wte.weight (V, D)")
        if not positive_integer(heads):
            raise SpecError(f"heads must be a positive integer, got {heads!r}")
        vocab, dim = table.shape
        layers = len({int(m.group(1)) for k in tensors if (m := re.match(r"transformer\.h\.(\d+)\.", k))})
        fc = tensors.get("transformer.h.0.mlp.fc_in.weight")
        if fc is None or fc.dim() != 2:
            raise SpecError("the GPT-J state dict has no matrix transformer.h.0.mlp.fc_in.weight")
        tied, head = output_head(tensors, table, tied)
        build = partial(cls, vocab, dim, layers, heads, rotary_dim, fc.shape[0], eps, positions, activation, tied,
                        classes_last)  # fmt: skip
        return load_decoder(build, tensors, head, tied, f"GPT-J with {layers} blocks of width {dim}",
                            "transformer.wte.weight")

    @classmethod
    def from_config(cls, config: Mapping[str, object], state: Mapping[str, Tensor], classes_last: bool = True) -> GPTJ:
        """The model of a checkpoint's ``config.json`` (as a dict) and state dict: ``n_head`` (or
        ``num_attention_heads``), ``rotary_dim`` (default 64; null: the whole width, as transformers reads it, so
        only with one head), ``layer_norm_epsilon`` (default
        1e-5), ``n_positions`` (default 2048), ``activation_function`` (default ``gelu_new``) and
        ``tie_word_embeddings`` (default false); the sizes the config gives (``n_embd``, ``vocab_size``, ``n_layer``,
        ``n_inner``) must be the tensors'.

        Raises:
            ValueError: a field of the wrong kind, another activation, or what `from_state_dict` raises.
        """
        heads = config.get("n_head", config.get("num_attention_heads"))
        eps, positions = config.get("layer_norm_epsilon", 1e-5), config.get("n_positions", 2048)
        if not positive_integer(heads) or not positive_number(eps) or not positive_integer(positions):
            raise SpecError(f"the config's n_head and n_positions must be positive integers and its layer_norm_epsilon "
                            f"a positive number, got {heads!r}, {positions!r} and {eps!r}")  # fmt: skip
        rotary_dim = config.get("rotary_dim", 64)
        if rotary_dim is None and heads != 1:  # transformers then turns n_embd features: a head's only with one head
            raise SpecError(f"the config's rotary_dim is null, which transformers reads as all {config.get('n_embd')} "
                            f"features of the width, more than a head's with n_head={heads}; it cannot run such a "
                            "model")  # fmt: skip
        activation = config_activation(config, "activation_function", "gelu_new", "GPTJ")
        tied = config.get("tie_word_embeddings", False)
        if not isinstance(tied, bool):
            raise SpecError(f"the config's tie_word_embeddings must be true or false, got {tied!r}")
        model = cls.from_state_dict(state, heads, rotary_dim, float(eps), positions, activation, tied, classes_last)
        body = model.transformer
        check_config_sizes(config, {"n_embd": body.wte.embedding_dim, "vocab_size": body.wte.num_embeddings,
                                    "n_layer": len(body.h), "n_inner": body.h[0].mlp.fc_in.out_features})  # fmt: skip
        return model


def gptj_from_spec(spec: str, state: Mapping[str, Tensor]) -> GPTJ:
    """The model of a ``gptj:config=PATH`` SPEC (`GPTJ.from_config`; `sharpness._specs.decoder_from_config_spec`)."""
    return decoder_from_config_spec(spec, state, "gptj", GPTJ.from_config, "its heads and rotary features")
