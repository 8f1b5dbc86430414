"""Features of a linear layer read only by other linear layers (a bottleneck without activation, LoRA's ``B A``):
``GL(k)`` on them, ``W1 <- M^T W1``, ``b1 <- M^T b1``, ``W2 <- W2 M^-T``, and where one layer with a bias of its own
reads them directly, the shift ``b1 + u``, ``b2 - W2 u`` besides. Checked against hand-built elements, the dense
quotient reference, and the cases that keep diagonal scales instead (a reader with units of its own, a GL factor on
the other side of a tensor)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from test_transformer_quotient import _params, _with, dense_quotient_spectrum, measure_value
from torch import nn

import manifolds
import sharpness
from sharpness import Rescalings, Solver, verify_invariance
from sharpness.measures._draws import Draws

N, D_IN, K, HIDDEN, D_OUT = 12, 6, 4, 5, 3


class Bottleneck(nn.Module):
    """``head(relu(x + up(dropout(down(x)))))``: ``down``'s 4 features read by ``up`` alone, through dropout; ``up``'s
    outputs added to the input, so they have no units of their own."""

    def __init__(self, bias: bool = True):
        super().__init__()
        self.down, self.drop = nn.Linear(D_IN, K, bias=bias), nn.Dropout(0.1)
        self.up, self.head = nn.Linear(K, D_IN), nn.Linear(D_IN, D_OUT)

    def forward(self, x):
        return self.head(torch.relu(x + self.up(self.drop(self.down(x)))))


class ReluAfter(Bottleneck):
    """``head(relu(up(down(x))))``: ``up``'s ReLU units are free, so ``down``'s features keep positive scales."""

    def forward(self, x):
        return self.head(torch.relu(self.up(self.down(x))))


class SumAfter(Bottleneck):
    """``head(relu(up(down(x)) + side(x)))``: the sum's ReLU units move ``up``'s rows in the diagonal rescaling group
    alone (the factor search reads no units through a sum)."""

    def __init__(self):
        super().__init__()
        self.side = nn.Linear(D_IN, D_IN)

    def forward(self, x):
        return self.head(torch.relu(self.up(self.down(x)) + self.side(x)))


class TokensAfter(Bottleneck):
    """``head(relu(up(down(x))).reshape(-1, D_IN))`` on ``(N, T, D_IN)``: the reshape of the tokens pins the diagonal
    rescaling group, while the factor search follows it and frees ``up``'s ReLU units."""

    def forward(self, x):
        return self.head(torch.relu(self.up(self.down(x))).reshape(-1, D_IN))


class LoRA(nn.Module):
    """A frozen layer plus a rank-2 adapter ``scale * B(A(dropout(x)))``, then GELU and a head."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(D_IN, HIDDEN)
        self.lora_A, self.lora_B = nn.Linear(D_IN, 2, bias=False), nn.Linear(2, HIDDEN, bias=False)
        self.drop, self.head = nn.Dropout(0.1), nn.Linear(HIDDEN, D_OUT)
        self.base.requires_grad_(False)

    def forward(self, x):
        return self.head(nn.functional.gelu(self.base(x) + self.lora_B(self.lora_A(self.drop(x))) * 0.5))


class Padded(nn.Module):
    """``down``'s features padded with a zero row along the tokens before ``up``: GL still, no shift."""

    def __init__(self):
        super().__init__()
        self.down, self.up, self.head = nn.Linear(D_IN, K), nn.Linear(K, HIDDEN), nn.Linear(HIDDEN, D_OUT)

    def forward(self, x):
        h = self.up(nn.functional.pad(self.down(x), (0, 0, 0, 1)))
        return self.head(nn.functional.gelu(h).mean(1))


class OutputIntoLinear(nn.Module):
    """Attention whose output projection is read by a Linear alone: its columns are the value/output factors'."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.proj, self.head = nn.Linear(4, HIDDEN), nn.Linear(HIDDEN, D_OUT)

    def forward(self, x):
        return self.head(torch.relu(self.proj(self.attn(x, x, x, need_weights=False)[0])).mean(1))


class HandAttention(nn.Module):
    """Attention written by hand whose value reads a Linear ``pre`` alone and whose output projection ``o`` a Linear
    ``proj`` reads alone: the value's rows and ``o``'s columns are the value/output factors', so neither pair is GL."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.pre, self.v, self.o = (nn.Linear(4, 4) for _ in range(5))
        self.proj, self.head = nn.Linear(4, HIDDEN), nn.Linear(HIDDEN, D_OUT)

    def forward(self, x):
        n, t, _ = x.shape
        q, k, v = (t.view(n, t.shape[1], 2, 2).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(self.pre(x))))
        h = (q @ k.transpose(-2, -1)).softmax(-1) @ v
        return self.head(torch.relu(self.proj(self.o(h.transpose(1, 2).reshape(n, t, 4)))).mean(1))


def _make(cls, seed: int = 0):
    torch.manual_seed(seed)
    model = cls().double().eval()
    with torch.no_grad():  # away from the default initialization
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(N, D_IN, dtype=torch.float64)
    return model, nn.CrossEntropyLoss(), (x, torch.arange(N) % D_OUT)


def _pairs(sym):
    return [f for f in sym.factors if "read by linear layers alone" in f.label]


def _invertible(g, k):
    """A well-conditioned random matrix that moves the Euclidean geometry: ``(I + R / 2) diag(exp(1.5 s))``."""
    scales = torch.exp(1.5 * torch.randn(k, generator=g, dtype=torch.float64))
    return (torch.eye(k, dtype=torch.float64) + 0.5 * torch.randn(k, k, generator=g, dtype=torch.float64)) * scales


def test_a_bottleneck_gets_gl_on_its_features_and_the_bias_shift():
    model, _, (x, _) = _make(Bottleneck)
    sym = manifolds.transformer_symmetry(model, x)
    (pair,) = _pairs(sym)
    assert (pair.kind, pair.size, pair.dim) == ("GL", K, K * K)
    assert {(b.name, b.axis, b.how) for b in pair.blocks} == {
        ("down.weight", 0, "T"), ("down.bias", 0, "T"), ("up.weight", 1, "invT")}  # fmt: skip
    assert pair.absorption is not None and (pair.absorption[0].name, pair.absorption[1]) == ("down.bias", "up.bias")
    assert sym.dim == K * K  # the sum with the input and the head's outputs pin the rest
    assert "and the shift down.bias rows 0:4 <- (.) + u, up.bias <- (.) - W u" in sym.describe(), sym.describe()


def _hand_moved(model, g):
    """By hand: ``M`` on ``down``'s outputs and a shift ``u`` of its bias taken out of ``up``'s bias."""
    m, u = _invertible(g, K), torch.randn(K, generator=g, dtype=torch.float64)
    sd = {n: p.detach().clone() for n, p in model.named_parameters()}
    sd["down.weight"] = m.T @ sd["down.weight"]
    sd["down.bias"] = m.T @ sd["down.bias"] + u
    sd["up.bias"] = sd["up.bias"] - sd["up.weight"] @ torch.linalg.inv(m.T) @ u
    sd["up.weight"] = sd["up.weight"] @ torch.linalg.inv(m).T
    return _with(model, sd)


def test_the_symmetry_measure_equals_the_dense_reference_and_ignores_the_group_while_euclidean_moves():
    model, loss, data = _make(Bottleneck)
    sym = manifolds.transformer_symmetry(model, data[0])
    reference = dense_quotient_spectrum(model, loss, data, manifolds.symmetry_metric(sym, _params(model)), sym)
    before = measure_value(model, loss, data, k=2)
    assert np.allclose(before, reference[::-1][:2], rtol=1e-8, atol=0), (before, reference[::-1][:2])
    euclidean = sharpness.euclidean_sharpness(model, loss, data, dtype=torch.float64, progress=False).value
    for twin in (_hand_moved(model, torch.Generator().manual_seed(1)),
                 sym.transformed(model, sym.random_element(2.5, torch.Generator().manual_seed(2)))):  # fmt: skip
        with torch.no_grad():
            assert (twin(data[0]) - model(data[0])).abs().max() < 1e-12
        after = measure_value(twin, loss, data, k=2)
        assert np.allclose(after, before, rtol=1e-8, atol=0), (before, after)
        moved = sharpness.euclidean_sharpness(twin, loss, data, dtype=torch.float64, progress=False).value
        assert max(moved, euclidean) / min(moved, euclidean) > 1.5, (euclidean, moved)


def test_lora_adapters_get_gl_of_their_rank_beside_a_frozen_layer():
    model, loss, data = _make(LoRA)
    sym = manifolds.transformer_symmetry(model, data[0])
    (pair,) = _pairs(sym)
    assert pair.size == 2 and pair.absorption is None  # no biases to shift
    assert {b.name for b in pair.blocks} == {"lora_A.weight", "lora_B.weight"}
    before = measure_value(model, loss, data)
    g = torch.Generator().manual_seed(3)
    m = _invertible(g, 2)
    sd = {n: p.detach().clone() for n, p in model.named_parameters()}
    sd["lora_A.weight"] = m.T @ sd["lora_A.weight"]
    sd["lora_B.weight"] = sd["lora_B.weight"] @ torch.linalg.inv(m).T
    twin = _with(model, sd)
    with torch.no_grad():
        assert (twin(data[0]) - model(data[0])).abs().max() < 1e-12
    after = measure_value(twin, loss, data)
    assert np.allclose(after, before, rtol=1e-8, atol=0), (before, after)
    trainable = sym.restricted(_params(model))
    reference = dense_quotient_spectrum(model, loss, data, manifolds.symmetry_metric(trainable, _params(model)),
                                        trainable)  # fmt: skip
    assert np.allclose(before, reference[-1:], rtol=1e-8, atol=0), (before, reference[-1:])


def test_a_zero_pad_keeps_gl_but_not_the_shift():
    model, _, _ = _make(Padded)
    x = torch.randn(N, 3, D_IN, dtype=torch.float64)
    sym = manifolds.transformer_symmetry(model, x)
    (pair,) = _pairs(sym)
    assert pair.size == K and pair.absorption is None  # a shift of `down`'s bias would not reach the padded row
    twin = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(4)))
    with torch.no_grad():
        assert (twin(x) - model(x)).abs().max() < 1e-12


def test_without_biases_there_is_no_shift():
    model, _, (x, _) = _make(lambda: Bottleneck(bias=False))
    (pair,) = _pairs(manifolds.transformer_symmetry(model, x))
    assert pair.absorption is None and {b.name for b in pair.blocks} == {"down.weight", "up.weight"}


def test_an_output_projection_read_by_a_linear_keeps_its_columns_to_the_value_output_factors():
    model, _, _ = _make(OutputIntoLinear)
    x = torch.randn(N, 3, 4, dtype=torch.float64)
    sym = manifolds.transformer_symmetry(model, x)
    assert not _pairs(sym), sym.describe()
    assert sum("value/output" in f.label for f in sym.factors) == 2
    twin = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(5)))
    with torch.no_grad():
        assert (twin(x) - model(x)).abs().max() < 1e-12
    manifolds.symmetry_metric(sym, _params(model))  # built: no tensor moved on both sides by GL factors


def test_pairs_meeting_value_output_factors_keep_diagonal_scales():
    model, loss, data = _make(HandAttention)
    x = torch.randn(N, 3, 4, dtype=torch.float64)
    sym = manifolds.transformer_symmetry(model, x)
    assert not _pairs(sym), sym.describe()
    assert [f.kind for f in sym.factors if f.label.startswith("units of module 'pre'")] == ["diagonal"]
    assert any("'o'" in p.where and "GL factor" in p.reason for p in sym.pins), sym.describe()
    twin = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(6)))
    with torch.no_grad():
        assert (twin(x) - model(x)).abs().max() < 1e-12
    manifolds.symmetry_metric(sym, _params(model))


def test_a_reader_with_units_of_its_own_keeps_positive_scales_and_the_node_claims():
    """``up``'s ReLU units are in the diagonal rescaling group, whose ``node`` draws the symmetry measure must ignore:
    ``down``'s features keep their scales (a unit's metric weighs its row by the row's norm, which GL on the row's
    columns would change), and every kind verify draws leaves the measure as it is."""
    model, loss, data = _make(ReluAfter)
    sym = manifolds.transformer_symmetry(model, data[0])
    assert not _pairs(sym) and sym.dim == K + D_IN, sym.describe()
    rep = verify_invariance(model, loss, data, ["symmetry"], rescalings=Rescalings(("node", "layer", "group"), 1),
                            solver=Solver(tol=1e-10), progress=False)  # fmt: skip
    assert rep.outcome == "passed" and all(rep.verdict("symmetry", k) == "invariant" for k in rep.kinds), rep.table()


def test_units_in_the_diagonal_group_alone_keep_the_features_scales():
    model, loss, data = _make(SumAfter)
    sym = manifolds.transformer_symmetry(model, data[0])
    assert not _pairs(sym), sym.describe()
    rep = verify_invariance(model, loss, data, ["symmetry"], rescalings=Rescalings(("node", "group"), 1),
                            solver=Solver(tol=1e-10), progress=False)  # fmt: skip
    assert rep.outcome == "passed" and all(rep.verdict("symmetry", k) == "invariant" for k in rep.kinds), rep.table()


def test_units_the_factor_search_frees_keep_the_features_scales():
    model, loss, _ = _make(TokensAfter)
    x = torch.randn(N, 3, D_IN, dtype=torch.float64)
    sym = manifolds.transformer_symmetry(model, x)
    assert not _pairs(sym) and sym.diagonal_dim == 0, sym.describe()
    assert [f.kind for f in sym.factors if f.label.startswith("units of module 'up'")] == ["diagonal"], sym.describe()
    twin = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(8)))
    with torch.no_grad():
        assert (twin(x) - model(x)).abs().max() < 1e-12
    manifolds.symmetry_metric(sym, _params(model))


def test_relu_between_keeps_diagonal_units():
    """``down``'s features through a ReLU: only positive scalings commute with it, the pair is not GL."""

    class Relu(Bottleneck):
        def forward(self, x):
            return self.head(torch.relu(self.up(torch.relu(self.down(x)))))

    model, _, (x, _) = _make(Relu)
    sym = manifolds.transformer_symmetry(model, x)
    assert not _pairs(sym) and all(f.kind == "diagonal" for f in sym.factors), sym.describe()
    copy.deepcopy(sym)  # (the group is a plain value)


def test_verify_draws_the_pair_and_its_bias_shift_with_the_whole_group_not_as_attention():
    """A network whose only GL factor is a pair has no attention to test; its ``group`` copies move the pair and shift
    ``down``'s bias against ``up``'s, and the symmetry measure stays while Euclidean sharpness moves."""
    model, loss, data = _make(Bottleneck)
    params = _params(model)
    draws = Draws(manifolds.analyze(model, data[0]), params, None)
    assert "attention" not in draws.kinds and "group" in draws.kinds, draws.kinds
    assert "no attention head" in draws.untestable["attention"]
    drawn = draws.draw("group", params, 1.0, torch.Generator().manual_seed(7), lambda t: None)
    twin = _with(model, drawn)
    m_t = drawn["down.weight"] @ torch.linalg.pinv(params["down.weight"])  # the element's M^T (rows of full rank)
    shift = drawn["down.bias"] - m_t @ params["down.bias"]  # the drawn u
    assert float(shift.abs().min()) > 1e-3, shift
    torch.testing.assert_close(drawn["up.bias"], params["up.bias"] - drawn["up.weight"] @ shift, rtol=0, atol=1e-12)
    with torch.no_grad():
        assert (twin(data[0]) - model(data[0])).abs().max() < 1e-12
    rep = verify_invariance(model, loss, data, ["euclidean", "symmetry"], rescalings=Rescalings(("group",), trials=1),
                            solver=Solver(tol=1e-10), progress=False)  # fmt: skip
    verdicts = (rep.verdict("symmetry", "group"), rep.verdict("euclidean", "group"))
    assert verdicts == ("invariant", "changes"), rep.table()
    assert rep.group["attention_factors"] == 0


class AttentionThenBottleneck(nn.Module):
    """Self-attention, then an adapter ``up(down(h))`` added to its input ``h``: a pair with its bias shift."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(D_IN, 2, batch_first=True)
        self.down, self.up, self.head = nn.Linear(D_IN, K), nn.Linear(K, D_IN), nn.Linear(D_IN, D_OUT)

    def forward(self, x):
        h = x + self.attn(x, x, x, need_weights=False)[0]
        return self.head(torch.relu(h + self.up(self.down(h))).mean(1))


def test_attention_draws_leave_the_pair_and_its_bias_alone():
    model, _, _ = _make(AttentionThenBottleneck)
    x = torch.randn(N, 3, D_IN, dtype=torch.float64)
    params = _params(model)
    draws = Draws(manifolds.analyze(model, x), params, None)
    assert "attention" in draws.kinds and len(_pairs(draws.symmetry)) == 1, draws.symmetry.describe()
    for kind, moves in (("attention", False), ("group", True)):
        drawn = draws.draw(kind, params, 1.0, torch.Generator().manual_seed(9), lambda t: None)
        for name in ("down.weight", "down.bias", "up.bias"):
            assert bool((drawn[name] - params[name]).abs().max() > 1e-3) == moves, (kind, name)
        with torch.no_grad():
            assert (_with(model, drawn)(x) - model(x)).abs().max() < 1e-12


def test_more_features_than_a_reader_gives_or_the_layer_reads_keep_their_units():
    """k above a reader's outputs or the first layer's inputs: the product has rank below k, the orbit degenerates and
    the metric's Gram matrices are singular, so the features keep their scales (a 4-feature layer before 3 classes)."""
    g = torch.Generator().manual_seed(10)
    x, y = torch.randn(12, 6, generator=g, dtype=torch.float64), torch.arange(12) % 3
    for model in (nn.Sequential(nn.Linear(6, 4), nn.Dropout(0.1), nn.Linear(4, 3)),
                  nn.Sequential(nn.Linear(6, 3), nn.Linear(3, 5), nn.Linear(5, 3))):  # fmt: skip
        model = model.double().eval()
        sym = manifolds.transformer_symmetry(model, x)
        assert not _pairs(sym) or max(f.size for f in _pairs(sym)) <= 3, sym.describe()
        value = measure_value(model, nn.CrossEntropyLoss(), (x, y))
        assert bool(torch.isfinite(value).all()) and float(value[0]) > 0
    wide = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 6), nn.Tanh()).double().eval()  # k = 5 above 3 inputs
    assert not _pairs(manifolds.transformer_symmetry(wide, torch.randn(4, 3, dtype=torch.float64)))


def test_a_pair_after_layers_only_the_diagonal_group_moves_keeps_its_units():
    """A convolution's channels before a Linear pair: a GL on the pair would pin, tensor by tensor, the channel classes
    the convolution shares with the flattened layer (no factor stands for them), while the measures claim them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(12, 4), nn.Linear(4, 3),
                          nn.Linear(3, 3)).double().eval()  # fmt: skip
    x, y = torch.randn(6, 2, 4, 4, dtype=torch.float64), torch.arange(6) % 3
    sym = manifolds.transformer_symmetry(model, x)
    assert not _pairs(sym), sym.describe()
    rep = verify_invariance(model, nn.CrossEntropyLoss(), (x, y), ["symmetry"],
                            rescalings=Rescalings(("node", "layer", "group"), 1), solver=Solver(tol=1e-10),
                            dtype=torch.float64, progress=False)  # fmt: skip
    assert rep.outcome == "passed", rep.table()


def test_functional_dropout_in_training_is_no_identity():
    """``F.dropout(h, 0.5)`` masks each entry even in eval mode (its ``training`` defaults to True): scales of the
    features commute with it, maps mixing them do not. With ``training=False`` it is the identity."""

    class Functional(Bottleneck):
        def __init__(self, training: bool):
            super().__init__()
            self.training_dropout = training

        def forward(self, x):
            h = nn.functional.dropout(self.down(x), 0.5, training=self.training_dropout)
            return self.head(torch.relu(x + self.up(h)))

    for training, pairs in ((True, 0), (False, 1)):
        model, _, (x, _) = _make(lambda: Functional(training))  # noqa: B023 - called at once
        assert len(_pairs(manifolds.transformer_symmetry(model, x))) == pairs, training


class TokenTable(nn.Module):
    """Token ids -> a table of width 3 -> ``pin`` (3 -> 5) -> a tanh residual block -> ``pout`` (5 -> 3) -> the output
    layer, tied to the table (OPT-350m's layout in small) or not."""

    def __init__(self, tied: bool = True):
        super().__init__()
        self.emb, self.pin = nn.Embedding(7, 3), nn.Linear(3, 5, bias=False)
        self.mix, self.pout, self.head = nn.Linear(5, 5), nn.Linear(5, 3), nn.Linear(3, 7, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.pin(self.emb(ids))
        return self.head(self.pout(h + torch.tanh(self.mix(h)))).transpose(1, 2)


def _tokens():
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 7, (4, 5), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def test_a_tied_token_table_gets_one_gl_with_both_projections_checked_against_the_dense_reference():
    model, _, _ = _make(TokenTable)
    data, loss = _tokens(), nn.CrossEntropyLoss()
    sym = manifolds.transformer_symmetry(model, data[0])
    (table,) = _pairs(sym)
    assert {(b.name, b.axis, b.how) for b in table.blocks} == {
        ("emb.weight", 1, "T"), ("pin.weight", 1, "inv"), ("pout.weight", 0, "invT"), ("pout.bias", 0, "invT")}
    assert sym.dim == 9 and "tied output layer 'head'" in table.label, sym.describe()
    reference = dense_quotient_spectrum(model, loss, data, manifolds.symmetry_metric(sym, _params(model)), sym)
    before = measure_value(model, loss, data, k=2)
    assert np.allclose(before, reference[::-1][:2], rtol=1e-8, atol=0), (before, reference[::-1][:2])
    m = _invertible(torch.Generator().manual_seed(12), 3)  # by hand: E M^T, pin M^-1, M^-T pout
    sd = {n: p.detach().clone() for n, p in model.named_parameters()}
    sd["emb.weight"], sd["pin.weight"] = sd["emb.weight"] @ m.T, sd["pin.weight"] @ torch.linalg.inv(m)
    inv_t = torch.linalg.inv(m).T
    sd["pout.weight"], sd["pout.bias"] = inv_t @ sd["pout.weight"], inv_t @ sd["pout.bias"]
    twin = _with(model, sd)
    assert twin.head.weight is twin.emb.weight
    euclidean = sharpness.euclidean_sharpness(model, loss, data, dtype=torch.float64, progress=False).value
    for moved in (twin, sym.transformed(model, sym.random_element(1.5, torch.Generator().manual_seed(13)))):
        with torch.no_grad():
            assert (moved(data[0]) - model(data[0])).abs().max() < 1e-12
        assert np.allclose(measure_value(moved, loss, data, k=2), before, rtol=1e-8, atol=0)
        e = sharpness.euclidean_sharpness(moved, loss, data, dtype=torch.float64, progress=False).value
        assert max(e, euclidean) / min(e, euclidean) > 1.5, (euclidean, e)


def test_an_untied_token_table_and_its_output_pair_get_a_gl_each():
    model, _, _ = _make(lambda: TokenTable(tied=False))
    ids, _ = _tokens()
    sym = manifolds.transformer_symmetry(model, ids)
    labels = sorted(f.label for f in _pairs(sym))
    assert labels == ["features of module 'pout' (Linear) (read by linear layers alone)",
                      "features of the embedding table 'emb.weight' (read by linear layers alone)"], sym.describe()
    twin = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(14)))
    with torch.no_grad():
        assert (twin(ids) - model(ids)).abs().max() < 1e-12


def test_a_token_table_read_by_a_sum_or_shared_otherwise_is_pinned():
    """The table's features added to positions (GPT-2, OPT-125m), or the table read directly besides the lookup: no
    basis change keeps the function, the features are pinned with the reason."""

    class Summed(TokenTable):
        def __init__(self):
            super().__init__()
            self.positions = nn.Parameter(torch.randn(5, 3))

        def forward(self, ids):
            return self.head(self.pout(self.pin(self.emb(ids) + self.positions))).transpose(1, 2)

    class ReadDirectly(TokenTable):
        def forward(self, ids):
            h = self.pin(self.emb(ids))
            return (self.head(self.pout(h + torch.tanh(self.mix(h)))) + self.emb.weight.sum()).transpose(1, 2)

    ids = _tokens()[0]
    for cls in (Summed, ReadDirectly):
        model, _, _ = _make(cls)
        sym = manifolds.transformer_symmetry(model, ids)
        assert not _pairs(sym), sym.describe()
        twin = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(15)))
        with torch.no_grad():
            assert (twin(ids) - model(ids)).abs().max() < 1e-12
    assert any(p.where.startswith("features of the embedding table") and "not read by Linears alone" in p.reason
               for p in manifolds.transformer_symmetry(_make(Summed)[0], ids).pins)  # fmt: skip


def test_a_table_whose_rows_span_less_than_its_width_has_no_gl():
    """A padding row stays zero: 3 rows of width 3, one of them padding, span 2 features, so the table's column Gram
    matrix is singular. Structurally refused with the reason; a table singular by its values (two equal rows) is
    refused by the measure, naming it, where it returned 1.3e7 before."""

    class Padded(TokenTable):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(3, 3, padding_idx=0)
            self.head = nn.Linear(3, 3, bias=False)
            self.head.weight = self.emb.weight

    ids = torch.randint(0, 3, (4, 5), generator=torch.Generator().manual_seed(16))
    model, loss = _make(Padded)[0], nn.CrossEntropyLoss()
    sym = manifolds.transformer_symmetry(model, ids)
    assert not _pairs(sym) and any("a padding row among them stays zero" in p.reason for p in sym.pins)
    model.emb.padding_idx = None
    with torch.no_grad():
        model.emb.weight[0] = model.emb.weight[1]  # rank 2 by its values
    assert len(_pairs(manifolds.transformer_symmetry(model, ids))) == 1
    with pytest.raises(manifolds.UnsupportedModelError, match=r"undefined at this point: emb\.weight"):
        measure_value(model, loss, (ids, torch.roll(ids, -1, dims=1)))


def test_a_table_dropped_for_the_diagonal_group_is_said_to_be():
    """The table's features reach ``pin`` alone, whose ReLU units (a max over the tokens after them) the diagonal group
    moves: the table's GL would take them from it, so it is dropped, and `describe` says so."""

    class Pooled(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.pin = nn.Embedding(7, 3), nn.Linear(3, 5)
            self.l2, self.out = nn.Linear(5, 5), nn.Linear(5, 7)

        def forward(self, ids):
            return self.out(torch.tanh(self.l2(torch.relu(self.pin(self.emb(ids))).amax(1, keepdim=True))))

    sym = manifolds.transformer_symmetry(_make(Pooled)[0], _tokens()[0])
    assert not _pairs(sym)
    assert "moved by the diagonal rescaling group instead: features of the embedding table 'emb.weight'" in \
        sym.describe(), sym.describe()  # fmt: skip


class PooledLoRA(nn.Module):
    """A LayerNorm's tokens averaged, then read by a head and by a rank-2 adapter ``B(A(.))`` beside it (``"linear"``),
    or also by a tanh (``"tanh"``): the mean's two (three) readers share the LayerNorm's scale."""

    def __init__(self, how: str = "linear"):
        super().__init__()
        self.how, self.norm, self.head = how, nn.LayerNorm(D_IN), nn.Linear(D_IN, D_OUT)
        self.lora_A, self.lora_B = nn.Linear(D_IN, 2, bias=False), nn.Linear(2, D_OUT, bias=False)

    def forward(self, x):
        pooled = self.norm(x).mean(1)
        out = self.head(pooled) + self.lora_B(self.lora_A(pooled))
        return out + torch.tanh(pooled)[:, :D_OUT] if self.how == "tanh" else out


def test_a_mean_read_by_several_linears_trades_the_norm_s_scale_against_all_of_them():
    """The LayerNorm's 6 scales traded against the head's and the adapter's columns through the mean over the tokens,
    and GL(2) on the adapter's features: the symmetry measure is the dense reference's and unchanged under an
    element built by hand; a third reader through a tanh pins the scales and leaves the adapter its GL."""
    torch.manual_seed(0)
    model = PooledLoRA().double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(N, 3, D_IN, dtype=torch.float64)
    loss, data = nn.CrossEntropyLoss(), (x, torch.arange(N) % D_OUT)
    sym = manifolds.transformer_symmetry(model, x)
    (pair,) = _pairs(sym)
    assert pair.size == 2 and sym.dim == D_IN + 4, sym.describe()
    norm = [f for f in sym.factors if "affine scale of module 'norm'" in f.label]
    assert len(norm) == 1 and {(b.name, b.axis) for b in norm[0].blocks} >= {("head.weight", 1), ("lora_A.weight", 1)}
    before = measure_value(model, loss, data, k=2)
    reference = dense_quotient_spectrum(model, loss, data, manifolds.symmetry_metric(sym, _params(model)), sym)
    assert np.allclose(before, reference[::-1][:2], rtol=1e-8, atol=0), (before, reference[::-1][:2])
    g = torch.Generator().manual_seed(4)
    m, c = _invertible(g, 2), torch.exp(torch.randn(D_IN, generator=g, dtype=torch.float64))
    sd = {n: p.detach().clone() for n, p in model.named_parameters()}
    sd["norm.weight"], sd["norm.bias"] = sd["norm.weight"] * c, sd["norm.bias"] * c
    sd["head.weight"] = sd["head.weight"] / c
    sd["lora_A.weight"] = m.T @ (sd["lora_A.weight"] / c)
    sd["lora_B.weight"] = sd["lora_B.weight"] @ torch.linalg.inv(m).T
    twin = _with(model, sd)
    with torch.no_grad():
        assert (twin(x) - model(x)).abs().max() < 1e-12
    assert np.allclose(measure_value(twin, loss, data, k=2), before, rtol=1e-8, atol=0)
    tanh = manifolds.transformer_symmetry(PooledLoRA("tanh").double().eval(), x)
    assert len(_pairs(tanh)) == 1 and tanh.dim == 4, tanh.describe()
