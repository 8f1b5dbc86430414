"""Loss lines and planes of real models: directions + grid evaluation + a [`Surface`][landscape.Surface] record.

Three kinds of chart map grid coordinates ``c = (a, b)`` to parameters:

* ``"straight"``: ``theta + a d1 + b d2`` (random, Euclidean-eigen, invariant-eigen, segment
  directions), evaluated with [`landscape.evaluate_grid`][landscape.evaluate_grid] and its first-layer fast path;
* ``"geodesic"`` (invariant-eigen directions): ``Exp_theta(a xi1 + b xi2)``, the exact exponential
  map of the quotient metric the eigenvectors belong to (node-wise: ``theta * exp((a xi1 + b xi2) /
  theta)`` entry-wise, the straight line in log-coordinates; layer-wise: the per-block cylinder
  geodesic), or, for a metric without a closed form (the symmetry metric of transformers), the geodesic
  equation integrated by RK4 ([`manifolds.GeodesicMap`][manifolds.GeodesicMap]: steps chosen at the grid's
  corners, error estimate in the metadata). The eigenvectors are horizontal, and the total-space geodesic
  of a horizontal vector stays horizontal and projects to the quotient geodesic, so the plane is the
  quotient's. Every
  rescaling the metric is invariant under is an isometry mapping geodesics to geodesics: the plane
  of a rescaled twin is the rescaled plane, the same function of ``(a, b)``;
* ``"gspace"``: ``w(v + a d1 + b d2)`` with ``v`` the G-space coordinates of ``theta``, ``d_i``
  random directions in coordinate space and ``w`` the inverse map of [`manifolds.GSpace`][manifolds.GSpace] (the
  skeleton weights held at the centre's values). By default the directions leave the chain roots at
  the centre's values, so every hidden unit's chain value, by which ``w`` divides, is the same at
  every point and the plane has no singular lines (``roots="free"`` moves them too). Coordinates and
  directions are invariant under every node-wise rescaling, so the plane of a rescaled twin is the
  same function of ``(a, b)``.

Curved charts are evaluated with [`landscape.evaluate_points`][landscape.evaluate_points].
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import vmap

from landscape._directions import (
    Directions,
    chain_root_mask,
    eigen_directions,
    gspace_directions,
    random_directions,
    require_chain,
    segment_direction,
    trainable,
)
from landscape._grid import check_compile, evaluate_grid, evaluate_points, grid_axis
from landscape._settings import DirectionSpec, Grid, as_direction_spec
from landscape._surface import Surface
from manifolds import GSpace
from manifolds._absorption import from_representative, to_representative
from sharpness import (
    Measure,
    Objective,
    QuotientMeasure,
    build_objective,
    get_measure,
)

SEGMENT_RANGE = (-0.5, 1.5)
# how figures name a metric whose name does not read as "<name>-wise"
METRIC_NAMES = {"symmetry": "symmetry metric: quotient by the whole symmetry group"}


def make_directions(
    objective: Objective, spec: DirectionSpec, k: int, progress: bool | None = None, gspace: GSpace | None = None
) -> Directions:
    """``k`` directions at the objective's parameters as ``spec`` says (G-space directions need ``gspace``);
    given `Directions` are passed through after a shape check. Where several processes share the data,
    every process gets process 0's directions."""
    made = _directions(objective, spec, k, progress, gspace)
    if objective.comm.world_size == 1:
        return made
    return dataclasses.replace(made, vectors=objective.comm.broadcast_(made.vectors.clone()))


def _directions(
    objective: Objective, spec: DirectionSpec, k: int, progress: bool | None, gspace: GSpace | None
) -> Directions:
    if isinstance(spec.kind, Directions):
        given = spec.kind
        size = gspace.dim if given.kind == "gspace" and gspace is not None else objective.layout.size
        if given.vectors.shape != (k, size):
            raise ValueError(f"expected {k} directions of length {size}, got shape {tuple(given.vectors.shape)}")
        return given
    if spec.kind == "random":
        return random_directions(objective.params, k, spec.seed, spec.normalization, spec.bias)
    if spec.kind == "eigen":
        return eigen_directions(objective, k, "euclidean", seed=spec.seed, progress=progress)
    if spec.kind == "invariant-eigen":
        return eigen_directions(objective, k, spec.metric, seed=spec.seed, progress=progress)
    if gspace is None:
        raise ValueError("G-space directions need the network's GSpace (gspace=manifolds.GSpace(model))")
    center = gspace.coordinates(objective.params)
    return gspace_directions(gspace, center, k, spec.seed, spec.normalization, spec.bias, spec.roots)


@dataclass(frozen=True)
class Chart:
    """How grid coordinates become parameters: the directions, the path and the point map.

    Attributes:
        directions: the directions (in the objective's layout; for ``path="gspace"`` in G-space).
        path: ``"straight"``, ``"geodesic"`` or ``"gspace"``.
        point_fn: ``(B, k) -> (B, n)`` flat parameters or ``{name: (B, *shape)}``, or ``None`` for the
            linear grid ``theta + c @ D``.
        info: what the metadata records about the path.
        crossed: for G-space charts, ``(P, k)`` coordinates -> ``(P,)`` int: how many hidden units'
            chain values of the G-space inverse map have changed sign (beyond a singularity of ``w(v)``).
        first_layer: ``(center, directions)`` when the first layer's parameters are linear in the
            coordinates although the chart is curved (G-space: ``W_1 = v_1 / d``), for the fast path.
    """

    directions: Directions
    path: str
    point_fn: Callable[[Tensor], Tensor] | None = None
    info: dict = field(default_factory=dict)
    crossed: Callable[[np.ndarray], np.ndarray] | None = None
    first_layer: tuple[Tensor, Tensor] | None = None

    def evaluate(self, objective: Objective, coords: np.ndarray, grid: Grid, progress: bool | None):
        how = {"strategy": grid.strategy, "compile": grid.compile, "progress": progress}
        if self.point_fn is None:
            return evaluate_grid(objective, self.directions.vectors, coords, **how)
        return evaluate_points(objective, self.point_fn, coords, first_layer=self.first_layer, **how)


def _gspace_chart(objective: Objective, spec: DirectionSpec, k: int) -> Chart:
    """``w(v + sum c_i d_i)``: a plane in G-space coordinates mapped back to weights."""
    gs = GSpace(require_chain(objective.model, "G-space planes"), params=objective.params)
    missing = [n for n in objective.layout.names if n not in gs.names]
    if missing:
        raise ValueError(
            f"parameter {missing[0]!r} is not a weight or bias of the network's layers, so G-space has no coordinate "
            "for it; G-space planes need a model whose parameters are all layer weights and biases"
        )
    v = gs.coordinates(objective.params).detach()
    d = make_directions(objective, spec, k, gspace=gs)
    D = d.vectors.to(v)
    names = objective.layout.names
    weights = vmap(lambda u: gs.weights(u, check=False))  # crossed singularities are counted instead

    def point_fn(c: Tensor) -> dict[str, Tensor]:
        w = weights(torch.addmm(v, c.to(v), D))
        return {n: w[n] for n in names}

    # A unit's chain value c is its chain root times a fixed factor, so w(v) is singular where a root is 0,
    # and a root that changed sign marks a crossed singularity; the roots are coordinates, linear in (a, b).
    where = chain_root_mask(gs).nonzero().flatten().to(v.device)
    root0, root_dirs = v[where], D[:, where]
    sign0 = torch.sign(root0)
    held = bool((root_dirs == 0).all())  # fixed roots (also for given directions that happen to hold them)

    def crossed(coords: np.ndarray) -> np.ndarray:
        r = root0 + torch.as_tensor(coords).to(v) @ root_dirs
        return (~(r * sign0 > 0)).sum(dim=-1).cpu().numpy()

    # the first layer is linear in the coordinates (W_1 = v_1 / d, b_1 = u_1 / d): the fast path applies
    with torch.no_grad():
        ends = objective.layout.flatten(point_fn(torch.cat([torch.zeros(1, k), torch.eye(k)]).to(v)))
    info = {
        "path": "gspace",
        "path_detail": "theta(a, b) = w(v + a d1 + b d2): v the G-space (basis-path) coordinates of the centre, d_i "
        "random directions in coordinate space, w the inverse map with the skeleton weights held at the centre's "
        "values; invariant under node-wise rescaling"
        + (
            "; the chain roots are held at the centre's values, so no chain value changes and w has no singularity "
            "on the plane"
            if held
            else "; the chain roots move too, so w is singular where one of them crosses 0 (see crossed)"
        ),
        "gspace_dim": gs.dim,
        "skeleton": "default (G-SGD: designated and predecessor entries on the diagonal, modulo the widths)",
        "chain_roots": int(root0.numel()),
        "roots": "fixed" if held else "free",
    }
    return Chart(d, "gspace", point_fn, info, crossed, first_layer=(ends[0], ends[1:] - ends[0]))


def _geodesic_chart(objective: Objective, d: Directions, measure: Measure, radius: float) -> Chart:
    """``Exp_theta(sum c_i xi_i)`` along the geodesics of the eigenvectors' quotient metric: its exact exponential
    map, or (a metric without one, e.g. the symmetry metric) the geodesic equation integrated up to ``radius``."""
    if d.info.get("metric") != measure.name or not isinstance(measure, QuotientMeasure):
        raise ValueError(
            f"geodesic planes need invariant-eigen directions of a quotient metric, got {d.info.get('metric')!r} "
            f"directions under the {measure.name!r} measure"
        )
    vectors = d.vectors.to(objective.device, objective.dtype)
    representative = getattr(measure, "representative", None)  # the symmetry measure's: value biases absorbed
    centre = objective if representative is None else representative(objective)
    quotient = measure.quotient(centre)
    if centre is objective:
        point_fn = quotient.geodesic_map(vectors, radius)
    else:  # the geodesics of the representative, carried back by the translation (the same function at every
        # point), as the directions were carried from there
        point_fn = _carried_back(quotient, measure.group(objective), objective, vectors, radius)
    info = {"path": "geodesic", "path_metric": measure.name,
            "path_detail": f"theta(a, b) = Exp_theta(a ξ1 + b ξ2): {getattr(point_fn, 'detail', quotient.geodesic)}"}
    if hasattr(point_fn, "steps"):  # integrated numerically: how, and how well
        info |= {"geodesic_steps": point_fn.steps, "geodesic_error": point_fn.error, "geodesic_method": "rk4"}
    return Chart(d, "geodesic", point_fn, info)


def _carried_back(quotient, group, objective: Objective, vectors: Tensor, radius: float):
    """The geodesic map at the representative of ``objective``'s point (`manifolds._absorption`) of ``vectors``
    carried there, its points carried back: ``(B, k) -> (B, n)``, with the map's ``steps``, ``error`` and
    ``detail``."""
    layout, params = objective.layout, objective.params
    at_representative = layout.flatten(to_representative(group, params, layout.unflatten(vectors)))
    inner = quotient.geodesic_map(at_representative, radius)

    def carried(coords: Tensor) -> Tensor:
        return layout.flatten(from_representative(group, params, layout.unflatten(inner(coords))))

    for name in ("steps", "error", "detail"):
        if hasattr(inner, name):
            setattr(carried, name, getattr(inner, name))
    return carried


def make_chart(objective: Objective, spec: DirectionSpec, k: int, progress: bool | None = None,
               radius: float = 1.0) -> Chart:  # fmt: skip
    """The directions and the map from grid coordinates to parameters (see the module docstring); ``radius`` is
    the largest ``|c_i|`` the chart will be asked for (geodesics integrated numerically choose their steps there)."""
    if spec.kind_name == "gspace":
        return _gspace_chart(objective, spec, k)
    d = make_directions(objective, spec, k, progress)
    if spec.path == "geodesic":
        given = isinstance(spec.kind, Directions)
        return _geodesic_chart(objective, d, get_measure(d.info.get("metric") if given else spec.metric), radius)
    return Chart(d, "straight", None, {"path": "straight", "path_detail": "theta + sum_i c_i d_i"})


def _describe(d: Directions) -> str:
    """How the directions were obtained, from what ``d.info`` records; directions given by the caller may record
    nothing (``info`` is optional), so each missing entry is left out of the wording instead of guessed."""
    s = "s" if d.k > 1 else ""
    info = d.info
    biases = f"biases: {info['bias']}" if "bias" in info else None
    if d.kind == "random":
        norm = info.get("normalization")
        how = "" if norm in (None, "none") else f"{norm}-normalized "
        return f"{'given ' if norm is None else ''}random {how}direction{s}" + (f" ({biases})" if biases else "")
    if d.kind == "eigen":
        return f"the top Euclidean Hessian eigenvector{s}"
    if d.kind == "invariant-eigen":
        metric = METRIC_NAMES.get(info.get("metric"), f"{info.get('metric')}-wise quotient metric")
        metric = metric if "metric" in info else "a quotient metric"
        return f"the top Riemannian Hessian eigenvector{s} ({metric})"
    if d.kind == "gspace":
        norm = info.get("normalization")
        how = {"element": "normalized per coordinate by |v_j|", "layer": "normalized per coordinate block"}.get(
            norm, "unnormalized" if norm is not None else None
        )
        held = {"fixed": "chain roots fixed", "free": "chain roots free"}.get(info.get("roots"))
        parts = ", ".join(part for part in (how, held, biases) if part)
        return f"{'' if norm is not None else 'given '}random G-space direction{s}" + (f" ({parts})" if parts else "")
    return "the segment between two points"


def _title(chart: Chart, plane: bool) -> str:
    d = chart.directions
    if chart.path == "gspace":
        where = "the G-space plane w(v + a δ + b η)" if plane else "the G-space line w(v + t δ)"
        return f"loss on {where} of {_describe(d)}"
    if chart.path == "geodesic":
        return f"loss on the geodesic {'plane' if plane else 'line'} Exp(·) of {_describe(d)}"
    return f"loss on the plane of {_describe(d)}" if plane else f"loss along {_describe(d)}"


def _metadata(objective: Objective, chart: Chart, values, center: dict, build_seconds: float) -> dict:
    return {
        "directions": chart.directions.to_dict(),
        **chart.info,
        "center_loss": center["loss"],
        "center_accuracy": center.get("accuracy"),
        "strategy": values.strategy,
        "compiled": values.compiled,
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


def _crossed(chart: Chart, coords: np.ndarray, shape: tuple[int, ...]) -> tuple[dict, dict]:
    """``extras`` and metadata marking the grid points beyond a G-space singularity (G-space charts only)."""
    if chart.crossed is None:
        return {}, {}
    counts = chart.crossed(coords).reshape(shape)
    note = (
        "crossed[i, j]: how many predecessor-chain roots of w(v) (of chain_roots) have changed sign at the grid point; "
        "each crossing passes a singularity of the G-space inverse map, where w(v) = v / c diverges as c -> 0"
    )
    return {"crossed": counts}, {"crossed_points": int((counts > 0).sum()), "crossed_note": note}


def loss_plane(
    model: nn.Module | None,
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None,
    data: object,
    directions: str | Directions | DirectionSpec = "random",
    *,
    grid: Grid | None = None,
    dtype: torch.dtype | None = None,
    objective: Objective | None = None,
    progress: bool | None = None,
) -> Surface:
    """The whole-data-set loss on a plane through ``theta``, ``a, b in [-span, span]``.

    The plane is ``theta + a d1 + b d2`` (``path="straight"``), ``Exp_theta(a xi1 + b xi2)`` for
    invariant-eigen directions with ``path="geodesic"``, or ``w(v + a d1 + b d2)`` in G-space for
    G-space directions (see the module docstring).

    Args:
        model: as for [`sharpness.Objective`][sharpness.Objective]; ``theta`` is the model's parameters
            (read, never modified); not used when ``objective`` is given.
        loss_fn: as for [`sharpness.Objective`][sharpness.Objective]; not used when ``objective`` is given.
        data: as for [`sharpness.Objective`][sharpness.Objective]; not used when ``objective`` is given.
        directions: a `DirectionSpec` (kind, normalization, metric, path, chain roots, seed), or just
            its kind (``"random"``, ``"eigen"``, ``"invariant-eigen"``, ``"gspace"``) or precomputed
            `Directions` with two rows (of kind ``"gspace"``: in G-space coordinates) with the defaults.
        grid: span, points per axis and evaluation strategy (default ``Grid()``: span 1, 51 x 51 points).
        dtype: evaluation dtype (``None``: the model's).
        objective: an existing objective (chunking, device and memory budget set there) instead of a new one.
        progress: progress bars (``None``: only on a terminal).

    Returns:
        [`Surface`][landscape.Surface] with ``loss[i, j]`` at ``(x[j], y[i])``, the accuracy for class-index
            targets, and metadata recording the directions (seeds, normalization), the path, the center
            loss and the timing. G-space planes also hold ``extras["crossed"]``, per grid point the number
            of singularities of the inverse map crossed on the way from the centre (chain roots that changed
            sign; always 0 with ``roots="fixed"``); ``metadata["crossed_points"]`` counts the points where it
            is not 0, and ``metadata["roots"]`` says whether the chain roots were held.

    Raises:
        manifolds.UnsupportedModelError: G-space or geodesic planes of a model without the rescaling
            symmetry (the message names the module).
    """
    spec, grid = as_direction_spec(directions), grid or Grid()
    grid.require_memory(2)
    obj = build_objective(model, loss_fn, data, objective, dtype=dtype)
    check_compile(grid.compile, grid.strategy, obj.device)  # before the directions are computed
    start = time.perf_counter()
    chart = make_chart(obj, spec, 2, progress, radius=grid.span)
    build = time.perf_counter() - start
    axis = grid_axis(-grid.span, grid.span, grid.steps)
    yy, xx = np.meshgrid(axis, axis, indexing="ij")
    coords = np.stack([xx.ravel(), yy.ravel()], axis=1)
    values = chart.evaluate(obj, coords, grid, progress)
    shape = (len(axis), len(axis))
    extras, crossed = _crossed(chart, coords, shape)
    d = chart.directions
    return Surface(
        x=axis, y=axis, loss=values.loss.reshape(shape),
        accuracy=None if values.accuracy is None else values.accuracy.reshape(shape),
        x_label=d.labels[0], y_label=d.labels[1], z_label="loss", title=_title(chart, plane=True), extras=extras,
        metadata={**_metadata(obj, chart, values, obj.evaluate(), build), **crossed},
    )  # fmt: skip


def loss_line(
    model: nn.Module | None,
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None,
    data: object,
    directions: str | Directions | DirectionSpec = "random",
    *,
    to: nn.Module | Mapping[str, Tensor] | None = None,
    lim: tuple[float, float] | None = None,
    grid: Grid | None = None,
    dtype: torch.dtype | None = None,
    objective: Objective | None = None,
    progress: bool | None = None,
) -> Surface:
    """The whole-data-set loss along a line ``theta + t d``.

    With ``to`` (a second model or its parameters) the line is the segment direction
    ``d = theta_to - theta`` (``t = 0``: the model, ``t = 1``: ``to``), drawn over ``lim`` (default
    ``(-0.5, 1.5)``), as in the parametric line plots of Goodfellow et al. and Keskar et al.; the grid
    contains both ends exactly. Otherwise ``d`` is one direction as ``directions`` says (see
    [`loss_plane`][landscape.loss_plane], including the path and G-space lines ``w(v + t d)``) over ``lim`` (default
    ``(-grid.span, grid.span)``), like the layer-normalized lines of the flatness paper's Fig. 2
    (``DirectionSpec(norm="layer")``).

    Args:
        model: as for [`loss_plane`][landscape.loss_plane].
        loss_fn: as for [`loss_plane`][landscape.loss_plane].
        data: as for [`loss_plane`][landscape.loss_plane].
        directions: as for [`loss_plane`][landscape.loss_plane].
        dtype: as for [`loss_plane`][landscape.loss_plane].
        objective: as for [`loss_plane`][landscape.loss_plane].
        progress: as for [`loss_plane`][landscape.loss_plane].
        to: the other end of a segment (a model or its parameters); then ``directions`` must be left as it is.
        lim: ``(lo, hi)`` range of ``t`` instead of the default.
        grid: points and evaluation strategy (default ``Grid()``; its ``span`` sets the default range).

    Returns:
        [`Surface`][landscape.Surface] of a line (``y`` is ``None``), loss and accuracy ``(m,)``.
    """
    spec, grid = as_direction_spec(directions), grid or Grid()
    grid.require_memory(1)
    if lim is not None and not (len(lim) == 2 and all(map(math.isfinite, lim)) and lim[0] < lim[1]):
        raise ValueError(f"lim must be (lo, hi) with finite lo < hi, got {lim!r}")
    if to is not None and (isinstance(spec.kind, Directions) or spec != DirectionSpec()):
        raise ValueError(
            "the segment between two checkpoints is a straight line; leave out the path, the directions and the roots"
        )
    obj = build_objective(model, loss_fn, data, objective, dtype=dtype)
    check_compile(grid.compile, grid.strategy, obj.device)  # before the directions are computed
    start = time.perf_counter()
    if to is not None:
        target = trainable(to) if isinstance(to, nn.Module) else dict(to)
        d = segment_direction(obj.params, {k: v.to(obj.device, obj.dtype) for k, v in target.items()})
        chart = Chart(d, "straight", None, {"path": "straight", "path_detail": "theta + t (theta_to - theta)"})
        lo, hi = SEGMENT_RANGE if lim is None else lim
        axis = grid_axis(lo, hi, grid.steps, anchors=(0.0, 1.0))
    else:
        lo, hi = (-grid.span, grid.span) if lim is None else lim
        chart = make_chart(obj, spec, 1, progress, radius=max(abs(lo), abs(hi)))
        axis = grid_axis(lo, hi, grid.steps)
    build = time.perf_counter() - start
    coords = axis[:, None]
    values = chart.evaluate(obj, coords, grid, progress)
    extras, crossed = _crossed(chart, coords, (len(axis),))
    title = (
        "loss along the segment from the model (α = 0) to the second point (α = 1)"
        if to is not None
        else _title(chart, plane=False)
    )
    return Surface(
        x=axis, y=None, loss=values.loss, accuracy=values.accuracy, x_label=chart.directions.labels[0],
        z_label="loss", title=title, extras=extras,
        metadata={**_metadata(obj, chart, values, obj.evaluate(), build), **crossed},
    )  # fmt: skip
