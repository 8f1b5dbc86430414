"""Epsilon-sharpness in any metric: the largest loss increase over a metric ball, to second order and measured.

Flatness paper, Definition 1 and its Riemannian form (section 2.3): with a retraction ``R`` at ``w``,

    S_eps = (max_{||xi||_g <= eps} f(R(xi)) - f(w)) / (1 + f(w))  ~  lambda_max eps^2 / (2 (1 + f(w))),

``lambda_max`` the top eigenvalue of the (Riemannian) Hessian. The approximation is exact to second
order at a critical point; away from one the gradient term ``eps ||grad f||_g`` dominates for small
``eps``. The maximum is measured by projected gradient ascent in whitened coordinates ``zeta``
(``||zeta|| = ||xi||_g``), where the ball is a Euclidean ball of horizontal vectors.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from manifolds import ParamLayout
from sharpness._progress import progress_bar
from sharpness._results import EigenResult, jsonable, write_text_atomic
from sharpness.measures._measure import Measure
from sharpness.measures._registry import get_measure
from sharpness.products._objective import Objective, build_objective
from sharpness.solvers._solve import Solver


@dataclass(frozen=True)
class EpsilonSharpness:
    """Epsilon-sharpness of a point in one metric, predicted to second order and measured.

    Attributes:
        epsilon: radius of the ball in the metric (``||xi||_g``; whitened units for quotient metrics,
            parameter units for ``"euclidean"``).
        metric: the metric's name.
        loss: ``f(w)``, the loss over the whole data set at the point.
        second_order: ``lambda_max eps^2 / (2 (1 + f))`` (dimensionless).
        measured: ``(max f(R(xi)) - f) / (1 + f)`` over the ball, the best value the ascent found
            (a lower bound of the true maximum; ``>= 0`` since the centre is in the ball).
        maximizer: ``(d,)`` the tangent vector ``xi`` attaining ``measured`` (horizontal,
            ``||xi||_g <= eps``), in the coordinates of ``lambda_max``'s eigenvectors.
        perturbed: ``(n,)`` the flat parameters ``R(xi)``.
        history: one record per evaluation: ``start`` (``+1``/``-1``: the sign of the top eigenvector
            the ascent started from), ``step``, ``sharpness`` (normalized as ``measured``), ``radius``
            (``||xi||_g``).
        lambda_max: the top eigenpair of the metric's Hessian ([`measure_sharpness`][sharpness.measure_sharpness]).
        start_sign: start of the ascent that found the maximum (``0``: the centre was best).
        steps: ascent steps per start.
        step_size: first step length as a fraction of ``epsilon``.
        seconds: wall time, eigen-solve included.
        layout: maps ``perturbed`` to named parameters.
    """

    epsilon: float
    metric: str
    loss: float
    second_order: float
    measured: float
    maximizer: Tensor
    perturbed: Tensor
    history: list[dict]
    lambda_max: EigenResult
    start_sign: int
    steps: int
    step_size: float
    seconds: float = 0.0
    layout: ParamLayout | None = field(default=None, repr=False)

    @property
    def ratio(self) -> float:
        """``measured / second_order`` (tends to 1 as ``eps -> 0`` at a critical point)."""
        return self.measured / self.second_order if self.second_order != 0.0 else math.nan

    def perturbed_parameters(self) -> dict[str, Tensor]:
        """``R(xi)`` as a dictionary shaped like the model's parameters."""
        if self.layout is None:
            raise ValueError("this result has no parameter layout; use .perturbed (flat)")
        return self.layout.unflatten(self.perturbed)

    def to_dict(self, with_vectors: bool = False, with_eigen: bool = True) -> dict:
        """JSON-serialisable summary (the maximizer and perturbed point only on request: they are large;
        ``with_eigen=False`` leaves out the eigen-solve's record, for reports that hold it already)."""
        out = {
            "epsilon": self.epsilon,
            "metric": self.metric,
            "loss": self.loss,
            "second_order": self.second_order,
            "measured": self.measured,
            "ratio": self.ratio,
            "lambda_max": self.lambda_max.value,
            "start_sign": self.start_sign,
            "steps": self.steps,
            "step_size": self.step_size,
            "seconds": self.seconds,
            "history": self.history,
        }
        if with_eigen:
            out["eigen"] = self.lambda_max.to_dict()
        if with_vectors:
            out["maximizer"] = self.maximizer
            out["perturbed"] = self.perturbed
        return jsonable(out)

    def save_json(self, path: str | os.PathLike, with_vectors: bool = False) -> None:
        """Write [`to_dict`][sharpness.EpsilonSharpness.to_dict] to ``path`` atomically."""
        write_text_atomic(path, json.dumps(self.to_dict(with_vectors), indent=2))


def second_order(lambda_max: float, epsilon: float, loss: float) -> float:
    """The second-order epsilon-sharpness ``lambda_max eps^2 / (2 (1 + f))`` (dimensionless)."""
    return lambda_max * epsilon**2 / (2.0 * (1.0 + loss))


def _into_ball(zeta: Tensor, radius: float) -> Tensor:
    """Radial projection of ``zeta`` onto the closed ball of ``radius``."""
    norm = float(torch.linalg.vector_norm(zeta))
    return zeta * (radius / norm) if norm > radius else zeta


def epsilon_sharpness(
    model: nn.Module | None,
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None,
    data: object,
    epsilon: float,
    metric: str | Measure = "node",
    *,
    steps: int = 20,
    step_size: float = 0.5,
    eigen: EigenResult | None = None,
    solver: Solver | None = None,
    objective: Objective | None = None,
    progress: bool | None = None,
) -> EpsilonSharpness:
    """Epsilon-sharpness of ``model`` in ``metric``: its second-order estimate and a measured maximum.

    The maximum of ``zeta -> f(R(zeta))`` over the horizontal ball ``||zeta|| <= eps`` (whitened
    coordinates, ``R`` the measure's retraction: ``w + zeta`` for ``"euclidean"``,
    ``expmap(unwhiten(zeta))`` for the quotients; see [`Measure.ball`][sharpness.Measure.ball]) is searched by projected
    gradient ascent started at ``+-eps`` times the top eigenvector (the maximizer to second order), keeping
    the better start. The gradient in ``zeta`` is the Euclidean gradient at the moved point pulled back
    through ``R`` with ``torch.func.vjp``; each step moves ``step_size * eps / sqrt(t + 1)`` along the
    normalized projected gradient and is projected back onto the horizontal space and the ball. The model
    is not modified.

    Args:
        model: as for [`Objective`][sharpness.Objective] (not used when ``objective`` is given).
        loss_fn: as for [`Objective`][sharpness.Objective] (not used when ``objective`` is given).
        data: as for [`Objective`][sharpness.Objective] (not used when ``objective`` is given).
        epsilon: ball radius ``> 0`` in the metric (see [`EpsilonSharpness.epsilon`][sharpness.EpsilonSharpness]).
        metric: a measure with a ball (`Measure.has_ball`: ``"euclidean"``, ``"layer"``, ``"node"``),
            by name or object.
        steps: ascent steps per start (``0``: evaluate the two starts only).
        step_size: first step length as a fraction of ``epsilon``.
        eigen: a precomputed top eigenpair of this measure at this point (e.g. to sweep ``epsilon``);
            computed with [`Measure.sharpness`][sharpness.Measure.sharpness] when ``None``.
        solver: eigen-solver settings for that eigenpair (default ``Solver()``).
        objective: an existing objective instead of a new one.
        progress: progress bar over the ascent evaluations and the eigen-solve (``None``: only on a
            terminal).

    Returns:
        [`EpsilonSharpness`][sharpness.EpsilonSharpness].

    Raises:
        ValueError: unknown measure, a measure without a ball, ``epsilon <= 0``, ``steps < 0``,
            or an ``eigen`` of another measure.
        UnsupportedModelError: a quotient metric on a model without the rescaling symmetry.
    """
    started = time.perf_counter()
    measure = get_measure(metric)
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"epsilon must be a positive radius, got {epsilon!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be a non-negative integer, got {steps!r}")
    if eigen is not None and eigen.info.get("metric") != measure.name:
        raise ValueError(f"eigen was computed for metric {eigen.info.get('metric')!r}, not {measure.name!r}")
    metric = measure.name

    obj = build_objective(model, loss_fn, data, objective)
    geometry = measure.ball(obj)
    if eigen is None:
        eigen = measure.sharpness(obj, 1, solver, progress)
    direction = geometry.project(geometry.whiten(eigen.eigenvectors[0].to(obj.device, obj.dtype)))
    norm = float(torch.linalg.vector_norm(direction))
    if norm == 0.0:
        raise ValueError("the top eigenvector has no horizontal component; it cannot start the ascent")
    direction = direction / norm

    f0 = float(obj.value())
    scale = 1.0 + f0

    def value_and_grad(zeta: Tensor) -> tuple[float, Tensor]:
        moved, pullback = torch.func.vjp(geometry.retract, zeta)
        value, egrad = obj.value_and_gradient(moved.detach())
        grad = pullback(egrad)[0]
        # A NaN step would be dropped silently by the best-value comparison; say so instead.
        if not bool(torch.isfinite(grad).all()):
            raise FloatingPointError(
                f"the gradient of the loss over the {metric} ball is not finite at radius "
                f"{float(torch.linalg.vector_norm(zeta)):.3g}; use a smaller epsilon"
            )
        return float(value), grad

    best_value, best_zeta, best_sign = f0, torch.zeros_like(direction), 0
    history: list[dict] = []
    with progress_bar(2 * (steps + 1), "epsilon-sharpness ascent", progress) as bar:
        for sign in (1, -1):
            zeta = sign * epsilon * direction
            for t in range(steps + 1):
                if t < steps:
                    value, grad = value_and_grad(zeta)
                else:  # the last point needs no gradient
                    value = float(obj.value(geometry.retract(zeta)))
                radius = float(torch.linalg.vector_norm(zeta))
                history.append({"start": sign, "step": t, "sharpness": (value - f0) / scale, "radius": radius})
                bar.update(1)
                if value > best_value:
                    best_value, best_zeta, best_sign = value, zeta, sign
                if t == steps:
                    break
                ascent = geometry.project(grad)
                ascent_norm = float(torch.linalg.vector_norm(ascent))
                if ascent_norm == 0.0:  # a stationary point of f o R on the horizontal space
                    break
                length = step_size * epsilon / math.sqrt(t + 1)
                zeta = _into_ball(geometry.project(zeta + (length / ascent_norm) * ascent), epsilon)

    return EpsilonSharpness(
        epsilon=float(epsilon),
        metric=metric,
        loss=f0,
        second_order=second_order(eigen.value, epsilon, f0),
        measured=(best_value - f0) / scale,
        maximizer=geometry.unwhiten(best_zeta),
        perturbed=geometry.retract(best_zeta).detach(),
        history=history,
        lambda_max=eigen,
        start_sign=best_sign,
        steps=steps,
        step_size=float(step_size),
        seconds=time.perf_counter() - started,
        layout=obj.layout,
    )
