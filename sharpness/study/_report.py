"""The report of a sharpness study: a Markdown page with the rank correlations of every measure with the
generalization gap, a grid of scatter plots (measure against gap, one panel per measure) and a summary plot of
the taus with their bootstrap intervals.

Figures are drawn on `matplotlib.figure.Figure` objects (no pyplot, so the caller's backend is left
alone) and written atomically with their provenance in the PNG metadata.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from sharpness._results import figure_bytes, write_atomic

DPI = 150
# A measure whose positive values span at least this ratio (two decades, so the axis has at least two labelled
# powers of ten) is drawn on a log axis.
LOG_SPAN = 100.0
MAX_CATEGORIES = 10


def _fmt(value: float, digits: int = 2) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:+.{digits}f}"


def _interval(low: float, high: float) -> str:
    if not (math.isfinite(low) and math.isfinite(high)):
        return ""
    return f" [{low:+.2f}, {high:+.2f}]"


def _color_column(table, hyper_columns: list[str], color_by: str | None) -> str | None:
    """The hyperparameter to colour by: ``color_by`` if given, else the first column with 2 to
    `MAX_CATEGORIES` distinct values, else the first column that varies."""
    if color_by is not None:
        if color_by not in table.columns:
            raise ValueError(f"color_by {color_by!r} is not a column of the table")
        return color_by
    varying = [c for c in hyper_columns if table[c].nunique(dropna=False) >= 2]
    few = [c for c in varying if table[c].nunique(dropna=False) <= MAX_CATEGORIES]
    return (few or varying or [None])[0]


def _use_log(values: np.ndarray) -> bool:
    finite = values[np.isfinite(values)]
    return finite.size > 1 and bool((finite > 0).all()) and finite.max() / finite.min() >= LOG_SPAN


def _label(value) -> str:
    return f"{value:g}" if isinstance(value, (float, np.floating)) else str(value)


def _category_colors(values) -> dict:
    """A colour (qualitative map) for each distinct value's label, in the values' sorted order (numbers first;
    labels as keys, so NaN, which equals nothing, is one category)."""
    from matplotlib import colormaps

    def order(v):
        number = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
        return (not number or v != v, float(v) if number and v == v else 0.0, str(v))

    labels = list(dict.fromkeys(_label(v) for v in sorted(values, key=order)))
    if len(labels) <= 10:
        return {label: colormaps["tab10"](i) for i, label in enumerate(labels)}
    cmap = colormaps["viridis"]
    return {label: cmap(i / (len(labels) - 1)) for i, label in enumerate(labels)}


def scatter_figure(table, summary, measures: list[str], gap: str, color: str | None):
    """Grid of panels, measure (x) against ``gap`` (y), one per measure, points coloured by ``color``."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import NullFormatter

    ncols = min(4, max(1, len(measures)))
    nrows = math.ceil(len(measures) / ncols)
    fig = Figure(figsize=(3.3 * ncols, 2.9 * nrows + 0.6), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, sharey=True)
    rows = summary.set_index("measure")
    y = table[gap].to_numpy(dtype=float)
    colors = _category_colors(table[color].tolist()) if color else {}
    point_colors = [colors[_label(v)] for v in table[color]] if color else "tab:blue"
    for ax, measure in zip(axes.flat, measures):
        x = table[measure].to_numpy(dtype=float)
        shown = np.isfinite(x) & np.isfinite(y)
        if shown.any():
            ax.scatter(x[shown], y[shown], s=18, c=np.asarray(point_colors, dtype=object)[shown].tolist()
                       if color else point_colors, edgecolors="black", linewidths=0.3)  # fmt: skip
        else:
            ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", va="center", color="gray")
        if _use_log(x):
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())  # labels at 2x, 3x ... would collide
        stats = rows.loc[measure] if measure in rows.index else None
        title = measure
        if stats is not None:
            title += f"\nτ = {_fmt(stats['tau'])}{_interval(stats['tau_low'], stats['tau_high'])}"
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(f"{measure} sharpness", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3, linewidth=0.5)
    for ax in axes[:, 0]:
        ax.set_ylabel("generalization gap" if gap == "gap" else gap, fontsize=8)
    for ax in list(axes.flat)[len(measures) :]:
        ax.set_visible(False)
    if color:
        handles = [Line2D([], [], marker="o", linestyle="", markerfacecolor=rgba, markeredgecolor="black",
                          markeredgewidth=0.3, label=label) for label, rgba in colors.items()]  # fmt: skip
        fig.legend(handles=handles, title=color, loc="outside lower center", ncols=min(len(colors), 8), fontsize=8,
                   title_fontsize=8, frameon=False)  # fmt: skip
    return fig


def summary_figure(summary, hyper_columns: list[str]):
    """Left: tau and psi of each measure with their intervals; right: the granulated tau of each column."""
    from matplotlib.figure import Figure

    measures = summary["measure"].tolist()
    n = len(measures)
    columns = [c for c in hyper_columns if f"tau_{c}" in summary.columns]
    fig = Figure(figsize=(4.2 + 0.75 * max(1, len(columns)) + 0.8, 0.9 + 0.42 * n), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[4.2, 0.75 * max(1, len(columns)) + 0.8])
    positions = np.arange(n)
    for offset, key, label, marker in ((-0.14, "tau", "Kendall τ", "o"), (0.14, "psi", "granulated τ ψ", "s")):
        values = summary[key].to_numpy(dtype=float)
        low = values - summary[f"{key}_low"].to_numpy(dtype=float)
        high = summary[f"{key}_high"].to_numpy(dtype=float) - values
        errors = np.nan_to_num(np.vstack([low, high]), nan=0.0)
        left.errorbar(values, positions + offset, xerr=errors, fmt=marker, markersize=5, capsize=2.5, label=label)
    left.axvline(0.0, color="gray", linewidth=0.8)
    left.set_xlim(-1.05, 1.05)
    left.set_yticks(positions, measures, fontsize=8)
    left.set_ylim(n - 0.5, -0.5)
    left.set_xlabel("rank correlation with the generalization gap", fontsize=8)
    left.tick_params(axis="x", labelsize=7)
    left.grid(axis="x", alpha=0.3, linewidth=0.5)
    left.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncols=2, frameon=False,
                borderaxespad=0.2)  # fmt: skip
    grid = summary[[f"tau_{c}" for c in columns]].to_numpy(dtype=float) if columns else np.full((n, 1), np.nan)
    image = right.imshow(np.ma.masked_invalid(grid), cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto")
    for (i, j), value in np.ndenumerate(grid):
        text = "n/a" if not math.isfinite(value) else f"{value:+.2f}"
        right.text(j, i, text, ha="center", va="center", fontsize=7,
                   color="white" if math.isfinite(value) and abs(value) > 0.6 else "black")  # fmt: skip
    right.set_xticks(range(grid.shape[1]), columns or ["(none)"], rotation=30, ha="right", fontsize=7)
    right.set_yticks(positions, [""] * n)
    right.set_title("ψ per hyperparameter", fontsize=8)
    fig.colorbar(image, ax=right, shrink=0.8).ax.tick_params(labelsize=7)
    return fig


def _markdown(table, summary, measures, hyper_columns, gap, figures: list[str], attrs: dict) -> str:
    n = len(table)
    confidence, n_boot = attrs.get("confidence"), attrs.get("n_boot")
    interval = (f"{100 * confidence:g}% bootstrap percentile intervals over {n_boot} resamples of the models"
                if confidence and n_boot else "bootstrap percentile intervals over resampled models")  # fmt: skip
    gap_text = "the generalization gap (test error minus training error)" if gap == "gap" else f"`{gap}`"
    lines = [
        "# Sharpness study",
        "",
        f"{n} models; {len(measures)} measure(s); hyperparameters: "
        + (", ".join(f"`{c}`" for c in hyper_columns) or "none")
        + ".",
        "",
        f"Kendall's τ compares the ranking of all models by a measure with their ranking by {gap_text}: +1 means "
        "the measure orders them exactly as their gaps, 0 no relation, −1 the reverse order. The granulated τ "
        "ψ_col (Jiang et al., ICLR 2020) is the mean τ within the groups of models that share every other "
        "hyperparameter, so it asks whether the measure tracks the gap when only `col` changes; ψ is the mean "
        f"of the ψ_col. In brackets: {interval}. n/a: undefined (fewer than two models, or no variation).",
        "",
    ]
    header = ["measure", "models", "τ", "ψ", *[f"ψ `{c}`" for c in hyper_columns]]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    rows = summary.set_index("measure")
    for measure in measures:
        s = rows.loc[measure]
        measured = int(np.isfinite(table[measure].to_numpy(dtype=float)).sum())
        cells = [f"`{measure}`", f"{measured}/{n}", _fmt(s["tau"]) + _interval(s["tau_low"], s["tau_high"]),
                 _fmt(s["psi"]) + _interval(s["psi_low"], s["psi_high"]),
                 *[_fmt(s.get(f"tau_{c}", math.nan)) for c in hyper_columns]]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    gaps = table[gap].to_numpy(dtype=float)
    if np.isfinite(gaps).any():
        lines += [f"Gaps range over [{np.nanmin(gaps):.4f}, {np.nanmax(gaps):.4f}].", ""]
    for name in figures:
        lines += [f"![{name}]({name})", ""]
    return "\n".join(lines)


def write_report(table, summary, out_dir: str | os.PathLike, measures: list[str], hyper_columns: list[str],
                 gap: str = "gap", *, color_by: str | None = None) -> list[Path]:  # fmt: skip
    """Write ``report.md``, ``scatter.png`` and ``summary.png`` into ``out_dir``.

    Args:
        table: the tidy table (pandas DataFrame, one row per model) with the measure, gap and hyperparameter
            columns.
        summary: `sharpness.study._stats.summarize` of the table (its ``attrs`` name the bootstrap).
        out_dir: the folder (created if needed).
        measures: the measure columns, in the order shown.
        hyper_columns: the hyperparameter columns.
        gap: the column of the generalization gap.
        color_by: the column colouring the scatter plots (default: the first hyperparameter with 2 to 10
            distinct values).

    Returns:
        The paths written: the page first, then the figures.

    Raises:
        ValueError: a measure missing from ``summary`` or a column missing from ``table``.
    """
    missing = [m for m in measures if m not in set(summary["measure"])]
    if missing:
        raise ValueError(f"the summary has no row for {', '.join(missing)}; summarize the same measures")
    absent = [c for c in [*measures, gap, *hyper_columns] if c not in table.columns]
    if absent:
        raise ValueError(f"the table has no column {', '.join(map(repr, absent))}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    color = _color_column(table, hyper_columns, color_by)
    shown = summary.set_index("measure").loc[measures].reset_index()
    figures = {
        "scatter.png": (scatter_figure(table, shown, measures, gap, color),
                        "sharpness study: each measure against the generalization gap"),
        "summary.png": (summary_figure(shown, hyper_columns),
                        "sharpness study: rank correlation of each measure with the generalization gap"),
    }  # fmt: skip
    written = []
    for name, (fig, title) in figures.items():
        description = f"{len(table)} models; measures {', '.join(measures)}; coloured by {color}"
        write_atomic(out / name, figure_bytes(fig, "png", DPI, title, description, software="sharpness study"))
        written.append(out / name)
    page = out / "report.md"
    write_atomic(page, _markdown(table, shown, measures, hyper_columns, gap, list(figures), dict(summary.attrs)))
    return [page, *written]
