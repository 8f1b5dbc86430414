"""The thesis's toy figures drawn and written to disk: PNG (+ PDF/SVG), interactive HTML, one ``.npz`` per surface."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import matplotlib as mpl
import numpy as np
import plotly.graph_objects as go
from matplotlib.figure import Figure

from landscape import _toys as toys
from landscape._plot_mpl import (
    STYLE,
    add_caption,
    draw_contour,
    draw_line,
    draw_surface3d,
    save_figure,
    shared_norm,
    surface_figure,
)
from landscape._plot_plotly import Overlay, plotly_figure, write_html
from landscape._surface import Surface

TOY_FIGURES = ("1.5", "1.6", "4.9", "gspace-1.5", "gspace-4.9")
CMAP = "RdBu_r"  # L = sin(y) takes both signs

THESIS = "C. Jestädt, Scale invariant parameter spaces for ReLU networks (bachelor thesis, Tübingen, 2025)"
READING_A = "reading (a): w₁ is set to each value, the network function changes with it"


def _hyperbola(c: float, lim: float, n: int = 400) -> np.ndarray:
    """The branch ``w1 > 0`` of ``w1 w2 = c`` inside the square ``[-lim, lim]^2``, ``(n, 2)``."""
    w1 = np.geomspace(abs(c) / lim, lim, n)
    return np.stack([w1, c / w1], axis=-1)


def _level_colors(n: int) -> list:
    return [mpl.colormaps["Dark2"](i) for i in range(n)]


# sin(y) lies in [-1, 1]: 0.2-spaced levels keep the stripes readable
LEVELS = np.linspace(-1.0, 1.0, 11)


def _fig_1_5(steps: int) -> tuple[Figure, list[Surface], go.Figure]:
    curve, plane = toys.fig_1_5_surfaces(steps)
    norm = shared_norm([plane])
    with mpl.rc_context(STYLE):
        fig = Figure(figsize=(11.0, 3.4), layout="constrained")
        ax = fig.add_subplot(1, 3, 1)
        draw_line(ax, curve, color="k", mark_center=False)
        ax.axvspan(curve.x[0], 0, color="0.9", zorder=0)
        ax.text(curve.x[0] / 2, 0.6, "relu(w) = 0", ha="center", fontsize=8, color="0.35")
        ax2 = fig.add_subplot(1, 3, 2)
        m = draw_contour(ax2, plane, norm, CMAP, LEVELS, label_levels=False)
        ax2.set_aspect("equal")
        ax3 = fig.add_subplot(1, 3, 3, projection="3d")
        draw_surface3d(ax3, plane, norm, CMAP)
        fig.colorbar(m, ax=[ax2, ax3], shrink=0.85, label=plane.z_label)
        fig.suptitle("Thesis Fig. 1.5: loss L = sin(y) of the 1- and 2-parameter networks (x = 1; no weight fixed)")
    html = plotly_figure([plane], title="Fig. 1.5 b: " + plane.title + ", L = sin(y)")
    return fig, [curve, plane], html


def _fig_1_6(steps: int, source: str) -> tuple[Figure, list[Surface], go.Figure]:
    s = toys.fig_1_6_surface(steps, source)
    pts, grads = s.extras["arrow_points"], s.extras["arrow_vector"]
    arrows = "∇L" if source == "text" else "−∇(0.1 w₁w₂)"
    lim = float(s.x[-1])
    # one common scale for all arrows, so their lengths compare: the longest is 0.9 axis units
    scale = float(np.linalg.norm(grads, axis=1).max()) / 0.9
    lines = [(_hyperbola(c, lim), f"w₁w₂ = {c:g}") for c in s.extras["invariant_levels"]]
    norm = shared_norm([s])
    with mpl.rc_context(STYLE):
        fig = Figure(figsize=(6.4, 5.6), layout="constrained")
        ax = fig.add_subplot()
        m = draw_contour(ax, s, norm, CMAP, LEVELS, label_levels=False)
        ax.axvspan(-lim, 0, color="w", alpha=0.45, zorder=2)
        ax.text(-lim / 2, lim * 0.55, "w₁ ≤ 0: relu(w₁) = 0,\nso y = 0 on the whole\nhalf-plane", ha="center",
                va="center", fontsize=8.5, zorder=3)  # fmt: skip
        for (line, name), color in zip(lines, _level_colors(len(lines))):
            ax.plot(line[:, 0], line[:, 1], color=color, lw=2.0, zorder=3, label=f"invariant line {name}")
        ax.quiver(pts[:, 0], pts[:, 1], grads[:, 0], grads[:, 1], angles="xy", scale_units="xy", scale=scale,
                  width=0.0055, color="k", zorder=5, label=f"{arrows} (common scale)")  # fmt: skip
        ax.plot(pts[:, 0], pts[:, 1], "o", color="k", ms=2.5, zorder=6)
        ax.legend(loc="lower left", framealpha=0.95).set_zorder(7)
        ax.set_xlim(-lim, lim)
        ax.set_ylim(-lim, lim)
        ax.set_aspect("equal")
        ax.set_title(
            "Thesis Fig. 1.6: invariant lines of y = w₂·relu(w₁), L = sin(y)\n"
            + ("arrows ∇L" if source == "text" else "arrows −∇(0.1 w₁w₂) (thesis code), parallel to ∇L")
            + "; rescaling by α scales them by (1/α, α)"
        )
        fig.colorbar(m, ax=ax, shrink=0.75, label=s.z_label)
    overlay = Overlay(
        lines=lines, arrow_points=pts, arrow_vectors=grads / scale,
        notes=[(-lim / 2, lim * 0.55, "w₁ ≤ 0: y = 0")],
    )  # fmt: skip
    html = plotly_figure([s], title=f"Fig. 1.6: invariant lines and the arrows {arrows} ({toys.SOURCE_LABELS[source]})",
                         overlays={0: overlay})
    return fig, [s], html


def _fig_4_9(steps: int, fixed: Sequence[float], source: str) -> tuple[Figure, list[Surface], go.Figure]:
    surfaces = toys.fig_4_9_surfaces(fixed, steps, source)
    lo, hi = toys.window_4_9(source)
    title = (
        f"Thesis Fig. 4.9 ({toys.SOURCE_LABELS[source]}): {surfaces[0].z_label}, x₁ = x₂ = 1, weights in "
        f"[{lo:g}, {hi:g}]; network b′: y = w₃·relu(w₁ + w₂) over (w₂, w₃)\n{READING_A}"
    )
    fig = surface_figure(
        surfaces, kinds=("contour", "surface"), cmap=CMAP, title=title, panel_size=(3.3, 3.1), levels=LEVELS,
        label_levels=False, panel_titles=[s.title.split("\n")[0] for s in surfaces],  # the reading: in the title
    )  # fmt: skip
    html = plotly_figure(surfaces, title=title)
    return fig, surfaces, html


def _gspace_1_5(steps: int) -> tuple[Figure, list[Surface], go.Figure]:
    plane, pos, neg = toys.gspace_b_surfaces(steps)
    lim = float(plane.x[-1])
    levels = toys.FIG_1_6_LEVELS
    colors = _level_colors(len(levels))
    norm = shared_norm([plane])
    with mpl.rc_context(STYLE):
        fig = Figure(figsize=(11.0, 4.2), layout="constrained")
        fig.get_layout_engine().set(wspace=0.08)
        ax = fig.add_subplot(1, 2, 1)
        m = draw_contour(ax, plane, norm, CMAP, LEVELS, label_levels=False)
        for c, color in zip(levels, colors):
            line = _hyperbola(c, lim)
            ax.plot(line[:, 0], line[:, 1], color=color, lw=2.0, label=f"v = {c:g}")
        ax.legend(loc="lower left", title="line w₁w₂ = v", framealpha=0.95)
        ax.set_aspect("equal")
        fig.colorbar(m, ax=ax, shrink=0.85, label=plane.z_label)
        ax2 = fig.add_subplot(1, 2, 2)
        draw_line(ax2, pos, color="k", mark_center=False, label="w₂ > 0: sin(relu(v)) = network a (Fig. 1.5 a)")
        ax2.plot(neg.x, neg.loss, color="0.5", lw=1.2, ls="--", label="w₂ < 0: sin(−relu(−v))")
        for c, color in zip(levels, colors):
            ax2.plot([c], toys.loss_b_gspace(c, np.sign(c)).numpy(), "o", color=color, ms=7, zorder=5)
        ax2.set_title("G-space: each invariant line is one point v (dots, same colors)")
        ax2.set_ylim(-1.15, 1.65)
        ax2.legend(loc="upper left")
        fig.suptitle(
            "Network b (y = w₂·relu(w₁), L = sin(y)) in weight space and in G-space: basis-path value v = w₁w₂, "
            "skeleton weight w₂ (no weight fixed)"
        )
    html = plotly_figure([plane], title="Network b in weight space; lines of constant v = w₁w₂",
                         overlays={0: Overlay(lines=[(_hyperbola(c, lim), f"v = {c:g}") for c in levels])})  # fmt: skip
    return fig, [plane, pos, neg], html


def _gspace_4_9(steps: int, fixed: Sequence[float], source: str) -> tuple[Figure, list[Surface], go.Figure]:
    (s,) = toys.gspace_4_9_surfaces(fixed, steps, source)
    lo, hi = toys.window_4_9(source)
    outlines = [(s.extras[f"outline_{i}"], f"plane w₁ = {b:g}") for i, b in enumerate(fixed)]
    zoom = toys.gspace_4_9_window(steps, source)
    norm = shared_norm([s])
    colors = _level_colors(len(outlines))
    with mpl.rc_context(STYLE):
        fig = Figure(figsize=(11.0, 4.6), layout="constrained")
        ax = fig.add_subplot(1, 2, 1)
        m = draw_contour(ax, s, norm, CMAP, LEVELS, label_levels=False)
        for (line, name), color in zip(outlines, colors):
            ax.plot(line[:, 0], line[:, 1], color=color, lw=2.2, label=name)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=len(outlines), frameon=False,
                  title=f"image of the window w₂, w₃ ∈ [{lo:g}, {hi:g}] of the fixed-w₁ plane")  # fmt: skip
        ax.set_title(
            f"G-space: one surface {toys.gspace_4_9_loss(source)} for every w₁;\n"
            "each fixed-w₁ plane covers a distorted piece"
        )
        ax2 = fig.add_subplot(1, 2, 2)
        draw_contour(ax2, zoom, norm, CMAP, LEVELS)
        ax2.set_aspect("equal")
        fig.colorbar(m, ax=[ax, ax2], shrink=0.85, label=s.z_label)
        fig.suptitle(
            "Fig. 4.9's network b′ (y = w₃·relu(w₁ + w₂)) in G-space: v₁ = w₁w₃, v₂ = w₂w₃, skeleton weight w₃ > 0\n"
            f"(no weight fixed; Fig. 4.9 {toys.SOURCE_LABELS[source]})"
        )
    html = plotly_figure([s], title=s.title, overlays={0: Overlay(lines=outlines)})
    return fig, [s, zoom], html


def _surface_stems(name: str, fixed: Sequence[float]) -> list[str]:
    if name == "1.5":
        return ["fig1_5_a", "fig1_5_b"]
    if name == "1.6":
        return ["fig1_6_b"]
    if name == "4.9":
        return ["fig4_9_a"] + [f"fig4_9_b_fixed{b:g}" for b in fixed]
    if name == "gspace-1.5":
        return ["gspace1_5_weights", "gspace1_5_v_pos", "gspace1_5_v_neg"]
    return ["gspace4_9", "gspace4_9_window"]


def toy_figure(
    name: str,
    out: str | os.PathLike,
    fixed: Sequence[float] = toys.FIG_4_9_FIXED,
    formats: Sequence[str] = ("png",),
    steps: int = 201,
    source: str | None = None,
    html_js: str = "directory",
    shared_folder: str | os.PathLike | None = None,
) -> list[Path]:
    """Compute, draw and write one toy figure.

    Args:
        name: ``"1.5"``, ``"1.6"``, ``"4.9"``, ``"gspace-1.5"`` (network b in G-space) or
            ``"gspace-4.9"`` (Fig. 4.9's network b in G-space).
        out: output folder (created if missing).
        fixed: the values of ``w1`` for Fig. 4.9 (and the planes outlined in ``gspace-4.9``).
        formats: figure formats among ``png``, ``pdf``, ``svg``.
        steps: grid points per axis of each surface.
        source: ``"code"`` (the printed figure, the default) or ``"text"`` for the figures whose thesis
            code differs from the thesis text (``"1.6"``, ``"4.9"``, ``"gspace-4.9"``; see
            :mod:`landscape._toys`); the other figures have one definition and take ``"text"`` or ``None``.
        html_js: where the HTML page gets plotly.js (``"directory"``, ``"inline"``, ``"cdn"``; see
            :func:`landscape.write_html`).
        shared_folder: with ``"directory"``, a folder whose ``plotly.min.js`` pages of several folders share
            (see :func:`landscape.write_html`; ``None``: beside the page).

    Returns:
        The written paths: figures, ``<stem>.html`` (interactive, offline) and ``.npz`` + ``.json``
        per surface (arrays ``x``, ``y``, ``loss``; fixed-weight panels also ``fixed``).
    """
    if name not in TOY_FIGURES:
        raise ValueError(f"unknown toy figure {name!r}; choose one of {', '.join(TOY_FIGURES)}")
    fixed = tuple(float(b) for b in fixed)
    source = toys.check_source(name, source)
    builders = {
        "1.5": lambda: _fig_1_5(steps),
        "1.6": lambda: _fig_1_6(steps, source),
        "4.9": lambda: _fig_4_9(steps, fixed, source),
        "gspace-1.5": lambda: _gspace_1_5(steps),
        "gspace-4.9": lambda: _gspace_4_9(steps, fixed, source),
    }
    fig, surfaces, html = builders[name]()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / ("fig" + name.replace(".", "_") if name[0].isdigit() else name.replace("-", "").replace(".", "_"))
    figure = name.replace("gspace-", "")
    thesis = f"{THESIS}, Fig. {figure}" + (" redrawn in G-space coordinates" if name.startswith("gspace") else "")
    description = f"{thesis}; {toys.SOURCE_LABELS[source]}" if source in toys.SOURCE_LABELS else thesis
    add_caption(fig, f"After {description}.")
    paths = save_figure(fig, stem, formats, description=description)
    paths += write_html(html, stem.with_name(stem.name + ".html"), html_js, meta={"source": description},
                        shared_folder=shared_folder)  # fmt: skip
    for s, surface_stem in zip(surfaces, _surface_stems(name, fixed)):
        paths.extend(s.save(out / surface_stem))
    return paths
