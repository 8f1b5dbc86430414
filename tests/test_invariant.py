"""Invariant sharpness on the layer-wise and node-wise quotients against dense references built
independently from torch.func.hessian and the G-space formulas of docs/math.md."""

import numpy as np
import pytest
import torch
from cases import make_case, mlp

from manifolds import (
    LayerScaleQuotient,
    NodeScaleQuotient,
    analyze,
    random_rescale,
    rescale_parameters,
)
from sharpness import (
    Layer,
    Objective,
    Solver,
    dense_hessian,
    dense_riemannian_hessian,
    dense_spectrum,
    euclidean_sharpness,
    invariant_sharpness,
)


def _dense_problem(case):
    obj = Objective(case.model, case.loss_fn, case.data)
    w = obj.layout.flatten(obj.params)
    return obj, w, obj.gradient(), dense_hessian(obj)


def _null_space(vertical: torch.Tensor, n: int) -> torch.Tensor:
    """Orthonormal ``(n, n - rank)`` basis of the complement of the rows of ``vertical``."""
    if vertical.shape[0] == 0:
        return torch.eye(n, dtype=torch.float64)
    u, s, _ = torch.linalg.svd(vertical.T, full_matrices=True)
    rank = int((s > 1e-10 * s.max()).sum())
    return u[:, rank:]


def node_reference(case) -> np.ndarray:
    """diag(|w|) H diag(|w|) + diag(w g) restricted to the complement of the rescaling directions."""
    obj, w, g, H = _dense_problem(case)
    structure = analyze(case.model)
    cols = []
    for i, h in enumerate(structure.hidden_units):  # J e_a = log|w(exp(e_a) at unit a)| - log|w|, exactly
        for a in range(h):
            factors = [torch.ones(u, dtype=torch.float64) for u in structure.hidden_units]
            factors[i][a] = np.e
            moved = obj.layout.flatten(rescale_parameters(obj.params, structure, factors))
            cols.append(torch.log(moved.abs()) - torch.log(w.abs()))
    S = torch.sign(w)
    vertical = torch.stack(cols) * S  # whitened coordinates are sign(w) * log-coordinates
    Q = _null_space(vertical, w.numel())
    M = torch.diag(w.abs()) @ H @ torch.diag(w.abs()) + torch.diag(w * g)
    return np.linalg.eigvalsh((Q.T @ M @ Q).numpy())[::-1]


def layer_reference(case) -> np.ndarray:
    """Per-block Levi-Civita Hessian of sum_B <.,.>/||w_B||^2, whitened, on the horizontal space."""
    obj, w, g, H = _dense_problem(case)
    layout, n = obj.layout, w.numel()
    structure = analyze(case.model)
    scale = torch.zeros(n, dtype=torch.float64)
    C = torch.zeros(n, n, dtype=torch.float64)
    for name in layout.names:
        sl = layout.slice(name)
        wb, gb = w[sl], g[sl]
        scale[sl] = wb.norm() ** 2
        C[sl, sl] = torch.outer(gb, wb) + torch.outer(wb, gb) - (wb @ gb) * torch.eye(wb.numel(), dtype=torch.float64)
    R = torch.diag(scale) @ H + C  # tangent-coordinate Riemannian Hessian
    Gh = torch.diag(scale.rsqrt())  # G^{1/2}
    A = Gh @ R @ torch.linalg.inv(Gh)
    L = len(structure.layers)
    vertical = []
    for j in range(L - 1):  # gamma = e_j (Lemma 2.6): beta_j = 1, beta_{j+1} = -1
        gamma = [1.0 if i == j else 0.0 for i in range(L)]
        beta = [gamma[i] - (gamma[i - 1] if i else 0.0) for i in range(L)]
        v = torch.zeros(n, dtype=torch.float64)
        for i, layer in enumerate(structure.layers):
            v[layout.slice(layer.weight)] = beta[i] * w[layout.slice(layer.weight)]
            if layer.bias is not None:
                v[layout.slice(layer.bias)] = gamma[i] * w[layout.slice(layer.bias)]
        vertical.append(Gh @ v)
    Q = _null_space(torch.stack(vertical), n)
    B = Q.T @ A @ Q
    return np.linalg.eigvalsh(((B + B.T) / 2).numpy())[::-1]


REFERENCES = {"node": node_reference, "layer": layer_reference}


@pytest.mark.parametrize("metric", ["layer", "node"])
def test_top_eigenvalues_match_dense_reference(rescalable_case, metric):
    ref = REFERENCES[metric](rescalable_case)[:3]
    # the library's dense reference (the group's action, no hand-written vertical space) is the same
    package = dense_spectrum(Objective(rescalable_case.model, rescalable_case.loss_fn, rescalable_case.data), metric)
    np.testing.assert_allclose(package[:3].numpy(), ref, rtol=1e-12)
    res = invariant_sharpness(rescalable_case.model, rescalable_case.loss_fn, rescalable_case.data,
                              metric=metric, k=3, solver=Solver(tol=1e-11), progress=False)
    assert res.converged
    np.testing.assert_allclose(res.eigenvalues.numpy(), ref, rtol=1e-8)
    assert res.info["riemannian_grad_norm"] > 1e-3  # a non-critical point: connection terms matter


@pytest.mark.parametrize("metric", ["layer", "node"])
def test_power_method_agrees_with_lanczos(metric):
    case = make_case("mlp_bias")
    lz = invariant_sharpness(case.model, case.loss_fn, case.data, metric=metric,
                             solver=Solver(tol=1e-11), progress=False)
    pw = invariant_sharpness(case.model, case.loss_fn, case.data, metric=metric,
                             solver=Solver(method="power", tol=1e-14, max_iter=5000), progress=False)
    assert pw.method == "power" and pw.converged
    assert pw.value == pytest.approx(lz.value, rel=1e-8)


def _rescaled_values(case, metric, kind, seeds=(1, 2)):
    values = []
    for seed in seeds:
        model = random_rescale(case.model, kind=kind, scale=1.0, generator=torch.Generator().manual_seed(seed))
        values.append(invariant_sharpness(model, case.loss_fn, case.data, metric=metric, solver=Solver(tol=1e-11),
                                          progress=False).value)
    return np.array(values)


@pytest.mark.parametrize("kind", ["node", "layer"])
def test_node_measure_is_invariant_under_every_rescaling(rescalable_case, kind):
    c = rescalable_case
    base = invariant_sharpness(c.model, c.loss_fn, c.data, metric="node",
                               solver=Solver(tol=1e-11), progress=False).value
    np.testing.assert_allclose(_rescaled_values(c, "node", kind), base, rtol=1e-8)


def test_layer_measure_is_invariant_under_layer_rescaling(rescalable_case):
    c = rescalable_case
    base = invariant_sharpness(c.model, c.loss_fn, c.data, metric="layer",
                               solver=Solver(tol=1e-11), progress=False).value
    np.testing.assert_allclose(_rescaled_values(c, "layer", "layer"), base, rtol=1e-8)


def test_layer_measure_changes_under_node_rescaling(rescalable_case):
    """Documents a limitation users must know: the flatness paper's layer-wise measure is not
    invariant under the full (node-wise) symmetry group."""
    c = rescalable_case
    base = invariant_sharpness(c.model, c.loss_fn, c.data, metric="layer",
                               solver=Solver(tol=1e-11), progress=False).value
    rel = np.abs(_rescaled_values(c, "layer", "node") - base) / base
    assert rel.max() > 0.1


def test_euclidean_sharpness_is_not_invariant():
    c = make_case("mlp_bias")
    base = euclidean_sharpness(c.model, c.loss_fn, c.data, solver=Solver(tol=1e-11), progress=False).value
    model = random_rescale(c.model, kind="layer", generator=torch.Generator().manual_seed(1))
    assert abs(euclidean_sharpness(model, c.loss_fn, c.data,
                                   solver=Solver(tol=1e-11), progress=False).value - base) > 0.1 * base


def _slopes(f, t_values):
    e = np.array([f(t) for t in t_values])
    return np.polyfit(np.log(t_values), np.log(e), 1)[0]


@pytest.mark.parametrize("quotient_cls", [LayerScaleQuotient, NodeScaleQuotient])
def test_taylor_expansion_along_the_exponential_map(rescalable_case, quotient_cls):
    c = rescalable_case
    obj = Objective(c.model, c.loss_fn, c.data)
    q = quotient_cls(obj.params, analyze(c.model), obj.layout)
    f0, egrad = obj.value_and_gradient()
    xi = q.proj_horizontal(torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(3)))
    xi = xi / q.norm(xi)
    rgrad = q.egrad2rgrad(egrad)
    first = float(q.inner(rgrad, xi))
    second = float(q.inner(xi, q.ehess2rhess(egrad, obj.hvp(xi), xi)))
    assert torch.allclose(q.proj_horizontal(rgrad), rgrad, atol=1e-12)  # f is invariant: grad is horizontal

    def value(t):
        return float(obj.value(q.expmap(t * xi))) - float(f0)

    ts = np.geomspace(1e-3, 3e-2, 5)
    # a wrong gradient leaves slope 1, a wrong Hessian slope 2
    assert _slopes(lambda t: abs(value(t) - t * first), ts) == pytest.approx(2.0, abs=0.1)
    assert _slopes(lambda t: abs(value(t) - t * first - 0.5 * t * t * second), ts) >= 2.85


def test_expmap_of_vertical_vector_stays_in_the_orbit():
    c = make_case("mlp_bias")
    obj = Objective(c.model, c.loss_fn, c.data)
    for cls in (LayerScaleQuotient, NodeScaleQuotient):
        q = cls(obj.params, analyze(c.model), obj.layout)
        v = q.vertical_basis()
        assert float(torch.linalg.matrix_norm(q.proj_horizontal(v[0]).unsqueeze(0))) < 1e-12
        moved = q.expmap(0.5 * v.sum(0))
        assert float(obj.value(moved)) == pytest.approx(float(obj.value()), rel=1e-12)


def test_non_homogeneous_activation_pins_its_units():
    """GELU pins every hidden unit: nothing to project, and the node measure is the log-coordinate Hessian."""
    c = make_case("mlp_bias")
    model = mlp([5, 4, 6, 3], activation=torch.nn.GELU).double().eval()
    group = analyze(model).group
    assert group.dim == 0
    assert any("GELU is not positively homogeneous" in str(pin) for pin in group.pins)
    result = invariant_sharpness(model, c.loss_fn, c.data, metric="node", solver=Solver(tol=1e-12), progress=False)
    obj = Objective(model, c.loss_fn, c.data)
    w = obj.layout.flatten(obj.params)
    log_hessian = w[:, None] * dense_hessian(obj) * w[None, :] + torch.diag(w * obj.gradient())
    assert result.value == pytest.approx(float(torch.linalg.eigvalsh(log_hessian)[-1]), rel=1e-9)


def test_zero_norm_block_layer_metric_error_or_exclude():
    c = make_case("mlp_bias")
    with torch.no_grad():
        c.model[2].bias.zero_()
    with pytest.raises(ValueError, match=r"2\.bias"):
        invariant_sharpness(c.model, c.loss_fn, c.data, metric="layer", progress=False)
    exclude = Layer(zero_blocks="exclude")
    res = invariant_sharpness(c.model, c.loss_fn, c.data, exclude, solver=Solver(tol=1e-10), progress=False)
    model = random_rescale(c.model, kind="layer", generator=torch.Generator().manual_seed(4))
    res2 = invariant_sharpness(model, c.loss_fn, c.data, exclude, solver=Solver(tol=1e-10), progress=False)
    assert res2.value == pytest.approx(res.value, rel=1e-8)
    assert float(res.parameter_vectors()[0]["2.bias"].abs().max()) == 0.0


def test_unknown_metric_is_refused():
    c = make_case("mlp_bias")
    with pytest.raises(ValueError, match="unknown sharpness metric 'fancy'; choose one of euclidean, layer, node"):
        invariant_sharpness(c.model, c.loss_fn, c.data, metric="fancy", progress=False)
    with pytest.raises(ValueError, match="'euclidean' measure is not invariant under any rescaling"):
        invariant_sharpness(c.model, c.loss_fn, c.data, metric="euclidean", progress=False)


def _horizontal_spectrum(obj):
    """Eigenvalues, largest first, of the node-wise whitened Hessian on the horizontal space (dense reference)."""
    return torch.linalg.eigvalsh(dense_riemannian_hessian(obj, "node")).flip(0)


def test_node_measure_past_the_positive_eigenvalues_equals_the_dense_reference():
    """k reaching into the negative eigenvalues: without the horizontal projection a spurious 0 would appear."""
    torch.manual_seed(0)  # LeakyReLU: no dead unit, so no zero eigenvalue besides the rescaling directions
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LeakyReLU(0.2), torch.nn.Linear(6, 5),
                                torch.nn.LeakyReLU(0.2), torch.nn.Linear(5, 3)).double().eval()  # fmt: skip
    g = torch.Generator().manual_seed(3)
    # regression: cross-entropy would add zero eigenvalues of its own (logits shifted by a constant)
    x, y = torch.randn(300, 4, generator=g, dtype=torch.float64), torch.randn(300, 3, generator=g, dtype=torch.float64)
    loss = torch.nn.MSELoss()
    obj = Objective(model, loss, (x, y))
    reference = _horizontal_spectrum(obj)
    positive = int((reference > 1e-9).sum())
    k = positive + 4
    assert k < len(reference) and bool((reference[positive:k] < -1e-9).all())  # no zero (nor tie) among them
    result = invariant_sharpness(model, loss, (x, y), metric="node", k=k, solver=Solver(tol=1e-12), objective=obj,
                                 progress=False)  # fmt: skip
    torch.testing.assert_close(result.eigenvalues, reference[:k], rtol=0, atol=1e-9 * float(reference[0]))


def test_node_measure_at_a_saddle_point_equals_the_dense_reference():
    """A two-layer linear network at the critical point built from the smaller singular pair of its target map:
    the gradient vanishes and the Hessian is indefinite."""
    u, v = (torch.linalg.qr(torch.randn(2, 2, generator=torch.Generator().manual_seed(s), dtype=torch.float64)).Q
            for s in (0, 1))  # fmt: skip
    A = u @ torch.diag(torch.tensor([3.0, 1.0], dtype=torch.float64)) @ v.T
    X = torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)  # X^T X = 4 I
    Y = X @ A.T
    model = torch.nn.Sequential(torch.nn.Linear(2, 1, bias=False), torch.nn.Linear(1, 2, bias=False)).double()
    with torch.no_grad():  # W2 W1 = sigma_2 u_2 v_2^T: a critical point that is not the minimum
        model[0].weight.copy_(v[:, 1][None, :])
        model[1].weight.copy_(u[:, 1][:, None])
    loss = torch.nn.MSELoss()
    obj = Objective(model.eval(), loss, (X, Y))
    assert float(obj.gradient().norm()) < 1e-14
    reference = _horizontal_spectrum(obj)
    assert float(reference[0]) > 0 > float(reference[-1])  # a saddle
    result = invariant_sharpness(model, loss, (X, Y), metric="node", k=len(reference), solver=Solver(tol=1e-12),
                                 objective=obj, progress=False)  # fmt: skip
    torch.testing.assert_close(result.eigenvalues, reference, rtol=0, atol=1e-10 * float(reference.abs().max()))
    assert result.info["riemannian_grad_norm"] < 1e-14
