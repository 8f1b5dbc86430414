"""Gauge-fixed sharpness: the Euclidean Hessian at the minimum-norm representative of a network.

Every node-wise (channel-wise, layer-wise) rescaling of a network gauges to the same minimum-l2-norm
weights (the gauge paper's Theorem 2.1), so the Euclidean Hessian spectrum there is a property of the
function alone: an invariant sharpness without a Riemannian metric.
"""

from __future__ import annotations

import warnings

from manifolds import NetworkStructure, analyze, min_norm_gauge_parameters
from sharpness._euclidean import solve_euclidean
from sharpness._objective import Objective
from sharpness._results import EigenResult
from sharpness._solve import SolveSettings

# The eigenvalue inherits the gauge's error, so the gauge is solved far below solver tolerances.
GAUGE_TOL = 1e-12
GAUGE_MAX_ITER = 100_000


def minnorm_sharpness(
    objective: Objective, metric: str, settings: SolveSettings, structure: NetworkStructure | None, zero_blocks: str
) -> EigenResult:
    """Top eigenpairs of the Euclidean Hessian at the minimum-l2-norm gauge of ``objective.params``.

    The point is moved by the node-wise rescaling of :func:`manifolds.min_norm_gauge_parameters`
    (``p = 2``, Jacobi updates to ``max |a_i - 1| < 1e-12``); the loss is unchanged, the Hessian is
    that of the canonical representative.

    Args:
        objective: loss over the data set at the point to measure.
        metric: ``"minnorm"`` (fixed by the measure registry).
        settings: ``SolveSettings`` of the eigen-solver.
        structure: a precomputed :func:`manifolds.analyze` result, or ``None``.
        zero_blocks: unused (the Euclidean metric has no zero-norm blocks); fixed by the registry.

    Returns:
        :class:`EigenResult` with Euclidean unit eigenvectors at the gauged parameters
        (``coordinates="gauged"``), ``info`` holding ``gauge_iterations``, ``gauge_gamma`` (eq. (20)
        imbalance left), ``gauge_converged``, ``gauge_norm_reduction`` (``||W||^2`` after / before)
        ``hvp_strategy`` and ``data_span`` (see :func:`sharpness._euclidean.solve_euclidean`).

    Raises:
        UnsupportedModelError: positive rescaling is not a symmetry of the model.
        ValueError: a hidden unit with all incoming or all outgoing weights zero.
    """
    structure = structure or analyze(objective.model)
    gauged, history = min_norm_gauge_parameters(
        objective.params, structure, p=2.0, tol=GAUGE_TOL, max_iter=GAUGE_MAX_ITER
    )
    if not history.converged:
        warnings.warn(
            f"the minimum-norm gauge did not converge in {history.iterations} updates (imbalance "
            f"{history.gamma:.2e}), so the 'minnorm' sharpness is not exactly rescaling-invariant",
            RuntimeWarning,
            stacklevel=3,
        )
    result = solve_euclidean(objective.with_params(gauged), settings)
    return result.replace(
        coordinates="gauged",
        info={
            **result.info,
            "gauge_iterations": history.iterations,
            "gauge_gamma": history.gamma,
            "gauge_converged": history.converged,
            "gauge_norm_reduction": history.objective[-1] / history.objective[0],
        },
    )
