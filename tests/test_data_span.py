"""Data-span coordinates of the first Linear layer: the operator against the dense Hessian, and the Euclidean
solves that use it (eigenpairs, chunking, fallback where zero eigenvalues rank among the top k)."""

import numpy as np
import pytest
import torch
from cases import make_case, mlp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sharpness import Euclidean, Objective, Solver, dense_hessian, euclidean_sharpness
from sharpness.products._data_span import DataSpanHessian, data_span_hessian
from sharpness.products._hessian import HessianOperator


def span_operator(case, **objective_kwargs) -> DataSpanHessian:
    span = data_span_hessian(HessianOperator(Objective(case.model, case.loss_fn, case.data, **objective_kwargs)))
    assert span is not None
    return span


def dense_factor(factor) -> torch.Tensor:
    """The triangular factor's blocks assembled into one ``(n, n)`` float64 matrix."""
    n = factor.bounds[-1]
    out = torch.zeros(n, n, dtype=torch.float64)
    for (i, j), block in factor.blocks.items():
        out[factor.rows(i), factor.rows(j)] = block.double()
    return out


def span_map(span: DataSpanHessian) -> torch.Tensor:
    """``(N, size)``: the isometry from the operator's coordinates to parameters, built densely in float64
    (``V = U L^{-1} X`` for the first weight, the identity elsewhere)."""
    X = torch.cat([state.saved[0] for state in span.states]).double()
    basis = torch.linalg.solve_triangular(dense_factor(span.factor), X, upper=False)  # L^{-1} X: orthonormal rows
    params = span.objective.layout
    columns = []
    for u in torch.eye(span.size, dtype=torch.float64):
        parts = span.layout.unflatten(u)
        full = {name: (parts[name] @ basis if name == span.weight else parts[name]) for name in params.names}
        columns.append(params.flatten(full))
    return torch.stack(columns, dim=1)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("chunk_size", [None, 3])
def test_operator_is_the_hessian_on_the_span_of_the_data(bias, chunk_size):
    case = make_case("mlp_wide")
    if not bias:
        torch.manual_seed(1)
        case.model = mlp([10, 6, 4, 3], bias=False).double().eval()
    span = span_operator(case, chunk_size=chunk_size)
    assert (span.samples, span.features) == (7, 10) and span.size == case.model[0].weight.numel() * 7 // 10 + sum(
        p.numel() for name, p in case.model.named_parameters() if name != "0.weight"
    )
    A = torch.stack([span.matvec(e) for e in torch.eye(span.size)], dim=1)
    H = dense_hessian(Objective(case.model, case.loss_fn, case.data))
    V = span_map(span)
    torch.testing.assert_close(V.T @ V, torch.eye(span.size), rtol=0, atol=1e-12)  # isometric coordinates
    torch.testing.assert_close(A, A.T, rtol=0, atol=1e-13)
    torch.testing.assert_close(H @ V, V @ A, rtol=0, atol=1e-12)  # H maps the span into itself as A says
    torch.testing.assert_close(A, V.T @ H @ V, rtol=0, atol=1e-12)
    # every nonzero eigenvalue of H is one of A; H is zero outside the span
    h = np.linalg.eigvalsh(H.numpy())
    a = np.linalg.eigvalsh(A.numpy())
    nonzero = h[np.abs(h) > 1e-10]
    np.testing.assert_allclose(np.sort(nonzero), np.sort(a[np.abs(a) > 1e-10]), rtol=1e-10, atol=1e-12)
    outside = torch.eye(H.shape[0]) - V @ V.T
    assert float((H @ outside).abs().max()) < 1e-12


def test_products_add_into_out_and_count():
    span = span_operator(make_case("mlp_wide"))
    u = torch.randn(span.size, generator=torch.Generator().manual_seed(0))
    out = torch.randn(span.size, generator=torch.Generator().manual_seed(1))
    expected = out + span.matvec(u)
    before = span.n_matvec
    assert span.matvec_add(u, out) is out
    torch.testing.assert_close(out, expected, rtol=1e-14, atol=1e-14)
    assert span.n_matvec == before + 1


@pytest.mark.parametrize("method", ["lanczos", "low-memory-lanczos", "power"])
def test_top_eigenpairs_match_dense_and_come_back_in_parameter_space(method):
    case = make_case("mlp_wide")
    H = dense_hessian(Objective(case.model, case.loss_fn, case.data))
    ref = np.linalg.eigvalsh(H.numpy())[::-1][:3]
    assert ref[2] > 1e-6  # positive top 3: the span solve's answer stands
    tol = 1e-13 if method == "power" else 1e-10
    res = euclidean_sharpness(case.model, case.loss_fn, case.data, k=3,
                              solver=Solver(method=method, tol=tol, max_iter=5000),
                              progress=False)  # fmt: skip
    full = euclidean_sharpness(case.model, case.loss_fn, case.data, k=3,
                               solver=Solver(method=method, tol=tol, max_iter=5000),
                               progress=False, data_span=False)  # fmt: skip
    assert res.info["data_span"] == {"samples": 7, "features": 10} and full.info["data_span"] is None
    np.testing.assert_allclose(res.eigenvalues.numpy(), ref, rtol=1e-8)
    np.testing.assert_allclose(full.eigenvalues.numpy(), ref, rtol=1e-8)
    assert res.eigenvectors.shape == (3, H.shape[0])
    for lam, v in zip(res.eigenvalues, res.eigenvectors):
        assert float(v.norm()) == pytest.approx(1.0, abs=1e-14)
        assert float(v[v.abs().argmax()]) > 0  # canonical sign
        assert float(torch.linalg.vector_norm(H @ v - lam * v)) / float(lam) < (1e-5 if method == "power" else 1e-8)
    # the products that map the eigenvectors back are counted
    assert res.n_matvec >= res.iterations + 3 if method != "power" else res.n_matvec > 3


@pytest.mark.parametrize("chunk_size", [1, 3, None])
def test_same_eigenvalues_whatever_chunking_and_data_form(chunk_size):
    case = make_case("mlp_wide")
    H = dense_hessian(Objective(case.model, case.loss_fn, case.data))
    ref = np.linalg.eigvalsh(H.numpy())[::-1][:2]
    for data in (case.data, DataLoader(TensorDataset(case.X, case.y), batch_size=2)):
        objective = Objective(case.model, case.loss_fn, data, chunk_size=chunk_size)
        res = Euclidean().sharpness(objective, 2, Solver(tol=1e-10), progress=False)
        assert res.info["data_span"] is not None
        np.testing.assert_allclose(res.eigenvalues.numpy(), ref, rtol=1e-8)


def test_sum_reduction_and_float32():
    case = make_case("mlp_wide")
    mean = euclidean_sharpness(case.model, case.loss_fn, case.data, solver=Solver(tol=1e-10), progress=False)
    total = euclidean_sharpness(case.model, nn.CrossEntropyLoss(reduction="sum"), case.data, solver=Solver(tol=1e-10),
                                progress=False)  # fmt: skip
    assert total.info["data_span"] is not None
    assert total.value == pytest.approx(mean.value * 7, rel=1e-10)
    single = euclidean_sharpness(case.model, case.loss_fn, case.data,
                                 solver=Solver(tol=1e-5), dtype=torch.float32, progress=False)
    assert single.info["data_span"] is not None and single.eigenvectors.dtype == torch.float32
    assert single.value == pytest.approx(mean.value, rel=1e-5)


def test_zero_eigenvalues_outside_the_span_are_not_missed():
    # A linear model under a negated squared error: the Hessian is negative on the span of the 7 samples and
    # zero outside it, so its top eigenvalues are zeros the span solve cannot see: it falls back to full
    # coordinates, and counts the products it spent.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 3, bias=False)).double().eval()
    X = torch.randn(7, 10, generator=torch.Generator().manual_seed(2))
    y = torch.randn(7, 3, generator=torch.Generator().manual_seed(3))
    loss_fn = lambda out, target: -nn.functional.mse_loss(out, target)  # noqa: E731
    H = dense_hessian(Objective(model, loss_fn, (X, y)))
    assert np.linalg.eigvalsh(H.numpy())[-1] == pytest.approx(0.0, abs=1e-14)
    span = data_span_hessian(HessianOperator(Objective(model, loss_fn, (X, y))))
    assert float(np.linalg.eigvalsh(torch.stack([span.matvec(e) for e in torch.eye(span.size)]).numpy())[-1]) < -1e-3
    # (a single Krylov vector sees one copy of the repeated 0: deflated power iteration finds several)
    for method, k in [("lanczos", 1), ("power", 3)]:
        res = euclidean_sharpness(model, loss_fn, (X, y), k=k, solver=Solver(method=method, tol=1e-10), progress=False)
        assert res.info["data_span"] is None and res.converged
        np.testing.assert_allclose(res.eigenvalues.numpy(), 0.0, atol=1e-12)
        for v in res.eigenvectors:
            assert float(torch.linalg.vector_norm(H @ v)) < (1e-12 if method == "lanczos" else 1e-6)
        full = euclidean_sharpness(model, loss_fn, (X, y), k=k, solver=Solver(method=method, tol=1e-10), progress=False,
                                   data_span=False)  # fmt: skip
        assert res.n_matvec > full.n_matvec


def test_where_data_span_coordinates_do_not_apply():
    wide = make_case("mlp_wide")
    for case, hvp in [
        (make_case("mlp_bias"), "auto"),  # 23 samples of 5 features
        (make_case("cnn"), "auto"),  # the first layer is a convolution
        (wide, "graph"),  # no R-operator products
    ]:
        res = euclidean_sharpness(case.model, case.loss_fn, case.data, solver=Solver(tol=1e-8, hvp=hvp), progress=False)
        assert res.info["data_span"] is None
        with pytest.raises(ValueError, match="data-span coordinates need"):
            euclidean_sharpness(case.model, case.loss_fn, case.data, solver=Solver(hvp=hvp), data_span=True,
                                progress=False)  # fmt: skip
    # fewer samples than features, but too close to their number for the set-up to pay for itself
    from sharpness.products._data_span import _pays_off

    assert _pays_off(500, 784, 300) and _pays_off(700, 784, 300) and _pays_off(7, 10, 6)  # F1; 3 x 3 blocks; tiny
    assert not _pays_off(3000, 3072, 300) and not _pays_off(750, 784, 300)
    torch.manual_seed(0)
    near = mlp([310, 2, 3]).double().eval()  # 300 samples of 310 features, 2 hidden units
    X, y = torch.randn(300, 310, generator=torch.Generator().manual_seed(1)), torch.arange(300) % 3
    assert not _pays_off(300, 310, 2)
    assert euclidean_sharpness(near, wide.loss_fn, (X, y),
                               solver=Solver(tol=1e-8), progress=False).info["data_span"] is None
    # the chunk states do not fit in memory: products stream, the span operator needs them kept
    streamed = Objective(wide.model, wide.loss_fn, wide.data, chunk_size=2, memory_budget=1)
    assert data_span_hessian(HessianOperator(streamed)) is None


def test_duplicate_samples_factor_by_qr_and_keep_the_spectrum():
    from sharpness.products._data_span import _gram_factor

    case = make_case("mlp_wide")
    X, y = torch.cat([case.X, case.X[:2]]), torch.cat([case.y, case.y[:2]])  # 9 samples, rank 7
    with pytest.raises(torch.linalg.LinAlgError):
        torch.linalg.cholesky(X @ X.T)
    for chunks in ([X], [X[:4], X[4:]]):
        lower = _gram_factor(chunks)
        torch.testing.assert_close(lower @ lower.T, X @ X.T, rtol=0, atol=1e-12)
        assert torch.equal(lower, torch.tril(lower))
    well_posed = _gram_factor([case.X[:3], case.X[3:]])  # blocks of the Gram matrix: the Cholesky factor
    torch.testing.assert_close(well_posed, torch.linalg.cholesky(case.X @ case.X.T), rtol=0, atol=1e-13)
    H = dense_hessian(Objective(case.model, case.loss_fn, (X, y)))
    ref = np.linalg.eigvalsh(H.numpy())[::-1][:3]
    res = euclidean_sharpness(case.model, case.loss_fn, (X, y), k=3, solver=Solver(tol=1e-10), progress=False)
    assert res.info["data_span"] == {"samples": 9, "features": 10}
    np.testing.assert_allclose(res.eigenvalues.numpy(), ref, rtol=1e-8)
    for lam, v in zip(res.eigenvalues, res.eigenvectors):
        assert float(torch.linalg.vector_norm(H @ v - lam * v)) / float(lam) < 1e-8


@pytest.mark.parametrize("n", [7, 374, 375, 1000, 1301])  # 1, 1, 2, 4 and 4 blocks per side
def test_triangular_products_by_blocks_are_the_dense_ones(n):
    from sharpness.products._data_span import _LowerTriangular

    g = torch.Generator().manual_seed(n)
    lower = torch.tril(torch.randn(n, n, generator=g))
    factor = _LowerTriangular(lower)
    assert factor.count == {7: 1, 374: 1, 375: 2, 1000: 4, 1301: 4}[n]
    b = torch.randn(n, 5, generator=g)
    torch.testing.assert_close(factor.left(b, torch.empty(n, 5)), lower @ b, rtol=0, atol=1e-10 * n)
    a = torch.randn(3, n, generator=g)
    wide = torch.randn(3, n + 4, generator=g)
    out = wide[:, 2 : n + 2]  # not contiguous: a block of a longer vector, as the operator's output is
    expected = out + a @ lower
    factor.right_add(a, out)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10 * n)
    torch.testing.assert_close(dense_factor(factor), lower, rtol=0, atol=0)


def test_more_pairs_than_the_span_has_are_solved_in_full_coordinates():
    case = make_case("mlp_wide")
    span = span_operator(case)
    k = span.size + 1
    res = euclidean_sharpness(case.model, case.loss_fn, case.data, k=k,
                              solver=Solver(method="power", tol=1e-6, max_iter=200),
                              progress=False)  # fmt: skip
    assert res.info["data_span"] is None and res.eigenvalues.shape == (k,)
