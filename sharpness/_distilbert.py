"""DistilBERT sequence classifiers as HuggingFace's ``DistilBertForSequenceClassification`` computes them (eval mode:
no dropout), written so that ``torch.fx`` traces them; the module names and state-dict keys are HuggingFace's, so a
fine-tuned checkpoint (``distilbert-base-uncased-finetuned-sst-2-english``, say) loads as it is
(`DistilBert.from_state_dict`).

The embeddings are the token's and its position's tables summed, then LayerNorm (no token types). Each block is
post-LayerNorm, as BERT's (`sharpness._bert`): ``h = LN(x + out_lin(attn(x)))``, then ``LN(h + lin2(act(lin1(h))))``;
attention projects queries, keys and values with separate Linears and attends over the keys the attention mask keeps,
scale ``hd^-1/2``. The classifier reads the first ([CLS]) token's state through
``classifier(relu(pre_classifier(h_0)))`` (a ReLU, where BERT's pooler has tanh). Every LayerNorm's epsilon is 1e-12
(fixed in transformers' code, not in the config).

Inputs are token ids ``(N, T)`` (every token attended), or ids and attention mask stacked on axis 1 ``(N, 2, T)``, as
DistilBERT's tokenizer returns them (no token types); outputs are logits ``(N, C)``.

State-dict keys (``i`` the block index; ``D`` the width, ``V`` the vocabulary, ``P`` the positions, ``F`` the MLP's
width, ``C`` the classes)::

    distilbert.embeddings.word_embeddings.weight (V, D), .position_embeddings.weight (P, D),
        .LayerNorm.weight, .LayerNorm.bias (D,)
    distilbert.transformer.layer.i.attention.{q_lin,k_lin,v_lin,out_lin}.weight (D, D), .bias (D,)
    distilbert.transformer.layer.i.sa_layer_norm.weight, .bias (D,)
    distilbert.transformer.layer.i.ffn.lin1.weight (F, D), .bias (F,); .ffn.lin2.weight (D, F), .bias (D,)
    distilbert.transformer.layer.i.output_layer_norm.weight, .bias (D,)
    pre_classifier.weight (D, D), .bias (D,); classifier.weight (C, D), .bias (C,)
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from sharpness._bert import ACTIVATIONS, attend, check_encoder_sizes, check_token_rows
from sharpness._specs import TOKEN_DTYPES, SpecError, check_config_sizes, load_fitting, positive_integer

EPS = 1e-12  # transformers' DistilBERT LayerNorms: fixed in its code


def is_distilbert_buffer(key: str) -> bool:
    """Whether a checkpoint key is the index buffer older HuggingFace versions saved (``embeddings.position_ids``):
    dropped on loading, the model builds its positions itself."""
    return re.fullmatch(r"(distilbert\.)?embeddings\.position_ids", key) is not None


class Embeddings(nn.Module):
    def __init__(self, vocab: int, positions: int, dim: int, eps: float):
        super().__init__()
        self.word_embeddings, self.position_embeddings = nn.Embedding(vocab, dim), nn.Embedding(positions, dim)
        self.LayerNorm = nn.LayerNorm(dim, eps=eps)

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.arange(ids.size(1), device=ids.device)
        return self.LayerNorm(self.word_embeddings(ids) + self.position_embeddings(positions))


class MultiHeadSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_lin, self.k_lin, self.v_lin = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out_lin = nn.Linear(dim, dim)

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:
        return self.out_lin(attend(self.q_lin(x), self.k_lin(x), self.v_lin(x), self.heads, keep))


class FFN(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.lin1, self.lin2, self.act = nn.Linear(dim, hidden), nn.Linear(hidden, dim), act

    def forward(self, x: Tensor) -> Tensor:
        return self.lin2(ACTIVATIONS[self.act](self.lin1(x)))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, eps: float, act: str):
        super().__init__()
        self.attention, self.sa_layer_norm = MultiHeadSelfAttention(dim, heads), nn.LayerNorm(dim, eps=eps)
        self.ffn, self.output_layer_norm = FFN(dim, hidden, act), nn.LayerNorm(dim, eps=eps)

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:
        h = self.sa_layer_norm(self.attention(x, keep) + x)
        return self.output_layer_norm(self.ffn(h) + h)


class Transformer(nn.Module):
    def __init__(self, layers: int, *block: object):
        super().__init__()
        self.layer = nn.ModuleList(TransformerBlock(*block) for _ in range(layers))

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:
        for layer in self.layer:
            x = layer(x, keep)
        return x


class DistilBertBody(nn.Module):
    def __init__(self, vocab: int, positions: int, dim: int, layers: int, heads: int, hidden: int, eps: float,
                 act: str):  # fmt: skip
        super().__init__()
        self.embeddings = Embeddings(vocab, positions, dim, eps)
        self.transformer = Transformer(layers, dim, heads, hidden, eps, act)

    def forward(self, ids: Tensor, keep: Tensor) -> Tensor:
        return self.transformer(self.embeddings(ids), keep)


class DistilBert(nn.Module):
    """A DistilBERT encoder with its sequence classifier, as HuggingFace's ``DistilBertForSequenceClassification``
    computes it in eval mode.

    Args:
        vocab: vocabulary size ``V`` (``vocab_size``).
        positions: the longest sequence ``P`` (``max_position_embeddings``).
        dim: width ``D`` (``dim``), a multiple of ``heads``.
        layers: number of blocks (``n_layers``).
        heads: attention heads per block (``n_heads``).
        classes: the classifier's outputs ``C`` (``num_labels``; 1 for regression).
        hidden: the MLP's width (``hidden_dim``); ``None``: ``4 * dim``.
        act: the MLP's activation (``activation``): ``"gelu"``, ``"relu"``, ``"gelu_new"`` or
            ``"gelu_pytorch_tanh"``.
        eps: the LayerNorms' epsilon (1e-12 in transformers' DistilBERT, which no config sets).

    Inputs are ``(N, T)`` token ids or ``(N, 2, T)`` ids and attention mask (1 for a token, 0 for padding), ``T <=
    P``; outputs are logits ``(N, C)``.
    """

    takes_token_ids = True  # the command lines keep the data's integer X as it is for such a model
    heads_key = "n_heads"  # the config's field, named by the command line's messages

    def __init__(self, vocab: int, positions: int, dim: int, layers: int, heads: int, classes: int = 2,
                 hidden: int | None = None, act: str = "gelu", eps: float = EPS):  # fmt: skip
        super().__init__()
        check_encoder_sizes(dim, heads, eps, act, "activation", vocab=vocab, positions=positions, layers=layers,
                            classes=classes, hidden=hidden)  # fmt: skip
        self.distilbert = DistilBertBody(vocab, positions, dim, layers, heads, 4 * dim if hidden is None else hidden,
                                         eps, act)  # fmt: skip
        self.pre_classifier, self.classifier = nn.Linear(dim, dim), nn.Linear(dim, classes)

    def check_tokens(self, inputs: Tensor) -> None:
        """Raises ``ValueError`` (one sentence) unless ``inputs`` are ``(N, T)`` or ``(N, 2, T)`` integers: ids below
        the vocabulary size, a mask of 0 and 1 keeping each sequence's first token, and ``T`` at most the positions
        the model has."""
        embeddings = self.distilbert.embeddings
        if inputs.dtype not in TOKEN_DTYPES or inputs.dim() not in (2, 3) or (inputs.dim() == 3 and
                                                                              inputs.shape[1] != 2):  # fmt: skip
            raise ValueError(f"DistilBERT takes int64 (or int32) token ids (N, T), or ids and attention mask stacked "
                             f"(N, 2, T), not {tuple(inputs.shape)} {str(inputs.dtype).removeprefix('torch.')} "
                             "values")  # fmt: skip
        check_token_rows(inputs, embeddings.position_embeddings.num_embeddings,
                         [(embeddings.word_embeddings.num_embeddings, "token ids"), (2, "attention mask values")],
                         mask=1)  # fmt: skip

    def forward(self, inputs: Tensor) -> Tensor:
        # (N, T) or (N, 2, T) without a branch on the shape (fx traces no branch): a missing mask is all ones
        rows = inputs.reshape(inputs.size(0), -1, inputs.size(-1))
        rows = torch.cat((rows, torch.ones_like(rows[:, :1])), dim=1)
        keep = (rows[:, 1] != 0)[:, None, None, :]  # (N, 1, 1, T): the keys each query attends
        h = self.distilbert(rows[:, 0], keep)
        return self.classifier(torch.relu(self.pre_classifier(h[:, 0])))

    @classmethod
    def from_config(cls, config: Mapping[str, object], state: Mapping[str, Tensor]) -> DistilBert:
        """The model of a checkpoint's ``config.json`` (as a dict) and state dict: ``n_heads`` and ``activation``
        (default ``gelu``), and the sizes (``dim``, ``hidden_dim``, ``n_layers``), which must be the tensors'.

        Raises:
            ValueError: a field missing or of the wrong kind, sizes other than the tensors', or what
                `from_state_dict` raises.
        """
        heads, act = config.get("n_heads"), config.get("activation", "gelu")
        if not positive_integer(heads):
            raise SpecError(f"the config's n_heads must be a positive integer, got {heads!r}")
        if not isinstance(act, str) or act not in ACTIVATIONS:
            raise SpecError(f"the config's activation is {act!r}; sharpness.DistilBert computes "
                            f"{', '.join(ACTIVATIONS)}")  # fmt: skip
        model = cls.from_state_dict(state, heads, act)
        held = {"dim": model.pre_classifier.in_features, "n_layers": len(model.distilbert.transformer.layer),
                "hidden_dim": model.distilbert.transformer.layer[0].ffn.lin1.out_features}  # fmt: skip
        check_config_sizes(config, held)
        return model

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor], heads: int, act: str = "gelu",
                        eps: float = EPS) -> DistilBert:  # fmt: skip
        """The model of a ``DistilBertForSequenceClassification`` checkpoint's state dict (an old ``position_ids``
        buffer dropped), its sizes read off the tensors; ``heads`` (``n_heads``) and ``act`` (``activation``) are in
        its ``config.json``, which no shape holds.

        Raises:
            ValueError: a key is missing or unknown, a shape does not fit, or ``heads`` does not divide the width.
        """
        tensors = {k: v for k, v in state.items() if not is_distilbert_buffer(k)}
        word, position = (f"distilbert.embeddings.{t}_embeddings.weight" for t in ("word", "position"))
        for key in (word, position, "classifier.weight"):
            if tensors.get(key, torch.empty(0)).dim() != 2:
                owner = " (a DistilBertForSequenceClassification checkpoint has one)" if key.startswith("cl") else ""
                raise SpecError(f"the DistilBERT state dict has no matrix {key}{owner}")
        vocab, dim = tensors[word].shape
        layers = len({int(m.group(1)) for k in tensors
                      if (m := re.match(r"distilbert\.transformer\.layer\.(\d+)\.", k))})  # fmt: skip
        inner = tensors.get("distilbert.transformer.layer.0.ffn.lin1.weight", torch.empty(0))
        if not positive_integer(heads):
            raise SpecError(f"heads must be a positive integer, got {heads!r}")
        try:
            model = cls(vocab, tensors[position].shape[0], dim, layers, heads, tensors["classifier.weight"].shape[0],
                        inner.shape[0] if inner.dim() == 2 else 4 * dim, act, eps)  # fmt: skip
        except ValueError as failure:
            raise SpecError(str(failure)) from None
        return load_fitting(model, tensors, f"DistilBERT with {layers} blocks of width {dim}", set(), word)


__all__ = ["DistilBert"]
