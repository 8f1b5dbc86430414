"""An automatic reviewer of matplotlib figures: no clipped or overlapping text, no linear axis over decades.

[`layout_problems`][landscape.layout_problems] draws a figure and lists, one sentence each,

* every visible text (titles, suptitle, axis and tick labels, colour-bar labels, contour labels,
  legends, annotations, 3-D axis labels, offset texts) that reaches beyond the figure's edge, and
  every clipped text (contour labels) that reaches beyond its clip box (the axes);
* every pair of visible texts whose boxes overlap by more than ``tolerance`` pixels both ways
  (texts that merely touch pass);
* every axis with a linear scale (x, y, z of 3-D axes, and colour bars or colour-mapped data with a
  linear norm) whose non-negative data span more than ``max_decades`` decades: the small values
  would be drawn as zero next to the large ones, and a logarithmic scale shows them.

Only what a draw really renders is checked (tick labels outside the view are not drawn), and the
boxes are the renderer's window extents at the figure's own dpi. [`check_layout`][landscape.check_layout] raises
[`LayoutError`][landscape.LayoutError] listing every problem; the tests run it on every figure the toolkit writes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import numpy as np
from matplotlib import colors
from matplotlib.axes import Axes
from matplotlib.collections import Collection
from matplotlib.contour import ContourSet
from matplotlib.figure import Figure
from matplotlib.image import AxesImage
from matplotlib.patches import Rectangle
from matplotlib.text import Text


class LayoutError(AssertionError):
    """A figure a reviewer would send back: clipped or overlapping text, or a linear axis over decades."""


@contextlib.contextmanager
def _recording_texts() -> Iterator[list[Text]]:
    """Record every `Text` whose ``draw`` runs with something to show (visible, non-empty)."""
    drawn: list[Text] = []
    original = Text.draw

    def draw(self, renderer):
        if self.get_visible() and self.get_text().strip() and self not in drawn:
            drawn.append(self)
        return original(self, renderer)

    Text.draw = draw
    try:
        yield drawn
    finally:
        Text.draw = original


def _draw(fig: Figure):
    """Draw ``fig`` with an Agg renderer (attached if the figure has none) and return the renderer."""
    if not hasattr(fig.canvas, "get_renderer"):
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(fig)
    fig.canvas.draw()
    return fig.canvas.get_renderer()


def _name(text: Text) -> str:
    """``'...'`` with the text's role where it is known, for a readable problem sentence."""
    content = " ".join(text.get_text().split())
    content = content if len(content) <= 40 else content[:37] + "..."
    role = "text"
    fig = text.get_figure(root=True)
    if fig is not None and text is getattr(fig, "_suptitle", None):
        role = "suptitle"
    for ax in fig.axes if fig is not None else ():
        if text in (ax.title, getattr(ax, "_left_title", None), getattr(ax, "_right_title", None)):
            role = "title"
        for letter in "xyz":
            axis = getattr(ax, f"{letter}axis", None)
            if axis is None:
                continue
            if text is axis.label:
                role = f"{letter}-axis label"
            elif text is axis.get_offset_text():
                role = f"{letter}-axis offset text"
            elif any(text in (t.label1, t.label2) for t in axis.get_major_ticks() + axis.get_minor_ticks()):
                role = f"{letter} tick label"
    return f"{role} {content!r}"


def _corners(text: Text, box, renderer) -> np.ndarray:
    """The text's box as four corners ``(4, 2)`` in pixels: rotated texts (3-D axis labels, vertical
    labels at an angle) get their rotated rectangle, not the larger axis-aligned box around it. The
    axis-aligned box of a rotated rectangle has the rectangle's centre, so only the unrotated size is needed."""
    angle = text.get_rotation() % 180.0
    if min(angle % 90.0, 90.0 - angle % 90.0) < 0.5:  # horizontal or vertical: the box is exact
        return np.array([[box.x0, box.y0], [box.x1, box.y0], [box.x1, box.y1], [box.x0, box.y1]])
    rotation = text.get_rotation()
    text.set_rotation(0)
    try:
        flat = text.get_window_extent(renderer)
    finally:
        text.set_rotation(rotation)
    w, h = flat.width / 2, flat.height / 2
    c, s = math.cos(math.radians(rotation)), math.sin(math.radians(rotation))
    local = np.array([[-w, -h], [w, -h], [w, h], [-w, h]])
    return local @ np.array([[c, s], [-s, c]]) + [(box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2]


def _overlap(a: np.ndarray, b: np.ndarray) -> float:
    """How far two convex quadrilaterals overlap: the smallest overlap of their projections on the four
    edge normals (separating axis theorem); 0 or less when they are apart."""
    depth = math.inf
    for quad in (a, b):
        for k in range(2):
            edge = quad[k + 1] - quad[k]
            normal = np.array([-edge[1], edge[0]]) / (np.hypot(*edge) or 1.0)
            pa, pb = a @ normal, b @ normal
            depth = min(depth, min(pa.max(), pb.max()) - max(pa.min(), pb.min()))
    return depth


def _decades(values: np.ndarray, quantile: float = 0.0) -> float:
    """Decades spanned by non-negative data: ``log10(max / q)`` with ``q`` the smallest positive value (or
    its ``quantile``: for coordinates, where a grid point next to 0 is not data spanning decades); 0 for
    signed data."""
    values = np.asarray(values, dtype=float).ravel()
    values = values[np.isfinite(values)]
    if values.size == 0 or values.min() < 0 or values.max() <= 0:
        return 0.0
    positive = values[values > 0]
    return math.log10(positive.max() / np.quantile(positive, quantile))


def _in_view(values: np.ndarray, other: np.ndarray, lim: tuple[float, float] | None) -> np.ndarray:
    """``values`` at the points whose other coordinate lies in ``lim`` (``None``: all)."""
    if lim is None:
        return values
    lo, hi = min(lim), max(lim)
    keep = (other >= lo) & (other <= hi)
    return values[keep]


def _axis_data(ax: Axes) -> dict[str, list[np.ndarray]]:
    """The data drawn on each coordinate axis of ``ax`` (lines, bars, scatter points) within its view."""
    data: dict[str, list[np.ndarray]] = {"x": [], "y": []}
    xlim, ylim = ax.get_xlim(), ax.get_ylim()
    for line in ax.get_lines():
        if not line.get_visible():
            continue
        x = np.asarray(line.get_xdata(), dtype=float)
        y = np.asarray(line.get_ydata(), dtype=float)
        if x.shape != y.shape or x.size < 2:
            continue  # axhline/axvline and markers carry no range of data
        data["x"].append(_in_view(x, y, ylim))
        data["y"].append(_in_view(y, x, xlim))
    bars = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_visible()]
    if bars:
        data["y"].append(np.array([p.get_y() + p.get_height() for p in bars]))
    return data


def _colour_data(mappable) -> np.ndarray | None:
    """The data a colour-mapped artist shows: a contour set's range (its array holds only the levels),
    otherwise its array."""
    if isinstance(mappable, ContourSet):
        return np.array([mappable.zmin, mappable.zmax], dtype=float)
    array = mappable.get_array() if hasattr(mappable, "get_array") else None
    if array is None or np.size(array) < 2:
        return None
    return np.ma.filled(np.ma.asarray(array, dtype=float), np.nan)


def _mappables(ax: Axes) -> Iterator[tuple[object, np.ndarray]]:
    for artist in [*ax.collections, *ax.images]:
        if isinstance(artist, (Collection, AxesImage)) and artist.get_visible() and artist.get_cmap() is not None:
            data = _colour_data(artist)
            if data is not None:
                yield artist, data


def _linear_norm(norm) -> bool:
    return type(norm) in (colors.Normalize, colors.TwoSlopeNorm, colors.CenteredNorm)


def _scale_problems(fig: Figure, max_decades: float) -> list[str]:
    problems = []
    for k, ax in enumerate(fig.axes):
        where = f"axes {k}" + (f" ({ax.get_title()!r})" if ax.get_title() else "")
        colorbar = getattr(ax, "_colorbar", None)
        if colorbar is not None:
            mappable = colorbar.mappable
            data = _colour_data(mappable)
            if data is not None and _linear_norm(mappable.norm):
                span = _decades(data)
                if span > max_decades:
                    problems.append(f"the colour bar of {where} has a linear scale over {span:.1f} decades of data")
            continue
        for letter, values in _axis_data(ax).items():
            if not values or getattr(ax, f"get_{letter}scale")() != "linear":
                continue
            span = _decades(np.concatenate(values), 0.01 if letter == "x" else 0.0)
            if span > max_decades:
                problems.append(f"the {letter} axis of {where} has a linear scale over {span:.1f} decades of data")
        if ax.name == "3d" and ax.get_zscale() == "linear" and ax.has_data():
            span = _decades(np.array(ax.zz_dataLim.intervalx))
            if span > max_decades:
                problems.append(f"the z axis of {where} is linear over {span:.1f} decades of data")
        for artist, array in _mappables(ax):
            span = _decades(array) if _linear_norm(artist.norm) else 0.0
            if span > max_decades:
                problems.append(f"the colour scale of {where} is linear over {span:.1f} decades of data")
    return problems


def layout_problems(fig: Figure, tolerance: float = 1.0, max_decades: float = 3.0) -> list[str]:
    """What a reviewer would send back about ``fig``, one sentence per problem (empty: none).

    Args:
        fig: a matplotlib figure; it is drawn (with an Agg canvas if it has none).
        tolerance: pixels (at the figure's dpi) by which texts may overlap each other or the edge.
        max_decades: the most decades of non-negative data a linear scale may span.

    Returns:
        Sentences naming each clipped text, each overlapping pair and each linear axis over decades.
    """
    with _recording_texts() as drawn:
        renderer = _draw(fig)
    edge = fig.bbox
    boxes = [(t, t.get_window_extent(renderer)) for t in drawn]
    problems = []
    for text, box in boxes:
        beyond = {
            "left": edge.x0 - box.x0, "right": box.x1 - edge.x1, "bottom": edge.y0 - box.y0, "top": box.y1 - edge.y1,
        }  # fmt: skip
        sides = [f"{side} by {px:.0f} px" for side, px in beyond.items() if px > tolerance]
        if sides:
            problems.append(f"{_name(text)} is clipped at the figure's {', '.join(sides)}")
        clip = text.get_clip_box() if text.get_clip_on() else None
        if clip is not None and not sides:  # contour labels, clipped annotations: cut at their axes' edge
            cut = max(clip.x0 - box.x0, box.x1 - clip.x1, clip.y0 - box.y0, box.y1 - clip.y1)
            if cut > tolerance:
                problems.append(f"{_name(text)} is cut at the edge of its axes by {cut:.0f} px")
    quads = [_corners(t, box, renderer) for t, box in boxes]
    for i, (a, box_a) in enumerate(boxes):
        for j in range(i + 1, len(boxes)):
            b, box_b = boxes[j]
            if box_a.x1 < box_b.x0 or box_b.x1 < box_a.x0 or box_a.y1 < box_b.y0 or box_b.y1 < box_a.y0:
                continue
            depth = _overlap(quads[i], quads[j])
            if depth > tolerance:
                problems.append(f"{_name(a)} overlaps {_name(b)} (by {depth:.0f} px)")
    return problems + _scale_problems(fig, max_decades)


def check_layout(fig: Figure, tolerance: float = 1.0, max_decades: float = 3.0) -> None:
    """Raise `LayoutError` listing every problem `layout_problems` finds in ``fig``."""
    problems = layout_problems(fig, tolerance, max_decades)
    if problems:
        raise LayoutError(f"{len(problems)} layout problem(s):\n- " + "\n- ".join(problems))
