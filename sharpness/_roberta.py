"""RoBERTa sequence classifiers as HuggingFace's ``RobertaForSequenceClassification`` computes them (eval mode: no
dropout), written so that ``torch.fx`` traces them; XLM-RoBERTa's and CamemBERT's classifiers are the same function
with the same keys. The module names and state-dict keys are HuggingFace's, so a fine-tuned checkpoint (RoBERTa on
MNLI or SST-2, say) loads as it is (`Roberta.from_state_dict`).

RoBERTa is BERT's encoder (`sharpness._bert`: post-LayerNorm blocks, separate query, key and value Linears) with two
differences in what it computes:

- **positions** are numbered as fairseq numbers them: a token's position is ``pad + k`` where ``k`` counts the tokens
  up to it (itself included) that are not the padding id ``pad`` (``pad_token_id``, 1 in every released checkpoint),
  and a padding token's is ``pad``. The table therefore has ``pad + 1`` rows more than the longest sequence (514 rows
  for 512 tokens), and what decides a position is the padding id in the token ids, not the attention mask;
- **no pooler**: the classifier is a head of its own, ``out_proj(tanh(dense(h_0)))`` on the first (``<s>``) token's
  state.

Inputs are those of `sharpness.Bert`: token ids ``(N, T)``, or ids, token types and attention mask stacked
``(N, 3, T)`` (``(N, 2, T)`` without the mask); RoBERTa has one token type (0). Outputs are logits ``(N, C)``.

State-dict keys (``i`` the block index; ``D`` the width, ``V`` the vocabulary, ``P`` the position table's rows, ``F``
the MLP's width, ``C`` the classes)::

    roberta.embeddings.word_embeddings.weight (V, D), .position_embeddings.weight (P, D),
        .token_type_embeddings.weight (1, D), .LayerNorm.weight, .LayerNorm.bias (D,)
    roberta.encoder.layer.i.attention.self.{query,key,value}.weight (D, D), .bias (D,)
    roberta.encoder.layer.i.attention.output.dense.weight (D, D), .bias; .attention.output.LayerNorm.weight, .bias
    roberta.encoder.layer.i.intermediate.dense.weight (F, D), .bias (F,)
    roberta.encoder.layer.i.output.dense.weight (D, F), .bias (D,); .output.LayerNorm.weight, .bias
    classifier.dense.weight (D, D), .bias (D,); classifier.out_proj.weight (C, D), .bias (C,)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from sharpness._bert import (
    BertBody,
    TokenClassifier,
    check_encoder_sizes,
    encoder_config,
)
from sharpness._specs import SpecError


class RobertaClassificationHead(nn.Module):
    """``out_proj(tanh(dense(x[:, 0])))``: the first token's state ``(N, T, D)`` -> logits ``(N, C)``."""

    def __init__(self, dim: int, classes: int):
        super().__init__()
        self.dense, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.out_proj(torch.tanh(self.dense(x[:, 0])))


class Roberta(TokenClassifier):
    """A RoBERTa encoder with its classification head, as HuggingFace's ``RobertaForSequenceClassification`` (and
    ``XLMRobertaForSequenceClassification``, ``CamembertForSequenceClassification``) computes it in eval mode.

    Args:
        vocab: vocabulary size ``V`` (``vocab_size``).
        positions: the position table's rows ``P`` (``max_position_embeddings``); sequences hold at most
            ``P - pad - 1`` tokens.
        dim: width ``D`` (``hidden_size``), a multiple of ``heads``.
        layers: number of blocks (``num_hidden_layers``).
        heads: attention heads per block (``num_attention_heads``).
        classes: the classifier's outputs ``C`` (``num_labels``; 1 for regression).
        hidden: the MLP's width (``intermediate_size``); ``None``: ``4 * dim``.
        types: token types (``type_vocab_size``, 1 in RoBERTa's checkpoints).
        eps: the LayerNorms' epsilon (``layer_norm_eps``, 1e-5 in RoBERTa's checkpoints).
        act: the MLP's activation (``hidden_act``): ``"gelu"``, ``"relu"``, ``"gelu_new"`` or
            ``"gelu_pytorch_tanh"``.
        pad: the padding token's id (``pad_token_id``), which numbers the positions (see the module's docstring).

    Inputs are ``(N, T)`` token ids, ``(N, 2, T)`` ids and token types, or ``(N, 3, T)`` ids, token types and
    attention mask, ``T <= P - pad - 1``; outputs are logits ``(N, C)``.
    """

    family, prefix, checkpoint = "RoBERTa", "roberta", "RobertaForSequenceClassification"
    spec_integers = ("pad",)  # the command line's roberta:heads=H,pad=ID

    def __init__(self, vocab: int, positions: int, dim: int, layers: int, heads: int, classes: int = 2,
                 hidden: int | None = None, types: int = 1, eps: float = 1e-5, act: str = "gelu",
                 pad: int = 1):  # fmt: skip
        super().__init__()
        check_encoder_sizes(dim, heads, eps, act, vocab=vocab, positions=positions, layers=layers, classes=classes,
                            hidden=hidden, types=types)  # fmt: skip
        if isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < min(vocab, positions - 1):
            raise ValueError(f"pad_token_id={pad!r} must be a token id below both the vocabulary ({vocab}) and the "
                             f"position table's rows less one ({positions - 1})")  # fmt: skip
        self.roberta = BertBody(vocab, positions, types, dim, layers, heads, 4 * dim if hidden is None else hidden,
                                eps, act, pooler=False, padding=pad)  # fmt: skip
        self.classifier = RobertaClassificationHead(dim, classes)

    def _longest(self) -> int:
        """The positions a sequence may fill: the table's rows past the padding's (``P - pad - 1``)."""
        return super()._longest() - self.roberta.embeddings.padding - 1

    @classmethod
    def from_config(cls, config: Mapping[str, object], state: Mapping[str, Tensor]) -> Roberta:
        """The model of a checkpoint's ``config.json`` (as a dict) and state dict: ``num_attention_heads``,
        ``layer_norm_eps`` (default 1e-12, transformers' default; RoBERTa's checkpoints set 1e-5), ``hidden_act``
        (default ``gelu``) and ``pad_token_id`` (default 1); a config asking for another function
        (``position_embedding_type`` other than ``absolute``, a decoder) is refused.

        Raises:
            ValueError: a field missing or of the wrong kind, another function, or what `from_state_dict` raises.
        """
        heads, eps, act = encoder_config(config, "sharpness.Roberta")
        cls._check_config(config, "sharpness.Roberta")
        pad = config.get("pad_token_id", 1)
        if isinstance(pad, bool) or not isinstance(pad, int):
            raise SpecError(f"the config's pad_token_id must be an integer, got {pad!r}")
        model = cls.from_state_dict(state, heads, eps, act, pad)
        model._check_config_sizes(config)
        return model

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor], heads: int, eps: float = 1e-5, act: str = "gelu",
                        pad: int = 1) -> Roberta:  # fmt: skip
        """The model of a ``RobertaForSequenceClassification`` checkpoint's state dict (old ``position_ids`` and
        ``token_type_ids`` buffers are dropped), its sizes read off the tensors; ``heads`` (``num_attention_heads``),
        ``eps`` (``layer_norm_eps``), ``act`` (``hidden_act``) and ``pad`` (``pad_token_id``) are in its
        ``config.json``, which no shape holds.

        Raises:
            ValueError: a key is missing or unknown, a shape does not fit, ``heads`` does not divide the width, or
                ``pad`` is not a token id.
        """
        return cls._build(*cls._read(state, "classifier.out_proj.weight", heads), eps=eps, act=act, pad=pad)


__all__ = ["Roberta"]
