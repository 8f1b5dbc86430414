"""Geodesic sharpness (da Silva, Dangel and Oore, ICML 2025): the worst loss increase over a geodesic ball.

Only the paper's abstract could be read while this was written; the definitions below follow it and the
toolkit's issue 33 ("the worst loss on a geodesic ball of the quotient, with geodesics approximated to second
order; the first-order approximation is adaptive sharpness"), worked out here. With a metric ``g`` on the
parameters that the network's symmetry group leaves invariant,

    S_geo = max_{xi horizontal, ||xi||_g <= rho} f(gamma_xi(1)) - f(w),

``gamma_xi`` the geodesic of ``g`` from ``w`` with initial velocity ``xi``. Horizontal vectors (``g``-orthogonal
to the group orbit) are the tangent space of the quotient, so this is the worst case over a geodesic ball of
the quotient manifold. The geodesic is replaced by its Taylor polynomial:

    order 2:  gamma_xi(1) ~ w + xi - 1/2 Gamma_w(xi, xi)      (Christoffel symbols of g, by autodiff of g)
    order 1:  gamma_xi(1) ~ w + xi

Every rescaling ``w -> t w`` of the group is linear and an isometry of ``g``, so ``Gamma_{tw}(t xi, t xi) =
t Gamma_w(xi, xi)``: it maps the horizontal ball and both approximate geodesics at ``w`` onto those at ``t w``,
and ``S_geo`` is invariant at either order (the ascent even follows the same path in whitened coordinates).

**First order = adaptive sharpness.** With the node metric ``g = sum xi_k^2 / w_k^2`` the whitened coordinates
are ``z = xi / |w|``, so the order-1 point is ``w + |w| z`` over ``||z|| <= rho``: adaptive sharpness (l2) with
the same ``rho``, once the horizontal constraint is dropped (``horizontal=False``; the result equals
`adaptive_sharpness` to rounding, same starts and steps). Adaptive sharpness does not restrict ``z``, and
at first order that matters: moving ``w + |w| z`` along an orbit direction is a rescaling only to first order,
so the unrestricted ball reaches other functions through it. The second-order geodesic of the node metric is
``w (1 + u + u^2 / 2)`` with ``u = xi / w`` (``Gamma_w(xi, xi) = -xi^2 / w``): the exact geodesic ``w exp(u)``
to third order.

The maximum is searched like adaptive sharpness's (one ascent loop, ``_adaptive._worst_case``): projected
gradient ascent in ``z`` (normalized, horizontal steps, projected back onto the ball), from the centre, from
``+-rho`` times the measure's top eigenvector (its second-order maximizer at a critical point) and from random
horizontal points of the sphere. The gradient in ``z`` is the Euclidean gradient at the curve's end pulled
back through ``z -> gamma(unwhiten(z))`` by ``torch.func.vjp`` (the Christoffel term is itself a JVP and a VJP
of the metric function, so this is a nested transform).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from manifolds import Metric, MetricQuotient, ParamLayout, UnsupportedModelError, layer_metric, node_metric
from sharpness._progress import progress_bar
from sharpness._results import EigenResult, jsonable
from sharpness.measures._adaptive import Ascent, SearchBall, _starts, _worst_case
from sharpness.measures._claims import symmetry_facts
from sharpness.measures._euclidean import Euclidean
from sharpness.measures._measure import Measure
from sharpness.measures._quotient import QuotientMeasure
from sharpness.measures._registry import get_measure
from sharpness.products._objective import Objective, build_objective
from sharpness.solvers._solve import Solver

ORDERS = (1, 2)


def _euclidean_metric() -> Metric:
    """The flat metric ``g(eta, xi) = eta^T xi``: geodesics are straight lines, ``Gamma = 0``."""
    return Metric(
        apply=lambda w, xi: xi,
        solve=lambda w, v: v,
        whiten=lambda w, xi: xi,
        unwhiten=lambda w, zeta: zeta,
        name="euclidean",
    )


# measure name -> the metric function whose connection gives the geodesics (the same metric as the measure's)
_METRICS: dict[str, Callable[[ParamLayout], Metric]] = {
    "euclidean": lambda layout: _euclidean_metric(),
    "layer": layer_metric,
    "node": lambda layout: node_metric(),
}


@dataclass(frozen=True)
class GeodesicSharpness:
    """Geodesic sharpness of a point.

    Attributes:
        rho: radius of the ball in the metric, ``||xi||_g`` (dimensionless for ``"node"`` and ``"layer"``: a
            relative change of the weights; parameter units for ``"euclidean"``).
        metric: the metric's name (``"node"``, ``"layer"`` or ``"euclidean"``).
        order: ``2`` (second-order geodesics) or ``1`` (straight lines ``w + xi``).
        horizontal: whether ``xi`` was restricted to the horizontal space (the quotient's tangent space).
        value: the largest loss increase the ascent found, ``f(gamma_xi(1)) - f(w)`` (loss units; a lower bound
            of the true maximum, ``>= 0`` since the centre is in the ball).
        loss: ``f(w)`` over the whole data set.
        velocity: ``(n,)`` the best initial velocity ``xi`` (tangent vector, ``||xi||_g <= rho``).
        perturbation: ``(n,)`` ``gamma_xi(1) - w`` for that ``xi`` (parameter units).
        eigenvalue: the measure's top eigenvalue at the point when it was solved for (eigen starts), else
            ``None``; ``rho^2 / 2`` times it is the second-order prediction of ``value`` at a critical point.
        history: one record per evaluation: ``start`` (``"centre"``, ``"eigen+"``, ``"eigen-"``,
            ``"random k"``), ``step``, ``increase``, ``radius`` (``||xi||_g``), ``batch`` (always ``None``).
        ascent: the [`Ascent`][sharpness.Ascent] settings.
        invariant_under: the rescaling kinds that leave the value unchanged: the metric's measure's claim cut to
            the kinds this network's rescaling group has (empty where it has dimension 0).
        invariance_note: what was cut from that claim and why (``None`` when nothing was).
        seconds: wall time, eigen-solve included.
        layout: maps the vectors to named parameters.
    """

    rho: float
    metric: str
    order: int
    horizontal: bool
    value: float
    loss: float
    velocity: Tensor
    perturbation: Tensor
    eigenvalue: float | None
    history: list[dict]
    ascent: Ascent
    invariant_under: tuple[str, ...]
    seconds: float
    layout: ParamLayout = field(repr=False)
    invariance_note: str | None = None

    @property
    def second_order(self) -> float | None:
        """``rho^2 / 2 * eigenvalue``: the value to second order at a critical point (``None`` without eigenvalue)."""
        return None if self.eigenvalue is None else self.rho**2 / 2 * self.eigenvalue

    def to_dict(self, with_vectors: bool = False) -> dict:
        """JSON-serialisable summary (the vectors only on request: they are as long as the model)."""
        out = {
            "rho": self.rho,
            "metric": self.metric,
            "order": self.order,
            "horizontal": self.horizontal,
            "value": self.value,
            "loss": self.loss,
            "eigenvalue": self.eigenvalue,
            "second_order": self.second_order,
            "invariant_under": list(self.invariant_under),
            "invariance_note": self.invariance_note,
            "ascent": self.ascent.to_dict(),
            "history": self.history,
            "seconds": self.seconds,
        }
        if with_vectors:
            out["velocity"] = self.velocity
            out["perturbation"] = self.perturbation
        return jsonable(out)


def geodesic_ball(
    objective: Objective, measure: Measure, order: int = 2, horizontal: bool = True
) -> tuple[SearchBall, MetricQuotient]:
    """The geodesic ball of ``measure``'s metric at ``objective.params``, in whitened coordinates ``z``.

    Args:
        objective: the objective (its parameters are the centre ``w``).
        measure: ``Node()``, ``Layer(...)`` or ``Euclidean()`` (by object).
        order: ``2``: ``z -> w + xi - 1/2 Gamma(xi, xi)``; ``1``: ``z -> w + xi``; ``xi = W^-1 z``.
        horizontal: project ``z`` onto the whitened horizontal space of the measure's quotient (nothing to
            project for ``Euclidean``).

    Returns:
        ``(ball, geometry)``: the `SearchBall` the ascent searches and the `manifolds.MetricQuotient`
            of the metric at ``w`` (no vertical space: it gives the whitening and the Christoffel symbols, the
            measure's own quotient gives the horizontal projection, which scales with the group).

    Raises:
        ValueError: the metric is not defined at ``w`` (a zero weight for ``"node"``, a zero tensor for ``"layer"``).
        UnsupportedModelError: a quotient metric on a model whose rescaling group is unknown (with
            ``horizontal``: there is no horizontal space to restrict the ball to).
    """
    w = objective.layout.flatten(objective.params)
    # the symmetry measure's quotient is its metric's geometry at w already (the metric depends on the group)
    quotient = measure.quotient(objective) if measure.name == "symmetry" else None
    geometry = quotient or MetricQuotient(_METRICS[measure.name](objective.layout), w)
    project = None
    if horizontal and measure.name != "euclidean":
        quotient = quotient or measure.quotient(objective)
        if getattr(quotient, "projected", True) is False:  # no group, no horizontal space to restrict the ball to
            raise UnsupportedModelError(
                "geodesic sharpness restricts the ball to the horizontal space, which needs the rescaling group, and "
                f"it is unknown ({quotient.structure.group_failure}); pass horizontal=False to search the whole "
                "tangent ball"
            )
        project = quotient.whitened_projection
    unwhiten = geometry.unwhiten
    if order == 1:
        def point(z: Tensor) -> Tensor:
            return w + unwhiten(z)
    else:
        def point(z: Tensor) -> Tensor:
            return geometry.second_order_geodesic(unwhiten(z))

    def pullback(z: Tensor, egrad: Tensor) -> Tensor:
        return torch.func.vjp(point, z)[1](egrad)[0]  # d/dz f(point(z)) = J^T egrad

    def to_z(xi: Tensor) -> Tensor:
        z = geometry.whiten(xi)
        return z if project is None else project(z)

    ball = SearchBall(point=point, pullback=pullback, to_z=to_z, movable=torch.ones_like(w, dtype=torch.bool),
                      project=project, radius="radius ||xi||_g")  # fmt: skip
    return ball, geometry


def geodesic_sharpness(
    model: nn.Module | None,
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None,
    data: object,
    rho: float,
    *,
    metric: str | Measure = "node",
    order: int = 2,
    horizontal: bool = True,
    ascent: Ascent | None = None,
    eigen: EigenResult | None = None,
    objective: Objective | None = None,
    dtype: torch.dtype | None = None,
    progress: bool | None = None,
) -> GeodesicSharpness:
    """Geodesic sharpness of ``model``: the worst loss increase over the (approximate) geodesic ball of radius ``rho``.

    See the module docstring for the definition. The loss is over the whole data set; the model is not modified.

    Args:
        model: as for [`Objective`][sharpness.Objective] (not used when ``objective`` is given).
        loss_fn: as for [`Objective`][sharpness.Objective] (not used when ``objective`` is given).
        data: as for [`Objective`][sharpness.Objective] (not used when ``objective`` is given).
        rho: radius ``> 0`` of the ball in the metric, ``||xi||_g``.
        metric: ``"node"`` (default; invariant under node-, channel- and layer-wise rescaling), ``"layer"``
            (layer-wise only), ``"symmetry"`` (`manifolds.symmetry_metric`: invariant under the whole group,
            attention heads' ``GL(h)`` and normalization trades included; the ball is centred at the point with the
            attention's value biases absorbed into the output biases, the same function: see the symmetry measure,
            and ``velocity`` is a tangent there) or ``"euclidean"``
            (flat metric: straight lines, nothing projected, not
            invariant), by name or measure object (e.g. ``Layer(zero_blocks="error")``).
        order: ``2`` (second-order geodesics, the paper's measure) or ``1`` (``w + xi``).
        horizontal: restrict ``xi`` to the horizontal space (the definition); ``False`` searches the whole
            tangent ball, which with ``metric="node", order=1`` is exactly adaptive sharpness (l2).
        ascent: search settings (default `Ascent()`; ``samples`` is not used).
        eigen: this measure's top eigenpair at this point, to start from without solving for it again.
        objective: an existing objective instead of a new one.
        dtype: evaluation dtype (default: the model's).
        progress: progress bar over the loss evaluations (``None``: only on a terminal).

    Returns:
        [`GeodesicSharpness`][sharpness.GeodesicSharpness].

    Raises:
        ValueError: bad ``rho``, ``order`` or ``horizontal``, a metric other than these three, an ``eigen`` of
            another measure, or a point where the metric is undefined (a zero weight under ``"node"``, a zero
            tensor under ``"layer"``).
        UnsupportedModelError: a quotient metric on a model whose rescaling group is unknown (with
            ``horizontal``: there is no horizontal space to restrict the ball to).
        FloatingPointError: the gradient is not finite inside the ball (``rho`` too large).
    """
    started = time.perf_counter()
    if not (isinstance(rho, (int, float)) and not isinstance(rho, bool) and math.isfinite(rho) and rho > 0):
        raise ValueError(f"rho must be a positive radius, got {rho!r}")
    if isinstance(order, bool) or order not in ORDERS:
        raise ValueError(f"order must be 1 or 2 (the order of the geodesic's Taylor polynomial), got {order!r}")
    if not isinstance(horizontal, bool):
        raise ValueError(f"horizontal must be True or False, got {horizontal!r}")
    measure = get_measure(metric)
    if not isinstance(measure, (QuotientMeasure, Euclidean)) or measure.name not in (*_METRICS, "symmetry"):
        raise ValueError(
            f"geodesic sharpness needs a metric on the parameters; {measure.name!r} has none: use "
            f"{', '.join(repr(m) for m in (*_METRICS, 'symmetry'))}"
        )
    if eigen is not None and eigen.info.get("metric") != measure.name:
        raise ValueError(f"eigen was computed for metric {eigen.info.get('metric')!r}, not {measure.name!r}")
    ascent = ascent or Ascent()
    generator = torch.Generator().manual_seed(ascent.seed)
    obj = build_objective(model, loss_fn, data, objective, dtype=dtype)
    if measure.name == "symmetry":  # centred at the value biases' representative (the same function), as the measure
        obj = measure.representative(obj)
    ball, geometry = geodesic_ball(obj, measure, order, horizontal)
    solved: list[EigenResult] = []

    def make_starts() -> list[tuple[str, Tensor]]:
        direction = None
        if ascent.eigen_start:
            solved.append(eigen or measure.sharpness(obj, 1, Solver(), progress=False))
            direction = solved[0].eigenvectors[0]
        return _starts(obj, ball, "l2", float(rho), ascent, generator, direction)

    total = (ascent.steps + 1) * (1 + 2 * ascent.eigen_start + ascent.restarts)
    with progress_bar(total, f"geodesic sharpness ({measure.name}, order {order})", progress) as bar:
        value, f0, best_z, history = _worst_case(
            obj, ball, "l2", float(rho), ascent, make_starts, lambda: bar.update(1), None
        )
    w = obj.layout.flatten(obj.params)
    claims = symmetry_facts(tuple(measure.invariant_under), obj)  # the claim the group found supports
    return GeodesicSharpness(
        rho=float(rho),
        metric=measure.name,
        order=order,
        horizontal=horizontal,
        value=value,
        loss=f0,
        velocity=geometry.unwhiten(best_z).detach(),
        perturbation=(ball.point(best_z) - w).detach(),
        eigenvalue=solved[0].value if solved else None,
        history=history,
        ascent=ascent,
        invariant_under=tuple(claims["invariant_under"]),
        seconds=time.perf_counter() - started,
        layout=obj.layout,
        invariance_note=claims.get("invariance_note"),
    )
