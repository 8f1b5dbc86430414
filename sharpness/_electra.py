"""ELECTRA sequence classifiers as HuggingFace's ``ElectraForSequenceClassification`` computes them (eval mode: no
dropout), written so that ``torch.fx`` traces them; the module names and state-dict keys are HuggingFace's, so a
fine-tuned discriminator (``electra-base-discriminator`` on MNLI, say) loads as it is (`Electra.from_state_dict`).

ELECTRA is BERT's encoder (`sharpness._bert`: post-LayerNorm blocks, separate query, key and value Linears) with two
differences in what it computes:

- **the embeddings may be narrower than the blocks** (``embedding_size < hidden_size``: 128 against 256 in
  ELECTRA-small): the three tables and their LayerNorm have width ``E``, and a Linear ``embeddings_project``
  ``(D, E)`` widens their sum to ``D`` before the first block. Its LayerNorm's output is then read by that Linear
  alone, so its scale is traded against the projection's columns (BERT's feeds a residual sum and is pinned);
- **no pooler**: the classifier is a head of its own, ``out_proj(gelu(dense(h_0)))`` on the first ([CLS]) token's
  state (GELU, where BERT's pooler has tanh).

Inputs are those of `sharpness.Bert`: token ids ``(N, T)``, or ids, token types and attention mask stacked
``(N, 3, T)`` (``(N, 2, T)`` without the mask). Outputs are logits ``(N, C)``.

State-dict keys (``i`` the block index; ``E`` the embeddings' width, ``D`` the blocks', ``V`` the vocabulary, ``P``
the positions, ``S`` the token types, ``F`` the MLP's width, ``C`` the classes)::

    electra.embeddings.word_embeddings.weight (V, E), .position_embeddings.weight (P, E),
        .token_type_embeddings.weight (S, E), .LayerNorm.weight, .LayerNorm.bias (E,)
    electra.embeddings_project.weight (D, E), .bias (D,)   (only where E != D)
    electra.encoder.layer.i...   (BERT's block keys, `sharpness._bert`)
    classifier.dense.weight (D, D), .bias (D,); classifier.out_proj.weight (C, D), .bias (C,)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sharpness._bert import BertBody, TokenClassifier, check_encoder_sizes, encoder_config


class ElectraClassificationHead(nn.Module):
    """``out_proj(gelu(dense(x[:, 0])))``: the first token's state ``(N, T, D)`` -> logits ``(N, C)``."""

    def __init__(self, dim: int, classes: int):
        super().__init__()
        self.dense, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.out_proj(F.gelu(self.dense(x[:, 0])))


class Electra(TokenClassifier):
    """An ELECTRA discriminator with its classification head, as HuggingFace's ``ElectraForSequenceClassification``
    computes it in eval mode.

    Args:
        vocab: vocabulary size ``V`` (``vocab_size``).
        positions: the longest sequence ``P`` (``max_position_embeddings``).
        dim: the blocks' width ``D`` (``hidden_size``), a multiple of ``heads``.
        layers: number of blocks (``num_hidden_layers``).
        heads: attention heads per block (``num_attention_heads``).
        classes: the classifier's outputs ``C`` (``num_labels``; 1 for regression).
        hidden: the MLP's width (``intermediate_size``); ``None``: ``4 * dim``.
        types: token types ``S`` (``type_vocab_size``).
        eps: the LayerNorms' epsilon (``layer_norm_eps``).
        act: the MLP's activation (``hidden_act``): ``"gelu"``, ``"relu"``, ``"gelu_new"`` or
            ``"gelu_pytorch_tanh"``.
        embedding: the embeddings' width ``E`` (``embedding_size``); ``None``: ``dim`` (no projection).

    Inputs are ``(N, T)`` token ids, ``(N, 2, T)`` ids and token types, or ``(N, 3, T)`` ids, token types and
    attention mask, ``T <= P``; outputs are logits ``(N, C)``.
    """

    family, prefix, checkpoint = "ELECTRA", "electra", "ElectraForSequenceClassification"

    def __init__(self, vocab: int, positions: int, dim: int, layers: int, heads: int, classes: int = 2,
                 hidden: int | None = None, types: int = 2, eps: float = 1e-12, act: str = "gelu",
                 embedding: int | None = None):  # fmt: skip
        super().__init__()
        check_encoder_sizes(dim, heads, eps, act, vocab=vocab, positions=positions, layers=layers, classes=classes,
                            hidden=hidden, types=types, embedding=embedding)  # fmt: skip
        self.electra = BertBody(vocab, positions, types, dim, layers, heads, 4 * dim if hidden is None else hidden,
                                eps, act, pooler=False, embedding=embedding)  # fmt: skip
        self.classifier = ElectraClassificationHead(dim, classes)

    @classmethod
    def from_config(cls, config: Mapping[str, object], state: Mapping[str, Tensor]) -> Electra:
        """The model of a checkpoint's ``config.json`` (as a dict) and state dict: ``num_attention_heads``,
        ``layer_norm_eps`` (default 1e-12) and ``hidden_act`` (default ``gelu``), and the widths (``hidden_size``,
        ``embedding_size``), which must be the tensors'; a config asking for another function
        (``position_embedding_type`` other than ``absolute``, a decoder) is refused.

        Raises:
            ValueError: a field missing or of the wrong kind, another function, or what `from_state_dict` raises.
        """
        heads, eps, act = encoder_config(config, "sharpness.Electra")
        cls._check_config(config, "sharpness.Electra")
        model = cls.from_state_dict(state, heads, eps, act)
        model._check_config_sizes(config, embedding_size=model.electra.embeddings.word_embeddings.embedding_dim)
        return model

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor], heads: int, eps: float = 1e-12,
                        act: str = "gelu") -> Electra:  # fmt: skip
        """The model of an ``ElectraForSequenceClassification`` checkpoint's state dict (old ``position_ids`` and
        ``token_type_ids`` buffers dropped), its sizes read off the tensors (the blocks' width off the head's first
        layer, the embeddings' off the token table); ``heads`` (``num_attention_heads``), ``eps``
        (``layer_norm_eps``) and ``act`` (``hidden_act``) are in its ``config.json``, which no shape holds.

        Raises:
            ValueError: a key is missing or unknown, a shape does not fit, or ``heads`` does not divide the width.
        """
        tensors, sizes = cls._read(state, "classifier.out_proj.weight", heads)
        # the blocks' width: the projection's outputs where the embeddings are widened, else the head's
        blocks = tensors.get("electra.embeddings_project.weight", tensors.get("classifier.dense.weight"))
        blocks = torch.empty(0) if blocks is None else blocks
        if blocks.dim() == 2 and blocks.shape[0] != sizes["dim"]:  # narrower embeddings, widened by a projection
            sizes = {**sizes, "dim": blocks.shape[0], "embedding": sizes["dim"]}
        return cls._build(tensors, sizes, eps=eps, act=act)


__all__ = ["Electra"]
