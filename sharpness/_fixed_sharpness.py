"""Fixed-weight sharpness: the Hessian restricted to the free weights at the +-1 representative.

Every point of a node-wise rescaling orbit is rescaled to the same representative, the one whose
fixed weights (one outgoing weight per hidden unit, thesis ch. 3) are all +-1 (thesis 6.3.1): the
fixed weights determine the factors uniquely and positive rescalings keep their signs. With a
selection that does not depend on the gauge (the default ``"diagonal"``), the spectrum of the Hessian
in the free coordinates there is a property of the function alone. The Hungarian selection depends on
the weights' scales, so the measure built on it is not invariant.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from manifolds import FixedWeightSpace, NetworkStructure
from sharpness._hessian import HessianOperator
from sharpness._objective import Objective
from sharpness._operator import CallableOperator
from sharpness._results import EigenResult
from sharpness._solve import SolveSettings


def fixed_sharpness(
    objective: Objective,
    metric: str,
    settings: SolveSettings,
    structure: NetworkStructure | None,
    zero_blocks: str,
    selection: str | Mapping[str, Tensor] = "diagonal",
) -> EigenResult:
    """Top eigenpairs of ``P H P`` at the representative of ``objective.params`` with every fixed weight +-1.

    ``H`` is the Euclidean Hessian there and ``P`` the coordinate projection onto the free weights, so the
    eigenvalues are those of the free-free block of ``H`` (the solver works in the range of ``P``; the
    fixed coordinates never enter the spectrum).

    Args:
        objective: loss over the data set at the point to measure.
        metric: ``"fixed"`` (fixed by the measure registry).
        settings: ``SolveSettings`` of the eigen-solver.
        structure: a precomputed :func:`manifolds.analyze` result, or ``None``.
        zero_blocks: unused (the Euclidean metric has no zero-norm blocks); fixed by the registry.
        selection: which weights are fixed (see :class:`manifolds.FixedWeightSpace`); only a
            gauge-independent one (``"diagonal"``, or a fixed mask) gives a rescaling-invariant measure.

    Returns:
        :class:`EigenResult` with unit eigenvectors at the representative, zero on the fixed entries
        (``coordinates="fixed"``); ``info`` holds ``n_free``, ``n_fixed``, ``factor_min`` / ``factor_max``
        (range of the node factors that moved the point to the representative) and ``hvp_strategy``.

    Raises:
        UnsupportedModelError: positive rescaling is not a symmetry of the model.
        ValueError: a fixed weight is zero (no rescaling makes it +-1).
    """
    space = FixedWeightSpace(objective.model, selection, params=objective.params, structure=structure)
    representative = space.rescale_to_fixed_value(objective.params, 1.0)
    hessian = HessianOperator(objective.with_params(representative.params), settings.hvp)
    keep = space.free_mask.to(device=objective.device, dtype=objective.dtype)

    op = CallableOperator(
        lambda v: keep * hessian.matvec(keep * v),
        objective.layout.size,
        objective.dtype,
        objective.device,
        matmat=lambda vs: keep * hessian.matmat(keep * vs),
        project=lambda v: keep * v,
    )
    result = settings.solve(op)
    low, high = representative.factor_range
    return result.replace(
        coordinates="fixed",
        info={
            **result.info,
            "n_free": space.n_free,
            "n_fixed": space.n_fixed,
            "factor_min": low,
            "factor_max": high,
            "hvp_strategy": hessian.strategy,
        },
    )
