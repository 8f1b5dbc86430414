"""The demo's figures: sharpness bars with the invariance check, and the loss-surface panels."""

from __future__ import annotations

import os

import numpy as np

from landscape._demo_surfaces import SURFACE_METRICS, SurfacePanel

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


def _save(fig, path: str) -> None:
    """Save ``fig`` to ``path`` through a temporary file, then close it."""
    plt = _pyplot()
    tmp = path + ".tmp.png"
    try:
        fig.savefig(tmp, dpi=150)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)


def sharpness_figure(path: str, results: dict, report_verify: dict) -> None:
    """Bars of every measure on both minima, and the largest relative change under random rescalings."""
    plt = _pyplot()
    metrics = list(results["small_batch"]["measures"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True)
    x = np.arange(len(metrics))
    for offset, key, label in ((-0.2, "small_batch", "small batch"), (0.2, "full_batch", "full batch")):
        vals = [results[key]["measures"][m]["value"] for m in metrics]
        axes[0].bar(x + offset, vals, width=0.4, label=label)
    axes[0].set_yscale("log")
    axes[0].set_xticks(x, metrics)
    axes[0].set_ylabel("top eigenvalue")
    axes[0].set_title("Sharpness of the two minima (matched training loss)")
    axes[0].legend()
    kinds = report_verify["kinds"]
    for j, kind in enumerate(kinds):
        rel = [max(report_verify["max_relative_differences"][m][kind], 1e-17) for m in metrics]
        axes[1].bar(x + (j - (len(kinds) - 1) / 2) * 0.35, rel, width=0.35, label=f"{kind}-wise rescaling")
    axes[1].axhline(report_verify["rtol"], color="k", ls="--", lw=1, label="tolerance")
    axes[1].set_yscale("log")
    axes[1].set_xticks(x, metrics)
    axes[1].set_ylabel("max relative change")
    axes[1].set_title("Change under random function-preserving rescalings")
    axes[1].legend(fontsize=8)
    _save(fig, path)


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
) -> None:
    """Grid of loss-surface panels: rows are networks, columns the Euclidean and the invariant plane.

    Each column shares its coordinate range and its logarithmic colour scale across rows; contour
    lines are labelled with the loss, the centre (the trained network) is marked.
    """
    plt = _pyplot()
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import FormatStrFormatter

    rows = list(panels)
    fig, grid = plt.subplots(
        len(rows), len(SURFACE_METRICS), figsize=(3.7 * len(SURFACE_METRICS) + 0.4, 3.6 * len(rows) + 1.6),
        constrained_layout=True, squeeze=False,
    )  # fmt: skip
    for j, metric in enumerate(SURFACE_METRICS):
        lo = min(float(panels[r][metric].loss.min()) for r in rows)
        hi = max(float(panels[r][metric].loss.max()) for r in rows)
        hi = max(hi, lo * 1.5)
        norm = LogNorm(vmin=lo, vmax=hi)
        fill = np.geomspace(lo, hi, 40)
        lines = _line_levels(lo, hi)
        x = axes[metric]
        filled = None
        for i, row in enumerate(rows):
            ax = grid[i, j]
            panel = panels[row][metric]
            # loss[i, j] is at (a_i, b_j): a along v_1 on the horizontal axis
            filled = ax.contourf(x, x, panel.loss.T, levels=fill, norm=norm, cmap="viridis", extend="neither")
            if len(lines):
                cs = ax.contour(x, x, panel.loss.T, levels=lines, colors="white", linewidths=0.7)
                ax.clabel(cs, fmt="%g", fontsize=7, inline=True)
            ax.plot(0, 0, marker="+", color="red", markersize=10, mew=1.6)
            ax.set_aspect("equal")
            l1, l2 = panel.eigenvalues
            ax.set_title(
                f"{row_labels[row]}\n{LAMBDA_NAMES[metric]} $\\lambda_1$ = {l1:.4g}, $\\lambda_2$ = {l2:.4g}",
                fontsize=9,
            )
            ax.set_xlabel("$a$ (along $v_1$)", fontsize=8)
            ax.set_ylabel("$b$ (along $v_2$)", fontsize=8)
            ax.tick_params(labelsize=7)
        cbar = fig.colorbar(filled, ax=grid[:, j], location="bottom", shrink=0.9, aspect=25, pad=0.01)
        cbar.set_ticks(lines if len(lines) else [lo, hi])
        cbar.set_ticks([], minor=True)
        cbar.ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        cbar.set_label("training loss (log scale)", fontsize=8)
        cbar.ax.tick_params(labelsize=7)
        grid[0, j].annotate(
            COLUMN_TITLES[metric], xy=(0.5, 1.2), xycoords="axes fraction", ha="center", va="bottom",
            fontsize=10, fontweight="bold",
        )  # fmt: skip
    _save(fig, path)
