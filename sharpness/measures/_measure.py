"""What a sharpness measure is: one object per geometry, asked by every consumer.

A [`Measure`][sharpness.Measure] says what it is (``name``, ``description``), which rescalings leave it unchanged
(``invariant_under``), which symmetric operator it gives an [`Objective`][sharpness.Objective] (its top
eigenvalues are the measure), how that operator's eigenvectors map back to parameters, and, where the
measure has one, its epsilon ball (a retraction and a horizontal projection in whitened coordinates).
Sharpness, epsilon-sharpness, invariance verification and the landscape's eigenvector planes all take
the same object, so a new geometry is written once, in one place.
"""

from __future__ import annotations

import dataclasses
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from torch import Tensor

from manifolds import UnsupportedModelError
from sharpness._results import EigenResult, jsonable
from sharpness.measures._claims import symmetry_facts
from sharpness.products._objective import Objective
from sharpness.products._operator import SymmetricOperator
from sharpness.solvers._solve import Solver


def _identity(v: Tensor) -> Tensor:
    return v


@dataclass(frozen=True)
class BallGeometry:
    """The metric ball ``{R(xi) : ||xi||_g <= eps}`` around a point, in whitened coordinates ``zeta``.

    In ``zeta`` the metric is Euclidean, so the ball is ``{||zeta|| <= eps}`` intersected with the
    (whitened) horizontal space.

    Attributes:
        retract: ``zeta (d,) -> flat parameters (n,)``, ``R(unwhiten(zeta))``; must be differentiable
            with ``torch.func.vjp``.
        project: orthogonal projection of ``zeta (d,)`` onto the whitened horizontal space.
        whiten: tangent vector (the eigenvector coordinates of the measure's [`EigenResult`][sharpness.EigenResult]) ->
            ``zeta``.
        unwhiten: ``zeta`` -> tangent vector.
    """

    retract: Callable[[Tensor], Tensor]
    project: Callable[[Tensor], Tensor] = _identity
    whiten: Callable[[Tensor], Tensor] = _identity
    unwhiten: Callable[[Tensor], Tensor] = _identity


@dataclass
class CurvatureOperator:
    """A measure's symmetric operator at one point, and how its eigenvectors become parameter vectors.

    Attributes:
        operator: the symmetric operator on ``(d,)`` vectors whose top eigenvalues are the measure.
        to_parameters: ``(k, d)`` unit eigenvectors of ``operator`` -> ``(k, n)`` flat vectors in the
            objective's parameter layout (what [`EigenResult.coordinates`][sharpness.EigenResult] names).
        coordinates: what the mapped vectors are: ``"euclidean"`` (unit Euclidean parameter vectors),
            ``"tangent"`` (tangent vectors at the point, unit in the measure's metric), ``"gauged"`` /
            ``"fixed"`` (unit Euclidean vectors at the canonical representative the measure moved to).
        info: facts about the operator recorded in every result (``hvp_strategy`` and the measure's own).
    """

    operator: SymmetricOperator
    to_parameters: Callable[[Tensor], Tensor] = _identity
    coordinates: str = "euclidean"
    info: dict = field(default_factory=dict)


class Measure(ABC):
    """A sharpness measure: the top eigenvalues of a symmetric curvature operator of the loss.

    Subclasses are frozen dataclasses whose fields are the measure's options (e.g. which tensors the
    layer-wise metric leaves out); they set the class attributes and implement `operator`, and a
    measure with an epsilon ball implements `ball` too. The registry `sharpness.MEASURES`
    holds one default instance per name.

    Attributes:
        name: the registry key (``"euclidean"``, ``"layer"``, ``"node"``, ...).
        description: one sentence on what the measure is.
        invariant_under: the rescaling kinds (``"node"``, ``"layer"``) that leave it unchanged.
        needs_symmetry: whether the measure is defined only for models whose hidden units can be
            rescaled (every measure but the Euclidean one).
        tangent_eigenvectors: whether the eigenvectors come back as tangent vectors at the objective's own
            point, in its own parameter coordinates (``"euclidean"`` or ``"tangent"``), so lines and planes
            through the point can follow them (the landscape's eigen planes); not so for a measure that moves to
            a canonical representative or to other coordinates. Independent of [`has_ball`][sharpness.Measure.has_ball]
            (whether epsilon-sharpness is defined).
    """

    name: ClassVar[str]
    description: ClassVar[str]
    invariant_under: ClassVar[tuple[str, ...]]
    needs_symmetry: ClassVar[bool] = True
    tangent_eigenvectors: ClassVar[bool] = False

    @abstractmethod
    def operator(self, objective: Objective, hvp: str = "auto") -> CurvatureOperator:
        """The measure's operator at ``objective.params`` (``hvp``: the Hessian-vector product strategy)."""

    def ball(self, objective: Objective) -> BallGeometry:
        """The measure's epsilon ball at ``objective.params`` (for `sharpness.epsilon_sharpness`).

        Raises:
            ValueError: the measure has no ball geometry.
        """
        raise ValueError(
            f"the {self.name!r} measure has no metric ball (retraction and horizontal projection), so it has no "
            "epsilon-sharpness; use 'euclidean', 'layer' or 'node'"
        )

    @property
    def has_ball(self) -> bool:
        """Whether [`ball`][sharpness.Measure.ball] is implemented (epsilon-sharpness is defined for this measure)."""
        return type(self).ball is not Measure.ball

    def solve(self, objective: Objective, k: int, solver: Solver, progress: bool | None = None) -> EigenResult:
        """Top ``k`` eigenpairs of `operator`, eigenvectors mapped to parameters (no timing or facts
        about the objective: [`sharpness`][sharpness.Measure.sharpness] adds those)."""
        bound = self.operator(objective, solver.hvp)
        result = solver.solve(bound.operator, k, progress)
        return result.replace(
            eigenvectors=bound.to_parameters(result.eigenvectors),
            coordinates=bound.coordinates,
            info={**result.info, **bound.info},
        )

    def sharpness(self, objective: Objective, k: int = 1, solver: Solver | None = None,
                  progress: bool | None = None) -> EigenResult:  # fmt: skip
        """The measure at ``objective.params``: its top ``k`` eigenpairs and how they were found.

        Returns:
            `EigenResult` with ``.value`` the measure, ``layout`` and ``seconds`` set, and ``info``
                holding ``metric`` (this measure's name), ``loss``, ``n_params``, ``n_samples``,
                ``hvp_strategy``, what it measured (``n_measured`` of the ``n_params`` parameters; ``n_dropped``,
                and ``dropped`` saying why where some were left out, e.g. zero weights under the node-wise
                metric), its symmetry (``invariant_under``: `invariant_under` cut to the rescalings this
                network has, ``invariance_note`` saying what was cut and why, and ``group``: the rescaling group
                used, its dimensions and what pinned the rest; see `symmetry_facts`)
                and the measure's own facts.

        Raises:
            UnsupportedModelError: the measure does not apply to this model;
                `DegeneratePointError` (a subclass) where it does not exist at these weights.
        """
        start = time.perf_counter()
        result = self.solve(objective, k, solver or Solver(), progress)
        facts = objective.facts()
        return result.replace(
            layout=objective.layout,
            seconds=time.perf_counter() - start,
            info={
                "n_measured": facts["n_params"],
                "n_dropped": 0,
                **result.info,
                "metric": self.name,
                **facts,
                **symmetry_facts(tuple(self.invariant_under), objective),
            },
        )

    def to_dict(self) -> dict:
        """JSON-serialisable description: name, description, invariances and options."""
        return jsonable({
            "name": self.name,
            "description": self.description,
            "invariant_under": list(self.invariant_under),
            "options": {f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
        })


def require_trainable_layers(objective: Objective, what: str) -> None:
    """Raise `manifolds.UnsupportedModelError` unless every layer's weight and bias is among the objective's
    trainable parameters: ``what`` (a reparametrization of whole layers: fixed weights, G-space) moves them all.

    Args:
        objective: the objective measured.
        what: the measure, e.g. ``"the fixed-weight measure"``.
    """
    frozen = [n for layer in objective.structure.layers for n in (layer.weight, layer.bias)
              if n is not None and n not in objective.params]  # fmt: skip
    if frozen:
        raise UnsupportedModelError(
            f"{what} reparametrizes every layer's weight and bias, but {', '.join(frozen)} is not one of the "
            "trainable parameters (frozen with requires_grad=False, or the same tensor as another parameter, such as "
            "an output layer tied to the token embedding); make it trainable, or use the node, layer, minnorm or "
            "symmetry measure, which leave such tensors alone",
            short="needs every layer trainable",
        )
