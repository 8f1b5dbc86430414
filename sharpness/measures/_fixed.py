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
from dataclasses import dataclass

from torch import Tensor

from manifolds import FixedWeightSpace
from sharpness.measures._measure import CurvatureOperator, Measure, require_trainable_layers
from sharpness.products._hessian import HessianOperator
from sharpness.products._objective import Objective
from sharpness.products._operator import CallableOperator


@dataclass(frozen=True)
class Fixed(Measure):
    """The top eigenvalue of ``P H P`` at the representative of the point whose fixed weights are all +-1.

    ``H`` is the Euclidean Hessian there and ``P`` the coordinate projection onto the free weights, so the
    eigenvalues are those of the free-free block of ``H`` (the solver works in the range of ``P``; the fixed
    coordinates never enter the spectrum). Eigenvectors are unit vectors at the representative, zero on the
    fixed entries (``coordinates="fixed"``); ``info`` holds ``n_free``, ``n_fixed``, ``factor_min`` /
    ``factor_max`` (range of the node factors that moved the point to the representative).

    Attributes:
        selection: which weights are fixed (see `manifolds.FixedWeightSpace`); only a gauge-independent
            one (``"diagonal"``, the default, or a fixed mask) gives a rescaling-invariant measure.

    Raises (from [`operator`][sharpness.Fixed]):
        UnsupportedModelError: positive rescaling is not a symmetry of the model.
        DegeneratePointError: a fixed weight is zero (no rescaling makes it +-1).
    """

    selection: str | Mapping[str, Tensor] = "diagonal"

    name = "fixed"
    description = (
        "Hessian restricted to the free weights at the representative whose fixed weights (one outgoing weight "
        "per hidden unit, diagonal selection) are all +-1: invariant under node-, channel- and layer-wise "
        "rescaling"
    )
    invariant_under = ("node", "layer")

    def operator(self, objective: Objective, hvp: str = "auto") -> CurvatureOperator:
        require_trainable_layers(objective, "the fixed-weight measure")
        space = FixedWeightSpace(objective.model, self.selection, params=objective.params,
                                 structure=objective.structure)  # fmt: skip
        representative = space.rescale_to_fixed_value(objective.params, 1.0)
        hessian = HessianOperator(objective.with_params(representative.params), hvp)
        keep = space.free_mask.to(device=objective.device, dtype=objective.dtype)
        op = CallableOperator(
            lambda v: keep * hessian.matvec(keep * v),
            objective.layout.size,
            objective.dtype,
            objective.device,
            matmat=lambda vs: keep * hessian.matmat(keep * vs),
            project=lambda v: keep * v,
            comm=objective.comm,
            start_hint=lambda: keep * hessian.start_hint(),  # the gradient at the representative, free weights
        )
        low, high = representative.factor_range
        info = {"n_free": space.n_free, "n_fixed": space.n_fixed, "factor_min": low, "factor_max": high,
                "hvp_strategy": hessian.strategy}  # fmt: skip
        return CurvatureOperator(op, coordinates="fixed", info=info)
