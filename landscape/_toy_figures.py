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

TITLE_A_SHORT = "network a: y = relu(w)"
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


def _code_contourf(ax, s: Surface):
    """Filled contours as the thesis code draws them (``levels=25``, magma); the levels are kept in ``s.extras``."""
    filled = ax.contourf(s.x, s.y, s.loss, levels=toys.CODE_LEVELS, cmap=toys.CODE_CMAP, rasterized=True)
    s.extras["contour_levels"] = np.asarray(filled.levels, dtype=float)
    ax.set_xlabel(s.x_label)
    ax.set_ylabel(s.y_label)
    ax.set_aspect("equal")
    return filled


def _fig_1_5(steps: int | None, source: str) -> tuple[Figure, list[Surface], go.Figure]:
    curve, plane = toys.fig_1_5_surfaces(steps, source)
    code = source == "code"
    norm = shared_norm([plane])
    with mpl.rc_context(STYLE):
        fig = Figure(figsize=(8.4 if code else 11.0, 3.6), layout="constrained")
        ax = fig.add_subplot(1, 2 if code else 3, 1)
        draw_line(ax, curve, color="#231152" if code else "k", mark_center=False)
        ax.axvspan(curve.x[0], 0, color="0.9", zorder=0)
        ax.text(curve.x[0] / 2, 0.6, "relu(w) = 0", ha="center", fontsize=8, color="0.35")
        ax.set_title(TITLE_A_SHORT)
        ax2 = fig.add_subplot(1, 2 if code else 3, 2)
        if code:
            m = _code_contourf(ax2, plane)
            ax2.set_title(plane.title)
            fig.colorbar(m, ax=ax2, shrink=0.85, label=plane.z_label, ticks=[-1, 0, 1])
        else:
            m = draw_contour(ax2, plane, norm, CMAP, LEVELS, label_levels=False)
            ax2.set_aspect("equal")
            ax3 = fig.add_subplot(1, 3, 3, projection="3d")
            draw_surface3d(ax3, plane, norm, CMAP)
            fig.colorbar(m, ax=[ax2, ax3], shrink=0.85, label=plane.z_label)
        fig.suptitle("Thesis Fig. 1.5: loss L = sin(y) of the 1- and 2-parameter networks (x = 1; no weight fixed)")
    html = plotly_figure([plane], title="Fig. 1.5 b: " + plane.title + ", L = sin(y)")
    return fig, [curve, plane], html


def _fig_1_6(steps: int | None, source: str) -> tuple[Figure, list[Surface], go.Figure]:
    s = toys.fig_1_6_surface(steps, source)
    code = source == "code"
    pts, grads = s.extras["arrow_points"], s.extras["arrow_vector"]
    arrows = "∇L" if source == "text" else "−∇(0.1 w₁w₂)"
    lo, hi = float(s.x[0]), float(s.x[-1])
    # the code draws its arrows at scale 1 (lengths in axis units); the text's on one common scale, the
    # longest 0.9 axis units, so their lengths compare
    scale = 1.0 if code else float(np.linalg.norm(grads, axis=1).max()) / 0.9
    levels = s.extras["invariant_levels"]
    lines = [(_hyperbola(c, hi), f"w₁w₂ = {c:.4g}") for c in levels]
    norm = shared_norm([s])
    with mpl.rc_context(STYLE):
        fig = Figure(figsize=(6.4, 6.4 if code else 5.6), layout="constrained")
        ax = fig.add_subplot()
        if code:
            # exactly the code's lines: the zero contour of sin(0.5 w1 w2) on its grid
            ax.contour(s.x, s.y, s.extras["line_field"], levels=s.extras["line_levels"], colors="lightgray",
                       linewidths=1)  # fmt: skip
            ax.plot([], [], color="lightgray", lw=1, label="w₁w₂ = 2πk, k = 1..15: the zero lines of sin(0.5 w₁w₂)")
        else:
            m = draw_contour(ax, s, norm, CMAP, LEVELS, label_levels=False)
            ax.axvspan(lo, 0, color="w", alpha=0.45, zorder=2)
            ax.text(lo / 2, hi * 0.55, "w₁ ≤ 0: relu(w₁) = 0,\nso y = 0 on the whole\nhalf-plane", ha="center",
                    va="center", fontsize=8.5, zorder=3)  # fmt: skip
            for (line, name), color in zip(lines, _level_colors(len(lines))):
                ax.plot(line[:, 0], line[:, 1], color=color, lw=2.0, zorder=3, label=f"invariant line {name}")
        ax.quiver(pts[:, 0], pts[:, 1], grads[:, 0], grads[:, 1], angles="xy", scale_units="xy", scale=scale,
                  width=0.006 if code else 0.0055, color="k", zorder=5,
                  label=f"{arrows} " + ("at scale 1, on the grid of spacing 2" if code else "(common scale)"))
        if code:
            ax.set_xlabel(s.x_label)
            ax.set_ylabel(s.y_label)
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False)
        else:
            ax.plot(pts[:, 0], pts[:, 1], "o", color="k", ms=2.5, zorder=6)
            ax.legend(loc="lower left", framealpha=0.95).set_zorder(7)
            fig.colorbar(m, ax=ax, shrink=0.75, label=s.z_label)
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_aspect("equal")
        ax.set_title(
            "Thesis Fig. 1.6: invariant lines of y = w₂·relu(w₁), L = sin(y)\n"
            + ("arrows ∇L" if source == "text" else "arrows −∇(0.1 w₁w₂) (thesis code), parallel to ∇L")
            + "; rescaling by α scales them by (1/α, α)"
        )
    overlay = Overlay(
        lines=lines, arrow_points=pts, arrow_vectors=grads / scale,
        notes=[] if code else [(lo / 2, hi * 0.55, "w₁ ≤ 0: y = 0")],
    )  # fmt: skip
    title = f"Fig. 1.6: invariant lines and the arrows {arrows} ({toys.SOURCE_LABELS[source]})"
    if code:
        title += "; the code draws no loss, shown here for reference"
    html = plotly_figure([s], title=title, overlays={0: overlay})
    return fig, [s], html


def _fig_4_9_code(surfaces: list[Surface], title: str) -> Figure:
    """Fig. 4.9 as the thesis code draws it: (a) filled contours at 25 levels, (b)-(d) continuous colours."""
    norm = mpl.colors.Normalize(-1.0, 1.0)
    with mpl.rc_context(STYLE):
        fig = Figure(figsize=(3.3 * len(surfaces) + 0.9, 4.9), layout="constrained")
        axes = [fig.add_subplot(1, len(surfaces), i + 1) for i in range(len(surfaces))]
        _code_contourf(axes[0], surfaces[0])
        for ax, s in zip(axes[1:], surfaces[1:]):
            m = ax.pcolormesh(s.x, s.y, s.loss, norm=norm, cmap=toys.CODE_CMAP, shading="nearest", rasterized=True)
            ax.set_xlabel(s.x_label)
            ax.set_ylabel(s.y_label)
            ax.set_aspect("equal")
        for ax, s, name in zip(axes, surfaces, "abcdefghij"):
            ax.set_title(f"({name}) {s.metadata['function'].replace('relu', 'σ')}", fontsize=8.5)
        fig.colorbar(m, ax=axes, shrink=0.85, aspect=30, pad=0.02, label="L", ticks=[-1, 0, 1])
        fig.suptitle(title)
    return fig


def _fig_4_9(steps: int | None, fixed: Sequence[float], source: str) -> tuple[Figure, list[Surface], go.Figure]:
    surfaces = toys.fig_4_9_surfaces(fixed, steps, source)
    lo, hi = toys.window_4_9(source)
    loss = "L = sin(y) in (a), sin(0.3·y) in (b)-(d)" if source == "code" else surfaces[0].z_label
    title = (
        f"Thesis Fig. 4.9 ({toys.SOURCE_LABELS[source]}): {loss}, x₁ = x₂ = 1, weights in "
        f"[{lo:g}, {hi:g}]; network b′: y = w₃·relu(w₁ + w₂) over (w₂, w₃)\n{READING_A}"
    )
    if source == "code":
        fig = _fig_4_9_code(surfaces, title)
    else:
        fig = surface_figure(
            surfaces, kinds=("contour", "surface"), cmap=CMAP, title=title, panel_size=(3.3, 3.1), levels=LEVELS,
            label_levels=False, panel_titles=[s.title.split("\n")[0] for s in surfaces],  # the reading: in the title
        )  # fmt: skip
    html = plotly_figure(surfaces, title=title)
    return fig, surfaces, html


def _gspace_1_5(steps: int | None) -> tuple[Figure, list[Surface], go.Figure]:
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


def _gspace_4_9(steps: int | None, fixed: Sequence[float], source: str) -> tuple[Figure, list[Surface], go.Figure]:
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
    steps: int | None = None,
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
        steps: grid points per axis of each surface (default: the thesis code's 200 for ``source="code"``,
            201 for ``"text"``).
        source: ``"code"`` (the default: what the thesis's plotting code draws, on its windows and grids) or
            ``"text"`` (the thesis text's definitions, with the choices it leaves open stated in the caption)
            for the thesis's figures ``"1.5"``, ``"1.6"``, ``"4.9"`` and the chart ``"gspace-4.9"`` (see
            `landscape._toys`); ``"gspace-1.5"`` is the toolkit's own and takes ``"text"`` or ``None``.
        html_js: where the HTML page gets plotly.js (``"directory"``, ``"inline"``, ``"cdn"``; see
            `landscape.write_html`).
        shared_folder: with ``"directory"``, a folder whose ``plotly.min.js`` pages of several folders share
            (see `landscape.write_html`; ``None``: beside the page).

    Returns:
        The written paths: figures, ``<stem>.html`` (interactive, offline) and ``.npz`` + ``.json``
            per surface (arrays ``x``, ``y``, ``loss``; fixed-weight panels also ``fixed``; with ``source="code"``
            the filled-contour panels 1.5 (b) and 4.9 (a) also ``contour_levels``, the code's 25 automatic levels).
    """
    if name not in TOY_FIGURES:
        raise ValueError(f"unknown toy figure {name!r}; choose one of {', '.join(TOY_FIGURES)}")
    fixed = tuple(float(b) for b in fixed)
    source = toys.check_source(name, source)
    builders = {
        "1.5": lambda: _fig_1_5(steps, source),
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
    label = toys.SOURCE_LABELS[source]
    described = {"gspace-1.5": thesis, "gspace-4.9": f"{thesis}, from Fig. 4.9 {label}"}
    description = described.get(name, f"{thesis}; {label}")
    note = toys.NOTES.get(name, {}).get(source)
    add_caption(fig, f"After {description}." + (f"\n{note[0].upper()}{note[1:]}." if note else ""))
    paths = save_figure(fig, stem, formats, description=description)
    paths += write_html(html, stem.with_name(stem.name + ".html"), html_js, meta={"source": description},
                        shared_folder=shared_folder)  # fmt: skip
    for s, surface_stem in zip(surfaces, _surface_stems(name, fixed)):
        paths.extend(s.save(out / surface_stem))
    return paths
