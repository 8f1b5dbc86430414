"""Solves that skip redundant projections (issue 33, speed): an operator whose products are projected already
(`products_in_subspace`) is re-projected by the solvers only every few steps, and on the solvers' own projected
vectors (`in_subspace=True`) it skips projecting its input; the node projection works slice by slice and in place.
Same eigenvalues as without the skip, the public `matvec` still ``P A P v`` for any ``v``, rounding drift bounded."""

import dataclasses

import pytest
import torch
from test_node_projection import _INPUTS, _models, _reference_projector
from torch import nn

from manifolds import NodeScaleQuotient, NodeSymmetry
from manifolds import _node_symmetry as node_symmetry
from manifolds._quotient import _Quotient
from sharpness import (
    MEASURES,
    CallableOperator,
    Objective,
    dense_hessian,
    dense_spectrum,
    lanczos,
    low_memory_lanczos,
    power_iteration,
)
from sharpness.solvers import _vectors

SOLVERS = {"lanczos": lanczos, "low-memory-lanczos": low_memory_lanczos, "power": power_iteration}


def _depthwise() -> nn.Sequential:
    """A depthwise convolution (its output and input scales vary along the same axis: pairs counted one by one) with
    exact zeros in it, so the Gram matrix's counts of left-out pairs are exercised on such a tensor too."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3, groups=4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(16, 3)).double().eval()  # fmt: skip
    with torch.no_grad():
        model[2].weight[1, 0, 0, 0] = 0.0
        model[2].weight[2] = 0.0
        model[0].bias[0] = 0.0
    return model


def _example(name: str, samples: int = 2) -> torch.Tensor:
    shape = _INPUTS.get(name, (1, 6, 6))
    return torch.randn(samples, *shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def _node_objective(name: str) -> Objective:
    model = _depthwise() if name == "depthwise" else _models()[name]()
    x = _example(name, 24)
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (24,), generator=g)
    return Objective(model, nn.CrossEntropyLoss(), (x, y))


@pytest.mark.parametrize("matrix_min", [0, 10**9])  # every weight projected as a matrix, or by broadcasting
@pytest.mark.parametrize("name", ["mlp_zeros", "residual_zeros", "depthwise"])
def test_projection_in_place_equals_the_new_one_and_the_reference(name, matrix_min, monkeypatch):
    monkeypatch.setattr(node_symmetry, "_MATRIX_MIN", matrix_min)
    obj = _node_objective(name)
    w = obj.layout.flatten(obj.params)
    quotient = NodeScaleQuotient(obj.params, obj.structure, obj.layout)
    v = torch.randn(3, obj.layout.size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for sym in (quotient.symmetry, NodeSymmetry(obj.structure.group, obj.layout, w != 0, torch.sign(w))):
        new = sym.project_out(v)
        in_place = v.clone()
        assert sym.project_out(in_place, out=in_place) is in_place
        torch.testing.assert_close(in_place, new, rtol=0, atol=0)
    reference = _reference_projector(obj.model, _example(name))  # whitened coordinates: sign(w) P sign(w)
    n = obj.layout.size
    torch.testing.assert_close(quotient.whitened_projection(torch.eye(n, dtype=torch.float64)), reference, rtol=0,
                               atol=1e-12)  # fmt: skip


def test_node_operator_is_p_a_p_on_any_vector_and_skips_only_on_horizontal_ones():
    """The public product is ``P M P v`` for an arbitrary ``v`` (in log coordinates ``d = xi / w``, the whitened ones
    times ``sign(w)``); the in-subspace product (input not projected) and the in-place one (added to a horizontal
    ``out``) agree with it on horizontal vectors."""
    obj = _node_objective("cnn_bn_zeros")
    op = MEASURES["node"].operator(obj).operator
    assert op.products_in_subspace
    w, grad, hessian = obj.layout.flatten(obj.params), obj.gradient(), dense_hessian(obj)
    projector = _reference_projector(obj.model, _example("cnn_bn_zeros"))
    reference = projector @ (w.abs()[:, None] * hessian * w.abs()[None, :] + torch.diag(w * grad)) @ projector
    sign = torch.sign(w)
    projector, reference = (sign[:, None] * m * sign[None, :] for m in (projector, reference))
    tol = 1e-12 * float(reference.abs().max())
    v = torch.randn(2, w.numel(), generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    assert float((projector @ v[0] - v[0]).norm()) > 0.1  # far from horizontal
    torch.testing.assert_close(op.matvec(v[0]), reference @ v[0], rtol=0, atol=tol)
    h, out = projector @ v[0], projector @ v[1]
    torch.testing.assert_close(op.matvec(h, in_subspace=True), reference @ h, rtol=0, atol=tol)
    added = op.matvec_add(h, out.clone(), in_subspace=True)
    torch.testing.assert_close(added, out + reference @ h, rtol=0, atol=tol)


def _dense_projected(n: int = 40, removed: int = 6):
    """A symmetric ``A`` that does NOT vanish on the removed directions (so a missed projection changes the answer),
    the projection ``P`` off ``removed`` random directions, and the top eigenvalue of ``P A P`` on ``range(P)``."""
    g = torch.Generator().manual_seed(7)
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    a = a + a.T
    q, _ = torch.linalg.qr(torch.randn(n, removed, generator=g, dtype=torch.float64))
    a = a + 40.0 * q @ q.T  # the removed directions carry the largest eigenvalues of A itself

    def project(v):
        return v - q @ (q.T @ v)

    p = torch.eye(n, dtype=torch.float64) - q @ q.T
    basis = torch.linalg.svd(p)[0][:, : n - removed]
    top = torch.linalg.eigvalsh(basis.T @ a @ basis)[-2:].flip(0)
    return a, project, top


def _operators(a, project, honest: bool = True):
    """The projected operator ``P A P`` plainly (the solvers project everything), and with the skip: its
    in-subspace product ``P A v`` (``v`` taken as horizontal) and the claim that its products are projected. A
    dishonest one claims so while returning ``A P v``."""
    n = a.shape[0]

    def in_subspace(v, out=None):
        product = project(a @ v) if honest else a @ v
        return product if out is None else out.add_(product)

    plain = CallableOperator(lambda v: project(a @ project(v)), n, torch.float64, project=project)
    skipping = CallableOperator(lambda v: project(a @ project(v)) if honest else a @ project(v), n, torch.float64,
                                project=project, matvec_in_subspace=in_subspace, products_in_subspace=True)  # fmt: skip
    return plain, skipping


@pytest.mark.parametrize("method", list(SOLVERS))
def test_solves_with_and_without_the_skip_agree_and_a_false_claim_is_caught(method):
    a, project, top = _dense_projected()
    plain, skipping = _operators(a, project)
    v = torch.randn(a.shape[0], generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    reference = project(a @ project(v))  # the public product of any vector, which the skip must leave alone
    torch.testing.assert_close(skipping.matvec(v), reference, rtol=0, atol=1e-12 * float(reference.norm()))
    assert float((project(a @ v) - reference).norm()) > 0.1 * float(reference.norm())  # skipping P there would show
    kwargs = {"k": 2, "tol": 1e-13, "max_iter": 2000 if method == "power" else 40, "progress": False}
    with_skip = SOLVERS[method](skipping, generator=torch.Generator().manual_seed(0), **kwargs)
    without = SOLVERS[method](plain, generator=torch.Generator().manual_seed(0), **kwargs)
    rtol = 1e-7 if method == "power" else 1e-10  # power iteration: the Rayleigh-quotient change stops it
    torch.testing.assert_close(with_skip.eigenvalues, top, rtol=rtol, atol=0)
    torch.testing.assert_close(with_skip.eigenvalues, without.eigenvalues, rtol=rtol, atol=0)
    # The solvers do trust the claim: an operator claiming projected products it does not project leaks the
    # removed directions (eigenvalues near 40) into the spectrum, so the comparison above can fail.
    _, liar = _operators(a, project, honest=False)
    lied = SOLVERS[method](liar, generator=torch.Generator().manual_seed(0), **kwargs)
    assert float((lied.eigenvalues - top).abs().max()) > 1e-3 * float(top.abs().max())


@pytest.mark.parametrize("method", list(SOLVERS))
def test_node_solve_with_and_without_the_skip_and_its_drift(method):
    """Float64 node measure: the eigenvalues with the skip equal those of the operator that projects everything and
    the dense reference to 1e-10; the vertical part the solver's vectors gather by rounding between re-projections
    stays below 1e-12 of their norm."""
    obj = _node_objective("cnn_bn_zeros")
    op = MEASURES["node"].operator(obj).operator
    drift: list[float] = []
    fast = op._mv_in_subspace

    def recorded(v, out=None):
        for x in (v,) if out is None else (v, out):
            drift.append(float((x - op.project(x)).norm() / x.norm()))
        return fast(v, out=out)

    skipping = CallableOperator(op._mv, op.size, op.dtype, project=op.project, matvec_in_subspace=recorded,
                                products_in_subspace=True)  # fmt: skip
    plain = CallableOperator(op._mv, op.size, op.dtype, project=op.project)
    k = 1 if method == "power" else 2
    kwargs = {"k": k, "tol": 1e-12, "max_iter": 300 if method == "power" else 60, "progress": False}
    with_skip = SOLVERS[method](skipping, generator=torch.Generator().manual_seed(0), **kwargs)
    without = SOLVERS[method](plain, generator=torch.Generator().manual_seed(0), **kwargs)
    rtol = 1e-6 if method == "power" else 1e-10  # power iteration: the Rayleigh-quotient change stops it
    torch.testing.assert_close(with_skip.eigenvalues, without.eigenvalues, rtol=rtol, atol=0)
    torch.testing.assert_close(with_skip.eigenvalues, dense_spectrum(obj, "node")[:k], rtol=rtol, atol=0)
    assert len(drift) > 2 * _vectors._REPROJECT_EVERY  # products between re-projections were recorded
    assert max(drift) < 1e-12


def test_node_unwhiten_is_the_metric_division_at_two_passes_and_drops_non_finite_weights():
    """The node quotient's unwhitening ``|w| zeta`` (sign times ``w zeta``) equals the generic division by
    ``sqrt_metric`` to rounding, exactly 0 on zero weights; a point with a nan or an infinity falls back to the
    division, which drops those entries (0) where ``|w| zeta`` would not be 0."""
    obj = _node_objective("mlp_zeros")
    quotient = NodeScaleQuotient(obj.params, obj.structure, obj.layout)
    zeta = torch.randn(3, obj.layout.size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    divided = _Quotient.unwhiten(quotient, zeta)
    assert bool((quotient.point == 0).any())
    assert quotient._finite
    torch.testing.assert_close(quotient.unwhiten(zeta), divided, rtol=4e-16, atol=0)
    assert bool((quotient.unwhiten(zeta)[:, quotient.point == 0] == 0).all())
    point = quotient.point.clone()
    point[1], point[2] = float("nan"), float("inf")
    odd = NodeScaleQuotient(point, obj.structure, obj.layout)
    assert not odd._finite
    unwhitened = odd.unwhiten(zeta)
    torch.testing.assert_close(unwhitened, _Quotient.unwhiten(odd, zeta), rtol=0, atol=0)
    assert bool((unwhitened[:, 1:3] == 0).all())


def test_node_whitening_of_log_coordinates_and_dropped_entries_need_no_sign_or_metric_vector():
    """``sign(w) d`` is formed without a sign vector (``|d|`` with the sign of ``w d``, 0 on zero weights) and equals
    ``d * sign(w)`` exactly, where ``w d`` underflows too; the dropped entries come from the
    symmetry's left-out rows (or one pass where there is no group) and equal ``sqrt_metric == 0``; neither the sign
    nor ``sqrt_metric`` is formed on the way. A point with a nan or an infinity falls back to both vectors."""
    obj = _node_objective("mlp_zeros")
    quotient = NodeScaleQuotient(obj.params, obj.structure, obj.layout)
    d = torch.randn(2, obj.layout.size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    zero, kept = (torch.nonzero(quotient.point == 0).reshape(-1), torch.nonzero(quotient.point).reshape(-1))
    d[:, kept[:3]] = 0.0
    d[1, kept[3]], d[1, kept[4]] = 5e-324, -5e-324  # w d underflows to a signed 0
    assert bool((d[1, kept[3:5]] * quotient.point[kept[3:5]] == 0).all())
    assert zero.numel() and bool((d[:, zero] != 0).all())
    whitened = quotient.solver_hessian(torch.zeros(obj.layout.size, dtype=torch.float64), lambda v: v).to_whitened(d)
    dropped = quotient.dropped_entries()
    assert "_sign" not in vars(quotient) and "sqrt_metric" not in vars(quotient)
    expected = d * torch.sign(quotient.point)
    assert torch.equal(whitened, expected)  # the values (a zero's sign may differ: nothing reads it)
    assert whitened[1, kept[3]] == expected[1, kept[3]] != 0 and whitened[1, kept[4]] == expected[1, kept[4]] != 0
    assert torch.equal(quotient._to_whitened(d[0]), expected[0])
    assert torch.equal(dropped, torch.nonzero(quotient.sqrt_metric == 0).reshape(-1))
    assert torch.equal(dropped, zero)
    structure = dataclasses.replace(obj.structure, group=None, group_failure="untraceable (test)")
    ungrouped = NodeScaleQuotient(obj.params, structure, obj.layout)
    assert torch.equal(ungrouped.dropped_entries(), zero) and torch.equal(ungrouped._to_whitened(d), expected)
    point = quotient.point.clone()
    point[kept[0]], point[kept[1]] = float("nan"), float("inf")
    odd = NodeScaleQuotient(point, obj.structure, obj.layout)
    assert torch.equal(odd.dropped_entries(), torch.nonzero(odd.sqrt_metric == 0).reshape(-1))
    assert odd.dropped_entries().numel() == zero.numel() + 2
    torch.testing.assert_close(odd._to_whitened(d), d * torch.sign(point), rtol=0, atol=0, equal_nan=True)


def test_node_unwhitening_is_differentiable_with_the_metric_as_its_derivative():
    """Differentiated (epsilon-sharpness retracts through it, by autograd and by ``torch.func``), unwhitening keeps
    the derivative ``|w|`` (0 on zero weights), also where ``zeta`` is 0, where copysign's derivative would be 0."""
    obj = _node_objective("mlp_zeros")
    quotient = NodeScaleQuotient(obj.params, obj.structure, obj.layout)
    zeta = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    zeta[:5] = 0.0
    cotangent = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    value, pullback = torch.func.vjp(quotient.unwhiten, zeta)
    torch.testing.assert_close(value, quotient.unwhiten(zeta), rtol=1e-15, atol=0)  # 1 / (1 / |w|) rounds
    torch.testing.assert_close(pullback(cotangent)[0], quotient.point.abs() * cotangent, rtol=1e-15, atol=0)
    leaf = zeta.clone().requires_grad_(True)
    (quotient.unwhiten(leaf) @ cotangent).backward()
    torch.testing.assert_close(leaf.grad, quotient.point.abs() * cotangent, rtol=1e-15, atol=0)


def test_node_product_of_a_horizontal_vector_is_horizontal_unprojected_away_from_critical_points(monkeypatch):
    """``l(d) = L(w e^d)`` is constant along every rescaling direction ``J c``, so its Hessian has them in its kernel
    and, symmetric, a horizontal range: the solvers' products are not projected at all (no call of the projection),
    and are horizontal to rounding at a point with a large gradient, where the connection term ``diag(w g)`` is
    not small."""
    obj = _node_objective("cnn_bn_zeros")
    op = MEASURES["node"].operator(obj).operator
    w, grad = obj.layout.flatten(obj.params), obj.gradient()
    assert float((w * grad).norm()) > 1e-2  # not a critical point
    v = torch.randn(2, w.numel(), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    h, out = op.project(v[0]), op.project(v[1])
    calls = []
    project_out = NodeSymmetry.project_out
    monkeypatch.setattr(NodeSymmetry, "project_out", lambda *a, **k: calls.append(1) or project_out(*a, **k))
    products = [op.matvec(h, in_subspace=True), op.matvec_add(h, out.clone(), in_subspace=True) - out]
    assert not calls
    for product in products:
        assert float(product.norm()) > 1e-3
        assert float((product - op.project(product)).norm()) < 1e-12 * float(product.norm())
    torch.testing.assert_close(products[0], products[1], rtol=0, atol=1e-12 * float(products[0].norm()))
    torch.testing.assert_close(op.matvec(h), products[0], rtol=0, atol=1e-12 * float(products[0].norm()))


def test_symmetry_operator_keeps_the_skip_of_its_quotient():
    """The symmetry measure wraps its operator in the math attention kernel; the wrapper keeps the in-subspace
    product (no projection of the solvers' own vectors) and the claim that products are projected."""
    from test_transformer_quotient import make

    model, loss, data = make("mha_pre")
    obj = Objective(model, loss, data, dtype=torch.float64)
    op = MEASURES["symmetry"].operator(obj).operator
    assert op.products_in_subspace
    v = torch.randn(2, op.size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    h, out = op.project(v[0]), op.project(v[1])
    reference = op.matvec(h)
    tol = 1e-10 * float(reference.norm())
    torch.testing.assert_close(op.matvec(h, in_subspace=True), reference, rtol=0, atol=tol)
    torch.testing.assert_close(op.matvec_add(h, out.clone(), in_subspace=True), out + reference, rtol=0, atol=tol)


def test_low_memory_lanczos_finds_no_zero_ghost_where_the_wanted_eigenvalues_are_negative():
    """The node measure's products are horizontal only to rounding, and the rescaling directions are in its kernel,
    so their rounding acts as an eigenvalue of 0. Low-memory Lanczos deflates pair after pair; once the pair it
    looks for is below 0, that 0 would be the top of what is left (a wrong eigenvalue 0, measured at 8.6e-3 of the
    largest before the guard): it re-projects every product while its Ritz value is not clearly above 0. Float32,
    the top eigenvalues down to the second negative one, against the dense float64 spectrum."""
    reference = dense_spectrum(_node_objective("mlp_zeros"), "node")
    k = int((reference > 0).sum()) + 2
    assert k < reference.numel() and reference[k - 1] < reference[k - 2] < 0
    labels = torch.randint(0, 3, (24,), generator=torch.Generator().manual_seed(0))
    data = (_example("mlp_zeros", 24).float(), labels)
    obj = Objective(_models()["mlp_zeros"]().float(), nn.CrossEntropyLoss(), data)
    op = MEASURES["node"].operator(obj).operator
    result = low_memory_lanczos(op, k=k, tol=1e-5, max_iter=60, generator=torch.Generator().manual_seed(0),
                                progress=False)  # fmt: skip
    error = (result.eigenvalues - reference[:k]).abs().max() / reference.abs().max()
    assert float(error) < 1e-6, float(error)
