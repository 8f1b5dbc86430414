"""R-operator products of token models: tables read at integer ids (``nn.Embedding``, ``F.embedding``), a table tied to
the output layer (a language model's head), frozen tables and padding rows, and HuggingFace's GPT-2.

Every product is checked in float64 against the dense Hessian (`tests/test_rop_graph._check`: kept state, and
streamed in chunks of 3) to 1e-10 relative; GPT-2 against ``torch.func``'s forward-over-reverse products.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_rop_graph import _check
from torch import nn

from manifolds import UnsupportedModelError
from sharpness import GPT2, Objective, dense_hessian
from sharpness.products._rop_gradient import shared_gradient

VOCAB, WIDTH, TOKENS, CLASSES = 5, 4, 6, 3


def _tokens(n: int = 7, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n, TOKENS), generator=torch.Generator().manual_seed(seed))


def _off_init(model: nn.Module, seed: int = 1) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    model = model.double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.eval()


class Classifier(nn.Module):
    """Token and position tables, a LayerNorm, a mean over the tokens and a classifier."""

    def __init__(self, padding_idx: int | None = None):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH, padding_idx=padding_idx)
        self.positions = nn.Embedding(TOKENS, WIDTH)
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.size(1), device=ids.device))
        return self.head(torch.tanh(self.norm(x)).mean(1))


class TiedLM(nn.Module):
    """Next-token logits ``(N, V, T)`` from a table the output layer shares (module calls)."""

    def __init__(self, padding_idx: int | None = None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, padding_idx=padding_idx)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.mix(self.embed(ids)))).transpose(1, 2)


class FunctionalTiedLM(nn.Module):
    """The same written with functions of the table: ``F.embedding`` and ``x @ W.T``."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.empty(VOCAB, WIDTH))
        self.mix = nn.Linear(WIDTH, WIDTH)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(self.mix(F.embedding(ids, self.table))) @ self.table.T).transpose(1, 2)


def _frozen_tokens() -> nn.Module:
    model = _off_init(Classifier())
    model.tokens.weight.requires_grad_(False)
    return model


MODELS = {
    "classifier": lambda: _off_init(Classifier()),
    "tied": lambda: _off_init(TiedLM()),
    "functional_tied": lambda: _off_init(FunctionalTiedLM()),
    "frozen_table": _frozen_tokens,
    "padding_row": lambda: _off_init(Classifier(padding_idx=0)),
    "tied_padding_row": lambda: _off_init(TiedLM(padding_idx=2)),
}


def _targets(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    if isinstance(model, Classifier):
        return torch.randint(0, CLASSES, (ids.shape[0],), generator=g)
    return torch.randint(0, VOCAB, ids.shape, generator=g)


@pytest.mark.parametrize("name", MODELS)
def test_token_models_get_the_r_operator_products_of_the_dense_hessian(name):
    model = MODELS[name]()
    ids = _tokens()
    assert (ids == 0).any() and (ids == 2).any() and ids.unique().numel() < ids.numel()  # padding rows read; ids repeat
    obj = _check(model, ids, _targets(model, ids))
    # the gradient the gradient start reads is the objective's own pass here (a table keeps no error)
    torch.testing.assert_close(shared_gradient(obj, "rop"), obj.gradient(), rtol=1e-12, atol=1e-14)


def test_a_padding_row_is_held_fixed_as_autograd_holds_it():
    """The padding row's block of the Hessian is zero through the table (autograd's gradient holds it fixed), but a
    tied output layer still reads it: the products equal double backward's, and ``jvp`` (forward mode, which moves
    the padding row) is refused with the reason."""
    for model, pad in ((_off_init(Classifier(padding_idx=0)), 0), (_off_init(TiedLM(padding_idx=2)), 2)):
        ids = _tokens()
        obj = Objective(model, nn.CrossEntropyLoss(), (ids, _targets(model, ids)))
        H = dense_hessian(obj)
        table = next(k for k in obj.params if k.endswith(("tokens.weight", "embed.weight")))
        start = obj.layout.slice(table).start
        rows = slice(start + pad * WIDTH, start + (pad + 1) * WIDTH)
        g = torch.Generator().manual_seed(9)
        for _ in range(2):
            v = torch.randn(obj.layout.size, generator=g, dtype=torch.float64)
            torch.testing.assert_close(obj.hvp(v), obj.hvp(v, "double_backward"), rtol=0, atol=1e-12)
        if isinstance(model, Classifier):
            assert float(H[rows].abs().max()) == 0.0  # read only by the table: held fixed
        else:
            assert float(H[rows].abs().max()) > 1e-3  # the output layer reads it
        with pytest.raises(ValueError, match="padding row"):
            obj.hvp(torch.zeros(obj.layout.size, dtype=torch.float64), "jvp")


def test_a_tied_table_given_under_the_output_layer_s_name():
    model = _off_init(TiedLM())
    ids = _tokens()
    params = {"out.weight" if k == "embed.weight" else k: t for k, t in model.named_parameters()}
    obj = Objective(model, nn.CrossEntropyLoss(), (ids, _targets(model, ids)), params=params)
    # kept under its first name, the one the model's analysis uses
    assert obj.hvp_strategy() == "rop" and "embed.weight" in obj.params and "out.weight" not in obj.params
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    torch.testing.assert_close(obj.hvp(v), obj.hvp(v, "double_backward"), rtol=0, atol=1e-12)


def test_a_table_with_max_norm_gets_autograd_s_products():
    model = _off_init(Classifier())
    model.tokens = nn.Embedding(VOCAB, WIDTH, max_norm=10.0).double()
    obj = Objective(model, nn.CrossEntropyLoss(), (_tokens(), torch.zeros(7, dtype=torch.long)))
    assert obj.hvp_strategy() == "graph"


@pytest.mark.parametrize("option", ["scale_grad_by_freq", "sparse"])
def test_tables_whose_gradient_is_no_loss_s_are_refused_unless_frozen(option):
    """``scale_grad_by_freq`` divides the gradient by the ids' counts (its double backward is not symmetric: 0.63
    relative asymmetry measured); sparse gradients do not add over chunks. The function is the same without them."""
    model = _off_init(Classifier())
    model.tokens = nn.Embedding(VOCAB, WIDTH, **{option: True}).double()
    data = (_tokens(), torch.zeros(7, dtype=torch.long))
    with pytest.raises(UnsupportedModelError, match=f"module 'tokens' is an nn.Embedding with {option}=True"):
        Objective(model, nn.CrossEntropyLoss(), data)
    model.tokens.weight.requires_grad_(False)  # a frozen table: a constant, whatever its gradient would be
    obj = Objective(model, nn.CrossEntropyLoss(), data)
    assert obj.hvp_strategy() == "rop"


class FunctionalPadded(nn.Module):
    """``F.embedding(ids, W, padding_idx=1)`` with ``W`` tied to the output (``x @ W.T``)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.empty(VOCAB, WIDTH))
        self.mix = nn.Linear(WIDTH, WIDTH)

    def forward(self, ids):
        return (torch.tanh(self.mix(F.embedding(ids, self.table, padding_idx=1))) @ self.table.T).transpose(1, 2)


def test_a_functional_padding_row_is_held_fixed_and_refuses_jvp(monkeypatch):
    model = _off_init(FunctionalPadded())
    ids = _tokens()
    obj = _check(model, ids, _targets(model, ids))
    with pytest.raises(ValueError, match="the embedding at graph node 'embedding' holds its padding row fixed"):
        obj.hvp(torch.zeros(obj.layout.size, dtype=torch.float64), "jvp")
    # where autograd streams (a layer's hook keeps the R-operator off; one on the model itself would leave no graph to
    # read the functional padding row from), "auto" never even times jvp
    model.mix.register_forward_hook(lambda m, i, o: o)
    streamed = Objective(model, nn.CrossEntropyLoss(), (ids, _targets(model, ids)), chunk_size=3, memory_budget=1)
    timed = []
    monkeypatch.setattr(Objective, "_hvp_jvp", lambda self, *a: timed.append(a))
    assert streamed.hvp_strategy() == "double_backward" and not timed


class Functional(nn.Module):
    """A table read by ``F.embedding`` with ``options``, or by ``torch.embedding`` (the op under it) with a padding
    row, then a tanh and a classifier."""

    def __init__(self, **options):
        super().__init__()
        self.options = options
        self.table = nn.Parameter(torch.empty(VOCAB, WIDTH))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, ids):
        if self.options.get("op"):
            h = torch.embedding(self.table, ids, 1)
        else:
            h = F.embedding(ids, self.table, **self.options)
        return self.head(torch.tanh(h).mean(1))


@pytest.mark.parametrize("option", ["scale_grad_by_freq", "sparse"])
def test_functional_tables_whose_gradient_is_no_loss_s_are_refused(option):
    model = _off_init(Functional(**{option: True}))
    obj = Objective(model, nn.CrossEntropyLoss(), (_tokens(), torch.zeros(7, dtype=torch.long)))
    for derivative in (lambda: obj.hvp(torch.zeros(obj.layout.size, dtype=torch.float64)), obj.gradient):
        with pytest.raises(UnsupportedModelError, match=f"graph node 'embedding' passes {option}=True"):
            derivative()


def test_the_op_under_f_embedding_with_a_padding_row_refuses_jvp():
    model = _off_init(Functional(op=True))
    obj = Objective(model, nn.CrossEntropyLoss(), (_tokens(), torch.arange(7) % CLASSES))
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    torch.testing.assert_close(obj.hvp(v), dense_hessian(obj) @ v, rtol=0, atol=1e-12)  # autograd's, the row fixed
    with pytest.raises(ValueError, match="holds its padding row fixed"):
        obj.hvp(v, "jvp")


def test_jvp_is_allowed_where_the_padded_table_is_not_differentiated():
    model = _off_init(Classifier(padding_idx=0))
    model.tokens.weight.requires_grad_(False)
    ids = _tokens()
    obj = Objective(model, nn.CrossEntropyLoss(), (ids, _targets(model, ids)))
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    torch.testing.assert_close(obj.hvp(v, "jvp"), dense_hessian(obj) @ v, rtol=0, atol=1e-12)


def test_gpt2_products_are_the_r_operator_s():
    state = load_file(str(Path(__file__).parent / "data" / "gpt2_tiny_hf.safetensors"))
    state.pop("__input_ids"), state.pop("__logits")
    model = GPT2.from_state_dict(state, heads=2, classes_last=False)
    vocab = model.transformer.wte.num_embeddings
    g = torch.Generator().manual_seed(0)
    ids, targets = torch.randint(0, vocab, (6, 8), generator=g), torch.randint(0, vocab, (6, 8), generator=g)
    obj = Objective(model, nn.CrossEntropyLoss(), (ids, targets))
    assert obj.hvp_strategy() == "rop" and "lm_head.weight" not in obj.params  # the tied head reads the table
    V = torch.randn(2, obj.layout.size, generator=g, dtype=torch.float64)
    for v in V:
        ref = obj.hvp(v, "jvp")
        torch.testing.assert_close(obj.hvp(v), ref, rtol=0, atol=1e-12 * float(ref.abs().max()))
    torch.testing.assert_close(obj.hvp_batch(V), torch.stack([obj.hvp(v, "double_backward") for v in V]), rtol=0,
                               atol=1e-12 * float(V.abs().max()))  # fmt: skip


class PositionArithmetic(nn.Module):
    """Attention scores plus a diagonal bonus computed from integer positions by ``torch.sub(..., alpha=A)``: with
    ``A = 2**53 + 1`` (no float holds it) the call is replayed as it is; with ``A = 3`` it is read as a sum of integer
    tensors."""

    def __init__(self, alpha: int):
        super().__init__()
        self.alpha = alpha
        self.emb, self.q, self.k, self.v = nn.Embedding(VOCAB, WIDTH), *(nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        x = self.emb(ids)
        t = torch.arange(ids.size(1), device=ids.device)
        gap = torch.sub(t[:, None] * self.alpha, t[None, :], alpha=self.alpha)  # alpha (i - j), exact in int64
        s = self.q(x) @ self.k(x).transpose(1, 2) + (gap == 0).to(x.dtype)
        return self.out(torch.softmax(s, -1) @ self.v(x)).transpose(1, 2)


@pytest.mark.parametrize("alpha", [3, 2**53 + 1])
def test_integer_position_arithmetic_is_replayed_exactly(alpha):
    model = _off_init(PositionArithmetic(alpha))
    ids = _tokens()
    obj = Objective(model, nn.CrossEntropyLoss(), (ids, _targets(model, ids)))
    assert obj.hvp_strategy() == "rop"
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ref = obj.hvp(v, "double_backward")
    torch.testing.assert_close(obj.hvp(v), ref, rtol=0, atol=1e-12 * float(ref.abs().max()))
