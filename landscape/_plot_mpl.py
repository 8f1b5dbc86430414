"""Static figures of loss surfaces with matplotlib: filled contours, heatmaps, 3D surfaces, lines.

Every drawing function takes an ``Axes`` and a [`Surface`][landscape.Surface] and returns
the mappable it drew, so callers can arrange panels freely; [`surface_figure`][landscape.surface_figure] arranges a grid
of panels (rows = kinds of drawing, columns = surfaces) with one shared color scale, and
[`save_figure`][landscape.save_figure] writes PNG/PDF/SVG atomically.
"""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Sequence
from pathlib import Path

import matplotlib as mpl
import numpy as np
from matplotlib import colors, patheffects, ticker
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.figure import Figure

from landscape._surface import Surface, resolve_log
from sharpness.io import figure_bytes, write_atomic

FORMATS = ("png", "pdf", "svg")
KINDS = ("contour", "heatmap", "surface")

STYLE = {
    "font.size": 9,
    "axes.titlesize": 9.5,
    "axes.labelsize": 9,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "legend.fontsize": 8,
    "figure.titlesize": 11,
    "savefig.bbox": "tight",
    "savefig.pad_inches": 0.05,
}


def default_cmap(surfaces: Sequence[Surface]) -> str:
    """A diverging map for losses of both signs (the toys' ``sin``), a sequential one otherwise."""
    lo = min(float(np.nanmin(s.loss)) for s in surfaces)
    hi = max(float(np.nanmax(s.loss)) for s in surfaces)
    return "RdBu_r" if lo < 0 < hi else "viridis"


def shared_norm(surfaces: Sequence[Surface], log: bool = False) -> colors.Normalize:
    """One color scale covering every surface (``log``: logarithmic; needs a positive loss)."""
    finite = [s.loss[np.isfinite(s.loss)] for s in surfaces]
    lo = min(float(f.min()) for f in finite)
    hi = max(float(f.max()) for f in finite)
    if log:
        if lo <= 0:
            raise ValueError(f"a log color scale needs a positive loss, but the smallest value is {lo:.3g}")
        return colors.LogNorm(lo, hi if hi > lo else lo * 10)
    if hi == lo:
        lo, hi = lo - 0.5, hi + 0.5
    return colors.Normalize(lo, hi)


def contour_levels(norm: colors.Normalize, n: int = 20) -> np.ndarray:
    """About ``n`` round contour levels spanning ``norm``'s range (1-2-5 per decade on a log scale)."""
    if isinstance(norm, colors.LogNorm):
        lo, hi = math.floor(math.log10(norm.vmin)), math.ceil(math.log10(norm.vmax))
        mantissas = (1, 2, 5) if hi - lo <= 6 else (1,)
        levels = np.array([m * 10.0**e for e in range(lo, hi + 1) for m in mantissas])
        # keep one level on either side of the data so the colors span the whole range
        inside = np.flatnonzero((levels >= norm.vmin) & (levels <= norm.vmax))
        if inside.size < 3:  # a narrow range (within a factor of about 5): round levels of the linear scale
            linear = ticker.MaxNLocator(n, steps=[1, 2, 2.5, 5, 10]).tick_values(norm.vmin, norm.vmax)
            return linear[linear > 0]
        return levels[max(inside.min() - 1, 0) : min(inside.max() + 2, len(levels))]
    return ticker.MaxNLocator(n, steps=[1, 2, 2.5, 5, 10]).tick_values(norm.vmin, norm.vmax)


def _level_format(levels: np.ndarray):
    span = float(np.ptp(levels)) or 1.0
    gaps = np.diff(np.unique(levels))
    # enough significant digits to tell neighbouring levels apart (2.302 next to 2.304), at least 2
    step, top = (float(gaps.min()) if gaps.size else span), float(np.abs(levels).max()) or 1.0
    digits = max(2, math.ceil(math.log10(top / step)) + 1)

    def fmt(value: float) -> str:
        return f"{value:.{digits}g}" if abs(value) >= span * 1e-6 else "0"

    return fmt


def draw_contour(
    ax: Axes,
    s: Surface,
    norm: colors.Normalize,
    cmap: str = "viridis",
    levels: np.ndarray | None = None,
    label_levels: bool = True,
    mark_center: bool = False,
):
    """Filled contour of ``s`` with thin labeled level lines; returns the filled ``ContourSet``."""
    levels = contour_levels(norm) if levels is None else levels
    filled = ax.contourf(s.x, s.y, s.loss, levels=levels, norm=norm, cmap=cmap)
    lines = ax.contour(
        s.x, s.y, s.loss, levels=levels, colors="k", linewidths=0.4, alpha=0.55, negative_linestyles="solid"
    )
    if label_levels:
        # label every other line so labels do not pile up where the surface is steep
        label_contours(ax, lines, (s.x[0], s.x[-1]), (s.y[0], s.y[-1]), levels=levels[::2], fontsize=6.5,
                       fmt=_level_format(levels))  # fmt: skip
    if mark_center:
        mark_center_and_minimum(ax, s)
    _label(ax, s)
    return filled


def label_contours(ax: Axes, lines, xlim: tuple[float, float], ylim: tuple[float, float], margin: float = 0.07,
                   **kwargs) -> list:
    """Inline labels on the contour ``lines``, none centred within ``margin`` (a fraction of the axis range)
    of an edge, where the axes would cut it (corner labels): matplotlib's positions are computed first,
    those near an edge dropped, and the rest placed inline (so no line keeps a gap for a dropped label)."""
    (x0, x1), (y0, y1) = sorted(xlim), sorted(ylim)
    mx, my = margin * (x1 - x0), margin * (y1 - y0)
    trial = ax.clabel(lines, inline=False, **kwargs)
    keep = [t.get_position() for t in trial if x0 + mx <= t.get_position()[0] <= x1 - mx
            and y0 + my <= t.get_position()[1] <= y1 - my]  # fmt: skip
    for text in list(trial):
        text.remove()
    del lines.labelTexts[:], lines.labelCValues[:]
    if not keep:
        return []
    labels = ax.clabel(lines, inline=True, manual=keep, **kwargs)
    for text in labels:  # a halo in the opposite shade keeps each label readable on any fill
        r, g, b, _ = colors.to_rgba(text.get_color())
        text.set_color((r, g, b))  # opaque: a faint line's label would blur into its halo
        halo = "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"
        text.set_path_effects([patheffects.withStroke(linewidth=1.6, foreground=halo, alpha=0.75)])
    return labels


def mark_center_and_minimum(ax: Axes, s: Surface) -> str:
    """Mark the centre (the model, ``+``) and, where it differs, the grid's smallest loss (``x``); returns
    the phrase saying both losses, for a title or caption."""
    return mark_grid_points(ax, s.x, s.y, s.loss)


def mark_grid_points(ax: Axes, x: np.ndarray, y: np.ndarray, loss: np.ndarray) -> str:
    """`mark_center_and_minimum` for a grid given as arrays: ``loss[i, j]`` at ``(x[j], y[i])``, the centre
    at ``(0, 0)`` (nothing is marked where the grid does not contain it)."""
    if not (np.any(x == 0) and np.any(y == 0)):
        return ""
    center = float(loss[int(np.flatnonzero(y == 0)[0]), int(np.flatnonzero(x == 0)[0])])
    ax.plot([0], [0], marker="+", color="w", markersize=9, markeredgewidth=1.6, zorder=5)
    ax.plot([0], [0], marker="+", color="k", markersize=7, markeredgewidth=0.8, zorder=6)
    k = np.unravel_index(int(np.nanargmin(loss)), loss.shape)
    low = float(loss[k])
    if not low < center:  # the centre itself, or as low as it
        return f"+ centre: loss {center:.4g} (the grid's minimum)"
    ax.plot([x[k[1]]], [y[k[0]]], marker="x", color="w", markersize=8, markeredgewidth=2.0, zorder=5)
    ax.plot([x[k[1]]], [y[k[0]]], marker="x", color="r", markersize=7, markeredgewidth=1.0, zorder=6)
    return f"+ centre: loss {center:.4g};  × grid minimum: {low:.4g}"


def draw_heatmap(ax: Axes, s: Surface, norm: colors.Normalize, cmap: str = "viridis", mark_center: bool = False):
    """Heatmap of ``s`` (cells centered on the grid points, also for non-uniform axes)."""
    mesh = ax.pcolormesh(s.x, s.y, s.loss, norm=norm, cmap=cmap, shading="nearest", rasterized=True)
    if mark_center:
        mark_center_and_minimum(ax, s)
    _label(ax, s)
    return mesh


def draw_surface3d(ax: Axes, s: Surface, norm: colors.Normalize, cmap: str = "viridis", max_lines: int = 301):
    """3D surface of ``s``; on a log color scale the height is ``log10(loss)``."""
    log = isinstance(norm, colors.LogNorm)
    xx, yy = np.meshgrid(s.x, s.y)
    z = np.log10(s.loss) if log else s.loss
    mappable = ax.plot_surface(
        xx, yy, z, cmap=cmap, norm=colors.Normalize(np.log10(norm.vmin), np.log10(norm.vmax)) if log else norm,
        rcount=min(max_lines, len(s.y)), ccount=min(max_lines, len(s.x)), linewidth=0, antialiased=False,
    )  # fmt: skip
    # every grid line drawn (steep sines alias into jagged facets when rows are skipped); few ticks, and the
    # labels a little away from them, so labels and tick labels do not collide
    for axis in (ax.xaxis, ax.yaxis, ax.zaxis):
        axis.set_major_locator(ticker.MaxNLocator(4))
    ax.set_xlabel(s.x_label, labelpad=5)
    ax.set_ylabel(s.y_label, labelpad=5)
    ax.set_zlabel(f"log₁₀ {s.z_label}" if log else s.z_label, labelpad=4)
    ax.set_box_aspect(None, zoom=0.88)
    ax.tick_params(pad=0)
    ax.set_title(_wrap(s.title))
    ax.view_init(elev=32, azim=-125)
    return mappable


def draw_line(
    ax: Axes, s: Surface, log: bool = False, accuracy: bool = True, mark_center: bool = True, **kwargs
):
    """Loss along a line (accuracy on a second axis when present); ``mark_center``: a dot at ``x = 0``."""
    (line,) = ax.plot(s.x, s.loss, color=kwargs.pop("color", "C0"), lw=kwargs.pop("lw", 1.6), **kwargs)
    if log:
        ax.set_yscale("log")
    j = np.flatnonzero(s.x == 0)
    if mark_center and j.size:
        ax.plot(s.x[j], s.loss[j], "o", color=line.get_color(), ms=4, zorder=4)
    ax.set_xlabel(s.x_label)
    ax.set_ylabel(s.z_label)
    ax.set_title(s.title)
    ax.grid(alpha=0.3, lw=0.5)
    if accuracy and s.accuracy is not None:
        twin = ax.twinx()
        twin.plot(s.x, 100 * s.accuracy, color="C1", lw=1.0, ls="--")
        twin.set_ylabel("accuracy (%)", color="C1")
        twin.tick_params(axis="y", colors="C1")
    return line


def _wrap(title: str, width: int = 48) -> str:
    """Break long title lines so neighbouring panel titles do not run into each other."""
    return "\n".join(textwrap.fill(line, width) for line in title.split("\n"))


def _label(ax: Axes, s: Surface) -> None:
    ax.set_xlabel(s.x_label)
    ax.set_ylabel(s.y_label)
    ax.set_title(_wrap(s.title))
    ax.xaxis.set_major_locator(ticker.MaxNLocator(5))
    ax.yaxis.set_major_locator(ticker.MaxNLocator(5))


def add_caption(fig: Figure, text: str, fontsize: float = 7.5) -> None:
    """A caption under the panels (wrapped to the figure's width), where provenance and notes go."""
    width = max(40, int(fig.get_figwidth() * 72 / (0.52 * fontsize)))
    wrapped = "\n".join(textwrap.fill(line, width) for line in text.split("\n"))
    fig.supxlabel(wrapped, fontsize=fontsize, color="0.25", ha="center", linespacing=1.3)


def surface_figure(
    surfaces: Sequence[Surface],
    kinds: Sequence[str] = ("contour", "surface"),
    log: bool | str = False,
    cmap: str | None = None,
    title: str | None = None,
    panel_size: tuple[float, float] = (3.4, 3.0),
    mark_center: bool = False,
    levels: np.ndarray | None = None,
    label_levels: bool = True,
    panel_titles: Sequence[str] | None = None,
    caption: str | None = None,
) -> Figure:
    """Panels of 2-D surfaces with one shared color scale and colorbar.

    Args:
        surfaces: 2-D surfaces, one column each (a single surface: its drawings in one row).
        kinds: one row per entry, each ``"contour"``, ``"heatmap"`` or ``"surface"`` (3D).
        log: logarithmic color scale (and ``log10`` heights in 3D); ``"auto"``: logarithmic where the
            losses are positive and span more than two decades.
        cmap: colormap name (default: diverging for signed losses, viridis otherwise).
        title: figure title.
        panel_size: inches per panel.
        mark_center: mark the point ``(0, 0)`` (the model's own parameters, ``+``) in 2-D panels, and the
            grid's smallest loss (``x``) where it lies elsewhere; the caption gives both losses.
        levels: contour levels (default: about 20 round values over the shared range).
        label_levels: write level values on the contour lines.
        panel_titles: one short title per surface (default: the surfaces' own titles), shown once per
            column (on the first row).
        caption: text under the panels (provenance, notes), wrapped to the figure's width.

    Returns:
        The matplotlib ``Figure``.
    """
    if not surfaces or any(s.is_line for s in surfaces):
        raise ValueError("surface_figure draws 2-D surfaces; use line_figure for lines")
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"unknown drawing kind {bad[0]!r}; choose from {', '.join(KINDS)}")
    if panel_titles is not None and len(panel_titles) != len(surfaces):
        raise ValueError(f"give one panel title per surface: {len(panel_titles)} titles for {len(surfaces)} surfaces")
    log = resolve_log(log, surfaces)
    norm = shared_norm(surfaces, log)
    cmap = cmap or default_cmap(surfaces)
    levels = contour_levels(norm) if levels is None else levels
    # one surface: its drawings side by side; several: one row per kind, one column per surface
    rows, cols = (1, len(kinds)) if len(surfaces) == 1 else (len(kinds), len(surfaces))
    notes = []
    with mpl.rc_context(STYLE):
        fig = Figure(
            figsize=(panel_size[0] * cols + 0.9, panel_size[1] * rows + (0.5 if title else 0.2) + (0.4 if caption
                     else 0)), layout="constrained",
        )  # fmt: skip
        axes = []
        mappable = None
        for r, kind in enumerate(kinds):
            for c, s in enumerate(surfaces):
                index = r * len(surfaces) + c + 1
                if kind == "surface":
                    ax = fig.add_subplot(rows, cols, index, projection="3d")
                    draw_surface3d(ax, s, norm, cmap)
                elif kind == "heatmap":
                    ax = fig.add_subplot(rows, cols, index)
                    drawn = draw_heatmap(ax, s, norm, cmap, mark_center=False)
                    mappable = mappable or drawn
                else:
                    ax = fig.add_subplot(rows, cols, index)
                    drawn = draw_contour(ax, s, norm, cmap, levels, label_levels, mark_center=False)
                    mappable = mappable or drawn
                if mark_center and kind != "surface":
                    note = mark_center_and_minimum(ax, s)
                    if note and len(notes) < len(surfaces):
                        notes.append((panel_titles[c] if panel_titles is not None else f"panel {c + 1}", note))
                if len(surfaces) > 1:
                    # the column's title once, on the first row
                    ax.set_title((panel_titles[c] if panel_titles is not None else _wrap(s.title)) if r == 0 else "")
                elif panel_titles is not None:
                    ax.set_title(panel_titles[0])
                axes.append(ax)
        if mappable is None:
            mappable = ScalarMappable(norm=norm, cmap=cmap)
        if len(surfaces) == 1 and title:
            # the figure title names the surface; the panels say only what they draw
            for ax, kind in zip(axes, kinds):
                ax.set_title({"contour": "contours", "heatmap": "heatmap", "surface": "surface"}[kind])
        label = surfaces[0].z_label + (" (log scale)" if log else "")
        colorbar = fig.colorbar(mappable, ax=axes, shrink=0.85, aspect=30, pad=0.02, label=label)
        if log and norm.vmax < 10 * norm.vmin:  # less than a decade: LogLocator would leave it bare
            colorbar.ax.yaxis.set_major_locator(ticker.MaxNLocator(6))
            colorbar.ax.yaxis.set_major_formatter(ticker.ScalarFormatter())
            colorbar.ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        elif log:
            colorbar.ax.yaxis.set_major_locator(ticker.LogLocator())
            colorbar.ax.yaxis.set_major_formatter(ticker.LogFormatterSciNotation())
        if title:
            fig.suptitle(title)
        if len({note for _, note in notes}) == 1:
            notes = [("", notes[0][1] + (" (every panel)" if len(surfaces) > 1 else ""))]
        text = "\n".join([*([caption] if caption else []), "; ".join(f"{n}: {t}" if n else t for n, t in notes)])
        text = text.strip()
        if text:
            add_caption(fig, text)
    return fig


def line_figure(
    surfaces: Sequence[Surface],
    labels: Sequence[str] | None = None,
    log: bool | str = False,
    title: str | None = None,
    size: tuple[float, float] = (5.0, 3.4),
    marks: Sequence[tuple[float, str]] = (),
    caption: str | None = None,
) -> Figure:
    """Lines on one axes (flatness paper Fig. 2 style); accuracy is drawn only for a single line.

    ``log="auto"``: a logarithmic loss axis where the losses are positive and span more than two decades.
    ``marks``: ``(x, name)`` pairs drawn as dotted vertical lines named on a top axis (two checkpoints).
    ``caption``: text under the axes (provenance, notes).
    """
    if not surfaces or any(not s.is_line for s in surfaces):
        raise ValueError("line_figure draws lines; use surface_figure for 2-D surfaces")
    log = resolve_log(log, surfaces)
    with mpl.rc_context(STYLE):
        fig = Figure(figsize=(size[0], size[1] + (0.4 if caption else 0)), layout="constrained")
        ax = fig.add_subplot()
        for i, s in enumerate(surfaces):
            draw_line(ax, s, log=log, accuracy=len(surfaces) == 1, color=f"C{i}" if len(surfaces) > 1 else "C0",
                      label=None if labels is None else labels[i])  # fmt: skip
        if labels is not None:
            ax.legend()
        if marks:
            for x, _ in marks:
                ax.axvline(x, color="0.5", lw=0.8, ls=":")
            top = ax.secondary_xaxis("top")
            top.set_xticks([x for x, _ in marks], [name for _, name in marks], fontsize=7, color="0.3")
        if title:
            ax.set_title(title)
        if caption:
            add_caption(fig, caption)
    return fig


def save_figure(
    fig: Figure,
    stem: str | os.PathLike,
    formats: Sequence[str] = ("png",),
    dpi: int = 200,
    title: str | None = None,
    description: str = "",
) -> list[Path]:
    """Write ``STEM.<format>`` for each format (PNG at ``dpi``; PDF/SVG vector), each atomically.

    ``title`` (default: the figure's suptitle, or its first axes' title) and ``description`` (provenance:
    model, data, measure, the figure of the paper it reproduces) go into each file's metadata.
    """
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise ValueError(f"unknown figure format {bad[0]!r}; choose from {', '.join(FORMATS)}")
    if title is None:
        suptitle = fig.get_suptitle() if hasattr(fig, "get_suptitle") else ""
        title = suptitle or next((ax.get_title() for ax in fig.axes if ax.get_title()), "")
    title = " ".join(title.split())
    stem = Path(stem)
    paths = []
    with mpl.rc_context(STYLE):
        about = "; ".join(" ".join(line.split()) for line in description.splitlines() if line.strip())
        for fmt in formats:
            path = stem.with_name(f"{stem.name}.{fmt}")
            write_atomic(path, figure_bytes(fig, fmt, dpi, title, about, software="landscape (matplotlib)"))
            paths.append(path)
    return paths
