"""Start vectors from the loss's gradient (`Solver(start="gradient")`, `SymmetricOperator.start_hint`).

Solver level: on explicit matrices whose hint is given, the start is the random unit vector plus the unit hint
(fewer products where the hint leans towards the top eigenvector, the same eigenvalues where it does not, the random
start itself where there is no usable hint). Measure level: every measure's hint is the loss's gradient in its
operator's coordinates (its inner product with any coordinate vector is the loss's derivative along the tangent
that vector stands for), and every measure's value is the same from either start.
"""

import pytest
import torch
from test_rop_graph import _data, _perturbed
from torch import nn

from sharpness import MEASURES, Objective, Solver
from sharpness._vit import ViT
from sharpness.products._data_span import data_span_hessian
from sharpness.products._hessian import HessianOperator
from sharpness.products._operator import DenseOperator, SymmetricOperator

CE = nn.CrossEntropyLoss()


class Hinted(DenseOperator):
    """An explicit symmetric matrix with a given start hint (``None``: none)."""

    def __init__(self, matrix, hint, project=None):
        super().__init__(matrix, project)
        self.hint = hint

    def start_hint(self):
        return self.hint


class Diagonal(SymmetricOperator):
    """``diag(d)`` with a given start hint: a Hessian's shape in miniature, a few outlying eigenvalues above a bulk,
    in a dimension where a random vector has a small component (about ``1 / sqrt(n)``) along each eigenvector."""

    def __init__(self, d, hint):
        super().__init__(d.numel(), d.dtype)
        self.d, self.hint = d, hint

    def _matvec(self, v):
        return self.d * v

    def start_hint(self):
        return self.hint


@pytest.mark.parametrize(("method", "tol"), [("lanczos", 1e-4), ("low-memory-lanczos", 1e-4), ("power", 1e-6)])
def test_a_hint_along_the_top_eigenvector_saves_products_and_one_across_it_changes_no_eigenvalue(method, tol):
    """With 100,000 eigenvalues (a bulk in [0, 1] below 1.8, 2.5 and 4), a hint whose cosine with the top eigenvector
    is 0.9 halves the products (Lanczos 10 to 5 here); one orthogonal to it costs at most a few more, and both
    find the top eigenvalue to the solver's tolerance. With no hint the solve is the random start's own."""
    n = 100_000
    d = torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    d[:3] = torch.tensor([4.0, 2.5, 1.8], dtype=torch.float64)
    noise = torch.randn(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    noise[0] = 0.0
    top = torch.zeros(n, dtype=torch.float64)
    top[0] = 1.0
    results = {}
    for name, hint in {"none": None, "top": top + 0.5 * noise / noise.norm(), "across": noise}.items():
        for start in ("random", "gradient"):
            solver = Solver(method, tol, max_iter=400, seed=3, start=start)
            results[name, start] = solver.solve(Diagonal(d, hint), 1, progress=False)
    for result in results.values():
        assert result.converged
        assert abs(float(result.eigenvalues[0]) - 4.0) < 4.0 * tol
    assert results["top", "gradient"].info["start"] == "gradient"
    assert results["top", "random"].info["start"] == "random"
    assert results["top", "gradient"].n_matvec <= 0.6 * results["top", "random"].n_matvec
    assert results["across", "gradient"].n_matvec <= results["across", "random"].n_matvec + 4
    # no hint: the random start itself, drawn from the same generator, so the very same solve
    assert results["none", "gradient"].info["start"] == "random"
    assert results["none", "gradient"].n_matvec == results["none", "random"].n_matvec
    torch.testing.assert_close(results["none", "gradient"].eigenvectors, results["none", "random"].eigenvectors,
                               rtol=0, atol=0)  # fmt: skip


@pytest.mark.parametrize("hint", ["zero", "nan", "outside the subspace"])
def test_a_hint_that_vanishes_or_is_not_finite_leaves_the_random_start(hint):
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(50, 50, generator=g, dtype=torch.float64))
    matrix = (q * torch.linspace(0.0, 1.0, 50, dtype=torch.float64)) @ q.T
    keep = torch.ones(50, dtype=torch.float64)
    keep[:5] = 0.0
    vector = {"zero": torch.zeros(50, dtype=torch.float64), "nan": torch.full((50,), float("nan"), dtype=torch.float64),
              "outside the subspace": 1.0 - keep}[hint]  # fmt: skip
    op = Hinted(matrix, vector, project=lambda v: keep * v)
    plain = Hinted(matrix, None, project=lambda v: keep * v)
    a = Solver(tol=1e-8, seed=2, start="gradient").solve(op, 2, progress=False)
    b = Solver(tol=1e-8, seed=2, start="random").solve(plain, 2, progress=False)
    assert a.info["start"] == "random"
    torch.testing.assert_close(a.eigenvalues, b.eigenvalues, rtol=0, atol=0)


def test_the_gradient_start_can_stop_on_a_close_eigenvalue_the_gradient_leans_towards():
    """Why ``start="gradient"`` is not the default: with eigenvalues 4.0 and 3.9 above a bulk in [0, 1] (20,000 of
    them) and a gradient along the second eigenvector, Lanczos at tol 2e-3 from the gradient start stops on 3.9 and
    calls it converged; from the default random start it finds 4.0."""
    n = 20_000
    d = torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    d[:2] = torch.tensor([4.0, 3.9], dtype=torch.float64)
    second = torch.zeros(n, dtype=torch.float64)
    second[1] = 1.0
    found = {start: Solver(tol=2e-3, seed=0, start=start).solve(Diagonal(d, second), 1, progress=False)
             for start in ("random", "gradient")}  # fmt: skip
    assert Solver().start == "random"
    assert all(r.converged for r in found.values())
    assert abs(float(found["random"].eigenvalues[0]) - 4.0) < 4.0 * 2e-3
    assert abs(float(found["gradient"].eigenvalues[0]) - 3.9) < 3.9 * 2e-3


def test_an_unknown_start_is_refused():
    with pytest.raises(ValueError, match="unknown start 'warm'; choose one of gradient, random"):
        Solver(start="warm")


def _mlp_objective(samples=12, features=5):
    torch.manual_seed(0)
    model = _perturbed(nn.Sequential(nn.Linear(features, 7), nn.ReLU(), nn.Linear(7, 6), nn.ReLU(), nn.Linear(6, 3)))
    x, y = _data((features,), n=samples)
    return Objective(model, CE, (x, y))


def _vit_objective():
    model = _perturbed(ViT(dim=4, heads=2, mlp=4))
    x, y = _data((64,), n=5, classes=10)
    return Objective(model, CE, (x, y))


class _ResidualMLP(nn.Module):
    """A first Linear layer of the data, then a residual block: a graph, not a chain."""

    def __init__(self, features=9):
        super().__init__()
        self.first, self.inner, self.out = nn.Linear(features, 7), nn.Linear(7, 7), nn.Linear(7, 3)

    def forward(self, x):
        h = torch.relu(self.first(x))
        return self.out(h + torch.relu(self.inner(h)))


@pytest.mark.parametrize("model", ["chain", "graph"])
def test_the_euclidean_hint_is_the_gradient_and_in_data_span_coordinates_its_image(model):
    """The Hessian's hint is the whole-data-set gradient (read off the R-operator's kept state: equal to autograd's
    to 1e-13); in data-span coordinates ``U`` (first weight ``V = U L^-1 X``) its inner product with any ``u`` is
    the gradient's with the parameter vector ``u`` stands for (a chain's from its first layer's errors, ``E^T L``;
    a graph's from the whole gradient, ``G_W X^T L^-T``)."""
    if model == "chain":
        obj = _mlp_objective(samples=4, features=9)
    else:
        x, y = _data((9,), n=4)
        obj = Objective(_perturbed(_ResidualMLP()), CE, (x, y))
    op = HessianOperator(obj)
    assert op.strategy == "rop"
    egrad = obj.gradient()
    torch.testing.assert_close(op.start_hint(), egrad, rtol=0, atol=1e-13 * float(egrad.abs().max()))
    span = data_span_hessian(op)
    assert span is not None
    u = torch.randn(span.size, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    blocks = span.layout.unflatten(u)
    x = torch.cat(span.inputs)
    first = blocks[span.weight] @ torch.linalg.solve_triangular(span._lower, x, upper=False)
    v = obj.layout.flatten({**blocks, span.weight: first})
    hint = span.start_hint()
    assert hint.shape == u.shape
    torch.testing.assert_close(hint @ u, egrad @ v, rtol=1e-11, atol=0)


@pytest.mark.parametrize("name", ["layer", "node", "gspace", "symmetry"])
def test_each_measure_hint_is_the_loss_derivative_in_its_coordinates(name):
    """``<hint, z> = <egrad, t(z)>`` for random ``z``, ``t(z)`` the parameter tangent ``z`` stands for (the measure's
    map of its eigenvectors, up to the sign it fixes): the hint is the loss's gradient in the operator's
    coordinates. A hint left whitened the other way (``G^1/2`` for ``G^-1/2``) or in whitened instead of log
    coordinates misses by far more than the tolerance."""
    obj = _vit_objective() if name == "symmetry" else _mlp_objective()
    bound = MEASURES[name].operator(obj)
    hint = bound.operator.start_hint()
    assert hint is not None and hint.shape == (bound.operator.size,)
    egrad = obj.gradient()
    g = torch.Generator().manual_seed(6)
    for _ in range(3):
        z = torch.randn(bound.operator.size, generator=g, dtype=torch.float64)
        tangent = bound.to_parameters(z[None])[0]
        assert abs(float(hint @ z)) == pytest.approx(abs(float(egrad @ tangent)), rel=1e-10)


@pytest.mark.parametrize("name", ["euclidean", "layer", "node", "gspace", "fixed", "minnorm", "symmetry"])
def test_every_measure_has_the_same_value_from_either_start(name):
    obj = _vit_objective() if name == "symmetry" else _mlp_objective()
    measure = MEASURES[name]
    values = {}
    for start in ("random", "gradient"):
        result = measure.sharpness(obj, 2, Solver(tol=1e-10, start=start), progress=False)
        assert result.converged and result.info["start"] == start
        values[start] = result.eigenvalues
    torch.testing.assert_close(values["gradient"], values["random"], rtol=1e-9, atol=0)
