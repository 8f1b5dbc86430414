"""Euclidean sharpness: top eigenvalues of the whole-data-set Hessian against numpy.linalg.eigh."""

import json

import numpy as np
import pytest
import torch
from cases import make_case
from torch.utils.data import DataLoader, TensorDataset

from sharpness import Euclidean, Objective, Solver, dense_hessian, euclidean_sharpness, hutchinson_trace
from sharpness.products._hessian import HessianOperator

SOLVER_TOL = {"lanczos": 1e-10, "low-memory-lanczos": 1e-10, "power": 1e-13}


def dense_top(case, k):
    H = dense_hessian(Objective(case.model, case.loss_fn, case.data)).numpy()
    return np.linalg.eigh(H)[0][::-1][:k], H


@pytest.mark.parametrize("method", ["lanczos", "low-memory-lanczos", "power"])
def test_top3_match_dense_eigh(case, method):
    ref, _ = dense_top(case, 3)
    res = euclidean_sharpness(case.model, case.loss_fn, case.data, k=3,
                              solver=Solver(method=method, tol=SOLVER_TOL[method], max_iter=5000), progress=False)
    assert res.converged
    np.testing.assert_allclose(res.eigenvalues.numpy(), ref, rtol=1e-8, atol=0)
    assert res.value == pytest.approx(ref[0], rel=1e-8)
    # eigenvectors come back shaped like the parameters and satisfy H v = lambda v
    vecs = res.parameter_vectors()
    assert set(vecs[0]) == {k for k, _ in case.model.named_parameters()}
    obj = Objective(case.model, case.loss_fn, case.data)
    for lam, v in zip(res.eigenvalues, res.eigenvectors):
        r = torch.linalg.vector_norm(obj.hvp(v) - lam * v) / abs(lam)
        assert r < 1e-5 if method == "power" else r < 1e-7


def test_negative_dominant_spectrum_reports_largest_algebraic():
    case = make_case("negative_dominant")
    ref, H = dense_top(case, 1)
    full = np.linalg.eigvalsh(H)
    assert abs(full[0]) > abs(full[-1])  # the case really is negative-dominant
    for method in ("lanczos", "low-memory-lanczos", "power"):
        res = euclidean_sharpness(case.model, case.loss_fn, case.data,
                                  solver=Solver(method=method, tol=SOLVER_TOL[method], max_iter=5000), progress=False)
        assert res.value == pytest.approx(ref[0], rel=1e-8), method


@pytest.mark.parametrize("chunk_size", [1, 7, None])
def test_same_eigenvalues_whatever_chunking_and_data_form(chunk_size):
    case = make_case("cnn")
    ref, _ = dense_top(case, 2)
    for data in (case.data, DataLoader(TensorDataset(case.X, case.y), batch_size=4)):
        objective = Objective(case.model, case.loss_fn, data, chunk_size=chunk_size)
        res = Euclidean().sharpness(objective, 2, Solver(tol=1e-10), progress=False)
        np.testing.assert_allclose(res.eigenvalues.numpy(), ref, rtol=1e-8)


def test_sum_reduction_scales_eigenvalues_by_n():
    case = make_case("mlp_mse_sum")
    total = euclidean_sharpness(case.model, case.loss_fn, case.data, solver=Solver(tol=1e-10), progress=False)
    mean = euclidean_sharpness(case.model, torch.nn.MSELoss(), case.data, solver=Solver(tol=1e-10), progress=False)
    assert total.value == pytest.approx(mean.value * case.y.numel(), rel=1e-9)


def test_hutchinson_trace_within_three_standard_errors(case):
    obj = Objective(case.model, case.loss_fn, case.data)
    trace = float(np.trace(dense_hessian(obj).numpy()))
    res = hutchinson_trace(HessianOperator(obj), n_probes=200, generator=torch.Generator().manual_seed(0))
    assert res.stderr > 0
    assert abs(res.estimate - trace) <= 3 * res.stderr


def test_result_reports_how_it_was_obtained(tmp_path):
    case = make_case("mlp_bias")
    res = euclidean_sharpness(case.model, case.loss_fn, case.data, k=2, solver=Solver(tol=1e-8), progress=False)
    assert res.method == "lanczos" and res.n_matvec > 0 and res.iterations > 0 and res.history
    assert res.info["metric"] == "euclidean" and res.info["n_params"] == 75 and res.info["n_samples"] == 23
    path = tmp_path / "r.json"
    res.save_json(path)
    loaded = json.loads(path.read_text())
    assert loaded["value"] == pytest.approx(res.value) and loaded["n_hvp"] == res.n_matvec
    assert loaded["converged"] is True and len(loaded["eigenvalues"]) == 2


def test_float32_agrees_with_float64():
    case = make_case("mlp_bias")
    r64 = euclidean_sharpness(case.model, case.loss_fn, case.data, solver=Solver(tol=1e-10), progress=False)
    r32 = euclidean_sharpness(case.model, case.loss_fn, case.data,
                              solver=Solver(tol=1e-5), dtype=torch.float32, progress=False)
    assert r32.eigenvectors.dtype == torch.float32
    assert r32.value == pytest.approx(r64.value, rel=1e-4)
