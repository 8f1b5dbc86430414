"""Attention written with ``torch.einsum`` (manifolds._einsum): read as the matrix products it is.

Each einsum block has a twin written with ``@`` and transposes. Same weights: same function, same group (factor by
factor), same invariant sharpness. The group's elements keep the outputs to 1e-10 in float64, those built here by hand
included, while a wrong one does not; einsums that are no matrix product are left alone and say so.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx, nn

import manifolds
from manifolds._einsum import as_matrix_products, rewritable
from manifolds._graph import trace_network
from sharpness import MEASURES, Objective, dense_hessian, euclidean_sharpness

D, H, HD, T, C = 8, 2, 4, 5, 3  # width, heads, head size, tokens, classes

# (scores, weighted values, how the heads are laid out): every pair computes the same attention
STYLES = {
    "heads_first": ("bhid,bhjd->bhij", "bhij,bhjd->bhid", "bhtd"),
    "tokens_first": ("bihd,bjhd->bhij", "bhij,bjhd->bihd", "bthd"),
    "spaced": ("b h i d, b h j d -> b h i j", "b h i j, b h j d -> b h i d", "bhtd"),
    "keys_first": ("bhjd,bhid->bhij", "bhjd,bhij->bhid", "bhtd"),  # operands in the other order
    "scores_transposed": ("bhid,bhjd->bhji", "bhji,bhjd->bhid", "bhtd"),  # scores stored (keys, queries)
}


class Block(nn.Module):
    """A pre-LN attention block and a LayerNorm-ReLU classifier; ``style`` names the einsums, ``None`` writes the same
    attention with ``@``."""

    def __init__(self, style: str | None, projection_einsum: bool = False):
        super().__init__()
        self.style, self.projection_einsum = style, projection_einsum
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(D, 12), nn.Linear(12, C)

    def project(self, layer: nn.Linear, y: torch.Tensor) -> torch.Tensor:
        if self.projection_einsum:  # the layer's weight and bias read directly: `y W^T + b` as an einsum
            return torch.einsum("btd,ed->bte", y, layer.weight) + layer.bias
        return layer(y)

    def heads(self, t: torch.Tensor, layout: str) -> torch.Tensor:
        b, n, _ = t.shape
        t = t.view(b, n, H, HD)
        return t.transpose(1, 2) if layout == "bhtd" else t

    def forward(self, x):
        b, n, _ = x.shape
        y = self.ln1(x)
        if self.style is None:
            q, k, v = (self.heads(self.project(f, y), "bhtd") for f in (self.q, self.k, self.v))
            a = (q @ k.transpose(-2, -1) * HD**-0.5).softmax(-1)
            o = (a @ v).transpose(1, 2).reshape(b, n, D)
        else:
            scores, values, layout = STYLES[self.style]
            q, k, v = (self.heads(self.project(f, y), layout) for f in (self.q, self.k, self.v))
            operands = (k, q) if self.style == "keys_first" else (q, k)
            s = torch.einsum(scores, *operands) * HD**-0.5
            axis = -2 if self.style == "scores_transposed" else -1
            a = s.softmax(axis)
            o = torch.einsum(values, *((v, a) if self.style == "keys_first" else (a, v)))
            o = o.reshape(b, n, D) if layout == "bthd" else o.transpose(1, 2).reshape(b, n, D)
        x = x + self.o(o)
        return self.fc2(torch.relu(self.fc1(self.ln2(x)))).mean(1)


def make(style, projection_einsum=False, seed=0):
    torch.manual_seed(seed)
    model = Block(style, projection_einsum).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(6, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    return model, x


def _twin(model: Block, style) -> Block:
    twin = copy.deepcopy(model)
    twin.style = style
    return twin


def _factor_summary(sym):
    """What each factor moves, without the label (the twin's labels name ``@`` products) and without which side of a
    query/key pair is read as the query (``A^T`` on one side and ``A^-1`` on the other is the same group either way)."""
    return sorted((f.kind, f.dim, tuple(sorted((b.name, b.axis, tuple(b.index)) for b in f.blocks)))
                  for f in sym.factors)  # fmt: skip


@pytest.mark.parametrize("style", STYLES)
def test_the_group_is_the_one_of_the_matmul_twin(style):
    model, x = make(style)
    twin = _twin(model, None)
    with torch.no_grad():
        assert (model(x) - twin(x)).abs().max() < 1e-12  # the same function
    sym, ref = manifolds.transformer_symmetry(model, x), manifolds.transformer_symmetry(twin, x)
    # per head GL(4) on query/key and on value/output (4 * 16), ln1's scale traded against q, k and v together (8),
    # ln2's against fc1 (8), fc1's ReLU units (12)
    assert sym.dim == ref.dim == 4 * HD * HD + D + D + 12, sym.describe()
    assert _factor_summary(sym) == _factor_summary(ref)
    assert "'einsum'" in sym.describe() and STYLES[style][0] in sym.describe()


def _elements_keep_the_function(sym, model, x, seed: int, moves: bool = False) -> None:
    """Three random elements of ``sym`` (seeded by ``seed``) keep ``model``'s outputs on ``x`` to 1e-10; where
    ``moves``, each also moves some parameter by more than 0.1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        ref = model(x)
        for _ in range(3):
            moved = sym.transformed(model, sym.random_element(1.0, g))
            assert (moved(x) - ref).abs().max() < 1e-10
            if moves:
                assert max((p - q).abs().max() for p, q in zip(model.parameters(), moved.parameters())) > 0.1


@pytest.mark.parametrize("style", ["tokens_first", "keys_first", "scores_transposed"])
def test_random_elements_keep_the_function(style):
    model, x = make(style)
    _elements_keep_the_function(manifolds.transformer_symmetry(model, x), model, x, 3, moves=True)


def _gl(g):
    return torch.eye(HD, dtype=torch.float64) + 0.5 * torch.randn(HD, HD, generator=g, dtype=torch.float64)


def test_hand_built_elements_keep_the_function_and_a_wrong_one_does_not():
    model, x = make("tokens_first")
    g = torch.Generator().manual_seed(4)
    a, b = [_gl(g) for _ in range(H)], [_gl(g) for _ in range(H)]

    def moved(wrong_key: bool):
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        for h in range(H):
            rows = slice(h * HD, (h + 1) * HD)
            key = a[h].T if wrong_key else torch.linalg.inv(a[h])  # right: q -> q A, k -> k A^-T
            for name, m in (("q", a[h].T), ("k", key), ("v", b[h].T)):
                sd[f"{name}.weight"][rows] = m @ sd[f"{name}.weight"][rows]
                sd[f"{name}.bias"][rows] = m @ sd[f"{name}.bias"][rows]
            sd["o.weight"][:, rows] = sd["o.weight"][:, rows] @ torch.linalg.inv(b[h]).T
        twin = copy.deepcopy(model)
        twin.load_state_dict(sd)
        return twin

    with torch.no_grad():
        ref = model(x)
        assert (moved(False)(x) - ref).abs().max() < 1e-10
        assert (moved(True)(x) - ref).abs().max() > 1e-3


@pytest.mark.parametrize(
    "style,projection_einsum", [("tokens_first", False), ("keys_first", True), ("scores_transposed", False)]
)
def test_the_r_operator_reads_einsums_and_gets_the_dense_hessian(style, projection_einsum):
    model, x = make(style, projection_einsum)
    y = torch.randint(0, C, (x.shape[0],), generator=torch.Generator().manual_seed(10))
    obj = Objective(model, nn.CrossEntropyLoss(), (x, y))
    assert obj.hvp_strategy() == "rop"  # not autograd's graph reuse: the einsums are read as matmuls
    H = dense_hessian(obj)
    g = torch.Generator().manual_seed(11)
    for _ in range(2):
        v = torch.randn(obj.layout.size, generator=g, dtype=torch.float64)
        torch.testing.assert_close(obj.hvp(v), H @ v, rtol=0, atol=1e-10 * float(H.abs().max()))


def test_the_invariant_sharpness_is_the_twins_and_does_not_move():
    model, x = make("tokens_first")
    y = torch.randint(0, C, (x.shape[0],), generator=torch.Generator().manual_seed(5))
    loss = nn.CrossEntropyLoss()
    sym = manifolds.transformer_symmetry(model, x)
    moved = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(6)))
    values = {}
    for name, m in (("einsum", model), ("matmul", _twin(model, None)), ("moved", moved)):
        obj = Objective(m, loss, (x, y))
        values[name] = float(MEASURES["symmetry"].sharpness(obj, k=1, progress=False).eigenvalues[0])
    assert max(values.values()) - min(values.values()) <= 1e-8 * max(values.values()), values
    before = euclidean_sharpness(model, loss, (x, y), progress=False).value
    after = euclidean_sharpness(moved, loss, (x, y), progress=False).value
    assert max(before, after) / min(before, after) > 2, (before, after)


@pytest.mark.parametrize("style", ["heads_first", None])
def test_einsum_projections_are_linear_layers(style):
    # `einsum("btd,ed->bte", y, W) + b` is `y @ W^T + b`: the query, key and value layers written so keep every factor
    model, x = make(style, projection_einsum=True)
    twin = copy.deepcopy(model)
    twin.projection_einsum = False
    with torch.no_grad():
        assert (model(x) - twin(x)).abs().max() < 1e-12
    sym, ref = manifolds.transformer_symmetry(model, x), manifolds.transformer_symmetry(twin, x)
    assert sym.dim == ref.dim == 4 * HD * HD + D + D + 12, sym.describe()
    assert _factor_summary(sym) == _factor_summary(ref)
    moved = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(9)))
    with torch.no_grad():
        assert (moved(x) - model(x)).abs().max() < 1e-10


class _Einsums(nn.Module):
    """One einsum of two data tensors, given its equation and how the operands are made from ``x`` ``(N, T, D)``."""

    def __init__(self, equation: str, make_operands):
        super().__init__()
        self.equation, self.make_operands = equation, make_operands
        self.lin, self.out = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = self.lin(x)
        return torch.einsum(self.equation, *self.make_operands(h, x))


REWRITTEN = {
    "bid,bjd->bij": lambda h, x: (h, x),
    "bjd,bid->bij": lambda h, x: (h, x),
    "bid,bjd->bji": lambda h, x: (h, x),
    "btd,de": lambda h, x: (h, x[0].T),  # implicit output: the letters seen once, sorted ('bet')
    "ed,btd->bte": lambda h, x: (x[0, :, :D].T[:D, :], h),
    "bij,bjd->bid": lambda h, x: (torch.einsum("bid,bjd->bij", h, x), x),
    # broadcast letters (multi-query attention): the key or value without a heads axis
    "bhid,bjd->bhij": lambda h, x: (h.view(2, D, 2, D // 2).transpose(1, 2), x[..., : D // 2]),
    "bhij,bjd->bhid": lambda h, x: (torch.einsum("bid,bjd->bij", h, x).view(2, 1, D, D).expand(2, 3, D, D), x),
    "hid,bjd->bhij": lambda h, x: (h[0].view(D, 2, D // 2).transpose(0, 1), x[..., : D // 2]),
}
LEFT = {  # equation: (operands, the reason given)
    "...id,...jd->...ij": (lambda h, x: (h, x), "it has an ellipsis"),
    "bid,bjd,bke->bij": (lambda h, x: (h, x, h), "it has 3 operands, not two tensors"),
    "bii,bid->bd": (lambda h, x: (h, x), "a letter is repeated in one term"),  # tokens and width are both D here
    "bid,bjd->bj": (lambda h, x: (h, x), "it sums an axis of one operand alone"),
    "bid,bjd->bijd": (lambda h, x: (h, x), "it is not one matrix product per batch entry"),  # no contraction
    "bid,bjd->ij": (lambda h, x: (h, x), "it is not one matrix product per batch entry"),  # two letters summed
}


def _graph_of(model, x):
    traced = trace_network(model, x)
    assert traced.graph is not None, traced.failure
    return traced.graph


@pytest.mark.parametrize("equation", list(REWRITTEN))
def test_rewritten_graphs_compute_the_same(equation):
    model = _Einsums(equation, REWRITTEN[equation]).double().eval()
    x = torch.randn(2, D, D, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    graph = _graph_of(model, x)
    einsums = [n for n in graph.nodes if rewritable(n)]
    rewritten = as_matrix_products(graph)
    assert einsums and rewritten is not graph
    assert not any(n.op == "call_function" and "einsum" in str(n.target) for n in rewritten.nodes)
    with torch.no_grad():
        expected = model(x)
        got = fx.GraphModule(model, rewritten)(x)
    assert got.shape == expected.shape and (got - expected).abs().max() < 1e-12
    for n in rewritten.nodes:  # every new node has its true shape
        if "shape" in n.meta and n.op == "call_method":
            assert n.meta["shape"] is not None


@pytest.mark.parametrize("equation", list(LEFT))
def test_other_einsums_are_left_and_pin_with_a_reason(equation):
    operands, reason = LEFT[equation]
    model = _Einsums(equation, operands).double().eval()
    x = torch.randn(2, D, D, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    graph = _graph_of(model, x)
    assert as_matrix_products(graph) is graph
    text = manifolds.transformer_symmetry(model, x).describe()
    assert f"product 'einsum' '{equation}'" in text and f"is not read as a matrix product: {reason}" in text, text


def test_broadcast_sizes_are_left():
    model = _Einsums("bid,bjd->bij", lambda h, x: (h, x[:1])).double().eval()  # b of size 2 against 1
    x = torch.randn(2, D, D, dtype=torch.float64)
    graph = _graph_of(model, x)
    assert not any(rewritable(n) for n in graph.nodes)


class _SelfProduct(nn.Module):
    """``einsum("bij,bjk->bik", a, a)`` (or ``a @ a``) of one Linear's output, read by an output Linear: the same
    tensor is the weights and the values, so no value/output factor exists."""

    def __init__(self, use_einsum: bool):
        super().__init__()
        self.use_einsum = use_einsum
        self.v, self.o = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x):
        a = self.v(x)  # (N, 2 tokens, 2 features)
        return self.o(torch.einsum("bij,bjk->bik", a, a) if self.use_einsum else a @ a)


@pytest.mark.parametrize("use_einsum", [True, False])
def test_one_tensor_as_both_factors_claims_nothing(use_einsum):
    torch.manual_seed(0)
    model = _SelfProduct(use_einsum).double()
    x = torch.randn(3, 2, 2, dtype=torch.float64)
    sym = manifolds.transformer_symmetry(model, x)
    assert not [f for f in sym.factors if f.kind == "GL"], sym.describe()
    assert "one tensor is both factors of the product" in sym.describe()


class _FeaturesFirst(nn.Module):
    """Values weighted by an einsum whose output puts the features before the query tokens (``"bij,bjd->bdi"``), or
    the same written with ``@``: the product read is ``v^T P^T``."""

    def __init__(self, use_einsum: bool):
        super().__init__()
        self.use_einsum = use_einsum
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        a = torch.einsum("bid,bjd->bij", self.q(x), self.k(x)).softmax(-1)
        v = self.v(x)
        o = torch.einsum("bij,bjd->bdi", a, v) if self.use_einsum else v.transpose(1, 2) @ a.transpose(1, 2)
        return self.o(o.transpose(1, 2))


@pytest.mark.parametrize("use_einsum", [True, False])
def test_values_times_weights_transposed_keep_the_value_factor(use_einsum):
    torch.manual_seed(1)
    model = _FeaturesFirst(use_einsum).double()
    x = torch.randn(3, T, D, dtype=torch.float64)
    sym = manifolds.transformer_symmetry(model, x)
    labels = [f.label for f in sym.factors if f.kind == "GL"]
    assert sum("value/output" in s for s in labels) == 1 and sum("query/key" in s for s in labels) == 1, labels
    assert sym.dim == 2 * D * D, sym.describe()  # one head of width D: GL(8) twice
    _elements_keep_the_function(sym, model, x, 2)


def test_pins_name_the_einsum_the_user_wrote():
    class Units(nn.Module):  # ReLU units of an einsum layer whose output order puts them before the tokens: pinned
        def __init__(self):
            super().__init__()
            self.w, self.o = nn.Parameter(torch.randn(6, 4)), nn.Linear(5, 2)

        def forward(self, x):
            return self.o(torch.relu(torch.einsum("btd,hd->bht", x, self.w)).transpose(1, 2).mean(2))

    text = manifolds.transformer_symmetry(Units(), torch.randn(3, 5, 4)).describe()
    assert "output of 'einsum' 'btd,hd->bht' (graph node 'einsum'): 6 channel(s)" in text, text
    assert "it feeds the axis order of 'einsum' 'btd,hd->bht'" in text and "'transpose'" not in text, text


class MultiQuery(nn.Module):
    """Multi-query attention: ``H`` query heads read one key head and one value head, which have no heads axis; the
    product broadcasts them (written with ``unsqueeze``, ``[:, None]`` or an einsum)."""

    def __init__(self, style: str):
        super().__init__()
        self.style = style
        self.q, self.k, self.v, self.o = nn.Linear(D, D), nn.Linear(D, HD), nn.Linear(D, HD), nn.Linear(D, D)
        self.head = nn.Linear(D, C)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.q(x).view(b, t, H, HD).transpose(1, 2), self.k(x), self.v(x)
        if self.style == "einsum":
            a = torch.einsum("bhid,bjd->bhij", q, k).softmax(-1)
            o = torch.einsum("bhij,bjd->bhid", a, v)
        elif self.style == "einsum_keys_rows":  # scores stored (keys, queries), the output with the heads after tokens
            a = torch.einsum("bhid,bjd->bhji", q, k).softmax(-2)
            o = torch.einsum("bhji,bjd->bihd", a, v).transpose(1, 2)
        elif self.style == "unsqueeze":
            a = (q @ k.unsqueeze(1).transpose(-2, -1)).softmax(-1)
            o = a @ v.unsqueeze(1)
        else:
            a = (q @ k[:, None].transpose(-2, -1)).softmax(-1)
            o = a @ v[:, None]
        return self.head(self.o(o.transpose(1, 2).reshape(b, t, D)).mean(1))


def _multi_query(style, seed=12):
    torch.manual_seed(seed)
    return MultiQuery(style).double().eval(), torch.randn(5, T, D, dtype=torch.float64)


@pytest.mark.parametrize("style", ["einsum", "einsum_keys_rows", "unsqueeze", "none"])
def test_multi_query_attention_shares_one_factor_across_the_query_heads(style):
    model, x = _multi_query(style)
    sym = manifolds.transformer_symmetry(model, x)
    labels = [f.label for f in sym.factors if f.kind == "GL"]
    assert any("query/key (key head shared by 2 query heads)" in s for s in labels), sym.describe()
    assert any("value/output (value head shared by 2 query heads)" in s for s in labels), sym.describe()
    # one GL(4) on query/key and one on value/output: 16 + 16; o's units, which the head reads on a linear path, are
    # pinned (the value/output factors move o's inputs, and the metric weighs a tensor's rows or columns, not both)
    assert sym.dim == 2 * HD * HD, sym.describe()
    assert "its inputs are moved by a GL factor (attention's value/output" in sym.describe(), sym.describe()
    _elements_keep_the_function(sym, model, x, 13)


def test_multi_query_hand_built_elements_and_a_wrong_one():
    model, x = _multi_query("einsum")
    g = torch.Generator().manual_seed(14)

    def moved(a_per_head):
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        for h, a in enumerate(a_per_head):  # every query head's rows by A^T
            rows = slice(h * HD, (h + 1) * HD)
            sd["q.weight"][rows], sd["q.bias"][rows] = a.T @ sd["q.weight"][rows], a.T @ sd["q.bias"][rows]
        inv = torch.linalg.inv(a_per_head[0])  # the one key head by A^-1
        sd["k.weight"], sd["k.bias"] = inv @ sd["k.weight"], inv @ sd["k.bias"]
        b = _gl(g)  # the value head by B^T, the output columns of every query head by B^-T
        sd["v.weight"], sd["v.bias"] = b.T @ sd["v.weight"], b.T @ sd["v.bias"]
        for h in range(H):
            cols = slice(h * HD, (h + 1) * HD)
            sd["o.weight"][:, cols] = sd["o.weight"][:, cols] @ torch.linalg.inv(b).T
        twin = copy.deepcopy(model)
        twin.load_state_dict(sd)
        return twin

    a = _gl(g)
    with torch.no_grad():
        assert (moved([a] * H)(x) - model(x)).abs().max() < 1e-10
        assert (moved([a, _gl(g)])(x) - model(x)).abs().max() > 1e-3  # the query heads must share the key's A


@pytest.mark.parametrize("style", ["einsum", "unsqueeze"])
def test_multi_query_products_are_the_r_operators_and_exact(style):
    model, x = _multi_query(style)
    y = torch.randint(0, C, (x.shape[0],), generator=torch.Generator().manual_seed(15))
    obj = Objective(model, nn.CrossEntropyLoss(), (x, y))
    assert obj.hvp_strategy() == "rop"
    H_ = dense_hessian(obj)
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(16), dtype=torch.float64)
    torch.testing.assert_close(obj.hvp(v), H_ @ v, rtol=0, atol=1e-10 * float(H_.abs().max()))
