"""Euclidean sharpness: the top eigenvalues of the Hessian of the whole-data-set loss."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from sharpness._results import EigenResult
from sharpness.measures._measure import BallGeometry, CurvatureOperator, Measure
from sharpness.products._data_span import data_span_hessian
from sharpness.products._hessian import HessianOperator
from sharpness.products._objective import Objective, build_objective
from sharpness.solvers._solve import Solver

# Eigenvectors found in data-span coordinates are mapped back through H v, so their eigenvalues must stand
# this many rounding units (of the largest one) above zero.
_NONZERO_ULPS = 100.0


@dataclass(frozen=True)
class Euclidean(Measure):
    """The top eigenvalue of the Euclidean Hessian ``H`` (units: loss per squared parameter unit).

    Not invariant under rescalings of a ReLU network (Dinh et al. 2017): a function-preserving rescaling
    changes it by orders of magnitude. Its ball is ``{w + xi : ||xi|| <= eps}`` (Definition 1 of the flatness
    paper).

    Attributes:
        data_span: solve with the first ``Linear`` layer's weight in coordinates of the span of its inputs
            (exact, and cheaper when there are fewer samples than input features: with ``n < d`` samples the
            Hessian vanishes on first-layer directions orthogonal to the data); ``None`` where that applies,
            ``True`` requires it (``ValueError`` where it does not), ``False`` never.
    """

    data_span: bool | None = None

    name = "euclidean"
    tangent_eigenvectors = True
    description = "top eigenvalue of the Euclidean Hessian (not rescaling-invariant)"
    invariant_under = ()
    needs_symmetry = False

    def operator(self, objective: Objective, hvp: str = "auto") -> CurvatureOperator:
        op = HessianOperator(objective, hvp)
        return CurvatureOperator(op, info={"hvp_strategy": op.strategy, "data_span": None})

    def solve(self, objective: Objective, k: int, solver: Solver, progress: bool | None = None) -> EigenResult:
        """Top eigenpairs, in data-span coordinates where they apply (see [`data_span`][sharpness.Euclidean]).

        In data-span coordinates the Hessian's exact null space outside the span is left out, so when one of
        the ``k`` eigenvalues found there is not positive (zeros from outside the span may rank above it), or
        ``k`` exceeds the span operator's size, the pairs are solved in full coordinates, whatever
        ``data_span`` says; ``n_matvec`` counts both solves and the products that map the eigenvectors back.
        The residuals and history reported are those of the solve that found the pairs: in data-span
        coordinates, of ``u``, while the eigenvector returned is ``H v / lambda`` normalized (``v`` the
        parameters ``u`` stands for), whose residual is of the same order. ``info["data_span"]`` holds the
        samples and input features of the coordinates the pairs were found in, or ``None``.
        """
        op = HessianOperator(objective, solver.hvp)
        span = None if self.data_span is False else data_span_hessian(op)
        if span is None and self.data_span:
            raise ValueError(
                "data-span coordinates need one process, R-operator products with the chunk states in memory, a first "
                "Linear layer and fewer samples than its input features, by enough to pay for their set-up; pass "
                "data_span=None or False"
            )
        spent = 0
        if span is not None and k <= span.size:
            result = solver.solve(span, k, progress)
            values = result.eigenvalues
            if float(values.min()) > _NONZERO_ULPS * torch.finfo(span.dtype).eps * float(values.abs().max()):
                return result.replace(
                    eigenvectors=span.lift(result.eigenvectors),
                    n_matvec=result.n_matvec + result.k,
                    info={**result.info, "hvp_strategy": op.strategy, "data_span": span.info()},
                )
            spent = result.n_matvec
        result = solver.solve(op, k, progress)
        return result.replace(
            n_matvec=result.n_matvec + spent, info={**result.info, "hvp_strategy": op.strategy, "data_span": None}
        )

    def ball(self, objective: Objective) -> BallGeometry:
        point = objective.layout.flatten(objective.params)
        return BallGeometry(retract=lambda zeta: point + zeta)


def euclidean_sharpness(
    model: nn.Module | None,
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None,
    data: object,
    k: int = 1,
    *,
    solver: Solver | None = None,
    data_span: bool | None = None,
    dtype: torch.dtype | None = None,
    objective: Objective | None = None,
    progress: bool | None = None,
) -> EigenResult:
    """Largest ``k`` eigenvalues of the Euclidean Hessian of the loss over the whole data set.

    Not invariant under rescalings of a ReLU network (Dinh et al. 2017): see
    [`invariant_sharpness`][sharpness.invariant_sharpness] for measures that are. The same as
    ``Euclidean(data_span).sharpness(objective, k, solver, progress)``.

    Args:
        model: as for [`Objective`][sharpness.Objective]; not used when ``objective`` is given.
        loss_fn: as for [`Objective`][sharpness.Objective]; not used when ``objective`` is given.
        data: as for [`Objective`][sharpness.Objective] (``(X, y)``, a DataLoader or an iterable of batches);
            not used when ``objective`` is given.
        k: number of eigenpairs.
        solver: eigen-solver settings ([`Solver`][sharpness.Solver]; default ``Solver()``: Lanczos, tol 1e-6).
        data_span: see [`Euclidean.data_span`][sharpness.Euclidean].
        dtype: evaluation dtype (``None``: the model's).
        objective: an existing objective (chunking, device and memory budget set there) instead of a new one.
        progress: show a progress bar (``None``: only on a terminal).

    Returns:
        [`EigenResult`][sharpness.EigenResult] with ``.value`` the largest eigenvalue (units of the loss per squared
            parameter unit), eigenvectors mappable to parameters with ``.parameter_vectors()``, and
            ``info`` holding ``loss``, ``n_params``, ``n_samples``, ``hvp_strategy``, ``metric`` and ``data_span``.
    """
    objective = build_objective(model, loss_fn, data, objective, dtype=dtype)
    return Euclidean(data_span).sharpness(objective, k, solver, progress)
