"""The metric-driven Riemannian Hessian (manifolds.MetricQuotient) against closed forms and dense references.

References are built independently: the closed-form layer and node quotients of manifolds._quotient, the dense
spectra of tests/test_invariant.py, and Christoffel symbols from an explicit (n, n, n) jacfwd of a dense metric.
"""

import numpy as np
import pytest
import scipy.linalg
import torch
from cases import make_case
from test_invariant import _null_space, layer_reference, node_reference

from manifolds import LayerScaleQuotient, Metric, MetricQuotient, NodeScaleQuotient, analyze, layer_metric, node_metric
from sharpness import CallableOperator, Objective, dense_hessian, lanczos

TIGHT = 1e-10


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _problem(case):
    obj = Objective(case.model, case.loss_fn, case.data)
    return obj, obj.layout.flatten(obj.params), obj.gradient(), dense_hessian(obj)


def _operator_matrix(op, n: int) -> torch.Tensor:
    return torch.stack([op(e) for e in torch.eye(n)]).T


def _horizontal_spectrum(q, g, H) -> np.ndarray:
    """Eigenvalues (descending) of the whitened quotient Hessian on the whitened horizontal space."""
    n = g.numel()
    M = _operator_matrix(q.whitened_hessian(g, lambda v: H @ v), n)
    assert rel(M, M.T) < TIGHT  # symmetric in whitened coordinates
    Q = _null_space(q.whitened_vertical_basis(), n)
    return np.linalg.eigvalsh((Q.T @ M @ Q).numpy())[::-1]


def _random(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# -- the closed forms on ReLU networks ----------------------------------------------------------------------------

CLOSED = {"layer": (LayerScaleQuotient, layer_metric, layer_reference),
          "node": (NodeScaleQuotient, lambda layout: node_metric(), node_reference)}


@pytest.mark.parametrize("kind", ["layer", "node"])
def test_metric_driven_hessian_equals_the_closed_form(rescalable_case, kind):
    closed_cls, make_metric, reference = CLOSED[kind]
    obj, w, g, H = _problem(rescalable_case)
    closed = closed_cls(obj.params, analyze(rescalable_case.model), obj.layout)
    q = MetricQuotient(make_metric(obj.layout), w, vertical=closed.vertical_basis().T)
    assert float(closed.norm(closed.egrad2rgrad(g))) > 1e-3  # non-critical: the connection terms matter
    for seed in range(3):
        xi = _random(w.numel(), seed)
        assert rel(q.connection_hessian(g, H @ xi, xi), closed.connection_hessian(g, H @ xi, xi)) < TIGHT
        h = closed.proj_horizontal(xi)
        assert rel(q.proj_horizontal(xi), h) < TIGHT
        assert rel(q.ehess2rhess(g, H @ h, h), closed.ehess2rhess(g, H @ h, h)) < TIGHT
    ours = _horizontal_spectrum(q, g, H)
    np.testing.assert_allclose(ours, reference(rescalable_case), rtol=TIGHT, atol=TIGHT * abs(ours).max())


def test_node_bilinear_form_is_the_log_coordinate_hessian():
    """In log coordinates the node Hessian is diag(w) H diag(w) + diag(w g); as a form on tangent vectors
    xi = w * zeta this is xi^T H eta + sum g xi eta / w."""
    obj, w, g, H = _problem(make_case("mlp_bias"))
    q = MetricQuotient(node_metric(), w)
    xi, eta = _random(w.numel(), 1), _random(w.numel(), 2)
    log_form = (xi / w) @ (torch.diag(w) @ H @ torch.diag(w) + torch.diag(w * g)) @ (eta / w)
    assert abs(float(q.hessian_form(g, xi, eta, H @ eta) - log_form)) < TIGHT * float(log_form.abs())


# -- a generic nonlinear metric against Christoffel symbols in index notation --------------------------------------

N = 13  # a 2-3-1 tanh network


def _tiny_loss(w: torch.Tensor) -> torch.Tensor:
    X = torch.linspace(-1, 1, 14).reshape(7, 2)
    y = torch.sin(3 * X[:, :1]) + X[:, 1:]
    W1, b1, W2, b2 = w[:6].reshape(3, 2), w[6:9], w[9:12].reshape(1, 3), w[12:]
    return ((torch.tanh(X @ W1.T + b1) @ W2.T + b2 - y) ** 2).mean()


_MIX = torch.randn(N, N, generator=torch.Generator().manual_seed(7), dtype=torch.float64) / N**0.5


def _coupling(w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(_MIX @ w)


def _dense_metric(w: torch.Tensor) -> torch.Tensor:  # diag(1 + w^2) + 0.3 s s^T: positive definite, nonlinear in w
    s = _coupling(w)
    return torch.diag(1 + w * w) + 0.3 * torch.outer(s, s)


def _apply(w, xi):
    s = _coupling(w)
    return (1 + w * w) * xi + 0.3 * s * (s @ xi)


def _dense_reference(w):
    """Euclidean g, the (N, N, N) Christoffel symbols Gamma^l_ij, the bilinear Hessian and G, by jacfwd."""
    G = _dense_metric(w)
    dG = torch.func.jacfwd(_dense_metric)(w)  # dG[i, j, k] = d_k G_ij
    first = 0.5 * (dG.permute(0, 2, 1) + dG - dG.permute(2, 0, 1))  # [k, i, j] = 1/2 (d_i G_kj + d_j G_ki - d_k G_ij)
    gamma = torch.einsum("lk,kij->lij", torch.linalg.inv(G), first)
    g = torch.func.grad(_tiny_loss)(w)
    form = torch.func.hessian(_tiny_loss)(w) - torch.einsum("l,lij->ij", g, gamma)
    return g, gamma, form, G


def _cholesky_whitening() -> dict:
    """W = L^T with G = L L^T: a non-symmetric factor (W^T W = G), to check that any factor gives the same Hessian."""
    def whiten(w, xi):
        return torch.linalg.cholesky(_dense_metric(w)).T @ xi

    def unwhiten(w, zeta):
        return torch.linalg.solve_triangular(torch.linalg.cholesky(_dense_metric(w)).T, zeta[:, None], upper=True)[:, 0]

    return {"solve": lambda w, v: torch.linalg.solve(_dense_metric(w), v), "whiten": whiten, "unwhiten": unwhiten}


GENERIC = {
    "dense fallback": lambda: Metric(_apply),
    "quadratic form": lambda: Metric.from_quadratic_form(lambda w, xi: xi @ _apply(w, xi)),
    "cholesky factor": lambda: Metric(_apply, **_cholesky_whitening()),
}


@pytest.mark.parametrize("variant", list(GENERIC))
def test_generic_metric_matches_dense_christoffel_symbols(variant):
    w = 0.8 * _random(N, 0)
    g, gamma, form, G = _dense_reference(w)
    H = torch.func.hessian(_tiny_loss)(w)
    q = MetricQuotient(GENERIC[variant](), w)
    xi, eta = _random(N, 1), _random(N, 2)
    assert rel(q.christoffel(xi, eta), torch.einsum("lij,i,j->l", gamma, xi, eta)) < TIGHT
    assert rel(q.christoffel(xi), torch.einsum("lij,i,j->l", gamma, xi, xi)) < TIGHT
    assert rel(q.christoffel(xi, eta), q.christoffel(eta, xi)) < TIGHT
    assert abs(float(q.hessian_form(g, xi, eta, H @ eta) - xi @ form @ eta)) < TIGHT * float(form.norm())
    assert rel(q.connection_hessian(g, H @ xi, xi), torch.linalg.solve(G, form @ xi)) < TIGHT
    # G-self-adjoint, and the whitened operator's spectrum is the generalized one of (form, G)
    assert abs(float(q.inner(eta, q.connection_hessian(g, H @ xi, xi)) - q.inner(xi, q.connection_hessian(
        g, H @ eta, eta)))) < TIGHT * float(form.norm())
    expected = scipy.linalg.eigh(form.numpy(), G.numpy(), eigvals_only=True)[::-1]
    np.testing.assert_allclose(_horizontal_spectrum(q, g, H), expected, rtol=TIGHT, atol=TIGHT * abs(expected).max())
    assert float(form.norm() - H.norm()) != 0 and rel(form, H) > 1e-2  # the connection term is not negligible


def _slope(errors, ts) -> float:
    return float(np.polyfit(np.log(ts), np.log(errors), 1)[0])


def test_taylor_expansion_along_the_second_order_geodesic():
    """f(w + t xi - t^2/2 Gamma(xi, xi)) = f + t g.xi + t^2/2 Hess f(xi, xi) + O(t^3); with the Euclidean
    Hessian in place of Hess f the error is O(t^2) (the test can fail)."""
    problems = []
    w = 0.8 * _random(N, 0)
    problems.append((_tiny_loss, MetricQuotient(Metric(_apply), w), w))
    case = make_case("mlp_bias")
    obj = Objective(case.model, case.loss_fn, case.data)
    wc = obj.layout.flatten(obj.params)

    def loss(p):
        return case.loss_fn(torch.func.functional_call(case.model, obj.layout.unflatten(p), (case.X,)), case.y)

    problems.append((loss, MetricQuotient(layer_metric(obj.layout), wc), wc))
    ts = np.geomspace(3e-4, 1e-2, 5)
    for f, q, w in problems:
        g = torch.func.grad(f)(w)
        xi = _random(w.numel(), 5)
        Hxi = torch.func.jvp(torch.func.grad(f), (w,), (xi,))[1]
        f0, first, second = float(f(w)), float(g @ xi), float(q.hessian_form(g, xi, xi, Hxi))
        values = [float(f(q.second_order_geodesic(xi, t))) - f0 - t * first for t in ts]
        riemannian = [abs(v - 0.5 * t * t * second) for v, t in zip(values, ts)]
        euclidean = [abs(v - 0.5 * t * t * float(xi @ Hxi)) for v, t in zip(values, ts)]
        assert _slope(riemannian, ts) >= 2.85
        assert _slope(euclidean, ts) == pytest.approx(2.0, abs=0.1)


# -- a GL(r) symmetry: the balanced metric on a factorization --------------------------------------------------------

M_ROWS, P_ROWS, R = 5, 4, 2
NF = (M_ROWS + P_ROWS) * R


def _factors(w):
    return w[: M_ROWS * R].reshape(M_ROWS, R), w[M_ROWS * R:].reshape(P_ROWS, R)


_TARGET = torch.randn(M_ROWS, P_ROWS, generator=torch.Generator().manual_seed(11), dtype=torch.float64)


def _factored_loss(w):  # any function of G K^T; non-convex so no point is special
    G, K = _factors(w)
    Z = G @ K.T
    return 0.5 * ((Z - _TARGET) ** 2).sum() + 0.1 * torch.sin(Z).sum()


def _gram_power(F: torch.Tensor, power: float) -> torch.Tensor:
    lam, vec = torch.linalg.eigh(F.T @ F)
    return (vec * lam**power) @ vec.T


def _balanced(power_apply: float) -> Metric:
    """tr((G^T G)^-1 xi_G^T eta_G) + tr((K^T K)^-1 xi_K^T eta_K); invariant under (G, K) -> (G A, K A^-T)."""
    def act(power):
        def f(w, xi):
            G, K = _factors(w)
            xG, xK = _factors(xi)
            return torch.cat([(xG @ _gram_power(G, power)).reshape(-1), (xK @ _gram_power(K, power)).reshape(-1)])
        return f

    return Metric(act(power_apply), solve=act(-power_apply), whiten=act(power_apply / 2),
                  unwhiten=act(-power_apply / 2), name="balanced")


def _vertical(w):
    """(G Omega, -K Omega^T) for the r^2 elementary Omega: the tangents of the GL(r) orbit, (n, r^2)."""
    G, K = _factors(w)
    cols = []
    for a in range(R):
        for b in range(R):
            omega = torch.zeros(R, R, dtype=w.dtype)
            omega[a, b] = 1.0
            cols.append(torch.cat([(G @ omega).reshape(-1), (-K @ omega.T).reshape(-1)]))
    return torch.stack(cols, dim=1)


def _act(w, A):
    G, K = _factors(w)
    return torch.cat([(G @ A).reshape(-1), (K @ torch.linalg.inv(A).T).reshape(-1)])


def _quotient_spectrum(metric, w):
    g, H = torch.func.grad(_factored_loss)(w), torch.func.hessian(_factored_loss)(w)
    return _horizontal_spectrum(MetricQuotient(metric, w, vertical=_vertical), g, H)


def test_balanced_metric_spectrum_is_invariant_under_gl():
    w = _random(NF, 3)
    A = torch.tensor([[2.5, 0.7], [-0.4, 0.3]], dtype=torch.float64)  # a hand-built group element, det 1.03
    moved = _act(w, A)
    assert abs(float(_factored_loss(moved) - _factored_loss(w))) < 1e-12
    assert float(torch.func.grad(_factored_loss)(w).norm()) > 1e-2  # not a critical point
    for metric in (_balanced(-1.0), Metric(_balanced(-1.0).apply)):  # given factors, and the dense fallback
        before, after = _quotient_spectrum(metric, w), _quotient_spectrum(metric, moved)
        assert before.size == NF - R * R
        np.testing.assert_allclose(after, before, rtol=TIGHT, atol=TIGHT * abs(before).max())
    euclid = [float(torch.linalg.eigvalsh(torch.func.hessian(_factored_loss)(p))[-1]) for p in (w, moved)]
    assert euclid[1] / euclid[0] > 2 or euclid[0] / euclid[1] > 2
    # the Euclidean metric on the same quotient is not an isometry of the group: its spectrum moves
    flat = Metric(lambda w, xi: xi, solve=lambda w, v: v, whiten=lambda w, x: x, unwhiten=lambda w, z: z)
    assert abs(_quotient_spectrum(flat, moved)[0] / _quotient_spectrum(flat, w)[0] - 1) > 1e-2


def test_balanced_vertical_directions_are_projected_out():
    w = _random(NF, 3)
    q = MetricQuotient(_balanced(-1.0), w, vertical=_vertical(w))
    assert q.vertical_dim == R * R
    V = _vertical(w)
    for v in V.T:
        assert float(q.proj_horizontal(v).norm()) < TIGHT * float(v.norm())
    h = q.proj_horizontal(_random(NF, 4))
    assert float((V.T @ q.metric.apply(w, h)).abs().max()) < TIGHT * float(h.norm())  # G-orthogonal to V


# -- refusals --------------------------------------------------------------------------------------------------------


def test_refuses_points_and_metrics_it_cannot_handle():
    w = _random(N, 0)
    zero = w.clone()
    zero[3] = 0.0
    with pytest.raises(ValueError, match="not finite at this point"):
        MetricQuotient(node_metric(), zero)
    with pytest.raises(ValueError, match="exceeds dense_limit"):
        MetricQuotient(Metric(_apply), w, dense_limit=5)
    with pytest.raises(ValueError, match="not positive definite"):
        MetricQuotient(Metric(lambda p, xi: xi - 2 * (xi @ p) * p / (p @ p)), w)  # a reflection: eigenvalue -1
    with pytest.raises(ValueError, match="shape \\(n, d\\)"):
        MetricQuotient(node_metric(), w, vertical=torch.ones(N + 1, 2))
    with pytest.raises(ValueError, match="both whiten and unwhiten"):
        Metric(_apply, whiten=lambda p, xi: xi)


def test_the_whitened_operator_feeds_the_toolkit_lanczos():
    """Built as sharpness.measures._quotient builds its operator (whitened map + projection): Lanczos finds
    the top eigenvalues of the dense horizontal spectrum, for the balanced metric and the layer metric."""
    w = _random(NF, 3)
    g, H = torch.func.grad(_factored_loss)(w), torch.func.hessian(_factored_loss)(w)
    obj, wc, gc, Hc = _problem(make_case("mlp_bias"))
    closed = LayerScaleQuotient(obj.params, analyze(make_case("mlp_bias").model), obj.layout)
    for q, grad, hess in ((MetricQuotient(_balanced(-1.0), w, vertical=_vertical), g, H),
                          (MetricQuotient(layer_metric(obj.layout), wc, vertical=closed.vertical_basis().T), gc, Hc)):
        op = CallableOperator(q.whitened_hessian(grad, lambda v, hess=hess: hess @ v), grad.numel(), grad.dtype,
                              "cpu", project=q.whitened_projection)
        res = lanczos(op, k=2, tol=1e-12, generator=torch.Generator().manual_seed(0), progress=False)
        np.testing.assert_allclose(res.eigenvalues.numpy(), _horizontal_spectrum(q, grad, hess)[:2], rtol=1e-9)
        top = q.unwhiten(res.eigenvectors[0])  # a horizontal tangent vector of unit g-norm
        assert abs(float(q.norm(top)) - 1) < 1e-9 and rel(q.proj_horizontal(top), top) < 1e-9
