"""Sharpness on the quotient by a network's whole symmetry group: attention heads, normalization scales, units.

The group is `manifolds.transformer_symmetry`'s (per-head GL factors on query/key and value/output,
LayerNorm/RMSNorm scale trades, token-wise ReLU units, and the diagonal rescaling group of ReLU and BatchNorm
networks); the metric is `manifolds.symmetry_metric` (invariant under all of it), and the measure is the top
eigenvalue of the exact Riemannian Hessian on the horizontal space (`manifolds.SymmetryQuotient`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from manifolds import MatrixSymmetry, SymmetryQuotient
from manifolds._absorption import absorbed, to_point
from manifolds._attention import required_symmetry  # the objective's structure holds the group
from sharpness.measures._measure import CurvatureOperator, Measure
from sharpness.measures._quotient import QuotientMeasure
from sharpness.products._boundary import _math_attention  # the one kernel with second derivatives
from sharpness.products._objective import Objective
from sharpness.products._operator import CallableOperator


@dataclass(frozen=True)
class Symmetry(QuotientMeasure):
    """Top eigenvalue of the quotient Hessian under the model's whole symmetry group (``"symmetry"``).

    Invariant under every element of the group `manifolds.transformer_symmetry` finds: per-head
    ``GL(hd)`` on query/key and on value/output, the affine scales of LayerNorm/RMSNorm traded against the layers
    reading them, token-wise ReLU unit scalings, and the node- and layer-wise rescalings of ReLU/BatchNorm
    networks. Frozen parameters stay as they are: the group is the subgroup that leaves them unchanged (every
    factor moving one is left out, see `manifolds.MatrixSymmetry.restricted`). Where that group has dimension 0
    the value is the top eigenvalue of the Riemannian Hessian of the metric alone and is invariant under nothing:
    ``info["symmetry_group_dim"]`` (the dimension of the group quotiented) says which case holds.
    The value biases of softmax attention are taken absorbed into the output bias (`representative`): adding ``u``
    to a head's value bias and ``-Wo_h u`` to the output bias keeps the function, a translation no matrix factor
    expresses, so the measure is taken at the one point of that orbit with zero value biases (the same function),
    and is invariant under the translations too. Eigenvectors are then the representative's (horizontal and of unit
    length there), carried to the point given by the translation's differential.
    Every product of the measure runs attention with the math kernel of ``scaled_dot_product_attention``
    (PyTorch's default CPU kernel has no second derivative). It has no metric ball yet (no epsilon-sharpness).
    Units: dimensionless, as the node measure.
    """

    name = "symmetry"
    description = ("quotient by the whole symmetry group (attention heads' GL factors, normalization scales, "
                   "ReLU units): invariant under all of it")
    invariant_under = ("node", "layer", "attention", "normalization")
    ball = Measure.ball  # geodesic balls on this quotient are another measure's job (no ball: no epsilon-sharpness)

    @staticmethod
    def group(objective: Objective) -> MatrixSymmetry:
        """The group quotiented: the model's whole symmetry group restricted to the objective's (trainable)
        parameters, frozen ones staying as they are (`manifolds.MatrixSymmetry.restricted`)."""
        # traced once per structure: an objective's copies at transformed parameters (verify's) share its graph
        return required_symmetry(objective.structure).restricted(objective.params)

    def quotient(self, objective: Objective) -> SymmetryQuotient:
        return SymmetryQuotient(self.group(objective), objective.params)

    def representative(self, objective: Objective) -> Objective:
        """``objective`` at the point of its orbit under the value-bias translations with zero value biases (the
        same function; `manifolds._absorption`), or ``objective`` itself where there is none to move."""
        moved = absorbed(self.group(objective), objective.params)
        return objective if moved is None else objective.with_params(moved)

    def operator(self, objective: Objective, hvp: str = "auto") -> CurvatureOperator:
        point = self.representative(objective)
        with _math_attention():
            bound = super().operator(point, hvp)
        group = self.group(objective)
        bound.info["symmetry_group_dim"] = group.dim
        if point is not objective:
            layout, params, back = objective.layout, objective.params, bound.to_parameters

            def to_parameters(vectors: Tensor) -> Tensor:  # tangents at the representative, carried to the point
                return layout.flatten(to_point(group, params, layout.unflatten(back(vectors))))

            bound.to_parameters = to_parameters
            bound.info["value_biases_absorbed"] = True
        inner = bound.operator

        def matvec(v: Tensor) -> Tensor:
            with _math_attention():
                return inner.matvec(v)

        def matvec_in_subspace(v: Tensor, out: Tensor | None = None) -> Tensor:
            # the solvers' own (horizontal) vectors: no projection of the input, and the products stay projected
            with _math_attention():
                return inner.matvec(v, in_subspace=True) if out is None else inner.matvec_add(v, out, in_subspace=True)

        bound.operator = CallableOperator(matvec, inner.size, inner.dtype, inner.device, project=inner.project,
                                          comm=inner.comm, matvec_in_subspace=matvec_in_subspace,
                                          products_in_subspace=inner.products_in_subspace,
                                          start_hint=inner.start_hint)  # fmt: skip
        return bound
