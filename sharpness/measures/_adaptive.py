"""Adaptive sharpness (Kwon et al. 2021; Andriushchenko et al. 2023): loss increase over a ball scaled by |w|.

With ``c = |w|`` entry-wise and normalized coordinates ``z = delta / c``:

    worst case   S_max = max_{||z||_p <= rho} f(w + c z) - f(w)            (p = 2 or infinity)
    average case S_avg = E_{z ~ N(0, rho^2 I)} f(w + c z) - f(w)

Any diagonal rescaling ``w -> t w`` (``t > 0``) that leaves ``f`` unchanged maps ``c -> t c`` and
``w + c z -> t (w + c z)``, so both are invariant under the whole rescaling group of the network, and
the ascent below follows the same ``z`` path before and after (its gradient ``c * grad f`` is invariant
too). To second order at a critical point ``S_max(l2) = rho^2 / 2 * lambda_max(diag(c) H diag(c))``, the
node-wise measure. Weights that are exactly 0 have ``c = 0`` and do not move.

The worst case is searched by projected gradient ascent in ``z`` (normalized gradient steps for l2, sign
steps for l-infinity, as in the reference code), from the centre, from ``+-rho`` times the node-wise top
eigenvector (the second-order maximizer) and from random points of the ball; the best point is kept.
``f`` is the loss over the whole data set; ``batch_size`` gives the reference code's variant instead, the
average over batches of each batch's own sharpness.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from manifolds import ParamLayout
from sharpness._progress import progress_bar
from sharpness._results import EigenResult
from sharpness.measures._quotient import Node
from sharpness.products._data import ChunkedData
from sharpness.products._objective import Objective, build_objective
from sharpness.solvers._solve import Solver

KINDS = ("l2", "linf", "average")


@dataclass(frozen=True)
class Ascent:
    """How the worst case is searched and the average case sampled.

    Attributes:
        steps: projected-ascent steps per start (``0``: evaluate the starts only).
        step_size: first step length as a fraction of ``rho``; step ``t`` has length
            ``step_size * rho / sqrt(t + 1)``.
        restarts: random starts in the ball, besides the centre and the two eigenvector starts.
        eigen_start: also start from ``+-rho`` times the node-wise top eigenvector (one eigen-solve).
        samples: noise draws for the average case.
        seed: seed of the random starts and of the noise.
    """

    steps: int = 20
    step_size: float = 0.5
    restarts: int = 2
    eigen_start: bool = True
    samples: int = 32
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "restarts", "samples", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.samples < 1:
            raise ValueError(f"samples must be at least 1, got {self.samples}")
        if not (isinstance(self.step_size, (int, float)) and 0 < self.step_size < math.inf):
            raise ValueError(f"step_size must be a positive number, got {self.step_size!r}")

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


@dataclass(frozen=True)
class AdaptiveSharpness:
    """Adaptive sharpness of a point.

    Attributes:
        rho: radius in normalized coordinates ``z = delta / |w|`` (dimensionless: a relative change).
        kind: ``"l2"`` or ``"linf"`` (worst case) or ``"average"``.
        value: the loss increase (loss units): the best the ascent found (a lower bound of the worst case),
            or the Monte Carlo mean; with ``batch_size``, the average over batches.
        loss: ``f(w)`` (whole data set; with ``batch_size`` the average of the batches' losses).
        standard_error: of the Monte Carlo mean (average case; ``None`` for the worst case).
        perturbation: ``(n,)`` the best ``delta = |w| z`` (worst case on the whole data set; else ``None``).
        history: one record per evaluation: ``start`` (``"centre"``, ``"eigen+"``, ``"eigen-"``,
            ``"random k"`` or ``"sample"``), ``step``, ``increase``, ``radius`` (``||z||_p``), ``batch``.
        batch_values: per-batch values when ``batch_size`` is given.
        ascent: the [`Ascent`][sharpness.Ascent] settings.
        batch_size: ``None`` (whole data set) or the batch size of the per-batch average.
        seconds: wall time.
        layout: maps ``perturbation`` to named parameters.
    """

    rho: float
    kind: str
    value: float
    loss: float
    standard_error: float | None
    perturbation: Tensor | None
    history: list[dict]
    batch_values: tuple[float, ...] | None
    ascent: Ascent
    batch_size: int | None
    seconds: float
    layout: ParamLayout = field(repr=False)

    def to_dict(self, with_vectors: bool = False) -> dict:
        out = {
            "rho": self.rho,
            "kind": self.kind,
            "value": self.value,
            "loss": self.loss,
            "standard_error": self.standard_error,
            "batch_size": self.batch_size,
            "batch_values": list(self.batch_values) if self.batch_values is not None else None,
            "ascent": self.ascent.to_dict(),
            "history": self.history,
            "seconds": self.seconds,
        }
        if with_vectors and self.perturbation is not None:
            out["perturbation"] = self.perturbation.tolist()
        return out


def _norm(z: Tensor, kind: str) -> float:
    return float(z.abs().max()) if kind == "linf" else float(torch.linalg.vector_norm(z))


def _project(z: Tensor, kind: str, rho: float) -> Tensor:
    if kind == "linf":
        return z.clamp(-rho, rho)
    norm = float(torch.linalg.vector_norm(z))
    return z * (rho / norm) if norm > rho else z


@dataclass(frozen=True)
class SearchBall:
    """A ball the worst-case ascent searches, in coordinates ``z`` where it is ``{||z||_p <= rho}``.

    Adaptive sharpness and geodesic sharpness differ only in this object: the ascent (starts, steps,
    projections, records) is one loop for both.

    Attributes:
        point: ``z (n,) -> flat parameters (n,)``: the point a perturbation reaches (``w + |w| z`` for
            adaptive sharpness, a geodesic's end for geodesic sharpness).
        pullback: ``(z, egrad) -> d/dz f(point(z))`` given the Euclidean gradient ``egrad (n,)`` at ``point(z)``.
        to_z: a tangent vector at ``w`` (the top eigenvector of a quotient measure) ``(n,) -> z`` direction.
        movable: ``(n,)`` bool; entries of ``z`` that may be non-zero (random starts are masked by it).
        project: orthogonal projection of ``z`` onto the admissible subspace (the horizontal space);
            ``None``: every ``z`` is admissible.
        radius: what ``||z||`` is, for messages (e.g. ``"relative radius"``).
    """

    point: Callable[[Tensor], Tensor]
    pullback: Callable[[Tensor, Tensor], Tensor]
    to_z: Callable[[Tensor], Tensor]
    movable: Tensor
    project: Callable[[Tensor], Tensor] | None = None
    radius: str = "radius"


def _adaptive_ball(obj: Objective) -> SearchBall:
    """``z -> w + |w| z``: the ``|w|``-scaled ball of adaptive sharpness (zero weights do not move)."""
    w = obj.layout.flatten(obj.params)
    c = w.abs()
    movable = c > 0
    return SearchBall(
        point=lambda z: w + c * z,
        pullback=lambda z, egrad: c * egrad,  # d/dz f(w + c z)
        to_z=lambda v: torch.where(movable, v / torch.where(movable, c, 1.0), 0.0),  # tangent xi -> z = xi / |w|
        movable=movable,
        radius="relative radius",
    )


def _starts(
    obj: Objective, ball: SearchBall, kind: str, rho: float, ascent: Ascent, generator, direction: Tensor | None
) -> list[tuple[str, Tensor]]:
    """The centre, ``+-rho`` times ``direction`` (a tangent vector; ``None``: no eigen starts) mapped to ``z``, and
    ``ascent.restarts`` random points of the ball's sphere (drawn from ``generator``, process 0's draw everywhere)."""
    zero = torch.zeros_like(ball.movable, dtype=obj.dtype)
    starts = [("centre", zero)]
    if direction is not None:
        z = ball.to_z(direction.to(obj.device, obj.dtype))
        if _norm(z, kind) > 0:
            z = z * (rho / _norm(z, kind))
            starts += [("eigen+", z), ("eigen-", -z)]
    for k in range(ascent.restarts):
        if kind == "linf":
            z = (2 * torch.rand(ball.movable.shape, generator=generator, dtype=obj.dtype) - 1) * rho
        else:
            z = torch.randn(ball.movable.shape, generator=generator, dtype=obj.dtype)
        if ball.project is None:
            if kind != "linf":
                z = z * (rho / float(torch.linalg.vector_norm(z)))
            z = obj.comm.broadcast_(z.to(obj.device)) * ball.movable
        else:  # onto the admissible subspace first, then onto the sphere (scaled once: rho may be subnormal)
            z = ball.project(obj.comm.broadcast_(z.to(obj.device)) * ball.movable)
            size = _norm(z, kind)
            if size == 0:  # a draw with no admissible component (measure zero): no start
                continue
            z = z * (rho / size)
        starts.append((f"random {k}", z))
    return starts


def _worst_case(
    obj: Objective,
    ball: SearchBall,
    kind: str,
    rho: float,
    ascent: Ascent,
    make_starts: Callable[[], list[tuple[str, Tensor]]],
    tick: Callable[[], None],
    batch: int | None,
) -> tuple[float, float, Tensor, list[dict]]:
    """Projected gradient ascent of ``z -> f(ball.point(z))`` over ``{||z||_p <= rho}`` (intersected with the range
    of ``ball.project``) from each of ``make_starts()`` (called after ``f(w)`` is evaluated: an eigen-solve in
    between may leave the objective's cached state otherwise); returns ``(best increase, f(w), best z, history)``."""
    f0 = float(obj.value())
    starts = make_starts()
    best_value, best_z = f0, torch.zeros_like(starts[0][1])
    history: list[dict] = []
    for label, z in starts:
        for t in range(ascent.steps + 1):
            if t < ascent.steps:
                value, egrad = obj.value_and_gradient(ball.point(z))
                value, grad = float(value), ball.pullback(z, egrad)
                if not bool(torch.isfinite(grad).all()):
                    raise FloatingPointError(
                        f"the gradient of the loss is not finite at {ball.radius} {_norm(z, kind):.3g}; use a "
                        "smaller rho"
                    )
            else:  # the last point needs no gradient
                value = float(obj.value(ball.point(z)))
            history.append({"start": label, "step": t, "increase": value - f0, "radius": _norm(z, kind),
                            "batch": batch})  # fmt: skip
            tick()
            if value > best_value:
                best_value, best_z = value, z
            if t == ascent.steps:
                break
            length = ascent.step_size * rho / math.sqrt(t + 1)
            if kind == "linf":
                z = _project(z + length * torch.sign(grad), kind, rho)
            else:
                if ball.project is not None:
                    grad = ball.project(grad)
                norm = float(torch.linalg.vector_norm(grad))
                if norm == 0.0:  # stationary in z
                    break
                z = z + (length / norm) * grad
                z = _project(z if ball.project is None else ball.project(z), kind, rho)
    return best_value - f0, f0, best_z, history


def _average_case(
    obj: Objective, rho: float, ascent: Ascent, generator, tick: Callable[[], None], batch: int | None
) -> tuple[float, float, float, list[dict]]:
    w = obj.layout.flatten(obj.params)
    c = w.abs()
    f0 = float(obj.value())
    increases, history = [], []
    for k in range(ascent.samples):
        z = obj.comm.broadcast_(rho * torch.randn(w.shape, generator=generator, dtype=obj.dtype).to(obj.device))
        increase = float(obj.value(w + c * z)) - f0
        increases.append(increase)
        history.append({"start": "sample", "step": k, "increase": increase, "radius": _norm(z, "l2"), "batch": batch})
        tick()
    values = torch.tensor(increases, dtype=torch.float64)
    error = float(values.std() / math.sqrt(len(increases))) if len(increases) > 1 else math.nan
    return float(values.mean()), f0, error, history


def adaptive_sharpness(
    model: nn.Module | None,
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None,
    data: object,
    rho: float,
    kind: str = "l2",
    *,
    ascent: Ascent | None = None,
    batch_size: int | None = None,
    eigen: EigenResult | None = None,
    dtype: torch.dtype | None = None,
    objective: Objective | None = None,
    progress: bool | None = None,
) -> AdaptiveSharpness:
    """Adaptive sharpness of ``model``: worst-case or average loss increase over the ``|w|``-scaled ball.

    See the module docstring for the definitions. Invariant under every function-preserving diagonal
    rescaling (residual, BatchNorm and concatenation networks included); the model is not modified.

    Args:
        model: as for `Objective` (not used when ``objective`` is given).
        loss_fn: as for `Objective` (not used when ``objective`` is given).
        data: as for `Objective` (not used when ``objective`` is given, except with ``batch_size``).
        rho: radius ``> 0`` in normalized coordinates ``z = delta / |w|`` (0.05 is a 5% change of each weight
            in l-infinity).
        kind: ``"l2"`` or ``"linf"`` (worst case, projected gradient ascent) or ``"average"`` (Gaussian noise).
        ascent: search and sampling settings (default `Ascent()`).
        batch_size: ``None`` for the loss over the whole data set; an integer for the reference code's
            variant: each batch of at most ``batch_size`` samples is measured on its own and the values are
            averaged.
        dtype: evaluation dtype (default: the model's).
        eigen: the node-wise top eigenpair at this point ([`Node`][sharpness.Node]), to start the worst-case ascent from
            without solving for it again (whole data set only).
        objective: an existing whole-data-set objective (then ``batch_size`` must be ``None``).
        progress: progress bar over the loss evaluations (``None``: only on a terminal).

    Returns:
        [`AdaptiveSharpness`][sharpness.AdaptiveSharpness].

    Raises:
        ValueError: bad ``rho``, ``kind`` or ``batch_size``, or ``objective`` together with ``batch_size``.
    """
    started = time.perf_counter()
    if not (isinstance(rho, (int, float)) and math.isfinite(rho) and rho > 0):
        raise ValueError(f"rho must be a positive radius, got {rho!r}")
    if kind not in KINDS:
        raise ValueError(f"unknown adaptive-sharpness kind {kind!r}; choose one of {', '.join(KINDS)}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}")
    if eigen is not None and eigen.info.get("metric") != "node":
        raise ValueError(f"eigen must be the node-wise top eigenpair, got one of {eigen.info.get('metric')!r}")
    if batch_size is not None and objective is not None:
        raise ValueError("batch_size measures each batch with its own objective; do not pass objective with it")
    ascent = ascent or Ascent()
    generator = torch.Generator().manual_seed(ascent.seed)
    if batch_size is None:
        objectives = [build_objective(model, loss_fn, data, objective, dtype=dtype)]
    else:
        whole = build_objective(model, loss_fn, data, None, dtype=dtype)
        objectives = [
            Objective(model, loss_fn, batch, dtype=whole.dtype, structure=whole.structure)
            for batch in ChunkedData(data, chunk_size=batch_size)
        ]
    per_start = ascent.steps + 1
    starts = 1 + 2 * ascent.eigen_start + ascent.restarts
    total = len(objectives) * (ascent.samples if kind == "average" else per_start * starts)
    values, losses, errors, history, perturbation = [], [], [], [], None
    with progress_bar(total, f"adaptive sharpness ({kind})", progress) as bar:
        for index, obj in enumerate(objectives):
            batch = index if batch_size is not None else None
            if kind == "average":
                value, f0, error, records = _average_case(
                    obj, float(rho), ascent, generator, lambda: bar.update(1), batch
                )
                errors.append(error)
            else:
                ball = _adaptive_ball(obj)
                start = eigen if batch_size is None else None

                def make_starts(obj=obj, ball=ball, start=start):
                    direction = None
                    if ascent.eigen_start:
                        direction = (start or Node().sharpness(obj, 1, Solver(), progress=False)).eigenvectors[0]
                    return _starts(obj, ball, kind, float(rho), ascent, generator, direction)

                value, f0, best_z, records = _worst_case(
                    obj, ball, kind, float(rho), ascent, make_starts, lambda: bar.update(1), batch
                )
                delta = obj.layout.flatten(obj.params).abs() * best_z  # |w| z
                perturbation = delta.detach() if batch_size is None else None
            values.append(value)
            losses.append(f0)
            history.extend(records)
    mean = sum(values) / len(values)
    standard_error = None
    if kind == "average":
        standard_error = math.sqrt(sum(e * e for e in errors)) / len(errors)
    return AdaptiveSharpness(
        rho=float(rho),
        kind=kind,
        value=mean,
        loss=sum(losses) / len(losses),
        standard_error=standard_error,
        perturbation=perturbation,
        history=history,
        batch_values=tuple(values) if batch_size is not None else None,
        ascent=ascent,
        batch_size=batch_size,
        seconds=time.perf_counter() - started,
        layout=objectives[0].layout,
    )
