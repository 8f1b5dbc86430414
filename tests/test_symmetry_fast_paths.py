"""The symmetry quotient's fast paths against the general ones they replace (float64, tiny transformers).

* the symmetry metric's closed-form Jacobian of ``w -> G(w) u`` (``A xi``, ``A^T eta``) against a JVP and a VJP of
  the metric, on models with node entries and references that read other references;
* the connection operator (`MetricQuotient.connection_operator`: the closed forms, or recorded graphs of ``G(w) u``,
  and the metric's closed-form derivative along ``u``) against `MetricQuotient.connection_covector` (three autodiff
  products per vector), for the symmetry metric and for metrics without a closed-form derivative;
* the per-point whitening and solve against the metric's own functions of the point;
* the Gram columns ``W V`` built from batches of probes against the dense whitened vertical basis, and ``M``
  against the coordinate-by-coordinate build (``dense_gram=True``);
* copies of an objective at transformed parameters share one trace of the symmetry, with unchanged values.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_transformer_quotient import _params, make

import manifolds
import manifolds._attention
import manifolds._symmetry_quotient as symmetry_quotient
from manifolds import SymmetryQuotient, layer_metric, node_metric, transformer_symmetry
from manifolds._connection import Metric, MetricQuotient
from sharpness import Objective
from sharpness.measures._ball_rows import ASCENT
from sharpness.measures._geodesic import geodesic_sharpness


def _quotient(name: str) -> SymmetryQuotient:
    if name == "timm_layer_scale":  # output projections whose rows a layer scale moves and columns GL factors
        from test_timm_layout import _small  # noqa: PLC0415 (its models need tests/timm_like.py)

        model, x = _small(init_values=0.5, global_pool="avg")
    else:
        model, _, (x, _) = make(name)
    return SymmetryQuotient(transformer_symmetry(model, x), _params(model))


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-12) -> None:
    assert float((a - b).abs().max()) <= rtol * float(b.abs().max()), (float((a - b).abs().max()), float(b.abs().max()))


@pytest.mark.parametrize("name", ["mha_post", "two_blocks", "timm_layer_scale"])
def test_symmetry_jacobian_equals_autodiff(name):
    q = _quotient(name)
    g = torch.Generator().manual_seed(3)
    u, xi, eta = torch.randn(3, q.point.numel(), generator=g, dtype=torch.float64)
    forward, backward = q.metric.jacobian(q.point, u)
    _close(forward(xi), q._dmetric(u, xi))  # A xi = DG[xi] u
    _close(backward(eta), q._dmetric_transpose(u, eta))  # A^T eta = grad_w <eta, G(w) u>


@pytest.mark.parametrize("name", ["mha_pre", "two_blocks", "timm_layer_scale"])
def test_symmetry_connection_operator_equals_the_autodiff_covector(name):
    q = _quotient(name)
    g = torch.Generator().manual_seed(0)
    u = torch.randn(q.point.numel(), generator=g, dtype=torch.float64)
    operator, derivative = q.connection_operator(u), q.metric.derivative(q.point, u)
    for _ in range(2):  # the recorded graphs serve every vector
        xi = torch.randn(q.point.numel(), generator=g, dtype=torch.float64)
        _close(derivative(xi), q._dmetric(xi, u))  # closed form of DG[u] xi against a JVP of the metric
        _close(operator(xi), q.connection_covector(u, xi))
    with torch.no_grad():  # a caller without gradients (a solver's loop) gets the same products
        operator = q.connection_operator(u)
    _close(operator(xi), q.connection_covector(u, xi))
    # the recorded-graph path the closed forms replace (any metric without them) still gives the same products
    recorded = MetricQuotient(dataclasses.replace(q.metric, jacobian=None), q.point).connection_operator(u)
    _close(recorded(xi), operator(xi))


def test_generic_connection_operator_equals_the_covector():
    """Without a closed-form derivative (layer, node and a balanced GL metric given as a quadratic form) and where
    the metric does not depend on the point at all (no graph to record)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(12, generator=g, dtype=torch.float64)
    layout = manifolds.ParamLayout.from_tensors({"a": w[:8].reshape(2, 4), "b": w[8:]})

    def balanced(p, xi):  # tr((X X^T)^-1 xi xi^T) on the first 2 x 4 block, Euclidean on the rest
        x, v = p[:8].reshape(2, 4), xi[:8].reshape(2, 4)
        return torch.trace(torch.linalg.solve(x @ x.T, v @ v.T)) + (xi[8:] ** 2).sum()

    euclidean = Metric(lambda p, xi: xi, lambda p, v: v, lambda p, xi: xi, lambda p, z: z, name="euclidean")
    for metric in (layer_metric(layout), node_metric(), Metric.from_quadratic_form(balanced), euclidean):
        q = MetricQuotient(metric, w)
        u = torch.randn(12, generator=g, dtype=torch.float64)
        operator = q.connection_operator(u)
        xi = torch.randn(12, generator=g, dtype=torch.float64)
        expected = q.connection_covector(u, xi)
        if metric is euclidean:
            assert float(operator(xi).abs().max()) == 0.0 == float(expected.abs().max())
        else:
            _close(operator(xi), expected)


@pytest.mark.parametrize("name", ["two_blocks", "timm_layer_scale"])
def test_point_maps_equal_the_metric_functions(name):
    q = _quotient(name)
    m, w = q.metric, q.point
    xi = torch.randn(2, w.numel(), generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for mine, theirs in ((q.whiten, m.whiten), (q.unwhiten, m.unwhiten), (q.egrad2rgrad, m.solve)):
        _close(mine(xi), theirs(w.expand_as(xi), xi))
    _close(q.unwhiten(q.whiten(xi)), xi)
    _close(q.egrad2rgrad(m.apply(w.expand_as(xi), xi)), xi)


@pytest.mark.parametrize("name", ["mha_pre", "two_blocks"])
def test_batched_gram_columns_equal_the_dense_vertical_basis(name, monkeypatch):
    model, _, (x, _) = make(name)
    symmetry, params = transformer_symmetry(model, x), _params(model)
    q = SymmetryQuotient(symmetry, params)
    wv = torch.stack([q.whiten(v) for v in symmetry.vertical_basis(params).T], dim=1)[:, symmetry.diagonal_dim:]
    columns = q._columns[0].to_dense()
    _close(columns, wv)
    assert q.gram_probes == 0  # read block by block, no probe
    ys = torch.randn(5, symmetry.dim, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    ys[:, : symmetry.diagonal_dim] = 0  # the factors' coordinates only: the blockwise tangents, not vmap
    _close(q._factor_tangents(ys), torch.func.vmap(q.vertical)(ys), 0.0)
    rows, cols, values = q._vertical_entries()  # V's nonzeros: the tangents of unit coordinates, exactly
    vertical = torch.zeros(q.point.numel(), columns.shape[1], dtype=torch.float64)
    unit = torch.eye(symmetry.dim, dtype=torch.float64)[symmetry.diagonal_dim:]
    _close(vertical.index_put_((rows, cols), values, accumulate=True), q._factor_tangents(unit).T, 0.0)
    if name == "mha_pre":  # a metric given: M from coloured probes, in batches of any size alike
        given = manifolds.symmetry_metric(symmetry, params)
        whole = SymmetryQuotient(symmetry, params, metric=given)
        monkeypatch.setattr(symmetry_quotient, "_PROBE_ENTRIES", 3 * q.point.numel())  # three probes per batch
        small = SymmetryQuotient(symmetry, params, metric=given)
        assert small.gram_probes == whole.gram_probes > 3
        _close(small._gram_factor[1], whole._gram_factor[1], 0.0)
        _close(whole._gram_factor[1] @ whole._gram_factor[1].T, columns.T @ columns)
    zeta = torch.randn(3, q.point.numel(), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    _close(q.whitened_projection(zeta[0]), q.whitened_projection(zeta)[0])  # one vector: matrix-vector products
    if symmetry.diagonal_dim == 0:  # the same M as the coordinate-by-coordinate build
        dense = SymmetryQuotient(symmetry, params, dense_gram=True)
        kind, chol = dense._gram_factor
        assert kind == "cholesky"
        _close(columns.T @ columns, chol @ chol.T)


def test_copies_share_one_trace_of_the_symmetry(monkeypatch):
    """Geodesic sharpness (verify's ``geodesic`` row) on an objective and on its copy at transformed parameters
    traces the group once, and the copy's value is the one a fresh objective of the transformed model gives."""
    model, loss, data = make("mha_pre")
    traced = []
    find = manifolds._attention.find_factors
    monkeypatch.setattr(manifolds._attention, "find_factors", lambda *a: traced.append(1) or find(*a))
    obj = Objective(model, loss, data, dtype=torch.float64)
    symmetry = obj.structure.symmetry
    element = symmetry.random_element(generator=torch.Generator().manual_seed(3))
    twin = obj.with_params(symmetry.act(obj.params, element))

    def value(objective):
        return geodesic_sharpness(None, None, None, 0.05, metric="symmetry", order=2, ascent=ASCENT,
                                  objective=objective, progress=False).value  # fmt: skip

    original, copy = value(obj), value(twin)
    assert len(traced) == 1
    fresh = value(Objective(symmetry.transformed(model, element), loss, data, dtype=torch.float64))
    assert len(traced) == 2 and abs(copy - fresh) <= 1e-12 * abs(fresh)
    assert abs(copy - original) <= 1e-8 * abs(original)
