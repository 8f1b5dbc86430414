"""GPT-2 as HuggingFace's ``GPT2LMHeadModel`` computes it (eager attention, no dropout), written so that ``torch.fx``
traces it: HuggingFace's own classes do not trace (their mask builders call ``torch.finfo`` on a traced dtype), so the
toolkit cannot read them. The module names and state-dict keys are HuggingFace's, so a GPT-2 checkpoint loads as it
is (`GPT2.from_state_dict`).

Each block is ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``; attention projects queries, keys and values with one
fused ``Conv1D`` (``x W + b``, ``W`` stored ``(in, out)``), splits them into heads, scores ``q k^T / sqrt(hd)`` under
a causal mask, and projects the heads' outputs with a second ``Conv1D``; the MLP is ``c_proj(gelu_tanh(c_fc(x)))``.
The logits are ``ln_f``'s output times the token embedding (the output layer shares the embedding's weight).

State-dict keys (``i`` the block index; ``D`` the width, ``V`` the vocabulary, ``P`` the positions)::

    transformer.wte.weight (V, D), transformer.wpe.weight (P, D)
    transformer.h.i.ln_1.weight, .bias (D,); transformer.h.i.ln_2.weight, .bias (D,)
    transformer.h.i.attn.c_attn.weight (D, 3D), .bias (3D,); transformer.h.i.attn.c_proj.weight (D, D), .bias (D,)
    transformer.h.i.mlp.c_fc.weight (D, 4D), .bias (4D,); transformer.h.i.mlp.c_proj.weight (4D, D), .bias (D,)
    transformer.ln_f.weight, .bias (D,); lm_head.weight (V, D), the same tensor as transformer.wte.weight
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sharpness._specs import (
    SpecError,
    check_token_ids,
    checkpoint_spec,
    load_fitting,
    positive_integer,
    positive_number,
)


def is_mask_buffer(key: str) -> bool:
    """Whether a checkpoint key is the causal-mask buffer older HuggingFace versions saved (``h.0.attn.bias``,
    ``h.0.attn.masked_bias``): dropped on loading, the model builds its mask itself."""
    return re.fullmatch(r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias", key) is not None


class Conv1D(nn.Module):
    """HuggingFace's ``Conv1D``: ``x W + b`` on the last axis, ``W`` stored ``(in, out)``."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.nf = out_features
        self.weight = nn.Parameter(torch.empty(in_features, out_features).normal_(std=0.02))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: Tensor) -> Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class GPT2Attention(nn.Module):
    """Causal self-attention of ``heads`` heads on ``(N, T, D)``, as HuggingFace's eager ``GPT2Attention``."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.c_attn, self.c_proj = Conv1D(3 * dim, dim), Conv1D(dim, dim)

    def _split(self, t: Tensor) -> Tensor:
        return t.view(t.size()[:-1] + (self.heads, self.dim // self.heads)).permute(0, 2, 1, 3)

    def forward(self, x: Tensor) -> Tensor:
        query, key, value = self.c_attn(x).split(self.dim, dim=2)
        query, key, value = self._split(query), self._split(key), self._split(value)
        token = torch.arange(x.size(1), device=x.device)  # the causal mask from the length (a buffer sliced by it
        # would not trace)
        scores = torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(self.dim // self.heads)
        scores = scores.masked_fill(token[None, :] > token[:, None], float("-inf"))
        out = torch.matmul(scores.softmax(dim=-1), value).permute(0, 2, 1, 3).contiguous()
        return self.c_proj(out.view(out.size()[:-2] + (self.dim,)))


class GPT2MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(4 * dim, dim), Conv1D(dim, 4 * dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # HuggingFace's "gelu_new"


class GPT2Block(nn.Module):
    def __init__(self, dim: int, heads: int, eps: float):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(dim, eps=eps), nn.LayerNorm(dim, eps=eps)
        self.attn, self.mlp = GPT2Attention(dim, heads), GPT2MLP(dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Body(nn.Module):
    def __init__(self, vocab: int, positions: int, dim: int, layers: int, heads: int, eps: float):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(positions, dim)
        self.h = nn.ModuleList(GPT2Block(dim, heads, eps) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim, eps=eps)

    def forward(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2(nn.Module):
    """GPT-2 with its language-model head, as HuggingFace's ``GPT2LMHeadModel`` computes it in eval mode.

    Args:
        vocab: vocabulary size ``V``.
        positions: the longest sequence ``P`` (``n_positions``).
        dim: width ``D`` (``n_embd``), a multiple of ``heads``.
        layers: number of blocks (``n_layer``).
        heads: attention heads per block (``n_head``).
        eps: the LayerNorms' epsilon (``layer_norm_epsilon``).

    Inputs are token ids ``(N, T)``, ``T <= P``; outputs are logits ``(N, T, V)`` (``classes_last=True``, as
    HuggingFace returns them) or ``(N, V, T)`` (``classes_last=False``: what ``nn.CrossEntropyLoss`` reads against
    ``(N, T)`` next-token targets, as the command line's ``--loss ce`` does).
    """

    takes_token_ids = True  # the command lines keep the data's integer X as it is for such a model

    def __init__(self, vocab: int, positions: int, dim: int, layers: int, heads: int, eps: float = 1e-5,
                 classes_last: bool = True):  # fmt: skip
        super().__init__()
        if not positive_integer(heads) or dim % heads:
            raise ValueError(f"dim={dim} is not a multiple of heads={heads}")
        self.classes_last = classes_last
        self.transformer = GPT2Body(vocab, positions, dim, layers, heads, eps)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2

    def check_tokens(self, input_ids: Tensor) -> None:
        """Raises ``ValueError`` (one sentence) unless ``input_ids`` are ``(N, T)`` integer ids below the vocabulary
        size, ``T`` at most the positions the model has."""
        check_token_ids(input_ids, self.transformer.wte.num_embeddings, self.transformer.wpe.num_embeddings, "GPT-2")

    def forward(self, input_ids: Tensor) -> Tensor:
        logits = self.lm_head(self.transformer(input_ids))
        return logits if self.classes_last else logits.transpose(1, 2)

    @classmethod
    def from_config(cls, config: Mapping[str, object], state: Mapping[str, Tensor], classes_last: bool = True) -> GPT2:
        """The model of a checkpoint's ``config.json`` (as a dict) and state dict: ``n_head`` and
        ``layer_norm_epsilon`` (default 1e-5); a config asking for another function than GPT-2's (an
        ``activation_function`` other than ``gelu_new``, ``scale_attn_weights`` false,
        ``scale_attn_by_inverse_layer_idx``) is refused.

        Raises:
            ValueError: a field missing or of the wrong kind, another function, or what `from_state_dict` raises.
        """
        heads, eps = config.get("n_head"), config.get("layer_norm_epsilon", 1e-5)
        if not positive_integer(heads) or not positive_number(eps):
            raise SpecError(f"the config's n_head must be a positive integer and its layer_norm_epsilon a positive "
                            f"number, got {heads!r} and {eps!r}")  # fmt: skip
        if config.get("activation_function", "gelu_new") != "gelu_new":
            raise SpecError(f"the config's activation_function is {config['activation_function']!r}; GPT-2's MLP "
                            "uses gelu_new")  # fmt: skip
        for option, plain in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False)):
            if config.get(option, plain) != plain:  # another function than sharpness.GPT2's
                raise SpecError(f"the config sets {option} to {config[option]!r}, which sharpness.GPT2 does not "
                                f"compute (it has {option}={plain})")  # fmt: skip
        return cls.from_state_dict(state, heads, float(eps), classes_last)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor], heads: int, eps: float = 1e-5,
                        classes_last: bool = True) -> GPT2:  # fmt: skip
        """The model of a GPT-2 checkpoint's state dict (``GPT2LMHeadModel``'s keys, or ``GPT2Model``'s without the
        ``transformer.`` prefix; ``attn.bias``/``attn.masked_bias`` mask buffers of older checkpoints are dropped),
        its sizes read off the tensors; ``heads`` is the checkpoint's ``n_head`` (``config.json``), which no shape
        holds.

        Raises:
            ValueError: a key is missing or unknown, a shape does not fit, or ``lm_head.weight`` differs from the
                token embedding (an untied head).
        """
        tensors = {}
        for key, value in state.items():
            if is_mask_buffer(key):
                continue  # the causal mask, which the model builds itself
            name = key if key.startswith(("transformer.", "lm_head.")) else f"transformer.{key}"
            tensors[name] = value
        head = tensors.pop("lm_head.weight", None)
        for key in ("transformer.wte.weight", "transformer.wpe.weight"):
            if key not in tensors:
                raise SpecError(f"the GPT-2 state dict has no {key!r}")
            if tensors[key].dim() != 2:
                raise SpecError(f"{key} has shape {tuple(tensors[key].shape)}; GPT-2's embeddings are matrices")
        vocab, dim = tensors["transformer.wte.weight"].shape
        positions = tensors["transformer.wpe.weight"].shape[0]
        layers = len({int(m.group(1)) for k in tensors if (m := re.match(r"transformer\.h\.(\d+)\.", k))})
        if head is not None and not torch.equal(head, tensors["transformer.wte.weight"]):
            raise SpecError("lm_head.weight differs from transformer.wte.weight: an untied output layer is no GPT-2")
        model = cls(vocab, positions, dim, layers, heads, eps, classes_last)
        return load_fitting(model, tensors, f"GPT-2 with {layers} blocks of width {dim}", {"lm_head.weight"},
                            "transformer.wte.weight")


def gpt2_from_spec(spec: str, state: Mapping[str, Tensor]) -> GPT2:
    """The model of a ``gpt2:config=PATH`` (the checkpoint's ``config.json``, `GPT2.from_config`) or
    ``gpt2:heads=H[,eps=E]`` SPEC from its checkpoint's ``state`` (sizes read off the tensors), its logits
    ``(N, V, T)`` for ``nn.CrossEntropyLoss`` against next-token targets.

    Raises:
        SpecError: an unknown or malformed option, neither ``config`` nor ``heads``, an unreadable config, or a state
            dict that does not fit.
    """
    options, config = checkpoint_spec(spec, "gpt2")
    try:
        if config is not None:
            return GPT2.from_config(config, state, classes_last=False)
        if set(options) - {"heads", "eps"} or "heads" not in options:
            raise SpecError("give the checkpoint's config.json (gpt2:config=PATH) or its number of heads (n_head), "
                            "e.g. gpt2:heads=12; the only other option is eps")  # fmt: skip
        try:
            heads, eps = int(options["heads"]), float(options.get("eps", 1e-5))
        except ValueError:
            raise SpecError("heads is a positive integer and eps a number") from None
        if heads < 1 or not positive_number(eps):
            raise SpecError("heads is a positive integer and eps a positive finite number")
        return GPT2.from_state_dict(state, heads, eps, classes_last=False)
    except ValueError as failure:  # a width that is no multiple of the heads, say
        raise SpecError(f"model spec {spec!r}: {failure}") from None
