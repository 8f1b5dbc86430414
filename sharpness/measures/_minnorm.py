"""Gauge-fixed sharpness: the Euclidean Hessian at the minimum-norm representative of a network.

Every node-wise (channel-wise, layer-wise) rescaling of a network gauges to the same minimum-l2-norm
weights (the gauge paper's Theorem 2.1), so the Euclidean Hessian spectrum there is a property of the
function alone: an invariant sharpness without a Riemannian metric.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from manifolds import min_norm_gauge_parameters
from sharpness._results import EigenResult
from sharpness.measures._euclidean import Euclidean
from sharpness.measures._measure import CurvatureOperator, Measure
from sharpness.products._objective import Objective
from sharpness.solvers._solve import Solver

# The eigenvalue inherits the gauge's error, so the gauge is solved far below solver tolerances.
GAUGE_TOL = 1e-12
GAUGE_MAX_ITER = 100_000


@dataclass(frozen=True)
class MinNorm(Measure):
    """The top eigenvalue of the Euclidean Hessian at the minimum-l2-norm gauge of the point.

    The point is moved by the node-wise rescaling of `manifolds.min_norm_gauge_parameters` (``p = 2``,
    Jacobi updates to ``max |a_i - 1| < 1e-12``); the loss is unchanged, the Hessian is that of the canonical
    representative. Eigenvectors are unit Euclidean vectors at the gauged parameters
    (``coordinates="gauged"``); ``info`` holds ``gauge_iterations``, ``gauge_gamma`` (eq. (20) imbalance left),
    ``gauge_converged``, ``gauge_norm_reduction`` (``||W||^2`` after / before) and, as for
    [`Euclidean`][sharpness.Euclidean], ``data_span``.

    Raises (from [`operator`][sharpness.MinNorm] and [`solve`][sharpness.MinNorm]):
        UnsupportedModelError: positive rescaling is not a symmetry of the model.
        DegeneratePointError: a hidden unit with all incoming or all outgoing weights zero (a dead unit: the
            gauge does not exist at this point; skipped where measures are chosen for you).
    """

    name = "minnorm"
    description = (
        "Euclidean Hessian at the minimum-l2-norm gauge (canonical representative): invariant under node-, "
        "channel- and layer-wise rescaling"
    )
    invariant_under = ("node", "layer")

    def gauged(self, objective: Objective) -> tuple[Objective, dict]:
        """The objective at the minimum-norm representative of ``objective.params``, and the gauge's facts."""
        gauged, history = min_norm_gauge_parameters(
            objective.params, objective.structure, p=2.0, tol=GAUGE_TOL, max_iter=GAUGE_MAX_ITER
        )
        if not history.converged:
            warnings.warn(
                f"the minimum-norm gauge did not converge in {history.iterations} updates (imbalance "
                f"{history.gamma:.2e}), so the 'minnorm' sharpness is not exactly rescaling-invariant",
                RuntimeWarning,
                stacklevel=4,
            )
        return objective.with_params(gauged), {
            "gauge_iterations": history.iterations,
            "gauge_gamma": history.gamma,
            "gauge_converged": history.converged,
            # no weight the gauge moves among the parameters (a subset of biases, say): nothing to reduce
            "gauge_norm_reduction": history.objective[-1] / history.objective[0] if history.objective[0] else 1.0,
        }

    def operator(self, objective: Objective, hvp: str = "auto") -> CurvatureOperator:
        gauged, facts = self.gauged(objective)
        bound = Euclidean().operator(gauged, hvp)
        return CurvatureOperator(bound.operator, coordinates="gauged", info={**bound.info, **facts})

    def solve(self, objective: Objective, k: int, solver: Solver, progress: bool | None = None) -> EigenResult:
        gauged, facts = self.gauged(objective)
        result = Euclidean().solve(gauged, k, solver, progress)  # data-span coordinates where they apply
        return result.replace(coordinates="gauged", info={**result.info, **facts})
