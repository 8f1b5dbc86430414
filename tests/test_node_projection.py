"""The node-wise horizontal projection (manifolds._node_symmetry, issue 33): the orthogonal projection on the entries
the node metric keeps when some weights are exactly zero, and the Gram matrix solved by its structure (sparse part
plus rank-one terms) equal to a dense solve."""

import pytest
import torch
from cases import mlp
from torch import nn

from manifolds import NodeScaleQuotient, NodeSymmetry, ParamLayout, analyze
from manifolds import _node_symmetry as node_symmetry
from sharpness import Objective, Solver, dense_hessian, dense_spectrum, invariant_sharpness
from sharpness._resnet import BasicBlock


def _zeroed_mlp() -> nn.Sequential:
    """A LeakyReLU MLP 4-6-5-3 with exact zeros: the first biases (zero-initialised), a few scattered weights, a
    hidden unit with no nonzero weight at all (its scale acts on nothing), and two units joined only by each other's
    weight (a pair of scales that moves nothing when they move together)."""
    torch.manual_seed(0)
    model = mlp([4, 6, 5, 3], activation=lambda: nn.LeakyReLU(0.2)).double().eval()
    w0, b0, w1, b1, w2 = model[0].weight, model[0].bias, model[2].weight, model[2].bias, model[4].weight
    with torch.no_grad():
        b0.zero_()
        w0[2, 1] = w1[3, 4] = w2[0, 2] = 0.0
        w0[0], w1[:, 0] = 0.0, 0.0  # unit 0 of the first hidden layer: nothing left
        w0[1], w1[:, 1], w1[1], b1[1], w2[:, 1] = 0.0, 0.0, 0.0, 0.0, 0.0  # units 1 and 1: only w1[1, 1] left
        w1[1, 1] = 0.7
    return model


def _bn_cnn(zero: bool) -> nn.Sequential:
    """conv-BN-ReLU twice, then a Linear: with ``zero``, the BatchNorm shifts and conv biases at their init (0)."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4),
                          nn.ReLU(), nn.Flatten(), nn.Linear(16, 3)).double()  # fmt: skip
    with torch.no_grad():
        for m in model:
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.copy_(0.0 if zero else torch.randn(m.bias.shape))
            elif isinstance(m, nn.Conv2d) and zero:
                m.bias.zero_()
    return model.eval()


class _Residual(nn.Module):
    def __init__(self, zero: bool):
        super().__init__()
        torch.manual_seed(2)
        self.stem = nn.Conv2d(1, 4, 3, padding=1, bias=False)
        self.blocks = nn.Sequential(BasicBlock(4, 4, 1), BasicBlock(4, 6, 2))
        self.fc = nn.Linear(6, 3)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, nn.BatchNorm2d) and not zero:
                    m.bias.normal_()
            if zero:
                self.stem.weight[0, 0, 1, 1] = 0.0

    def forward(self, x):
        return self.fc(self.blocks(torch.relu(self.stem(x))).mean(dim=(2, 3)))


def _models():
    return {
        "mlp": lambda: mlp([5, 7, 6, 3, 3]).double().eval(),  # hidden blocks 7x6 and 6x3: at 20, one rank-one
        "mlp_zeros": _zeroed_mlp,
        "cnn_bn": lambda: _bn_cnn(False),
        "cnn_bn_zeros": lambda: _bn_cnn(True),
        "residual": lambda: _Residual(False).double().eval(),
        "residual_zeros": lambda: _Residual(True).double().eval(),
    }


_INPUTS = {"mlp": (5,), "mlp_zeros": (4,), "cnn_bn": (1, 6, 6), "cnn_bn_zeros": (1, 6, 6), "residual": (1, 4, 4),
           "residual_zeros": (1, 4, 4)}  # fmt: skip


def _reference_projector(model: nn.Module, example: torch.Tensor) -> torch.Tensor:
    """``(n, n)``: the orthogonal projector on the kept (nonzero) entries orthogonal to the whitened orbit tangent
    ``sign(w) J c``, with ``J`` read off the group's own action by forward differentiation (independent of
    `NodeSymmetry`)."""
    group = analyze(model, example_input=example).group
    params = {k: p.detach() for k, p in model.named_parameters()}
    layout = ParamLayout.from_tensors(params)
    w = layout.flatten(params)

    def acted(c):
        return layout.flatten({k: v for k, v in group.act(params, c).items() if k in params})

    tangent = torch.func.jacfwd(acted)(torch.zeros(group.dim, dtype=w.dtype))  # (n, dim): w * J
    kept = w != 0
    vertical = tangent[kept] / w[kept].abs()[:, None]
    u, s, _ = torch.linalg.svd(vertical, full_matrices=False)
    basis = u[:, s > 1e-10 * s.max()]
    inside = torch.eye(int(kept.sum()), dtype=w.dtype) - basis @ basis.T
    out = torch.zeros(w.numel(), w.numel(), dtype=w.dtype)
    index = kept.nonzero().flatten()
    out[index[:, None], index[None, :]] = inside
    return out


def test_node_projection_is_orthogonal_on_the_kept_entries():
    """Regression: J kept rows at zero weights, so the projection was not the orthogonal one of the tangent space
    the metric uses (the node measure drifted off the dense reference); a scale acting on nothing, and two scales
    that only move together, must not break the solve."""
    model = _zeroed_mlp()
    example = torch.randn(2, 4, dtype=torch.float64)
    quotient = NodeScaleQuotient(dict(model.named_parameters()), analyze(model, example_input=example))
    n = quotient.layout.size
    ours = quotient.whitened_projection(torch.eye(n, dtype=torch.float64))
    torch.testing.assert_close(ours, _reference_projector(model, example), rtol=0, atol=1e-12)


def test_node_projection_of_a_group_of_dimension_zero_drops_the_zero_weights():
    """Regression: with no free scale the projection returned its input, zero-weight entries included."""
    model = nn.Linear(3, 2).double()
    with torch.no_grad():
        model.weight[0, 0] = 0.0
    structure = analyze(model, example_input=torch.randn(2, 3, dtype=torch.float64))
    assert structure.group.dim == 0
    quotient = NodeScaleQuotient(dict(model.named_parameters()), structure)
    out = quotient.whitened_projection(torch.ones(quotient.layout.size, dtype=torch.float64))
    expected = torch.ones(quotient.layout.size, dtype=torch.float64)
    expected[0] = 0.0  # weight[0, 0]: not in the tangent space
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_node_measure_with_zero_weights_equals_the_dense_reference():
    model = _zeroed_mlp()
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(64, 4, generator=g, dtype=torch.float64), torch.randn(64, 3, generator=g, dtype=torch.float64)
    loss = nn.MSELoss()
    obj = Objective(model, loss, (x, y))
    quotient = NodeScaleQuotient(obj.params, obj.structure, obj.layout)
    w, grad, hessian = obj.layout.flatten(obj.params), obj.gradient(), dense_hessian(obj)
    operator = quotient.whitened_hessian(grad, lambda v: hessian @ v)
    ours = torch.stack([operator(e) for e in torch.eye(w.numel(), dtype=torch.float64)])
    projector = _reference_projector(model, x[:2])
    reference = projector @ (w.abs()[:, None] * hessian * w.abs()[None, :] + torch.diag(w * grad)) @ projector
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-12 * float(reference.abs().max()))
    result = invariant_sharpness(model, loss, (x, y), "node", k=2, solver=Solver(tol=1e-12), objective=obj,
                                 progress=False)  # fmt: skip
    torch.testing.assert_close(result.eigenvalues, dense_spectrum(obj, "node")[:2], rtol=1e-10, atol=0)


@pytest.mark.parametrize("low_rank_min", [0, 20, 10**9])  # all dense blocks rank-one, some, none
@pytest.mark.parametrize("name", list(_models()))
def test_structured_gram_solve_equals_the_dense_one(name, low_rank_min, monkeypatch):
    model = _models()[name]()
    example = torch.randn(2, *_INPUTS[name], dtype=torch.float64)
    params = {k: p.detach() for k, p in model.named_parameters()}
    layout = ParamLayout.from_tensors(params)
    kept = layout.flatten(params) != 0
    group = analyze(model, example_input=example).group
    v = torch.randn(3, layout.size, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * kept
    signs = torch.sign(layout.flatten(params))  # J's rows signed: the node quotient's whitened coordinates
    dense = NodeSymmetry(group, layout, kept, signs)
    monkeypatch.setattr(node_symmetry, "_DENSE_LIMIT", 0)
    monkeypatch.setattr(node_symmetry, "_LOW_RANK_MIN", low_rank_min)
    structured = NodeSymmetry(group, layout, kept, signs)
    parts = structured._gram_parts()
    # rank-one terms, and whether S has pairs between classes (the sparse LU) or is diagonal (solved on the device);
    # with BatchNorm the convolutions feeding it are pinned, so no dense block is left at all
    paths = {"mlp": {0: (2, False), 20: (1, True), 10**9: (0, True)},
             "mlp_zeros": {0: (1, True), 20: (1, True), 10**9: (0, True)}}  # fmt: skip
    if name in paths:
        assert (len(parts.low_rank), parts.pairs.nnz > 0) == paths[name][low_rank_min]
    if name == "mlp_zeros":  # the scale acting on nothing, and one of the pair moving only together, are dropped
        assert int(parts.active.sum()) == group.dim - 2
    torch.testing.assert_close(structured.gram(), dense.gram(), rtol=0, atol=0)
    expected = dense.project_out(v)
    torch.testing.assert_close(structured.project_out(v), expected, rtol=0, atol=1e-12 * float(v.norm()))
    reference = v @ _reference_projector(model, example)
    torch.testing.assert_close(expected, reference, rtol=0, atol=1e-12 * float(v.norm()))
    if name.endswith("zeros"):
        assert not (structured.apply(torch.ones(group.dim, dtype=torch.float64)) * ~kept).any()


@pytest.mark.parametrize("density", [0.02, 0.3, 0.9])
def test_kept_pairs_graph_has_the_components_of_the_kept_entries(density):
    """The graph of a rank-one block with left-out entries (a star through a position joined to everything, else
    the pairs listed) joins the same classes as the pairs of the kept entries themselves."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    g = torch.Generator().manual_seed(int(density * 100))
    shape, none = (7, 6, 2), 9
    for _ in range(20):
        plus = torch.randint(0, none + 1, (7, 1, 1), generator=g)
        minus = torch.randint(0, none + 1, (1, 6, 1), generator=g)
        dropped = (torch.rand(shape, generator=g) < density).reshape(-1).nonzero().reshape(-1)
        rows, cols = node_symmetry._kept_edges(plus, minus, shape, dropped, 2)
        kept = torch.ones(84, dtype=torch.bool)
        kept[dropped] = False
        exact = (plus.expand(shape).reshape(-1)[kept].numpy(), minus.expand(shape).reshape(-1)[kept].numpy())
        labels = []
        for r, c in ((rows, cols), exact):
            graph = coo_matrix((torch.ones(len(r)).numpy(), (r, c)), shape=(none + 1, none + 1))
            labels.append(connected_components(graph, directed=False)[1])
        same = [[labels[i][a] == labels[i][b] for a in range(none + 1) for b in range(none + 1)] for i in (0, 1)]
        assert same[0] == same[1]


def _symmetry_cases():
    from test_transformer_quotient import make

    def transformer():
        model, _, (x, _) = make("two_blocks")
        return model, x

    def mlp_plain():
        return mlp([5, 7, 6, 3]).double().eval(), torch.randn(2, 5, dtype=torch.float64)

    return {"two_block_transformer": transformer, "mlp": mlp_plain}


@pytest.mark.parametrize("name", ["two_block_transformer", "mlp"])
def test_symmetry_projection_by_blocks_equals_the_dense_one(name):
    """The symmetry quotient's projection from the node part (diagonal group) and the sparse per-factor columns
    equals the orthogonal projection off the whitened dense vertical basis ``W V`` (``MatrixSymmetry.vertical_basis``,
    one orbit tangent per coordinate), and the vertical dimension is its rank."""
    from manifolds import SymmetryQuotient, transformer_symmetry

    model, x = _symmetry_cases()[name]()
    params = {k: p.detach() for k, p in model.named_parameters()}
    symmetry = transformer_symmetry(model, x)
    fast = SymmetryQuotient(symmetry, params)
    assert (fast._node is not None) == (symmetry.diagonal_dim > 0) and fast._columns is not None
    assert (name == "mlp") == (not symmetry.factors)  # the MLP is all node part, the transformer mostly factors
    wv = torch.stack([fast.whiten(v) for v in symmetry.vertical_basis(params).T], dim=1)  # (n, d)
    u, sigma, _ = torch.linalg.svd(wv, full_matrices=False)
    basis = u[:, sigma > 1e-10 * sigma.max()]
    assert fast.vertical_dim == basis.shape[1]
    zeta = torch.randn(3, fast.layout.size, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    scale = float(zeta.norm())
    expected = zeta - (zeta @ basis) @ basis.T
    torch.testing.assert_close(fast.whitened_projection(zeta), expected, rtol=0, atol=1e-11 * scale)
    torch.testing.assert_close(fast.whitened_projection(zeta[0]), expected[0], rtol=0, atol=1e-11 * scale)
