"""The Euclidean Hessian of an [`Objective`][sharpness.Objective] as a symmetric operator on flat vectors."""

from __future__ import annotations

from torch import Tensor

from sharpness.products._objective import Objective
from sharpness.products._operator import SymmetricOperator
from sharpness.products._rop_gradient import shared_gradient


class HessianOperator(SymmetricOperator):
    """``v -> H v`` with ``H`` the Hessian of the whole-data-set loss at ``objective.params``.

    Args:
        objective: the loss over the data set.
        strategy: how products are computed (see [`Objective.hvp`][sharpness.Objective.hvp]); resolved once.
    """

    def __init__(self, objective: Objective, strategy: str = "auto"):
        super().__init__(objective.layout.size, objective.dtype, objective.device, objective.comm)
        self.objective = objective
        self.strategy = objective.hvp_strategy(strategy)

    def _matvec(self, v: Tensor) -> Tensor:
        return self.objective.hvp(v, self.strategy)

    def _matvec_add(self, v: Tensor, out: Tensor) -> Tensor:
        return self.objective.hvp(v, self.strategy, out=out)

    def _matmat(self, vs: Tensor) -> Tensor:
        return self.objective.hvp_batch(vs, self.strategy)

    def start_hint(self) -> Tensor:
        """The whole-data-set gradient, flat ``(n,)``: read off the products' kept state where they keep one (no
        pass over the data), else one forward and backward pass."""
        return shared_gradient(self.objective, self.strategy)
