"""The demo's figures: sharpness bars with the invariance check, and the loss-surface panels."""

from __future__ import annotations

import math

import numpy as np

from landscape._demo_surfaces import SURFACE_METRICS, SurfacePanel
from landscape._surface import decades_apart
from sharpness.io import figure_bytes, write_atomic

COLUMN_TITLES = {
    "euclidean": "Euclidean Hessian plane\n(unit Euclidean norm)",
    "node": "invariant (node-wise) Hessian plane\n(unit node-metric norm)",
}
LAMBDA_NAMES = {"euclidean": "Euclidean", "node": "invariant"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


MODEL_LABEL = "MLP 64-128-128-10"


def _data(model: str) -> str:
    """The captions' provenance: data, ``model`` (how the report names it) and loss."""
    return f"scikit-learn digits (1797 images), {model}, cross-entropy"


def _save(fig, path: str, title: str, description: str) -> None:
    """Save ``fig`` to ``path`` as a PNG, atomically (title and provenance in its metadata), then close it."""
    try:
        write_atomic(path, figure_bytes(fig, "png", 150, title, description, software="landscape demo"))
    finally:
        _pyplot().close(fig)


def format_value(v: float) -> str:
    """Four significant digits, in scientific notation from 1e5 on (``1.000e+07``, not ``1e+07``)."""
    return f"{v:.3e}" if v != 0 and not 1e-3 <= abs(v) < 1e5 else f"{v:.4g}"


def sharpness_figure(path: str, results: dict, report_verify: dict, model: str = MODEL_LABEL) -> None:
    """One small panel per measure (values of different measures are not comparable: each gets its own
    linear axis from 0, both values written on the bars), and the largest relative change of each measure
    under random rescalings as dots on a log axis against the tolerance (exact zeros drawn at the bottom)."""
    plt = _pyplot()
    from matplotlib import ticker

    from landscape._plot_mpl import add_caption

    metrics = list(results["small_batch"]["measures"])
    keys = (("small_batch", "small batch", "C0"), ("full_batch", "full batch", "C1"))
    fig = plt.figure(figsize=(11.5, 5.0), layout="constrained")
    left, right = fig.subfigures(1, 2, width_ratios=[1.35, 1.0])
    cols = 3
    grid = left.subplots(math.ceil(len(metrics) / cols), cols, squeeze=False)
    for ax, m in zip(grid.flat, metrics):
        values = [results[key]["measures"][m]["value"] for key, _, _ in keys]
        lo, hi = min(values), max(values)
        log = decades_apart(lo, hi)  # a log axis (dots, no bars from a floor)
        for x, v, (_, _, color) in zip((0, 1), values, keys):
            if log:
                ax.plot([x], [v], "o", color=color, ms=8)
            else:
                ax.bar([x], [v], width=0.6, color=color)
            # A dot's radius is 4 points: its label starts above the dot, a bar's right above the bar.
            ax.annotate(format_value(v), (x, v), xytext=(0, 8 if log else 4), textcoords="offset points",
                        ha="center", va="bottom", fontsize=7.5)  # fmt: skip
        ax.set_title(m + (" (log scale)" if log else ""), fontsize=9)
        ax.set_xticks([0, 1], ["small\nbatch", "full\nbatch"], fontsize=7.5)
        ax.set_xlim(-0.6, 1.6)
        if log:
            ax.set_yscale("log")
            ax.set_ylim(lo / 4, hi * 40)  # room for the top dot's label inside the frame
        else:
            ax.set_ylim(0, hi * 1.38)  # the taller bar's label stays inside the frame
            ax.yaxis.set_major_locator(ticker.MaxNLocator(3))
            ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: format_value(v) if v else "0"))
        ax.tick_params(axis="y", labelsize=7)
    for ax in list(grid.flat)[len(metrics) :]:
        ax.set_visible(False)
    left.suptitle("Top eigenvalue of each measure at the two minima (matched training loss)", fontsize=10)
    left.supylabel("top eigenvalue (own scale per measure)", fontsize=8)

    ax = right.subplots()
    kinds = report_verify["kinds"]
    rel = {kind: [report_verify["max_relative_differences"][m][kind] for m in metrics] for kind in kinds}
    positive = [v for values in rel.values() for v in values if v > 0]
    floor = min(positive) / 10 if positive else 1e-17
    x = np.arange(len(metrics))
    for j, kind in enumerate(kinds):
        offset = (j - (len(kinds) - 1) / 2) * 0.22
        values = np.array(rel[kind], dtype=float)
        ax.plot(x + offset, np.where(values > 0, values, floor), "o", color=f"C{j + 2}", ms=6,
                label=f"{kind}-wise rescaling")  # fmt: skip
        for xi, v in zip(x + offset, values):
            if v == 0:
                ax.annotate("0", (xi, floor), xytext=(0, 5), textcoords="offset points", ha="center", fontsize=7)
    ax.axhline(report_verify["rtol"], color="k", ls="--", lw=1, label=f"tolerance {report_verify['rtol']:g}")
    ax.set_yscale("log")
    ax.set_xticks(x, metrics, rotation=30, ha="right", rotation_mode="anchor")
    ax.set_xlim(-0.6, len(metrics) - 0.4)
    ax.set_ylabel("largest relative change (log scale)")
    ax.grid(axis="y", alpha=0.3, lw=0.5)
    ax.legend(fontsize=7.5, loc="upper right")
    right.suptitle("Change under random function-preserving rescalings", fontsize=10)
    title, data = "Sharpness of small- vs full-batch minima and its invariance", _data(model)
    add_caption(fig, f"{data}; both minima at training loss ≤ 0.01. Measures: layer-wise quotient (Rangamani et al. "
                "2021), node-wise quotient, fixed weights (Jestädt 2025), minimum-norm gauge, G-space (Meng et al. "
                "2019), symmetry: the quotient by the network's whole symmetry group (attention heads, norms, units).")
    _save(fig, path, title, f"{data}; every sharpness measure of the toolkit on two minima, and its change under "
                            "random node- and layer-wise rescalings")  # fmt: skip


def _line_levels(lo: float, hi: float) -> np.ndarray:
    """Round contour values (1, 2, 5 times a power of ten) strictly inside ``(lo, hi)``."""
    decades = range(int(np.floor(np.log10(lo))), int(np.ceil(np.log10(hi))) + 1)
    levels = np.array([m * 10.0**e for e in decades for m in (1, 2, 5)])
    levels = levels[(levels > lo * 1.02) & (levels < hi / 1.02)]
    if len(levels) > 9:  # keep the labels legible
        levels = levels[:: int(np.ceil(len(levels) / 9))]
    return levels


def surfaces_figure(
    path: str,
    panels: dict[str, dict[str, SurfacePanel]],
    axes: dict[str, np.ndarray],
    row_labels: dict[str, str],
    model: str = MODEL_LABEL,
) -> None:
    """Grid of loss-surface panels: rows are networks, columns the Euclidean and the invariant plane.

    Each column shares its coordinate range and its logarithmic colour scale across rows; contour
    lines are labelled with the loss, the centre (the trained network) is marked.
    """
    plt = _pyplot()
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import FormatStrFormatter

    from landscape._plot_mpl import add_caption, label_contours, mark_grid_points

    rows = list(panels)
    fig = plt.figure(figsize=(3.9 * len(SURFACE_METRICS) + 0.4, 3.9 * len(rows) + 1.9), layout="constrained")
    columns = fig.subfigures(1, len(SURFACE_METRICS), squeeze=False)[0]
    for j, metric in enumerate(SURFACE_METRICS):
        column = columns[j]
        column_axes = column.subplots(len(rows), 1, squeeze=False)[:, 0]
        lo = min(float(panels[r][metric].loss.min()) for r in rows)
        hi = max(float(panels[r][metric].loss.max()) for r in rows)
        hi = max(hi, lo * 1.5)
        norm = LogNorm(vmin=lo, vmax=hi)
        fill = np.geomspace(lo, hi, 40)
        lines = _line_levels(lo, hi)
        x = axes[metric]
        filled = None
        for i, row in enumerate(rows):
            ax = column_axes[i]
            panel = panels[row][metric]
            # loss[i, j] is at (a_i, b_j): a along v_1 on the horizontal axis
            filled = ax.contourf(x, x, panel.loss.T, levels=fill, norm=norm, cmap="viridis", extend="neither")
            if len(lines):
                cs = ax.contour(x, x, panel.loss.T, levels=lines, colors="white", linewidths=0.7)
                label_contours(ax, cs, (x[0], x[-1]), (x[0], x[-1]), fmt="%g", fontsize=7)
            where = mark_grid_points(ax, x, x, panel.loss.T)  # the trained network and the grid's lowest point
            ax.set_aspect("equal")
            l1, l2 = panel.eigenvalues
            ax.set_title(
                f"{row_labels[row]}\n{LAMBDA_NAMES[metric]} $\\lambda_1$ = {l1:.4g}, $\\lambda_2$ = {l2:.4g}\n"
                f"{where}",
                fontsize=8.5,
            )
            ax.set_xlabel("$a$ (along $v_1$)", fontsize=8)
            ax.set_ylabel("$b$ (along $v_2$)", fontsize=8)
            ax.tick_params(labelsize=7)
        cbar = column.colorbar(filled, ax=column_axes, location="bottom", shrink=0.9, aspect=25, pad=0.01)
        cbar.set_ticks(lines if len(lines) else [lo, hi])
        cbar.set_ticks([], minor=True)
        cbar.ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        cbar.set_label("training loss (log scale)", fontsize=8)
        cbar.ax.tick_params(labelsize=7)
        column.suptitle(COLUMN_TITLES[metric], fontsize=10, fontweight="bold")
    title, data = "Loss planes along the top Hessian eigenvectors: Euclidean vs invariant (node-wise)", _data(model)
    add_caption(fig, f"{data}; training loss on the plane of the top two eigenvectors of each Hessian, at both minima "
                "and at a layer-wise rescaled copy")
    _save(fig, path, title, f"{data}; loss planes along the top two eigenvectors of the Euclidean and of the node-wise "
                            "Riemannian Hessian (Rangamani et al. 2021, generalized node-wise)")  # fmt: skip
