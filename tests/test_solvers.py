"""Eigen-solvers and the trace estimator against dense float64 references (numpy.linalg.eigh)."""

import json
import math

import numpy as np
import pytest
import torch

from sharpness import (
    CallableOperator,
    DenseOperator,
    hutchinson_trace,
    lanczos,
    low_memory_lanczos,
    power_iteration,
)

SOLVERS = [lanczos, low_memory_lanczos, power_iteration]
METHOD = {lanczos: "lanczos", low_memory_lanczos: "low-memory-lanczos", power_iteration: "power"}
# Power iteration's vectors converge half as fast (in digits) as its Rayleigh quotients.
VECTOR_TOL = {lanczos: 1e-8, low_memory_lanczos: 1e-8, power_iteration: 1e-5}
RESIDUAL_TOL = {lanczos: 1e-8, low_memory_lanczos: 1e-8, power_iteration: 1e-5}
SOLVE_TOL = {lanczos: 1e-10, low_memory_lanczos: 1e-10, power_iteration: 1e-12}


def orthogonal(n: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(seed)))
    return q


def with_spectrum(eigenvalues, seed: int = 0) -> torch.Tensor:
    """``Q diag(eigenvalues) Q^T`` for a random orthogonal ``Q``, exactly symmetric."""
    q = orthogonal(len(eigenvalues), seed)
    a = (q * torch.as_tensor(eigenvalues, dtype=torch.float64)) @ q.T
    return (a + a.T) / 2


def well_separated(n: int) -> np.ndarray:
    return np.concatenate([[100.0, 60.0, 40.0, 20.0], np.linspace(-10.0, 10.0, n - 4)])


def reference(matrix: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top ``k`` eigenvalues (descending) and eigenvectors ``(k, n)`` of a dense symmetric matrix."""
    values, vectors = np.linalg.eigh(matrix.numpy())
    return values[::-1][:k], vectors[:, ::-1][:, :k].T


def solve(solver, op, k, **kwargs):
    kwargs.setdefault("tol", SOLVE_TOL[solver])
    return solver(op, k=k, generator=torch.Generator().manual_seed(0), progress=False, **kwargs)


def sign_aligned_distance(u: torch.Tensor, v: np.ndarray) -> float:
    v = torch.as_tensor(v.copy())
    return min(float(torch.linalg.norm(u - v)), float(torch.linalg.norm(u + v)))


def complement_projection(n: int, r: int, seed: int):
    """Projection onto the orthogonal complement of ``r`` random directions, with a basis ``(n, n - r)``."""
    q = orthogonal(n, seed)
    excluded, kept = q[:, :r].T.contiguous(), q[:, r:]
    return (lambda v: v - excluded.T @ (excluded @ v)), excluded, kept


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("k", [1, 3])
def test_top_eigenpairs_match_dense(solver, k):
    matrix = with_spectrum(well_separated(120))
    op = DenseOperator(matrix)
    result = solve(solver, op, k)
    values, vectors = reference(matrix, k)

    np.testing.assert_allclose(result.eigenvalues.numpy(), values, rtol=1e-8)
    assert result.eigenvalues.dtype == torch.float64
    assert result.eigenvectors.shape == (k, 120) and result.eigenvectors.dtype == torch.float64
    np.testing.assert_allclose(torch.linalg.norm(result.eigenvectors, dim=1).numpy(), np.ones(k), rtol=1e-14)
    for i in range(k):
        assert sign_aligned_distance(result.eigenvectors[i], vectors[i]) < VECTOR_TOL[solver]
    assert float(result.residuals.max()) < RESIDUAL_TOL[solver]
    assert result.converged
    assert result.n_matvec == op.n_matvec
    assert result.value == float(result.eigenvalues[0])
    assert result.method == METHOD[solver]
    assert result.iterations == len(result.history)
    assert result.seconds > 0.0


def test_lanczos_matvecs_and_history():
    op = DenseOperator(with_spectrum(well_separated(120)))
    result = solve(lanczos, op, 3)
    # One product per iteration; the reported residuals are the Ritz estimates.
    assert result.n_matvec == result.iterations
    assert result.info == {"krylov_dimension": result.iterations, "restarts": 0, "residuals": "estimate"}
    last = result.history[-1]
    assert set(last) == {"iteration", "eigenvalues", "residual"}
    assert last["iteration"] == result.iterations and last["residual"] <= 1e-10
    np.testing.assert_allclose(last["eigenvalues"], [100.0, 60.0, 40.0], rtol=1e-10)
    # The estimates shrink to the tolerance: the first iterations are far from it.
    assert result.history[2]["residual"] > 1e-3


def test_power_spends_more_matvecs_than_lanczos():
    matrix = with_spectrum(well_separated(120))
    krylov = solve(lanczos, DenseOperator(matrix), 1)
    power = solve(power_iteration, DenseOperator(matrix), 1)
    assert krylov.n_matvec < power.n_matvec
    assert power.info["shifts"] == [None]
    assert power.info["stopping_rule"] == "rayleigh_quotient"


@pytest.mark.parametrize("solver", SOLVERS)
def test_negative_dominant_spectrum_gives_largest_algebraic(solver):
    eigenvalues = np.concatenate([[3.0, 1.0], np.linspace(-50.0, 0.0, 78)])
    op = DenseOperator(with_spectrum(eigenvalues, seed=1))
    result = solve(solver, op, 1)
    np.testing.assert_allclose(result.eigenvalues.numpy(), [3.0], rtol=1e-8)
    assert result.converged
    # Power iteration resolves the shifted operator, whose scale is 53, not 3.
    assert float(result.residuals[0]) < 20 * RESIDUAL_TOL[solver]
    if solver is power_iteration:
        # The plain run found -50 as the dominant eigenvalue and the shifted run then found 3.
        assert result.info["shifts"][0] == pytest.approx(-50.0, rel=1e-6)


@pytest.mark.parametrize("solver", SOLVERS)
def test_projected_operator_excludes_directions(solver):
    n, r = 100, 3
    project, excluded, kept = complement_projection(n, r, seed=2)
    # A huge eigenvalue along an excluded direction must not be reported.
    matrix = with_spectrum(well_separated(n), seed=3) + 1000.0 * torch.outer(excluded[0], excluded[0])
    op = DenseOperator(matrix, project=project)
    result = solve(solver, op, 2)
    restricted, restricted_vectors = reference(kept.T @ matrix @ kept, 2)

    np.testing.assert_allclose(result.eigenvalues.numpy(), restricted, rtol=1e-8)
    assert float(result.eigenvalues[0]) < 150.0
    assert float(torch.linalg.norm(result.eigenvectors @ excluded.T)) < 1e-10
    for i in range(2):
        expected = kept.numpy() @ restricted_vectors[i]
        assert sign_aligned_distance(result.eigenvectors[i], expected) < VECTOR_TOL[solver]
    assert float(result.residuals.max()) < RESIDUAL_TOL[solver]


@pytest.mark.parametrize("solver", SOLVERS)
def test_projected_all_negative_spectrum_has_no_spurious_zeros(solver):
    n, r = 80, 4
    project, _, kept = complement_projection(n, r, seed=4)
    restricted = np.concatenate([[-1.0, -3.0], np.linspace(-40.0, -5.0, n - r - 2)])
    # P A P: the restricted spectrum on the subspace, and a zero eigenvalue on every excluded direction,
    # above all of it.
    matrix = (kept * torch.as_tensor(restricted)) @ kept.T
    matrix = (matrix + matrix.T) / 2
    assert abs(reference(matrix, 1)[0][0]) < 1e-12
    op = DenseOperator(matrix, project=project)
    result = solve(solver, op, 2)

    np.testing.assert_allclose(result.eigenvalues.numpy(), [-1.0, -3.0], rtol=1e-8)
    assert result.converged
    assert float(result.residuals.max()) < 20 * RESIDUAL_TOL[solver]
    if solver is power_iteration:
        np.testing.assert_allclose(result.info["shifts"], [-40.0, -40.0], rtol=1e-6)


@pytest.mark.parametrize("solver", SOLVERS)
def test_k_larger_than_subspace_is_refused(solver):
    project, _, _ = complement_projection(12, 3, seed=6)
    op = DenseOperator(with_spectrum(np.arange(12.0), seed=7), project=project)
    with pytest.raises(ValueError, match="dimension 9"):
        solve(solver, op, 10)
    with pytest.raises(ValueError, match="size 12"):
        solve(solver, DenseOperator(torch.eye(12)), 13)
    with pytest.raises(ValueError, match="positive integer"):
        solve(solver, DenseOperator(torch.eye(12)), 0)


@pytest.mark.parametrize("solver", SOLVERS)
def test_multiple_of_identity(solver):
    op = DenseOperator(2.5 * torch.eye(40))
    result = solve(solver, op, 3)
    np.testing.assert_allclose(result.eigenvalues.numpy(), [2.5, 2.5, 2.5], rtol=1e-12)
    np.testing.assert_allclose((result.eigenvectors @ result.eigenvectors.T).numpy(), np.eye(3), atol=1e-14)
    assert float(result.residuals.max()) < 1e-12
    assert result.converged
    if solver is lanczos:
        # Every Krylov space is invariant after one product: two restarts give the three copies.
        assert result.info["restarts"] == 2 and result.n_matvec == 3
    if solver is low_memory_lanczos:
        # Per pair: one product (the Krylov space is invariant at once), none to regenerate the vector,
        # one for its true residual.
        assert result.info["krylov_dimensions"] == [1, 1, 1] and result.n_matvec == 6


def test_power_finds_every_copy_of_a_repeated_eigenvalue():
    eigenvalues = np.concatenate([[50.0, 50.0, 30.0], np.linspace(-10.0, 10.0, 57)])
    q = orthogonal(60, seed=8)
    matrix = with_spectrum(eigenvalues, seed=8)
    result = solve(power_iteration, DenseOperator(matrix), 2)
    np.testing.assert_allclose(result.eigenvalues.numpy(), [50.0, 50.0], rtol=1e-10)
    # The two vectors span the eigenspace: their coordinates in it form an orthogonal 2 x 2 matrix.
    coordinates = result.eigenvectors @ q[:, :2]
    np.testing.assert_allclose((coordinates @ coordinates.T).numpy(), np.eye(2), atol=1e-9)


def test_lanczos_repeated_top_eigenvalue_and_cluster():
    q = orthogonal(60, seed=9)
    repeated = with_spectrum(np.concatenate([[50.0, 50.0, 30.0], np.linspace(-10.0, 10.0, 57)]), seed=9)
    result = solve(lanczos, DenseOperator(repeated), 1)
    assert result.value == pytest.approx(50.0, rel=1e-12)
    # Any unit vector of the two-dimensional eigenspace is a right answer.
    assert float(torch.linalg.norm(result.eigenvectors[0] @ q[:, :2])) == pytest.approx(1.0, abs=1e-10)

    clustered = np.concatenate([[100.0, 99.9, 99.8, 50.0], np.linspace(-10.0, 10.0, 96)])
    matrix = with_spectrum(clustered, seed=10)
    result = solve(lanczos, DenseOperator(matrix), 3)
    values, vectors = reference(matrix, 3)
    np.testing.assert_allclose(result.eigenvalues.numpy(), values, rtol=1e-10)
    for i in range(3):
        assert sign_aligned_distance(result.eigenvectors[i], vectors[i]) < 1e-8


def test_lanczos_small_operator_terminates_exactly():
    eigenvalues = np.array([7.0, 3.0, 2.0, 1.5, 0.0, -1.0, -4.0, -9.0])
    matrix = with_spectrum(eigenvalues, seed=11)
    result = solve(lanczos, DenseOperator(matrix), 3)
    assert result.converged and result.iterations <= 8
    np.testing.assert_allclose(result.eigenvalues.numpy(), [7.0, 3.0, 2.0], rtol=1e-12)

    everything = solve(lanczos, DenseOperator(matrix), 8)
    assert everything.converged and everything.iterations == 8
    np.testing.assert_allclose(everything.eigenvalues.numpy(), eigenvalues, atol=1e-12)
    # The zero eigenvalue is only known to rounding, so its relative residual is not small.
    assert float(everything.residuals[everything.eigenvalues.abs() > 0.5].max()) < 1e-12


def test_lanczos_start_vector_on_an_eigenvector_ends_after_one_product():
    matrix = with_spectrum(well_separated(50), seed=12)
    _, vectors = reference(matrix, 1)
    op = DenseOperator(matrix)
    result = lanczos(op, v0=torch.as_tensor(vectors[0].copy()), progress=False)
    assert result.iterations == 1 and result.n_matvec == 1 and result.converged
    assert result.value == pytest.approx(100.0, rel=1e-12)
    with pytest.raises(ValueError, match="v0 has no component"):
        lanczos(op, v0=torch.zeros(50), progress=False)
    with pytest.raises(ValueError, match="max_iter"):
        lanczos(op, k=3, max_iter=2, progress=False)
    for solver in SOLVERS:
        with pytest.raises(ValueError, match="v0 has 3 entries"):
            solver(op, v0=torch.ones(3), progress=False)


@pytest.mark.parametrize("solver", SOLVERS)
def test_non_convergence_is_flagged(solver):
    op = DenseOperator(with_spectrum(well_separated(120)))
    result = solve(solver, op, 1, max_iter=2)
    assert not result.converged
    # Power iteration spends one more product on the true residual of its last iterate, low-memory
    # Lanczos one on regenerating the second Lanczos vector and one on the true residual.
    expected = {lanczos: 2, power_iteration: 3, low_memory_lanczos: 4}[solver]
    assert result.iterations == 2 and result.n_matvec == op.n_matvec == expected
    assert math.isfinite(result.value) and result.value < 100.0
    assert float(result.residuals[0]) > 1e-3


def test_power_vector_tolerance():
    matrix = with_spectrum(well_separated(120))
    result = solve(power_iteration, DenseOperator(matrix), 1, vector_tol=1e-9)
    values, vectors = reference(matrix, 1)
    assert result.info["stopping_rule"] == "vector" and result.info["vector_tol"] == 1e-9
    assert sign_aligned_distance(result.eigenvectors[0], vectors[0]) < 1e-8
    assert result.value == pytest.approx(values[0], rel=1e-12)


@pytest.mark.parametrize("solver", SOLVERS)
def test_float32_operator(solver):
    matrix = with_spectrum(well_separated(120)).float()
    result = solver(
        DenseOperator(matrix), k=2, tol=1e-6, generator=torch.Generator().manual_seed(0), progress=False
    )
    assert result.eigenvectors.dtype == torch.float32 and result.eigenvalues.dtype == torch.float64
    np.testing.assert_allclose(result.eigenvalues.numpy(), [100.0, 60.0], rtol=1e-5)
    assert result.converged and float(result.residuals.max()) < 1e-3


@pytest.mark.parametrize("solver", SOLVERS)
def test_same_seed_same_result_and_json(solver, capsys):
    matrix = with_spectrum(well_separated(60))
    first = solve(solver, DenseOperator(matrix), 2)
    second = solve(solver, DenseOperator(matrix), 2)
    assert torch.equal(first.eigenvalues, second.eigenvalues)
    assert torch.equal(first.eigenvectors, second.eigenvectors)

    summary = first.to_dict()
    assert json.loads(json.dumps(summary)) == summary
    assert summary["value"] == first.value and summary["n_hvp"] == first.n_matvec
    assert summary["converged"] is True and len(summary["history"]) == first.iterations
    assert len(json.loads(json.dumps(first.to_dict(with_vectors=True)))["eigenvectors"]) == 2

    op = CallableOperator(lambda v: matrix @ v, 60, torch.float64)
    shown = solver(op, k=1, tol=1e-8, generator=torch.Generator().manual_seed(0), progress=True)
    assert shown.value == pytest.approx(100.0, rel=1e-8)
    assert shown.n_matvec == op.n_matvec


def test_hutchinson_dense_within_three_standard_errors():
    eigenvalues = well_separated(120)
    op = DenseOperator(with_spectrum(eigenvalues, seed=13))
    result = hutchinson_trace(
        op, n_probes=300, batch_size=16, generator=torch.Generator().manual_seed(0), progress=False
    )
    assert abs(result.estimate - eigenvalues.sum()) < 3 * result.stderr
    assert result.samples.shape == (300,) and result.samples.dtype == torch.float64
    assert result.n_matvec == op.n_matvec == 300 and result.n_probes == 300
    assert result.estimate == pytest.approx(float(result.samples.mean()), rel=1e-14)
    assert result.stderr == pytest.approx(float(result.samples.std()) / math.sqrt(300), rel=1e-14)
    assert 0.0 < result.stderr < 0.1 * abs(eigenvalues.sum())
    summary = result.to_dict()
    assert json.loads(json.dumps(summary)) == summary and summary["n_hvp"] == 300


def test_hutchinson_exact_for_diagonal_and_restricted_to_subspace():
    diagonal = torch.linspace(-3.0, 5.0, 50)
    result = hutchinson_trace(DenseOperator(torch.diag(diagonal)), n_probes=7, batch_size=3, progress=False)
    np.testing.assert_allclose(result.samples.numpy(), np.full(7, float(diagonal.sum())), rtol=1e-13)
    assert result.stderr == pytest.approx(0.0, abs=1e-12)

    # Dropping coordinates restricts the trace to the kept block, still exactly.
    keep = torch.arange(50) >= 10
    restricted = DenseOperator(torch.diag(diagonal), project=lambda v: v * keep)
    result = hutchinson_trace(restricted, n_probes=5, progress=False)
    assert result.estimate == pytest.approx(float(diagonal[10:].sum()), rel=1e-13)

    project, _, kept = complement_projection(60, 5, seed=14)
    matrix = with_spectrum(well_separated(60), seed=15)
    result = hutchinson_trace(
        DenseOperator(matrix, project=project),
        n_probes=200,
        generator=torch.Generator().manual_seed(1),
        progress=False,
    )
    assert abs(result.estimate - float(torch.trace(kept.T @ matrix @ kept))) < 3 * result.stderr

    single = hutchinson_trace(DenseOperator(torch.diag(diagonal)), n_probes=1, progress=False)
    assert math.isnan(single.stderr)
    with pytest.raises(ValueError, match="n_probes"):
        hutchinson_trace(restricted, n_probes=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lanczos_residual_estimates_equal_true_residuals(dtype):
    matrix = with_spectrum(well_separated(120)).to(dtype)
    runs = {
        kind: lanczos(
            DenseOperator(matrix), k=3, tol=1e-4, residuals=kind,
            generator=torch.Generator().manual_seed(0), progress=False,
        )
        for kind in ("estimate", "true")
    }
    est, true = runs["estimate"], runs["true"]
    # Same run up to the final residual check, which costs one product per pair.
    assert true.n_matvec == est.n_matvec + 3 and true.info["residuals"] == "true"
    torch.testing.assert_close(true.eigenvectors, est.eigenvectors, rtol=0, atol=0)
    # The residuals sit near the 1e-4 tolerance; the estimate matches the true value to rounding.
    assert float(true.residuals.max()) > 1e-7
    eps = torch.finfo(dtype).eps
    np.testing.assert_allclose(est.residuals.numpy(), true.residuals.numpy(), rtol=0, atol=200 * eps)
    # Rayleigh quotients of the Ritz vectors equal the Ritz values to rounding.
    np.testing.assert_allclose(true.eigenvalues.numpy(), est.eigenvalues.numpy(), rtol=50 * eps)


def test_lanczos_rejects_unknown_residual_kind():
    with pytest.raises(ValueError, match="residuals must be one of estimate, true"):
        lanczos(DenseOperator(torch.eye(3, dtype=torch.float64)), residuals="exact", progress=False)


def test_low_memory_lanczos_matches_lanczos_and_counts_its_products():
    matrix = with_spectrum(well_separated(120))
    full = solve(lanczos, DenseOperator(matrix), 3)
    op = DenseOperator(matrix)
    low = solve(low_memory_lanczos, op, 3)
    np.testing.assert_allclose(low.eigenvalues.numpy(), full.eigenvalues.numpy(), rtol=1e-12)
    # Per pair: m first-pass products, m - 1 more to regenerate the Lanczos vectors of its Ritz vector and
    # one for its true residual.
    dims = low.info["krylov_dimensions"]
    assert low.info["restarts"] == [0, 0, 0]
    assert low.n_matvec == op.n_matvec == sum(2 * m for m in dims)
    assert low.iterations == len(low.history) == sum(dims)
    assert low.info["residuals"] == "true"
    # The history carries the pairs found so far and the current top Ritz value.
    assert [len(h["eigenvalues"]) for h in low.history] == [1] * dims[0] + [2] * dims[1] + [3] * dims[2]
    assert low.history[-1]["residual"] <= 1e-10
    # the reported residuals are the true ones
    for value, vector, residual in zip(low.eigenvalues, low.eigenvectors, low.residuals):
        true = float(torch.linalg.vector_norm(matrix @ vector - value * vector)) / abs(float(value))
        assert float(residual) == pytest.approx(true, rel=1e-6, abs=1e-15)
    with pytest.raises(ValueError, match="max_iter must be at least 1"):
        solve(low_memory_lanczos, op, 1, max_iter=0)


def test_low_memory_lanczos_finds_every_copy_of_a_repeated_eigenvalue():
    q = orthogonal(60, seed=8)
    matrix = with_spectrum(np.concatenate([[50.0, 50.0, 30.0], np.linspace(-10.0, 10.0, 57)]), seed=8)
    result = solve(low_memory_lanczos, DenseOperator(matrix), 3)
    np.testing.assert_allclose(result.eigenvalues.numpy(), [50.0, 50.0, 30.0], rtol=1e-10)
    coordinates = result.eigenvectors[:2] @ q[:, :2]
    np.testing.assert_allclose((coordinates @ coordinates.T).numpy(), np.eye(2), atol=1e-9)
    np.testing.assert_allclose((result.eigenvectors @ result.eigenvectors.T).numpy(), np.eye(3), atol=1e-12)


def test_low_memory_lanczos_float32_converges_before_ghosts_appear():
    # In float32 the Lanczos vectors lose orthogonality as soon as the top Ritz value converges; the
    # first pass stops there, and the regenerated Ritz vector has the estimated residual.
    matrix = with_spectrum(np.concatenate([[10.0, 9.99], np.linspace(-1.0, 8.9, 398)]), seed=13)
    op = DenseOperator(matrix.float())
    result = solve(low_memory_lanczos, op, 1, tol=1e-6)
    assert result.converged and result.value == pytest.approx(10.0, rel=1e-6)
    vector = result.eigenvectors[0].double()
    residual = float(torch.linalg.vector_norm(matrix @ vector - result.value * vector)) / 10.0
    assert residual < 1e-5


class _Diagonal(CallableOperator):
    """``diag(d)``, adding its products into ``out`` in place (as the Hessian operator does)."""

    def __init__(self, d: torch.Tensor):
        super().__init__(lambda v: d * v, d.numel(), d.dtype)
        self.d = d

    def _matvec_add(self, v, out):
        return out.addcmul_(self.d, v)


def _peak_bytes(fn, trace_path) -> int:
    """Peak of torch's CPU allocator bytes during ``fn`` above the level before it (profiler memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    prof.export_chrome_trace(str(trace_path))
    with open(trace_path) as fh:
        events = [e["args"] for e in json.load(fh)["traceEvents"] if e.get("name") == "[memory]"]
    assert events
    before = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(e["Total Allocated"] for e in events) - before


def test_low_memory_lanczos_holds_three_vectors_whatever_the_iterations(tmp_path):
    n = 1 << 18  # 1 MiB float32 vectors
    d = torch.cat([torch.tensor([10.0, 9.5]), torch.linspace(-1.0, 9.0, n - 2)]).float()
    vector_bytes = 4 * n

    def run(solver):
        result = solver(_Diagonal(d), k=1, tol=1e-5, generator=torch.Generator().manual_seed(0), progress=False)
        assert result.value == pytest.approx(10.0, rel=1e-5)
        return result

    low = _peak_bytes(lambda: run(low_memory_lanczos), tmp_path / "low.json")
    full = _peak_bytes(lambda: run(lanczos), tmp_path / "full.json")
    iterations = run(low_memory_lanczos).iterations
    assert iterations > 20  # a basis would be large
    assert low < 3.2 * vector_bytes
    assert full > 16 * vector_bytes


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_low_memory_lanczos_repairs_its_vector_when_a_large_negative_eigenvalue_converged_first(dtype):
    # -5000 converges before 3: the vectors lose orthogonality and the replayed Ritz vector has a component
    # along the -5000 direction (true residual 3.9e-7 in float64, 2.8e-3 in float32, against estimates of
    # 5e-11 and 5e-6). A restart from that vector repairs it, and the true residual is what is reported.
    # Whether float32 rounding loses enough orthogonality to need the restart depends on the machine's BLAS.
    matrix = with_spectrum(np.concatenate([[3.0, 1.0], [-5000.0], np.linspace(-5.0, 0.0, 77)]), seed=1)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    result = low_memory_lanczos(DenseOperator(matrix.to(dtype)), tol=tol, generator=torch.Generator().manual_seed(0),
                                progress=False)  # fmt: skip
    vector = result.eigenvectors[0].double()
    true = float(torch.linalg.vector_norm(matrix @ vector - result.value * vector)) / 3.0
    assert result.converged and result.info["restarts"] in ([[1]] if dtype == torch.float64 else [[0], [1]])
    assert true < (1e-10 if dtype == torch.float64 else 1e-4)
    assert float(result.residuals[0]) == pytest.approx(true, rel=1e-3 if dtype == torch.float64 else 0.1)
    assert result.value == pytest.approx(3.0, rel=1e-12 if dtype == torch.float64 else 1e-5)


def test_low_memory_lanczos_converges_on_zero_eigenvalues():
    # Once deflation has removed every nonzero eigenvalue the Krylov space is rounding next to ||A||.
    q = orthogonal(60, seed=14)
    matrix = (q * torch.as_tensor(np.r_[[3.0, 2.0, 1.0], np.zeros(57)])) @ q.T
    result = solve(low_memory_lanczos, DenseOperator((matrix + matrix.T) / 2), 5)
    assert result.converged and result.n_matvec < 100
    np.testing.assert_allclose(result.eigenvalues.numpy(), [3.0, 2.0, 1.0, 0.0, 0.0], atol=1e-12)


# ---- vector helpers the solvers share ----------------------------------------------------------
@pytest.mark.parametrize("second_pass", [False, True])
def test_gram_schmidt_norms_are_those_of_the_vectors(second_pass):
    from sharpness.solvers._vectors import KrylovBasis, _gram_schmidt

    n = 50
    block = orthogonal(n, 3)[:9].clone()
    basis = KrylovBasis(n, torch.float64, torch.device("cpu"), block_rows=4)  # rows spread over 3 blocks
    for row in block:
        basis.append(row)
    g = torch.Generator().manual_seed(1)
    v = torch.randn(n, generator=g)
    if second_pass:  # almost all of v in the span: the first pass removes most of it, DGKS repeats it
        v = block.T @ torch.randn(9, generator=g) + 1e-9 * v
    for rows in (block, basis):
        w, coeffs, norm, before = _gram_schmidt(v, rows)
        assert before == pytest.approx(float(torch.linalg.vector_norm(v)), rel=1e-12)
        assert norm == pytest.approx(float(torch.linalg.vector_norm(w)), rel=1e-12)
        assert float((block @ w).abs().max()) <= 1e-14 * before
        torch.testing.assert_close(coeffs, block @ v, rtol=0, atol=1e-14 * before)
        assert w is not v  # overwrite=False works in a copy


@pytest.mark.parametrize("rows", [3, 4, 9])  # the next row mid-block, at a block's start, after full blocks
def test_basis_coefficients_with_the_norm_of_its_next_row_and_scaled_subtraction(rows, monkeypatch):
    import sharpness.solvers._vectors as vectors
    from sharpness.solvers._vectors import KrylovBasis, _subtract_combination

    separate = []  # calls of the path with a separate pass for the norm
    original = vectors._coefficients
    monkeypatch.setattr(vectors, "_coefficients", lambda *args: separate.append(1) or original(*args))

    n = 40
    block = orthogonal(n, 4)[:rows].clone()
    basis = KrylovBasis(n, torch.float64, torch.device("cpu"), block_rows=4)
    for row in block:
        basis.append(row)
    v = torch.randn(n, generator=torch.Generator().manual_seed(2))
    nxt = basis.next_row()
    nxt.copy_(v)
    # the next row of a block: one pass; the spare vector of a full basis (rows=4) or any other vector: two
    for target, passes in ((nxt, [1] if rows % 4 == 0 else []), (v.clone(), [1])):
        separate.clear()
        coeffs, norm_sq = basis.coefficients_and_norm(target)
        assert separate == passes
        torch.testing.assert_close(coeffs, block @ v, rtol=0, atol=1e-14)
        assert norm_sq == pytest.approx(float(v @ v), rel=1e-14)
    expected = 0.25 * (v - block.T @ coeffs)
    _subtract_combination(nxt, basis.blocks(), coeffs, scale=0.25)
    torch.testing.assert_close(nxt, expected, rtol=0, atol=1e-14)
    before = nxt.clone()
    basis.append(nxt)  # already in place: nothing copied or scaled
    torch.testing.assert_close(basis[rows], before, rtol=0, atol=0)
    empty = torch.ones(3)
    _subtract_combination(empty, [], torch.zeros(0), scale=0.5)
    torch.testing.assert_close(empty, torch.full((3,), 0.5))


@pytest.mark.parametrize("case", ["one pass", "second pass", "breakdown"])
def test_lanczos_step_returns_the_normalized_three_term_recurrence(case, monkeypatch):
    import sharpness.solvers._lanczos as lanczos_module
    from sharpness.solvers._lanczos import lanczos_step
    from sharpness.solvers._vectors import KrylovBasis

    repeated = []  # calls of the general Gram-Schmidt (a repeated pass): only where one pass is not enough
    original = lanczos_module._gram_schmidt
    monkeypatch.setattr(lanczos_module, "_gram_schmidt", lambda *a, **kw: repeated.append(1) or original(*a, **kw))

    n = 30
    a = with_spectrum(np.linspace(-2.0, 3.0, n), seed=3)
    if case == "breakdown":  # q on a 2-dimensional invariant subspace: the second step's vector is rounding
        q = orthogonal(n, 3)  # the eigenvectors with_spectrum used
        q0 = (q[:, 0] + q[:, 1]) / math.sqrt(2.0)
    else:
        q0 = torch.randn(n, generator=torch.Generator().manual_seed(7))
        q0 /= torch.linalg.vector_norm(q0)
    op = DenseOperator(a)
    basis = KrylovBasis(n, torch.float64, torch.device("cpu"), block_rows=2)
    basis.append(q0)
    w, alpha, beta = lanczos_step(op, basis, 0.0)
    r = a @ q0 - alpha * q0
    assert alpha == pytest.approx(float(q0 @ a @ q0), rel=1e-13)
    assert beta == pytest.approx(float(torch.linalg.vector_norm(r)), rel=1e-12)
    torch.testing.assert_close(w, r / beta, rtol=0, atol=1e-13)
    basis.append(w)
    if case == "second pass":  # an operator whose product lies almost in the basis: DGKS repeats the pass
        near = basis[0] * 5.0 + basis[1] * 3.0
        op = CallableOperator(lambda v: near + 1e-6 * a @ v, n, torch.float64)
    repeated.clear()
    w2, alpha2, beta2 = lanczos_step(op, basis, beta)
    assert repeated == ([1] if case == "second pass" else [])
    if case == "breakdown":
        assert beta2 == 0.0
        return
    rows = torch.stack([basis[0], basis[1]])
    assert float(torch.linalg.vector_norm(w2)) == pytest.approx(1.0, abs=1e-14)
    assert float((rows @ w2).abs().max()) < 1e-14
    product = op.matvec(basis[1])
    rest = product - beta * basis[0] - alpha2 * basis[1]
    rest -= rows.T @ (rows @ rest)
    assert alpha2 == pytest.approx(float(basis[1] @ product), rel=1e-12)
    assert beta2 == pytest.approx(float(torch.linalg.vector_norm(rest)), rel=1e-8)
    torch.testing.assert_close(w2, rest / beta2, rtol=0, atol=1e-8 if case == "second pass" else 1e-13)


def test_canonical_signs_in_place_normalized_and_tie_rule():
    from sharpness.solvers._vectors import _canonical_signs

    rows = torch.tensor([[1.0, -3.0, 2.0], [0.5, 4.0, -1.0], [2.0, -2.0, 0.0], [0.0, 0.0, 0.0]])
    out = _canonical_signs(rows.clone())
    torch.testing.assert_close(out[0], torch.tensor([-1.0, 3.0, -2.0]))  # largest magnitude -3 flipped
    torch.testing.assert_close(out[1], torch.tensor([0.5, 4.0, -1.0]))
    torch.testing.assert_close(out[2], torch.tensor([2.0, -2.0, 0.0]))  # tie: the largest stays positive
    torch.testing.assert_close(out[3], torch.zeros(3))
    unit = rows[:3].clone()
    result = _canonical_signs(unit, normalize=True)
    assert result.data_ptr() == unit.data_ptr()
    torch.testing.assert_close(torch.linalg.vector_norm(result, dim=1), torch.ones(3, dtype=rows.dtype))
    torch.testing.assert_close(result[0], torch.tensor([-1.0, 3.0, -2.0]) / math.sqrt(14.0))


@pytest.mark.parametrize("solver", SOLVERS)
def test_user_start_vector_is_left_untouched(solver):
    a = with_spectrum(well_separated(30))
    v0 = torch.randn(30, generator=torch.Generator().manual_seed(5))
    kept = v0.clone()
    solve(solver, DenseOperator(a), 3, v0=v0)
    solve(solver, DenseOperator(a, project=lambda v: v), 2, v0=v0)
    assert torch.equal(v0, kept)


@pytest.mark.parametrize("m", [1, 2, 9, 64, 65, 90])  # 64/65: either side of the switch to the selective solver
def test_top_ritz_pairs_are_those_of_the_dense_tridiagonal(m):
    from sharpness.solvers._lanczos import _top_ritz

    rng = np.random.default_rng(m)
    d, e = rng.standard_normal(m), rng.uniform(0.1, 1.0, m - 1)
    dense = np.diag(d) + np.diag(e, 1) + np.diag(e, -1)
    values, vectors = np.linalg.eigh(dense)
    for k in {1, min(3, m), m}:
        theta, s, anorm = _top_ritz(list(d), list(e), k)
        np.testing.assert_allclose(theta, values[::-1][:k], rtol=0, atol=1e-13)
        assert np.all(np.diff(theta) <= 0)
        np.testing.assert_allclose(dense @ s, s * theta, rtol=0, atol=1e-12)  # eigenvectors, in order
        np.testing.assert_allclose(np.linalg.norm(s, axis=0), 1.0, rtol=1e-13)
        gershgorin = np.max(np.abs(d) + np.abs(np.r_[0.0, e]) + np.abs(np.r_[e, 0.0]))
        assert anorm == pytest.approx(gershgorin, rel=1e-15)
        assert anorm >= np.abs(values).max()
