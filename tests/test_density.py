"""Spectral density by stochastic Lanczos quadrature, against dense eigendecompositions and moments."""

import json
import math

import matplotlib
import numpy as np
import pytest
import torch
from cases import make_case

from sharpness import (
    DenseOperator,
    Objective,
    SpectralDensity,
    dense_hessian,
    hessian_spectral_density,
    spectral_density,
)

matplotlib.use("Agg")


def random_symmetric(eigenvalues, seed: int) -> torch.Tensor:
    n = len(eigenvalues)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(seed)))
    a = (q * torch.as_tensor(eigenvalues, dtype=torch.float64)) @ q.T
    return (a + a.T) / 2


def test_each_probe_integrates_polynomials_up_to_degree_2m_minus_1_exactly():
    n, m = 60, 6
    matrix = random_symmetric(np.linspace(-3.0, 5.0, n), seed=0)
    probes = torch.randn(3, n, generator=torch.Generator().manual_seed(1))
    result = spectral_density(DenseOperator(matrix), n_steps=m, probes=probes, progress=False)
    assert result.n_probes == 3 and result.n_matvec == 3 * m
    for v, nodes, weights in zip(probes, result.nodes, result.weights):
        v = v / torch.linalg.vector_norm(v)
        assert nodes.shape == weights.shape == (m,)
        assert float(weights.sum()) == pytest.approx(1.0, abs=1e-13)
        for p in range(1, 2 * m):
            exact = float(v @ torch.linalg.matrix_power(matrix, p) @ v)
            assert float((weights * nodes**p).sum()) == pytest.approx(exact, rel=1e-9, abs=1e-9 * 5.0**p)
        # degree 2m is not integrated exactly: the test above is not vacuous
        exact = float(v @ torch.linalg.matrix_power(matrix, 2 * m) @ v)
        assert abs(float((weights * nodes ** (2 * m)).sum()) - exact) > 1e-6 * exact


def test_a_full_krylov_space_gives_the_eigenvalues_and_the_probe_components():
    eigenvalues = np.array([-2.0, -0.5, 0.3, 1.0, 2.5, 4.0, 7.0, 9.0])
    matrix = random_symmetric(eigenvalues, seed=2)
    probe = torch.randn(1, 8, generator=torch.Generator().manual_seed(3))
    result = spectral_density(DenseOperator(matrix), n_steps=20, probes=probe, progress=False)
    np.testing.assert_allclose(result.nodes[0].numpy(), eigenvalues, atol=1e-10)
    _, vectors = np.linalg.eigh(matrix.numpy())
    v = probe[0].numpy() / np.linalg.norm(probe[0].numpy())
    np.testing.assert_allclose(result.weights[0].numpy(), (vectors.T @ v) ** 2, atol=1e-10)
    assert result.n_matvec == 8  # capped at n


def test_an_invariant_krylov_space_ends_the_probe_early():
    matrix = torch.diag(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64))
    probe = torch.tensor([[1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    result = spectral_density(DenseOperator(matrix), n_steps=4, probes=probe, progress=False)
    np.testing.assert_allclose(result.nodes[0].numpy(), [1.0, 2.0], atol=1e-14)
    np.testing.assert_allclose(result.weights[0].numpy(), [0.5, 0.5], atol=1e-14)
    assert result.n_matvec == 2


def test_random_probes_estimate_the_trace_and_the_density_integrates_to_one():
    n = 200
    eigenvalues = np.concatenate([np.linspace(0.0, 1.0, n - 5), [20.0, 30.0, 40.0, 50.0, 60.0]])
    result = spectral_density(
        DenseOperator(random_symmetric(eigenvalues, seed=4)), n_probes=30, n_steps=30,
        generator=torch.Generator().manual_seed(5), progress=False,
    )  # fmt: skip
    mean, stderr = result.moment(1)
    assert stderr > 0 and abs(mean - eigenvalues.mean()) < 3 * stderr
    # With 30 steps every probe resolves the isolated top eigenvalues: the largest node is 60.
    assert max(float(t.max()) for t in result.nodes) == pytest.approx(60.0, rel=1e-10)
    grid = result.grid(4000)
    assert float(torch.trapezoid(result.density(grid), grid)) == pytest.approx(1.0, abs=1e-6)
    # most of the mass sits in [0, 1], a few hundredths near the outliers
    grid = result.grid(20000, sigma=0.05)
    values = result.density(grid, sigma=0.05)
    assert float(torch.trapezoid(values, grid)) == pytest.approx(1.0, abs=1e-6)
    inside = (grid >= -0.2) & (grid <= 1.2)
    assert float(torch.trapezoid(values[inside], grid[inside])) == pytest.approx((n - 5) / n, abs=0.02)
    with pytest.raises(ValueError, match="sigma must be positive"):
        result.density(grid, sigma=0.0)


def test_a_projected_operator_gives_the_density_of_its_restriction():
    n, r = 50, 5
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(6)))
    excluded, kept = q[:, :r].T, q[:, r:]
    restricted = np.linspace(1.0, 2.0, n - r)
    matrix = (kept * torch.as_tensor(restricted)) @ kept.T + 100.0 * excluded.T @ excluded
    op = DenseOperator((matrix + matrix.T) / 2, project=lambda v: v - excluded.T @ (excluded @ v))
    result = spectral_density(op, n_probes=4, n_steps=45, generator=torch.Generator().manual_seed(7), progress=False)
    nodes = torch.cat(result.nodes)
    assert float(nodes.max()) <= 2.0 + 1e-10 and float(nodes.min()) >= 1.0 - 1e-10
    with pytest.raises(ValueError, match="no component in the operator's subspace"):
        spectral_density(op, n_steps=3, probes=excluded[:1].clone(), progress=False)


def test_hessian_density_matches_the_dense_hessian_quadratic_forms(tmp_path):
    case = make_case("mlp_bias")
    result = hessian_spectral_density(case.model, case.loss_fn, case.data, n_probes=3, n_steps=10, seed=2,
                                      progress=False)  # fmt: skip
    assert result.info["hvp_strategy"] == "rop" and result.info["n_params"] > 10
    # the same Rademacher probes, drawn again: each quadrature's first moment is v^T H v exactly
    H = dense_hessian(Objective(case.model, case.loss_fn, case.data))
    generator = torch.Generator().manual_seed(2)
    for nodes, weights in zip(result.nodes, result.weights):
        v = torch.randn(H.shape[0], generator=generator, dtype=H.dtype).sign_()
        v = v / torch.linalg.vector_norm(v)
        assert float((weights * nodes).sum()) == pytest.approx(float(v @ H @ v), rel=1e-10)
    path = tmp_path / "density.json"
    result.save_json(path)
    saved = json.loads(path.read_text())
    assert saved["n_probes"] == 3 and saved["n_steps"] == 10 and len(saved["nodes"][0]) == 10
    assert saved["mean_eigenvalue"] == pytest.approx(result.moment(1)[0])
    assert saved["loss"] == pytest.approx(result.info["loss"])
    ax = result.plot()
    assert ax.get_yscale() == "log" and len(ax.lines) == 1
    assert math.isfinite(float(result.default_sigma()))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"n_probes": 0}, "n_probes must be a positive integer"), ({"n_steps": 0}, "n_steps must be a positive integer"),
     ({"probes": torch.ones(1, 3)}, r"probes must have shape \(p >= 1, 6\)"),
     ({"probes": torch.ones(0, 6)}, r"probes must have shape")],
)  # fmt: skip
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        spectral_density(DenseOperator(torch.eye(6, dtype=torch.float64)), progress=False, **kwargs)


def test_result_type_and_float32():
    matrix = random_symmetric(np.concatenate([np.linspace(0.0, 0.3, 39), [1.0]]), seed=8).float()
    result = spectral_density(DenseOperator(matrix), n_probes=2, n_steps=8, generator=torch.Generator().manual_seed(0),
                              progress=False)  # fmt: skip
    assert isinstance(result, SpectralDensity)
    assert all(t.dtype == torch.float64 for t in result.nodes)
    assert float(torch.cat(result.nodes).max()) == pytest.approx(1.0, abs=1e-5)


def test_one_probe_has_no_standard_error_and_its_json_says_null(tmp_path):
    result = spectral_density(DenseOperator(torch.eye(5, dtype=torch.float64) * 2.0), n_probes=1, n_steps=3,
                              generator=torch.Generator().manual_seed(0), progress=False)  # fmt: skip
    assert result.moment(1) == (pytest.approx(2.0, rel=1e-14), None)
    result.save_json(tmp_path / "d.json")
    saved = json.loads((tmp_path / "d.json").read_text())
    assert saved["mean_eigenvalue_stderr"] is None and saved["n_hvp"] == 1

