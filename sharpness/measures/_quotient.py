"""Scale-invariant sharpness on a rescaling quotient: the top eigenvalues of the exact Riemannian Hessian.

The geometry itself (metric, horizontal projection, Levi-Civita Hessian, exponential map) is a quotient class
of `manifolds`; the measures here bind it to an objective.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
from torch import Tensor

from manifolds import DegeneratePointError, LayerScaleQuotient, NodeScaleQuotient
from sharpness.measures._measure import BallGeometry, CurvatureOperator, Measure
from sharpness.products._hessian import HessianOperator
from sharpness.products._objective import Objective
from sharpness.products._operator import CallableOperator
from sharpness.products._rop_gradient import shared_gradient
from sharpness.solvers._vectors import _canonical_signs


class QuotientMeasure(Measure):
    """The top eigenvalue of the Riemannian Hessian on a rescaling quotient (`quotient`).

    The operator is the whitened Riemannian Hessian restricted to the horizontal space (a symmetric map on
    ``zeta = G^{1/2} xi``); its eigenvectors come back as horizontal tangent vectors of unit ``g``-norm
    (``coordinates="tangent"``), and ``info["riemannian_grad_norm"]`` says how far the point is from a
    critical point (the Levi-Civita terms make the value exact there too). Units: dimensionless (loss per
    squared relative change of the weights).
    """

    drops: ClassVar[str]  # which parameters the metric leaves out, e.g. "exactly zero"
    tangent_eigenvectors = True  # horizontal tangent vectors at the point, unit in the metric

    @abstractmethod
    def quotient(self, objective: Objective) -> LayerScaleQuotient | NodeScaleQuotient:
        """The quotient geometry at ``objective.params``."""

    def measured(self, objective: Objective) -> tuple[LayerScaleQuotient | NodeScaleQuotient, dict]:
        """`quotient`, and what it measures: ``n_measured`` of the parameters, ``n_dropped`` and, where
        some are dropped, ``dropped`` (one sentence naming the tensors).

        Raises:
            DegeneratePointError: every parameter is dropped (e.g. an all-zero checkpoint).
        """
        quotient = self.quotient(objective)
        layout = objective.layout
        # A quotient without a diagonal G^{1/2} (the symmetry quotient) keeps every entry: it refuses points where
        # its metric is undefined instead of dropping entries.
        if not isinstance(quotient, (LayerScaleQuotient, NodeScaleQuotient)):
            return quotient, {"n_measured": layout.size, "n_dropped": 0}
        dropped = quotient.dropped_entries()  # the node quotient's come from its group: no pass over G^{1/2}
        n_measured = layout.size - dropped.numel()
        facts = {"n_measured": n_measured, "n_dropped": layout.size - n_measured}
        if n_measured == 0:
            raise DegeneratePointError(
                f"every parameter is {self.drops}, so the {self.name}-wise metric leaves nothing to measure; use the "
                "euclidean measure, or a checkpoint with nonzero weights",
                short="all parameters dropped",
            )
        if n_measured < layout.size:
            bounds = torch.tensor([[layout.slice(n).start, layout.slice(n).stop] for n in layout.names])
            ends = torch.searchsorted(dropped.cpu(), bounds)  # a tensor holds a dropped entry where they differ
            names = [name for name, (lo, hi) in zip(layout.names, ends.tolist()) if hi > lo]
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            facts["dropped"] = (
                f"{facts['n_dropped']} of {layout.size} parameters left out ({shown}): they are {self.drops}, where "
                f"the {self.name}-wise metric is undefined"
            )
        return quotient, facts

    def operator(self, objective: Objective, hvp: str = "auto") -> CurvatureOperator:
        quotient, measured = self.measured(objective)
        hessian = HessianOperator(objective, hvp)
        egrad = shared_gradient(objective, hessian.strategy)  # read off the products' kept state where they keep one
        solver_hessian = getattr(quotient, "solver_hessian", None)
        if solver_hessian is None:  # a quotient with only the whitened map (the symmetry quotient): as it is
            apply = quotient.whitened_hessian(egrad, hessian.matvec)

            def apply_horizontal(zeta: Tensor, out: Tensor | None = None) -> Tensor:
                # the solvers' own vectors are horizontal; the product is projected, and so is its sum with `out`
                product = apply(zeta, horizontal=True)
                return product if out is None else out.add_(product)

            # the loss's gradient in whitened coordinates zeta = W xi (W^T W = G): W G^-1 egrad = W^-T egrad
            op = CallableOperator(apply, objective.layout.size, objective.dtype, objective.device,
                                  project=quotient.whitened_projection, comm=objective.comm,
                                  matvec_in_subspace=apply_horizontal, products_in_subspace=True,
                                  start_hint=lambda: quotient.whiten(quotient.egrad2rgrad(egrad)))  # fmt: skip
            to_parameters = quotient.unwhiten
        else:
            # In the quotient's own solver coordinates (log coordinates for the node metric: no signs to apply). Its
            # products end with the projection, and on the solvers' own (horizontal) vectors it skips the first one.
            hess = solver_hessian(egrad, hessian.matvec, hessian.matvec_add)
            op = CallableOperator(hess.apply, objective.layout.size, objective.dtype, objective.device,
                                  project=hess.project, comm=objective.comm,
                                  matvec_in_subspace=partial(hess.apply, horizontal=True),
                                  products_in_subspace=True, start_hint=hess.gradient)  # fmt: skip

            def to_parameters(vectors: Tensor) -> Tensor:
                # back in whitened coordinates, signed there as the solvers sign their vectors (largest entry positive)
                return quotient.unwhiten(_canonical_signs(hess.to_whitened(vectors)))

        # ||G^-1 g||_g = ||G^-1/2 g|| for a diagonal metric: one unwhitening instead of two and a whitening
        diagonal = isinstance(quotient, (LayerScaleQuotient, NodeScaleQuotient))
        grad_norm = (torch.linalg.vector_norm(quotient.unwhiten(egrad)) if diagonal
                     else quotient.norm(quotient.egrad2rgrad(egrad)))  # fmt: skip
        return CurvatureOperator(
            op,
            to_parameters=to_parameters,
            coordinates="tangent",
            info={
                "riemannian_grad_norm": float(grad_norm),
                "hvp_strategy": hessian.strategy,
                **measured,
            }
            | ({"projection": quotient.projection_note} if getattr(quotient, "projection_note", None) else {}),
        )

    def ball(self, objective: Objective) -> BallGeometry:
        """The ball of the quotient metric, retracted with its exact exponential map."""
        quotient, _ = self.measured(objective)
        return BallGeometry(
            retract=lambda zeta: quotient.expmap(quotient.unwhiten(zeta)),
            project=quotient.whitened_projection,
            whiten=quotient.whiten,
            unwhiten=quotient.unwhiten,
        )


@dataclass(frozen=True)
class Layer(QuotientMeasure):
    """The layer-wise quotient metric of Rangamani et al.: ``g(eta, xi) = sum_B <eta_B, xi_B> / ||w_B||^2``.

    Invariant under layer-wise rescaling only: a node-wise rescaling changes it (see
    [`sharpness.verify_invariance`][sharpness.verify_invariance]).

    Attributes:
        zero_blocks: ``"error"`` (default) refuses a tensor of zero norm (the metric ``1/||w_B||^2`` is
            undefined there), naming it; ``"exclude"`` leaves such tensors out of the tangent space (they are
            fixed points of every rescaling, so the rest of the geometry is unchanged).
    """

    zero_blocks: str = "error"

    name = "layer"
    drops = "in a tensor of zero norm"
    description = "layer-wise quotient metric (Rangamani et al.): invariant under layer-wise rescaling only"
    invariant_under = LayerScaleQuotient.invariant_under

    def quotient(self, objective: Objective) -> LayerScaleQuotient:
        return LayerScaleQuotient(objective.params, objective.structure, objective.layout, self.zero_blocks)


@dataclass(frozen=True)
class Node(QuotientMeasure):
    """The node-wise quotient metric ``g(eta, xi) = sum_k eta_k xi_k / w_k^2``.

    In ``u = log|w|`` it is Euclidean and every positive rescaling a translation, so its Riemannian Hessian is
    exactly ``diag(w) H diag(w) + diag(w * g)``: invariant under node-, channel- and layer-wise rescaling at
    every point (the elementwise adaptive sharpness of Kwon et al. 2021, made exact).
    """

    name = "node"
    drops = "exactly zero"
    description = "node-wise quotient metric: invariant under node-, channel- and layer-wise rescaling"
    invariant_under = NodeScaleQuotient.invariant_under

    def quotient(self, objective: Objective) -> NodeScaleQuotient:
        return NodeScaleQuotient(objective.params, objective.structure, objective.layout)
