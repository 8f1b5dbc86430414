"""Loss lines and planes of real models: directions + grid evaluation + a :class:`Surface` record."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import Tensor, nn

from landscape._directions import Directions, eigen_directions, random_directions, segment_direction, trainable
from landscape._surface import Surface
from sharpness import Objective, evaluate_grid, grid_axis

DIRECTION_KINDS = ("random", "eigen", "invariant-eigen")
SEGMENT_RANGE = (-0.5, 1.5)


def _objective(model, loss_fn, data, objective, dtype, device, chunk_size, memory_budget) -> Objective:
    if objective is not None:
        return objective
    return Objective(
        model, loss_fn, data, chunk_size=chunk_size, dtype=dtype, device=device, memory_budget=memory_budget
    )


def make_directions(
    objective: Objective,
    kind: str | Directions,
    k: int,
    seed: int = 0,
    norm: str = "filter",
    bias: str = "zero",
    metric: str = "node",
    progress: bool | None = None,
) -> Directions:
    """``k`` directions at the objective's parameters: ``"random"`` (normalized by ``norm``/``bias``),
    ``"eigen"`` (Euclidean Hessian) or ``"invariant-eigen"`` (Riemannian Hessian under ``metric``);
    a :class:`Directions` is passed through after a shape check."""
    if isinstance(kind, Directions):
        if kind.vectors.shape != (k, objective.layout.size):
            raise ValueError(
                f"expected {k} directions of length {objective.layout.size}, got shape {tuple(kind.vectors.shape)}"
            )
        return kind
    if kind == "random":
        return random_directions(objective.params, k, seed, norm, bias)
    if kind == "eigen":
        return eigen_directions(objective, k, "euclidean", seed=seed, progress=progress)
    if kind == "invariant-eigen":
        return eigen_directions(objective, k, metric, seed=seed, progress=progress)
    raise ValueError(f"unknown direction kind {kind!r}; choose one of {', '.join(DIRECTION_KINDS)}")


def _describe(d: Directions) -> str:
    s = "s" if d.k > 1 else ""
    if d.kind == "random":
        norm = d.info["normalization"]
        return f"random {'' if norm == 'none' else norm + '-normalized '}direction{s} (biases: {d.info['bias']})"
    if d.kind == "eigen":
        return f"the top Euclidean Hessian eigenvector{s}"
    if d.kind == "invariant-eigen":
        return f"the top Riemannian Hessian eigenvector{s} ({d.info['metric']}-wise quotient metric)"
    return "the segment between two points"


def _metadata(objective: Objective, d: Directions, values, center: dict, build_seconds: float) -> dict:
    return {
        "directions": d.to_dict(),
        "center_loss": center["loss"],
        "center_accuracy": center.get("accuracy"),
        "strategy": values.strategy,
        "grid_batch": values.batch,
        "grid_seconds": values.seconds,
        "direction_seconds": build_seconds,
        "points_per_second": values.points_per_second,
        "n_points": int(len(values.loss)),
        "n_samples": objective.n_samples,
        "n_params": objective.layout.size,
        "dtype": str(objective.dtype).replace("torch.", ""),
        "data_chunk_size": objective.data.chunk_size,
        "memory_budget": objective.memory_budget,
        "reduction": objective.reduction,
    }


def loss_plane(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    data: object,
    *,
    directions: str | Directions = "random",
    span: float = 1.0,
    steps: int = 51,
    norm: str = "filter",
    bias: str = "zero",
    metric: str = "node",
    seed: int = 0,
    strategy: str = "auto",
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    chunk_size: int | None = None,
    memory_budget: int = 2 * 2**30,
    progress: bool | None = None,
    objective: Objective | None = None,
) -> Surface:
    """The whole-data-set loss on the plane ``theta + a d1 + b d2``, ``a, b in [-span, span]``.

    Args:
        model, loss_fn, data: as for :class:`sharpness.Objective`; ``theta`` is the model's parameters
            (read, never modified).
        directions: ``"random"``, ``"eigen"``, ``"invariant-eigen"`` or a :class:`Directions` with two rows.
        span: half-width of the square in direction units.
        steps: grid points per axis; the grid always contains ``(0, 0)`` (inserted when ``steps`` is even).
        norm, bias: normalization of random directions (``"filter"``, ``"layer"``, ``"none"``; biases
            ``"zero"`` or ``"keep"``).
        metric: quotient metric of ``"invariant-eigen"`` directions (``"node"`` or ``"layer"``).
        seed: seed of the random directions (direction ``i`` uses ``seed + i``) or of the eigen-solver.
        strategy: grid evaluation strategy (see :func:`sharpness.evaluate_grid`).
        dtype, device, chunk_size, memory_budget: evaluation settings of the objective.
        progress: progress bars (``None``: only on a terminal).
        objective: reuse an existing objective (then ``model``, ``loss_fn``, ``data`` and the evaluation
            settings are taken from it).

    Returns:
        :class:`Surface` with ``loss[i, j]`` at ``(x[j], y[i])``, the accuracy for class-index
        targets, and metadata recording the directions (seeds, normalization), the center loss and
        the timing.
    """
    obj = _objective(model, loss_fn, data, objective, dtype, device, chunk_size, memory_budget)
    if not span > 0:
        raise ValueError(f"the span must be positive, got {span}")
    start = time.perf_counter()
    d = make_directions(obj, directions, 2, seed, norm, bias, metric, progress)
    build = time.perf_counter() - start
    axis = grid_axis(-span, span, steps)
    yy, xx = np.meshgrid(axis, axis, indexing="ij")
    values = evaluate_grid(obj, d.vectors, np.stack([xx.ravel(), yy.ravel()], axis=1), strategy=strategy,
                           progress=progress)  # fmt: skip
    shape = (len(axis), len(axis))
    return Surface(
        x=axis, y=axis, loss=values.loss.reshape(shape),
        accuracy=None if values.accuracy is None else values.accuracy.reshape(shape),
        x_label=d.labels[0], y_label=d.labels[1], z_label="loss",
        title=f"loss on the plane of {_describe(d)}",
        metadata=_metadata(obj, d, values, obj.evaluate(), build),
    )  # fmt: skip


def loss_line(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    data: object,
    *,
    to: nn.Module | Mapping[str, Tensor] | None = None,
    directions: str | Directions = "random",
    span: float = 1.0,
    steps: int = 51,
    lim: tuple[float, float] | None = None,
    norm: str = "filter",
    bias: str = "zero",
    metric: str = "node",
    seed: int = 0,
    strategy: str = "auto",
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    chunk_size: int | None = None,
    memory_budget: int = 2 * 2**30,
    progress: bool | None = None,
    objective: Objective | None = None,
) -> Surface:
    """The whole-data-set loss along a line ``theta + t d``.

    With ``to`` (a second model or its parameters) the line is the segment direction
    ``d = theta_to - theta`` (``t = 0``: the model, ``t = 1``: ``to``), drawn over ``lim`` (default
    ``(-0.5, 1.5)``), as in the parametric line plots of Goodfellow et al. and Keskar et al.; the grid
    contains both ends exactly. Otherwise ``d`` is one direction of kind ``directions`` (see
    :func:`loss_plane`) over ``lim`` (default ``(-span, span)``), like the layer-normalized lines of
    the flatness paper's Fig. 2 (``norm="layer"``).

    Returns:
        :class:`Surface` of a line (``y`` is ``None``), loss and accuracy ``(m,)``.
    """
    obj = _objective(model, loss_fn, data, objective, dtype, device, chunk_size, memory_budget)
    start = time.perf_counter()
    if to is not None:
        target = trainable(to) if isinstance(to, nn.Module) else dict(to)
        d = segment_direction(obj.params, {k: v.to(obj.device, obj.dtype) for k, v in target.items()})
        lo, hi = SEGMENT_RANGE if lim is None else lim
        axis = grid_axis(lo, hi, steps, anchors=(0.0, 1.0))
    else:
        if not span > 0:
            raise ValueError(f"the span must be positive, got {span}")
        d = make_directions(obj, directions, 1, seed, norm, bias, metric, progress)
        lo, hi = (-span, span) if lim is None else lim
        axis = grid_axis(lo, hi, steps)
    build = time.perf_counter() - start
    values = evaluate_grid(obj, d.vectors, axis[:, None], strategy=strategy, progress=progress)
    title = (
        "loss along the segment from the model (α = 0) to the second point (α = 1)"
        if to is not None
        else f"loss along {_describe(d)}"
    )
    return Surface(
        x=axis, y=None, loss=values.loss, accuracy=values.accuracy, x_label=d.labels[0], z_label="loss",
        title=title, metadata=_metadata(obj, d, values, obj.evaluate(), build),
    )  # fmt: skip
