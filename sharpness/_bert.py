"""BERT sequence classifiers as HuggingFace's ``BertForSequenceClassification`` computes them (eval mode: no dropout),
written so that ``torch.fx`` traces them: HuggingFace's own classes do not trace, so the toolkit cannot read them.
The module names and state-dict keys are HuggingFace's, so a fine-tuned checkpoint (BERT on MNLI, say, the language
models of the Hide & Seek paper) loads as it is (`Bert.from_state_dict`).

The embeddings are the token's, its position's and its segment's (token type) tables summed, then LayerNorm. Each
block is post-LayerNorm: ``h = LN(x + dense(attn(x)))``, then ``LN(h + out(act(inter(h))))``; attention projects
queries, keys and values with separate Linears, attends over the keys the attention mask keeps (no causal mask) with
scale ``hd^-1/2``, and the classifier reads ``tanh(pooler(h_0))``, the first ([CLS]) token's pooled state.

Inputs are token ids ``(N, T)`` (every token attended, token types 0), or what a tokenizer returns stacked on axis 1,
``(N, 3, T)``: ids, token types (``token_type_ids``, 0 for the first sentence and 1 for the second) and attention
mask (1 for a token, 0 for padding); ``(N, 2, T)`` holds ids and token types, every token attended. Outputs are logits
``(N, C)``.

State-dict keys (``i`` the block index; ``D`` the width, ``V`` the vocabulary, ``P`` the positions, ``S`` the token
types, ``F`` the MLP's width, ``C`` the classes)::

    bert.embeddings.word_embeddings.weight (V, D), .position_embeddings.weight (P, D),
        .token_type_embeddings.weight (S, D), .LayerNorm.weight, .LayerNorm.bias (D,)
    bert.encoder.layer.i.attention.self.{query,key,value}.weight (D, D), .bias (D,)
    bert.encoder.layer.i.attention.output.dense.weight (D, D), .bias; .attention.output.LayerNorm.weight, .bias
    bert.encoder.layer.i.intermediate.dense.weight (F, D), .bias (F,)
    bert.encoder.layer.i.output.dense.weight (D, F), .bias (D,); .output.LayerNorm.weight, .bias
    bert.pooler.dense.weight (D, D), .bias (D,); classifier.weight (C, D), .bias (C,)
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sharpness._specs import (
    TOKEN_DTYPES,
    SpecError,
    check_config_sizes,
    checkpoint_spec,
    load_fitting,
    positive_integer,
    positive_number,
)

# HuggingFace's hidden_act names -> the function (``gelu_new`` and ``gelu_pytorch_tanh`` are GELU's tanh form)
ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}  # fmt: skip


def is_index_buffer(key: str) -> bool:
    """Whether a checkpoint key is an index buffer older HuggingFace versions saved (``embeddings.position_ids``,
    ``embeddings.token_type_ids``): dropped on loading, the model builds its indices itself."""
    return re.fullmatch(r"(bert\.|roberta\.|electra\.)?embeddings\.(position_ids|token_type_ids)", key) is not None


class BertEmbeddings(nn.Module):
    """The three tables summed, then LayerNorm. ``padding``: ``None`` (BERT), positions ``0 .. T-1``; an id (RoBERTa,
    as fairseq numbers them), a token's position is ``padding`` plus the number of tokens up to it that are not
    ``padding``, and a padding token's is ``padding``."""

    def __init__(self, vocab: int, positions: int, types: int, dim: int, eps: float, padding: int | None = None):
        super().__init__()
        self.word_embeddings, self.position_embeddings = nn.Embedding(vocab, dim), nn.Embedding(positions, dim)
        self.token_type_embeddings, self.LayerNorm = nn.Embedding(types, dim), nn.LayerNorm(dim, eps=eps)
        self.padding = padding

    def forward(self, ids: Tensor, types: Tensor) -> Tensor:
        if self.padding is None:
            positions = torch.arange(ids.size(1), device=ids.device)
        else:
            real = (ids != self.padding).long()
            positions = torch.cumsum(real, dim=1) * real + self.padding
        x = self.word_embeddings(ids) + self.token_type_embeddings(types)
        return self.LayerNorm(x + self.position_embeddings(positions))


def check_token_rows(inputs: Tensor, longest: int, ranges: list[tuple[int, str]], mask: int) -> None:
    """Raises ``ValueError`` (one sentence) unless ``inputs``, ``(N, T)`` or rows stacked ``(N, R, T)`` (the shape and
    dtype checked by the caller), hold at least one token, ``T <= longest``, row ``i`` runs in ``0 .. size - 1`` for
    ``(size, what)`` the ``i``-th of ``ranges`` (``what`` names it), and the attention mask, row ``mask`` where given,
    keeps each sequence's first token (the one the encoder classifiers read)."""
    if inputs.shape[-1] == 0 or inputs.shape[0] == 0:
        raise ValueError("the sequences hold no tokens; give at least one sequence of at least one token")
    rows = inputs.reshape(inputs.shape[0], -1, inputs.shape[-1]).long()
    if rows.shape[-1] > longest:
        raise ValueError(f"sequences of {rows.shape[-1]} tokens are longer than its {longest} positions")
    for values, (size, what) in zip(rows.unbind(1), ranges):
        if int(values.min()) < 0 or int(values.max()) >= size:
            raise ValueError(f"{what} run from {int(values.min())} to {int(values.max())}, outside 0..{size - 1}")
    if rows.shape[1] > mask and not bool((rows[:, mask, 0] == 1).all()):
        raise ValueError("the attention mask leaves out a sequence's first token ([CLS], which the classifier "
                         "reads); the mask is 1 on tokens and 0 on padding at the end")  # fmt: skip


def attend(q: Tensor, k: Tensor, v: Tensor, heads: int, keep: Tensor) -> Tensor:
    """Multi-head attention of projected queries, keys and values ``(N, T, D)`` over the keys ``keep`` ``(N, 1, 1,
    T)`` holds true, scale ``hd^-1/2`` and no causal mask, the heads merged back: ``(N, T, D)``."""
    n, t, d = q.shape

    def split(x: Tensor) -> Tensor:
        return x.view(n, t, heads, d // heads).transpose(1, 2)

    out = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=keep)
    return out.transpose(1, 2).reshape(n, t, d)


class BertSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:
        return attend(self.query(x), self.key(x), self.value(x), self.heads, keep)


class BertSelfOutput(nn.Module):
    def __init__(self, inner: int, dim: int, eps: float):
        super().__init__()
        self.dense, self.LayerNorm = nn.Linear(inner, dim), nn.LayerNorm(dim, eps=eps)

    def forward(self, h: Tensor, x: Tensor) -> Tensor:
        return self.LayerNorm(self.dense(h) + x)


class BertAttention(nn.Module):
    def __init__(self, dim: int, heads: int, eps: float):
        super().__init__()
        self.self, self.output = BertSelfAttention(dim, heads), BertSelfOutput(dim, dim, eps)

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:
        return self.output(self.self(x, keep), x)


class BertIntermediate(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.dense, self.act = nn.Linear(dim, hidden), act

    def forward(self, x: Tensor) -> Tensor:
        return ACTIVATIONS[self.act](self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, eps: float, act: str):
        super().__init__()
        self.attention, self.intermediate = BertAttention(dim, heads, eps), BertIntermediate(dim, hidden, act)
        self.output = BertSelfOutput(hidden, dim, eps)

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:
        h = self.attention(x, keep)
        return self.output(self.intermediate(h), h)


class BertEncoder(nn.Module):
    def __init__(self, layers: int, *block: object):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(*block) for _ in range(layers))

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:
        for layer in self.layer:
            x = layer(x, keep)
        return x


class BertPooler(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dense = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.dense(x[:, 0]))


class BertBody(nn.Module):
    """Embeddings and blocks, with BERT's pooler (``pooler=True``: the first token's pooled state ``(N, D)``) or
    without it (RoBERTa's, ELECTRA's: every token's state ``(N, T, D)``; ``padding`` as in `BertEmbeddings`). Where the
    embeddings are narrower than the blocks (ELECTRA's ``embedding < dim``), a Linear ``embeddings_project`` widens
    them."""

    def __init__(self, vocab: int, positions: int, types: int, dim: int, layers: int, heads: int, hidden: int,
                 eps: float, act: str, pooler: bool = True, padding: int | None = None,
                 embedding: int | None = None):  # fmt: skip
        super().__init__()
        embedding = dim if embedding is None else embedding
        self.embeddings = BertEmbeddings(vocab, positions, types, embedding, eps, padding)
        if embedding != dim:
            self.embeddings_project = nn.Linear(embedding, dim)
        self.encoder = BertEncoder(layers, dim, heads, hidden, eps, act)
        if pooler:
            self.pooler = BertPooler(dim)

    def forward(self, ids: Tensor, types: Tensor, keep: Tensor) -> Tensor:
        e = self.embeddings(ids, types)
        h = self.encoder(self.embeddings_project(e) if hasattr(self, "embeddings_project") else e, keep)
        return self.pooler(h) if hasattr(self, "pooler") else h


class TokenClassifier(nn.Module):
    """What BERT's, RoBERTa's and ELECTRA's sequence classifiers share: the inputs they take, checked
    (`check_tokens`), and the forward from them (`_body` and ``classifier`` are the subclass's)."""

    takes_token_ids = True  # the command lines keep the data's integer X as it is for such a model
    # the model's name in messages, the encoder's attribute (its keys' prefix), transformers' class
    family, prefix, checkpoint = "BERT", "bert", "BertForSequenceClassification"

    def _body(self) -> BertBody:
        return getattr(self, self.prefix)

    @classmethod
    def _read(cls, state: Mapping[str, Tensor], head: str, heads: int) -> tuple[dict[str, Tensor], dict[str, int]]:
        """The tensors of a checkpoint's state dict (old index buffers dropped, ``LayerNorm.gamma``/``beta`` renamed
        ``weight``/``bias`` as transformers renames them) and the sizes they hold, as the constructors name them:
        ``vocab``, ``positions``, ``dim`` (the token table's width), ``layers``, ``heads``, ``classes`` (the rows of
        ``head``), ``hidden`` and ``types``.

        Raises:
            SpecError: an embedding table or the head's matrix is missing, or ``heads`` is not a positive integer.
        """
        # the LayerNorms' gamma and beta of checkpoints converted from TensorFlow, renamed as transformers renames them
        tensors = {k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias"): v
                   for k, v in state.items() if not is_index_buffer(k)}  # fmt: skip
        p = cls.prefix
        tables = [f"{p}.embeddings.{t}_embeddings.weight" for t in ("word", "position", "token_type")]
        for key in (*tables, head):
            if tensors.get(key, torch.empty(0)).dim() != 2:
                owner = f" (every {cls.checkpoint} checkpoint has one)" if key == head else ""
                raise SpecError(f"the {cls.family} state dict has no matrix {key}{owner}")
        vocab, dim = tensors[tables[0]].shape
        layers = len({int(m.group(1)) for k in tensors if (m := re.match(rf"{p}\.encoder\.layer\.(\d+)\.", k))})
        inter = tensors.get(f"{p}.encoder.layer.0.intermediate.dense.weight", torch.empty(0))
        if not positive_integer(heads):
            raise SpecError(f"heads must be a positive integer, got {heads!r}")
        sizes = {"vocab": vocab, "positions": tensors[tables[1]].shape[0], "dim": dim, "layers": layers,
                 "heads": heads, "classes": tensors[head].shape[0],
                 "hidden": inter.shape[0] if inter.dim() == 2 else 4 * dim, "types": tensors[tables[2]].shape[0]}
        return tensors, sizes

    @classmethod
    def _build(cls, tensors: dict[str, Tensor], sizes: dict[str, int], **options: object) -> TokenClassifier:
        """``cls(**sizes, **options)`` with ``tensors`` (`_read`'s) loaded, in the dtype of its token table.

        Raises:
            SpecError: the constructor refuses the sizes or options, or a tensor does not fit.
        """
        try:
            model = cls(**sizes, **options)
        except ValueError as failure:
            raise SpecError(str(failure)) from None
        what = f"{cls.family} with {sizes['layers']} blocks of width {sizes['dim']}"
        return load_fitting(model, tensors, what, set(), f"{cls.prefix}.embeddings.word_embeddings.weight")

    def _check_config_sizes(self, config: Mapping[str, object], **more: object) -> None:
        """Raises `SpecError` where ``config`` gives a size other than the tensors' (the vocabulary, positions, token
        types, widths, blocks, classes, and ``more``): the config describes another checkpoint."""
        body = self._body()
        layers, tables = body.encoder.layer, body.embeddings
        heads = [m for m in self.classifier.modules() if isinstance(m, nn.Linear)]
        held = {"vocab_size": tables.word_embeddings.num_embeddings,
                "max_position_embeddings": tables.position_embeddings.num_embeddings,
                "type_vocab_size": tables.token_type_embeddings.num_embeddings, "num_hidden_layers": len(layers),
                "hidden_size": heads[0].in_features, "num_labels": heads[-1].out_features,
                "intermediate_size": layers[0].intermediate.dense.out_features if len(layers) else None, **more}
        labels = config.get("id2label")  # transformers writes the labels' names, not their number
        if "num_labels" not in config and isinstance(labels, dict):
            config = {**config, "num_labels": len(labels)}
        check_config_sizes(config, held)

    @staticmethod
    def _check_config(config: Mapping[str, object], model: str) -> None:
        """Refuse a config asking for another function than the encoder classifiers compute (``model`` names it)."""
        for option, plain in (("position_embedding_type", "absolute"), ("is_decoder", False),
                              ("add_cross_attention", False)):  # fmt: skip
            if config.get(option, plain) != plain:
                raise SpecError(f"the config sets {option} to {config[option]!r}, which {model} does not compute (it "
                                f"has {option}={plain!r})")  # fmt: skip

    def _longest(self) -> int:
        """The most tokens a sequence may hold: the positions the model has."""
        return self._body().embeddings.position_embeddings.num_embeddings

    def check_tokens(self, inputs: Tensor) -> None:
        """Raises ``ValueError`` (one sentence) unless ``inputs`` are ``(N, T)``, ``(N, 2, T)`` or ``(N, 3, T)``
        integers: ids below the vocabulary size, token types below ``S``, a mask of 0 and 1 keeping each sequence's
        first token, and ``T`` at most the positions the model has."""
        embeddings = self._body().embeddings
        stacked = inputs.dim() == 2 or (inputs.dim() == 3 and inputs.shape[1] in (2, 3))
        if inputs.dtype not in TOKEN_DTYPES or not stacked:
            raise ValueError(f"{self.family} takes int64 (or int32) token ids (N, T), or ids, token types and "
                             f"attention mask stacked (N, 3, T) (or (N, 2, T) without the mask), not "
                             f"{tuple(inputs.shape)} {str(inputs.dtype).removeprefix('torch.')} values")  # fmt: skip
        ranges = [(embeddings.word_embeddings.num_embeddings, "token ids"),
                  (embeddings.token_type_embeddings.num_embeddings, "token types"), (2, "attention mask values")]
        check_token_rows(inputs, self._longest(), ranges, mask=2)

    def forward(self, inputs: Tensor) -> Tensor:
        # (N, T), (N, 2, T) or (N, 3, T) without a branch on the shape (fx traces no branch): the rows not given are
        # filled from (ids, types 0, mask 1)
        rows = inputs.reshape(inputs.size(0), -1, inputs.size(-1))
        full = torch.stack((rows[:, 0], torch.zeros_like(rows[:, 0]), torch.ones_like(rows[:, 0])), dim=1)
        rows = torch.cat((rows, full[:, rows.size(1) :]), dim=1)
        keep = (rows[:, 2] != 0)[:, None, None, :]  # (N, 1, 1, T): the keys each query attends
        return self.classifier(self._body()(rows[:, 0], rows[:, 1], keep))


class Bert(TokenClassifier):
    """A BERT encoder with its pooler and sequence classifier, as HuggingFace's ``BertForSequenceClassification``
    computes it in eval mode.

    Args:
        vocab: vocabulary size ``V`` (``vocab_size``).
        positions: the longest sequence ``P`` (``max_position_embeddings``).
        dim: width ``D`` (``hidden_size``), a multiple of ``heads``.
        layers: number of blocks (``num_hidden_layers``).
        heads: attention heads per block (``num_attention_heads``).
        classes: the classifier's outputs ``C`` (``num_labels``; 1 for regression).
        hidden: the MLP's width (``intermediate_size``); ``None``: ``4 * dim``.
        types: token types ``S`` (``type_vocab_size``).
        eps: the LayerNorms' epsilon (``layer_norm_eps``).
        act: the MLP's activation (``hidden_act``): ``"gelu"``, ``"relu"``, ``"gelu_new"`` or
            ``"gelu_pytorch_tanh"``.

    Inputs are ``(N, T)`` token ids, ``(N, 2, T)`` ids and token types, or ``(N, 3, T)`` ids, token types and
    attention mask (see the module's docstring), ``T <= P``; outputs are logits ``(N, C)``.
    """

    def __init__(self, vocab: int, positions: int, dim: int, layers: int, heads: int, classes: int = 2,
                 hidden: int | None = None, types: int = 2, eps: float = 1e-12, act: str = "gelu"):  # fmt: skip
        super().__init__()
        check_encoder_sizes(dim, heads, eps, act, vocab=vocab, positions=positions, layers=layers, classes=classes,
                            hidden=hidden, types=types)  # fmt: skip
        self.bert = BertBody(vocab, positions, types, dim, layers, heads, 4 * dim if hidden is None else hidden,
                             eps, act)  # fmt: skip
        self.classifier = nn.Linear(dim, classes)

    @classmethod
    def from_config(cls, config: Mapping[str, object], state: Mapping[str, Tensor]) -> Bert:
        """The model of a checkpoint's ``config.json`` (as a dict) and state dict: ``num_attention_heads``,
        ``layer_norm_eps`` (default 1e-12) and ``hidden_act`` (default ``gelu``); a config asking for another function
        (``position_embedding_type`` other than ``absolute``, a decoder) is refused.

        Raises:
            ValueError: a field missing or of the wrong kind, another function, or what `from_state_dict` raises.
        """
        heads, eps, act = encoder_config(config, "sharpness.Bert")
        cls._check_config(config, "sharpness.Bert")
        model = cls.from_state_dict(state, heads, eps, act)
        model._check_config_sizes(config)
        return model

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor], heads: int, eps: float = 1e-12, act: str = "gelu") -> Bert:
        """The model of a ``BertForSequenceClassification`` checkpoint's state dict (old ``position_ids`` and
        ``token_type_ids`` buffers are dropped, and ``LayerNorm.gamma``/``beta`` read as ``weight``/``bias``, as
        transformers reads them), its sizes read off the tensors; ``heads``
        (``num_attention_heads``), ``eps`` (``layer_norm_eps``) and ``act`` (``hidden_act``) are in its
        ``config.json``, which no shape holds.

        Raises:
            ValueError: a key is missing or unknown, a shape does not fit, or ``heads`` does not divide the width.
        """
        return cls._build(*cls._read(state, "classifier.weight", heads), eps=eps, act=act)


def check_encoder_sizes(dim: int, heads: int, eps: float, act: str, act_key: str = "hidden_act",
                        **sizes: int | None) -> None:  # fmt: skip
    """Raises ``ValueError`` unless every one of ``sizes`` (``vocab``, ``layers``, ``classes``, ...; ``None``: a default
    is taken) and ``dim`` is a positive integer, ``heads`` divides ``dim``, ``eps`` is a positive number and ``act``
    one of `ACTIVATIONS` (the encoder classifiers' constructors; ``act_key`` names the config's field in the
    message)."""
    for name, size in {"dim": dim, **sizes}.items():
        if size is not None and not positive_integer(size):
            raise ValueError(f"{name}={size!r} must be a positive integer")
    if not positive_integer(heads) or dim % heads:
        raise ValueError(f"dim={dim} is not a multiple of heads={heads}")
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise ValueError(f"{act_key} {act!r} is not one of {', '.join(ACTIVATIONS)}")
    if not positive_number(eps):
        raise ValueError(f"eps={eps} must be a positive finite number")


def encoder_config(config: Mapping[str, object], model: str) -> tuple[int, float, str]:
    """``(num_attention_heads, layer_norm_eps, hidden_act)`` of an encoder's ``config.json`` (defaults 1e-12 and
    ``gelu``, HuggingFace's), for `Bert` and `sharpness._hfvit.HFViT` (``model`` names it in the message).

    Raises:
        SpecError: a field missing or of the wrong kind, or an activation ``model`` does not compute.
    """
    heads, eps = config.get("num_attention_heads"), config.get("layer_norm_eps", 1e-12)
    if not positive_integer(heads) or not positive_number(eps):
        raise SpecError(f"the config's num_attention_heads must be a positive integer and its layer_norm_eps a "
                        f"positive number, got {heads!r} and {eps!r}")  # fmt: skip
    act = config.get("hidden_act", "gelu")
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise SpecError(f"the config's hidden_act is {act!r}; {model} computes {', '.join(ACTIVATIONS)}")
    return heads, float(eps), act


def encoder_from_spec(spec: str, state: Mapping[str, Tensor], family: str, model: type) -> nn.Module:
    """The model of a ``FAMILY:config=PATH`` (the checkpoint's ``config.json``, ``model.from_config``) or
    ``FAMILY:heads=H[,eps=E,act=A]`` SPEC from its checkpoint's ``state`` (sizes read off the tensors), for the
    encoder classifiers `Bert`, `sharpness._roberta.Roberta` (which also takes ``pad=ID``) and
    `sharpness._hfvit.HFViT`, whose ``from_state_dict(state, heads, ...)`` read the rest off the tensors (an option
    not given takes the class's default: ``eps`` 1e-12, HuggingFace's, but RoBERTa's 1e-5).

    Raises:
        SpecError: an unknown or malformed option, neither ``config`` nor ``heads``, an unreadable config, or a state
            dict that does not fit.
    """
    options, config = checkpoint_spec(spec, family)
    integers, heads_key = getattr(model, "spec_integers", ()), getattr(model, "heads_key", "num_attention_heads")
    try:
        if config is not None:
            return model.from_config(config, state)
        if set(options) - {"heads", "eps", "act", *integers} or "heads" not in options:
            more = "".join(f", {name}" for name in integers)
            raise SpecError(f"give the checkpoint's config.json ({family}:config=PATH) or its number of heads "
                            f"({heads_key}), e.g. {family}:heads=12; the other options are eps, act{more}")
        try:
            heads = int(options["heads"])
            given = {name: int(options[name]) for name in integers if name in options}
            if "eps" in options:
                given["eps"] = float(options["eps"])
        except ValueError:
            raise SpecError(f"heads{''.join(f' and {n}' for n in integers)} are integers and eps a number") from None
        if heads < 1 or not positive_number(given.get("eps", 1.0)):
            raise SpecError("heads is a positive integer and eps a positive finite number")
        if "act" in options:
            given["act"] = options["act"]
        return model.from_state_dict(state, heads, **given)
    except ValueError as failure:
        raise SpecError(f"model spec {spec!r}: {failure}") from None
