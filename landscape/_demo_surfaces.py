"""The demo's loss-surface panels: the loss on planes through each minimum along its top-2 Hessian
eigenvectors, Euclidean and node-wise invariant.

Two columns of planes ``w + a v_1 + b v_2``:

- ``"euclidean"``: ``v_1, v_2`` the top-2 eigenvectors of the Euclidean Hessian, unit Euclidean norm
  (coordinates in parameter units);
- ``"node"``: ``v_1, v_2`` the top-2 eigenvectors of the node-wise quotient (Riemannian) Hessian as
  ambient, horizontal tangent vectors of unit length in the node metric ``g = sum xi_k^2 / w_k^2``
  (coordinates in units of relative weight change).

A node-wise or layer-wise rescaling ``w -> D w`` (``D`` diagonal, positive) maps the node eigenvectors
to ``D v`` (the whitened operator ``|w| H |w| + diag(w g)`` is the same at ``D w``), so the rescaled
twin's node plane is ``D (w + a v_1 + b v_2)``: the same networks, the same loss at every grid point.
The Euclidean plane has no such property. Each eigenvector's sign is fixed by making its largest
entry in the metric's whitened coordinates (``v / |w|`` for the node metric) positive, a rule the
rescaling leaves unchanged.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

from landscape._grid import evaluate_grid, grid_axis
from sharpness import EigenResult, Objective, get_measure

SURFACE_METRICS = ("euclidean", "node")
# Half-width of every plane in a column: RANGE_SCALE / sqrt(largest lambda_1 of the column), so the
# quadratic model of the sharpest panel rises by RANGE_SCALE^2 / 2 at the edge along v_1.
RANGE_SCALE = 2.0
COORDINATE_UNITS = {"euclidean": "parameter units (Euclidean)", "node": "node-metric units (relative weight change)"}


@dataclass
class SurfacePanel:
    """One plane through one network: its two directions and the loss on the grid."""

    row: str
    metric: str
    eigenvalues: tuple[float, float]
    directions: Tensor  # (2, n)
    loss: np.ndarray | None = None  # (steps, steps): loss[i, j] at a = axis[i] (v_1), b = axis[j] (v_2)
    half_width: float = 0.0
    info: dict = field(default_factory=dict)


def plane_directions(result: EigenResult, objective: Objective, metric: str) -> Tensor:
    """The top-2 eigenvectors of ``result`` as ``(2, n)`` ambient directions of unit length in the measure
    ``metric`` (one of `SURFACE_METRICS`), horizontal, with the largest entry of each in the measure's
    whitened coordinates positive."""
    if metric not in SURFACE_METRICS:
        raise ValueError(f"no surface plane for metric {metric!r}; choose one of {', '.join(SURFACE_METRICS)}")
    if result.k < 2:
        raise ValueError(f"a plane needs two eigenvectors; the {metric} measure returned {result.k}")
    ball = get_measure(metric).ball(objective)
    whitened = torch.stack([ball.project(ball.whiten(v)) for v in result.eigenvectors[:2].to(objective.dtype)])
    whitened = whitened / torch.linalg.vector_norm(whitened, dim=1, keepdim=True)
    top = whitened.abs().argmax(dim=1)
    signs = torch.sign(whitened[torch.arange(2), top])
    return ball.unwhiten(whitened * signs[:, None])


def surface_panels(
    networks: Mapping[str, tuple[nn.Module, Mapping[str, EigenResult]]],
    data: tuple[Tensor, Tensor],
    steps: int = 25,
    range_scale: float = RANGE_SCALE,
    progress: bool | None = None,
) -> tuple[dict[str, dict[str, SurfacePanel]], dict[str, np.ndarray]]:
    """Loss on the top-2 eigenvector planes of every network (rows) under every surface metric (columns).

    Args:
        networks: ``{row: (float64 model, {metric: EigenResult with k >= 2})}`` for each metric of
            `SURFACE_METRICS`.
        data: ``(X, y)`` in float64.
        steps: grid points per axis (odd, so the centre is a grid point).
        range_scale: the half-width of a column is ``range_scale / sqrt(max lambda_1)`` over its rows.

    Returns:
        ``(panels, axes)``: ``panels[row][metric]`` and ``axes[metric]``, the ``(steps,)`` coordinates.
    """
    if steps < 3 or steps % 2 == 0:
        raise ValueError(f"the grid needs an odd number of points per axis (>= 3), got {steps}")
    panels: dict[str, dict[str, SurfacePanel]] = {}
    objectives = {}
    for row, (model, results) in networks.items():
        objective = Objective(model, nn.CrossEntropyLoss(), data, dtype=torch.float64)
        objectives[row] = objective
        panels[row] = {
            metric: SurfacePanel(
                row,
                metric,
                (float(results[metric].eigenvalues[0]), float(results[metric].eigenvalues[1])),
                plane_directions(results[metric], objective, metric),
            )
            for metric in SURFACE_METRICS
        }
    axes = {}
    for metric in SURFACE_METRICS:
        top = max(panels[row][metric].eigenvalues[0] for row in panels)
        half = range_scale / math.sqrt(top)
        axes[metric] = grid_axis(-half, half, steps)
        a, b = np.meshgrid(axes[metric], axes[metric], indexing="ij")
        coords = np.stack([a.ravel(), b.ravel()], axis=1)
        for row, objective in objectives.items():
            panel = panels[row][metric]
            values = evaluate_grid(objective, panel.directions, coords, progress=progress)
            panel.loss = values.loss.reshape(steps, steps)
            panel.half_width = half
            centre = panel.loss[steps // 2, steps // 2]
            panel.info = {
                "lambda_1": panel.eigenvalues[0],
                "lambda_2": panel.eigenvalues[1],
                "half_width": half,
                "center_loss": float(centre),
                "min_loss": float(panel.loss.min()),
                "max_loss": float(panel.loss.max()),
                "edge_loss_v1": float(max(panel.loss[0, steps // 2], panel.loss[-1, steps // 2])),
                "edge_loss_v2": float(max(panel.loss[steps // 2, 0], panel.loss[steps // 2, -1])),
                "grid_seconds": values.seconds,
            }
    return panels, axes


def surfaces_summary(panels: dict[str, dict[str, SurfacePanel]], axes: dict[str, np.ndarray], flat: str) -> dict:
    """The numbers behind the figure, for ``report.json``; ``flat`` is the row whose twin is ``"rescaled"``."""
    twin = {}
    if "rescaled" in panels:
        for metric in SURFACE_METRICS:
            a, b = panels[flat][metric].loss, panels["rescaled"][metric].loss
            twin[metric] = float(np.max(np.abs(a - b) / np.abs(a)))
    return {
        "grid_points": len(axes[SURFACE_METRICS[0]]),
        "range_rule": (
            f"half-width {RANGE_SCALE:g} / sqrt(largest lambda_1 in the column), the same for every row of a column"
        ),
        "coordinates": {m: COORDINATE_UNITS[m] for m in SURFACE_METRICS},
        "half_width": {m: float(axes[m][-1]) for m in SURFACE_METRICS},
        "panels": {row: {m: p.info for m, p in cols.items()} for row, cols in panels.items()},
        "rescaled_twin_of": flat,
        "twin_max_relative_difference": twin,
    }


def save_surfaces(path: str, panels: dict[str, dict[str, SurfacePanel]], axes: dict[str, np.ndarray]) -> None:
    """Write the grids to ``path`` (``.npz``, atomically): ``axis_<metric>`` ``(steps,)`` and
    ``loss_<row>_<metric>`` ``(steps, steps)`` with ``[i, j]`` at ``axis[i] v_1 + axis[j] v_2``, and
    ``eigenvalues_<row>_<metric>`` ``(2,)``."""
    arrays = {f"axis_{m}": axes[m] for m in SURFACE_METRICS}
    for row, cols in panels.items():
        for m, panel in cols.items():
            arrays[f"loss_{row}_{m}"] = panel.loss
            arrays[f"eigenvalues_{row}_{m}"] = np.asarray(panel.eigenvalues)
    tmp = path + ".tmp.npz"
    try:
        np.savez_compressed(tmp, **arrays)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def surfaces_markdown(surf: dict, lam: str, names: Mapping[str, str]) -> list[str]:
    """The paragraph and table about ``surfaces.png`` for ``report.md`` (``lam``: the twin's layer factors,
    ``names``: how to call the minima in prose)."""
    rows = {
        "small_batch": "small batch",
        "full_batch": "full batch",
        "rescaled": f"{names[surf['rescaled_twin_of']]}, rescaled",
    }
    half = surf["half_width"]
    twin = surf["twin_max_relative_difference"]
    exact = "; bitwise identical: the rescaling factors are powers of two" if twin["node"] == 0 else ""
    lines = [
        "## Loss surfaces",
        "",
        "![loss surfaces](surfaces.png)",
        "",
        f"Loss on the plane through each network spanned by the top-2 eigenvectors of the Euclidean Hessian "
        f"(unit Euclidean norm; half-width {half['euclidean']:.3g}) and of the node-wise invariant Hessian "
        f"(unit length in the node metric, i.e. in relative weight change; half-width {half['node']:.3g}); "
        f"{surf['grid_points']} x {surf['grid_points']} points per panel, {surf['range_rule']}. "
        f"The third row is the {names[surf['rescaled_twin_of']]} network after the layer rescaling ({lam}) above, "
        f"with its eigenvectors computed afresh: its invariant panel differs from the original's by at most "
        f"{twin['node']:.2g} (relative, over the grid{exact}), its Euclidean panel by up to {twin['euclidean']:.2g}. "
        "Grids: `surfaces.npz`.",
        "",
        "| network | plane | lambda_1 | lambda_2 | half-width | centre loss | min loss on grid | max loss on grid |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row, cols in surf["panels"].items():
        for metric, p in cols.items():
            lines.append(
                f"| {rows[row]} | {metric} | {p['lambda_1']:.4g} | {p['lambda_2']:.4g} | {p['half_width']:.3g} "
                f"| {p['center_loss']:.4g} | {p['min_loss']:.4g} | {p['max_loss']:.4g} |"
            )
    return [*lines, ""]
