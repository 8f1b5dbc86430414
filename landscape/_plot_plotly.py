"""Interactive loss surfaces with plotly: a 3D surface next to a contour map, in an HTML page.

Where plotly.js comes from is `HTML_JS`: ``"directory"`` (default) writes one shared
``plotly.min.js`` beside the pages, or in a folder that several output folders share (see
`plotly_js_path`), and points every page at it by a relative path, so a folder of pages stays small and
still opens offline (move the folders and the script together); ``"inline"`` puts plotly.js into each page (about
4.7 MB each: one self-contained file to mail or archive); ``"cdn"`` loads it from the plotly CDN (tiny
pages that need the internet). All panels share one color range and colorbar. Plotly has no
logarithmic color scale, so ``log`` plots ``log10(loss)`` and says so in the colorbar title.
"""

from __future__ import annotations

import html as html_text
import os
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from landscape._surface import Surface, resolve_log
from sharpness.io import write_atomic

HTML_JS = ("directory", "inline", "cdn")
PLOTLY_JS = "plotly.min.js"


@dataclass(frozen=True)
class Overlay:
    """Extra marks on a contour panel: polylines (``(m, 2)`` arrays) and arrows (points + vectors)."""

    lines: Sequence[tuple[np.ndarray, str]] = ()
    arrow_points: np.ndarray | None = None
    arrow_vectors: np.ndarray | None = None
    arrow_color: str = "black"
    notes: Sequence[tuple[float, float, str]] = field(default_factory=tuple)


def _z(s: Surface, log: bool) -> np.ndarray:
    """The plotted heights in float32: 7 significant digits are more than a page shows, and half the bytes of
    float64 (the page embeds every grid value twice, for the surface and the contour map)."""
    if not log:
        return np.asarray(s.loss, dtype=np.float32)
    if float(np.nanmin(s.loss)) <= 0:
        raise ValueError("a log color scale needs a positive loss")
    return np.log10(s.loss).astype(np.float32)


def _colorscale(surfaces: Sequence[Surface]) -> str:
    lo = min(float(np.nanmin(s.loss)) for s in surfaces)
    hi = max(float(np.nanmax(s.loss)) for s in surfaces)
    return "RdBu_r" if lo < 0 < hi else "Viridis"


def plotly_figure(
    surfaces: Sequence[Surface],
    title: str = "",
    log: bool | str = False,
    overlays: Mapping[int, Overlay] | None = None,
    line_labels: Sequence[str] | None = None,
) -> go.Figure:
    """A plotly figure: one row per 2-D surface (3D surface | contour), or one panel of lines.

    Args:
        surfaces: all 2-D surfaces, or all lines.
        title: figure title.
        log: plot ``log10(loss)``; ``"auto"``: where the losses are positive and span more than two decades.
        overlays: ``{surface index: Overlay}`` drawn on that surface's contour panel.
        line_labels: legend entries for lines.

    Returns:
        The ``plotly.graph_objects.Figure``.
    """
    if not surfaces:
        raise ValueError("nothing to plot: no surfaces given")
    log = resolve_log(log, surfaces)
    if all(s.is_line for s in surfaces):
        return _line_figure(surfaces, title, log, line_labels)
    if any(s.is_line for s in surfaces):
        raise ValueError("give either lines or 2-D surfaces, not both, to one plotly figure")
    overlays = overlays or {}
    zs = [_z(s, log) for s in surfaces]
    zmin = min(float(np.nanmin(z)) for z in zs)
    zmax = max(float(np.nanmax(z)) for z in zs)
    titles = [_wrap(s.title, PANEL_TITLE_CHARS) for s in surfaces]
    title_lines = max(t.count("<br>") + 1 for t in titles)
    # Heights in pixels: each row's panels, the gap under a row (its contour's axis title, then the next row's
    # panel title) and the top margin (the figure title, then the first row's panel title), so that no title
    # touches another at any page width.
    gap = 56 + 21 * title_lines
    height = PANEL_PX * len(surfaces) + gap * (len(surfaces) - 1)
    top = _title_px(title) + 21 * title_lines + 16
    fig = make_subplots(
        rows=len(surfaces), cols=2,
        specs=[[{"type": "surface"}, {"type": "xy"}] for _ in surfaces],
        subplot_titles=[t for title in titles for t in (title, "")],
        horizontal_spacing=0.08, vertical_spacing=gap / height if len(surfaces) > 1 else 0.1,
    )  # fmt: skip
    scale = _colorscale(surfaces)
    colorbar = {"title": {"text": ("log10 " if log else "") + surfaces[0].z_label}, "len": 0.9}
    for r, (s, z) in enumerate(zip(surfaces, zs), start=1):
        hover = f"{s.x_label}=%{{x:.4g}}<br>{s.y_label}=%{{y:.4g}}<br>{s.z_label}=%{{z:.5g}}<extra></extra>"
        # every trace carries the same explicit color range (a shared scale); only one shows its colorbar
        fig.add_trace(
            go.Surface(x=s.x, y=s.y, z=z, colorscale=scale, cmin=zmin, cmax=zmax, showscale=False,
                       hovertemplate=hover),
            row=r, col=1,
        )  # fmt: skip
        fig.add_trace(
            go.Contour(
                x=s.x, y=s.y, z=z, colorscale=scale, zmin=zmin, zmax=zmax, hovertemplate=hover, ncontours=24,
                showscale=r == 1, colorbar=colorbar,
                contours={"showlabels": True, "labelfont": {"size": 9}}, line={"width": 0.5},
            ),
            row=r, col=2,
        )  # fmt: skip
        scene = "scene" if r == 1 else f"scene{r}"
        fig.layout[scene].update(
            xaxis_title=s.x_label, yaxis_title=s.y_label, zaxis_title=("log10 " if log else "") + s.z_label
        )
        fig.update_xaxes(title_text=s.x_label, row=r, col=2, constrain="domain")
        # a square contour panel whatever the page's width (the plane's two axes span equal lengths)
        anchor = fig.get_subplot(r, 2).xaxis.plotly_name.replace("axis", "")
        ratio = float(s.x[-1] - s.x[0]) / float(s.y[-1] - s.y[0])
        fig.update_yaxes(title_text=s.y_label, row=r, col=2, scaleanchor=anchor, scaleratio=ratio, constrain="domain")
        if r - 1 in overlays:
            _add_overlay(fig, overlays[r - 1], r, s)
    fig.update_layout(
        title=_title(title), height=height + top + BOTTOM_PX, showlegend=False,
        margin={"t": top, "l": 40, "r": 40, "b": BOTTOM_PX},
    )  # fmt: skip
    return fig


# Layout in pixels and characters, for pages 1280 to 1920 px wide: a figure title of at most TITLE_CHARS
# characters a line (17 px font, about 1000 px wide) and panel titles of at most PANEL_TITLE_CHARS (16 px font,
# over half the page) fit the narrowest; PANEL_PX is each row's height, BOTTOM_PX holds the last axis title.
TITLE_CHARS = 110
PANEL_TITLE_CHARS = 64
PANEL_PX = 480
BOTTOM_PX = 60
TITLE_LINE_PX = 24


def _wrap(text: str, width: int) -> str:
    """``text`` broken at spaces into lines of at most ``width`` characters, joined by ``<br>`` (plotly does not
    wrap titles: a long one runs off both sides of the page)."""
    lines = text.replace("<br>", "\n").split("\n")
    return "<br>".join(part for line in lines for part in textwrap.wrap(line, width) or [""])


def _title_px(title: str) -> int:
    """Pixels the figure title takes at the top of the page, its padding included (none without a title)."""
    return 14 + TITLE_LINE_PX * (_wrap(title, TITLE_CHARS).count("<br>") + 1) if title else 0


def _title(title: str) -> dict:
    """The layout's title: wrapped, centred, at the top of the page (the margin under it is the caller's)."""
    return {"text": _wrap(title, TITLE_CHARS), "x": 0.5, "xanchor": "center", "y": 1, "yref": "container",
            "yanchor": "top", "pad": {"t": 12}}  # fmt: skip


def _add_overlay(fig: go.Figure, overlay: Overlay, row: int, s: Surface) -> None:
    for points, name in overlay.lines:
        fig.add_trace(
            go.Scatter(x=points[:, 0], y=points[:, 1], mode="lines", name=name, hoverinfo="name",
                       line={"color": "black", "width": 1.2, "dash": "dash"}),
            row=row, col=2,
        )  # fmt: skip
    if overlay.arrow_points is not None:
        # data-coordinate arrows: tail at the point, head at point + vector
        axis = fig.get_subplot(row, 2)
        xref, yref = axis.xaxis.plotly_name.replace("axis", ""), axis.yaxis.plotly_name.replace("axis", "")
        for (px, py), (vx, vy) in zip(overlay.arrow_points, overlay.arrow_vectors):
            fig.add_annotation(
                x=px + vx, y=py + vy, ax=px, ay=py, xref=xref, yref=yref, axref=xref, ayref=yref,
                showarrow=True, arrowhead=2, arrowsize=1, arrowwidth=1.6, arrowcolor=overlay.arrow_color, text="",
            )  # fmt: skip
    for x, y, text in overlay.notes:
        axis = fig.get_subplot(row, 2)
        fig.add_annotation(
            x=x, y=y, text=text, showarrow=False, font={"size": 11},
            xref=axis.xaxis.plotly_name.replace("axis", ""), yref=axis.yaxis.plotly_name.replace("axis", ""),
        )  # fmt: skip
    fig.update_xaxes(range=[float(s.x[0]), float(s.x[-1])], row=row, col=2)
    fig.update_yaxes(range=[float(s.y[0]), float(s.y[-1])], row=row, col=2)


def _line_figure(surfaces: Sequence[Surface], title: str, log: bool, labels: Sequence[str] | None) -> go.Figure:
    fig = go.Figure()
    for i, s in enumerate(surfaces):
        name = labels[i] if labels else s.title
        fig.add_trace(go.Scatter(x=s.x, y=s.loss, mode="lines", name=name))
        if s.accuracy is not None and len(surfaces) == 1:
            fig.add_trace(go.Scatter(x=s.x, y=100 * s.accuracy, mode="lines", name="accuracy (%)", yaxis="y2",
                                     line={"dash": "dash"}))  # fmt: skip
            fig.update_layout(yaxis2={"title": "accuracy (%)", "overlaying": "y", "side": "right"})
    fig.update_layout(
        title=_title(title), margin={"t": _title_px(title) + 30},
        xaxis_title=surfaces[0].x_label, yaxis_title=surfaces[0].z_label,
        yaxis_type="log" if log else "linear", height=520,
    )  # fmt: skip
    return fig


def write_html(
    fig: go.Figure,
    path: str | os.PathLike,
    js: str = "directory",
    title: str | None = None,
    meta: Mapping | None = None,
    shared_folder: str | os.PathLike | None = None,
) -> list[str]:
    """Write ``fig`` as an HTML page, atomically; returns the paths written.

    Args:
        fig: the plotly figure.
        path: the page.
        js: where plotly.js comes from (see `HTML_JS`): ``"directory"`` also writes
            ``plotly.min.js`` (once: an identical file is left alone) where `plotly_js_path` says and
            points the page at it by a relative path, ``"inline"`` embeds it, ``"cdn"`` loads it from the internet.
        title: the page's ``<title>`` (default: the figure's title, without markup).
        meta: provenance (model, data, measure, the paper's figure) stored as the figure's
            ``layout.meta`` in the page.
        shared_folder: with ``"directory"``, a folder whose one ``plotly.min.js`` the pages of several output
            folders share (such as the folder that holds them); ``None``: beside the page.

    Raises:
        ValueError: an unknown ``js``, or a ``plotly.min.js`` beside the page that is not plotly.js.
    """
    if js not in HTML_JS:
        raise ValueError(f"unknown plotly.js source {js!r}; choose from {', '.join(HTML_JS)}")
    if meta:
        fig = go.Figure(fig).update_layout(meta=dict(meta))
    if title is None:
        title = fig.layout.title.text or ""
    title = " ".join(title.replace("<br>", " ").split())
    page = fig.to_html(include_plotlyjs={"inline": True}.get(js, js), full_html=True,
                       config={"displaylogo": False})  # fmt: skip
    page = page.replace("<head>", f"<head><title>{html_text.escape(title)}</title>", 1)
    path = os.fspath(path)
    written = []
    if js == "directory":
        script = get_plotlyjs().encode("utf-8")
        target = plotly_js_path(os.path.dirname(path) or ".", shared_folder)
        src = os.path.relpath(target, os.path.dirname(os.path.abspath(path))).replace(os.sep, "/")
        page = page.replace(f'src="{PLOTLY_JS}"', f'src="{html_text.escape(src)}"', 1)
        if not (os.path.isfile(target) and _read(target) == script):
            write_atomic(target, script)
            written.append(target)
    write_atomic(path, page.encode("utf-8"))
    return [*written, path]


# How every plotly.js bundle begins: a file that does not is the user's own, never replaced.
PLOTLY_BANNER = b"/**\n* plotly.js v"


def plotly_js_path(folder: str | os.PathLike, shared_folder: str | os.PathLike | None = None) -> str:
    """Where the pages in ``folder`` get ``plotly.min.js`` with ``--html-js directory``: in ``shared_folder`` when
    one is given and its ``plotly.min.js`` is absent or a plotly.js bundle, else in ``folder`` itself.

    Raises:
        ValueError: ``folder``'s ``plotly.min.js`` would be used and is not a plotly.js bundle (the user's own file).
    """
    if shared_folder is not None:
        shared = os.path.join(os.fspath(shared_folder), PLOTLY_JS)
        if not os.path.lexists(shared) or _is_plotly_js(shared):
            return shared
    beside = os.path.join(os.fspath(folder), PLOTLY_JS)
    if os.path.lexists(beside) and not _is_plotly_js(beside):
        raise ValueError(f"{beside} exists and is not plotly.js, so it is not replaced; move it away or use "
                         "--html-js inline (plotly.js in the page) or cdn")  # fmt: skip
    return beside


def _is_plotly_js(path: str) -> bool:
    """Whether ``path`` is a regular file that begins as every plotly.js bundle does."""
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as fh:
        return fh.read(len(PLOTLY_BANNER)) == PLOTLY_BANNER


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()
