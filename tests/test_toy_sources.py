"""The thesis's toy figures under ``--source code`` equal its plotting code, number for number.

The reference values are written out here from the thesis's plotting code (the public repository
``chris-je/ScaleInvariantParameterSpaces``, folder ``experiments/``), on the code's own windows and grids:

* ``2.0 sin 1D.py`` (Fig. 1.5 a): ``x = linspace(-10, 10, 400)``, ``where(x > 0, sin(x), 0)``.
* ``2.1 loss 2D colors.py`` (Fig. 1.5 b): ``sin(x y)`` on ``linspace(0, 10, 200)^2``, ``contourf(levels=25)``.
* ``2.2 loss 2D arrows.py`` (Fig. 1.6): ``contour(sin(0.5 x y), levels=[0])`` on that grid; arrows at
  ``meshgrid(arange(0, 12, 2), arange(0, 12, 2))`` with ``(U, V) = -(0.1 y, 0.1 x)``,
  ``quiver(angles="xy", scale_units="xy", scale=1)``.
* ``5.0 parametrization plane.py`` (Fig. 4.9 a): ``sin(x + y)`` on the grid, ``contourf(levels=25)``.
* ``5.1 3D contour planes.py`` (Fig. 4.9 b-d): ``sin(0.3 Z (w + X))`` with ``X = w2``, ``Z = w3`` on the
  grid, coloured by ``Normalize(-1, 1)``.

Each test draws the figure the way the toy command does and checks both what it stores (the ``.npz``
files) and what it draws (the artists of the saved matplotlib figure).
"""

import numpy as np
import pytest
from matplotlib.collections import QuadMesh
from matplotlib.contour import ContourSet
from matplotlib.figure import Figure
from matplotlib.quiver import Quiver

from landscape import _toys as toys
from landscape._toy_figures import toy_figure

TOL = 1e-12
GRID = np.linspace(0, 10, 200)  # every 2-D panel of the thesis code
X, Y = np.meshgrid(GRID, GRID)  # the code's meshgrid: X[i, j] = GRID[j] (first weight), Y[i, j] = GRID[i]


@pytest.fixture
def drawn(monkeypatch):
    """The matplotlib figures the toy command saves, kept instead of rendered (what they draw is checked here;
    tests/test_figure_layout.py renders them)."""
    figures = []

    def savefig(self, *args, **kwargs):
        figures.append(self)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return figures


def _npz(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float), rtol=0, atol=TOL)


def _reference_levels(z) -> np.ndarray:
    """The levels the thesis code's ``contourf(x, y, z, levels=25)`` uses."""
    return Figure().subplots().contourf(X, Y, z, levels=25).levels


def _plane_axes(fig):
    return [ax for ax in fig.axes if ax.get_label() != "<colorbar>" and ax.name == "rectilinear"]


def _only(artists, kind):
    found = [a for a in artists if isinstance(a, kind)]
    assert len(found) == 1, found
    return found[0]


def test_fig_1_5_code_is_the_thesis_codes_curve_and_plane(tmp_path, drawn):
    toy_figure("1.5", tmp_path, source="code")
    x = np.linspace(-10, 10, 400)
    curve_ref = np.where(x > 0, np.sin(x), 0)
    plane_ref = np.sin(X * Y)
    a, b = _npz(tmp_path / "fig1_5_a.npz"), _npz(tmp_path / "fig1_5_b.npz")
    assert a["x"].shape == (400,) and b["loss"].shape == (200, 200)
    _close(a["x"], x)
    _close(a["loss"], curve_ref)
    _close(b["x"], GRID)
    _close(b["y"], GRID)
    _close(b["loss"], plane_ref)
    _close(b["contour_levels"], _reference_levels(plane_ref))
    # what is drawn: the curve's points, and the filled contours' field and levels
    (fig,) = drawn
    ax_a, ax_b = _plane_axes(fig)
    (line,) = ax_a.get_lines()
    _close(line.get_xdata(), x)
    _close(line.get_ydata(), curve_ref)
    filled = _only(ax_b.collections, ContourSet)
    assert filled.filled
    _close(filled.levels, _reference_levels(plane_ref))
    _close(filled.get_array(), Figure().subplots().contourf(X, Y, plane_ref, levels=25).get_array())
    assert filled.get_cmap().name == "magma"


def test_fig_1_6_code_is_the_thesis_codes_lines_and_arrows(tmp_path, drawn):
    toy_figure("1.6", tmp_path, source="code")
    f = _npz(tmp_path / "fig1_6_b.npz")
    field_ref = np.sin(0.5 * X * Y)
    _close(f["x"], GRID)
    _close(f["y"], GRID)
    _close(f["line_field"], field_ref)
    assert f["line_levels"].tolist() == [0.0]
    # the code's arrow grid and vectors, in its meshgrid's order
    xa = np.arange(0, 10 + 2.0, 2.0)
    xx, yy = np.meshgrid(xa, xa)
    u, v = -(0.1 * yy), -(0.1 * xx)
    _close(f["arrow_points"], np.stack([xx.ravel(), yy.ravel()], -1))
    _close(f["arrow_vector"], np.stack([u.ravel(), v.ravel()], -1))
    # the lines w1 w2 = c: the zeros 0.5 c = pi k of sin(0.5 w1 w2) inside the window (0 < c <= 100)
    c_ref = [np.pi * k / 0.5 for k in range(1, 100) if np.pi * k / 0.5 <= 100.0]
    assert len(c_ref) == 15
    _close(f["invariant_levels"], c_ref)
    # the true gradient of L = sin(w2 relu(w1)) at the arrow points, and the factor between the arrows
    w1, w2 = xx.ravel(), yy.ravel()
    c = np.cos(w2 * np.maximum(w1, 0))
    grad = np.stack([c * w2 * (w1 > 0), c * np.maximum(w1, 0)], -1)
    _close(f["arrow_gradient"], grad)
    _close(f["arrow_vector"] * c[:, None], -0.1 * np.stack([w2, w1], -1) * c[:, None])
    # what is drawn: the zero contour of the code's field on its grid, and the code's quiver
    (fig,) = drawn
    (ax,) = _plane_axes(fig)
    lines = _only(ax.collections, ContourSet)
    reference = Figure().subplots().contour(X, Y, field_ref, levels=[0])
    assert not lines.filled and lines.levels.tolist() == [0.0]
    assert len(lines.allsegs[0]) == len(reference.allsegs[0]) >= 15
    for seg, ref in zip(lines.allsegs[0], reference.allsegs[0]):
        _close(seg, ref)
    quiver = _only(ax.collections, Quiver)
    _close(quiver.X, xx.ravel())
    _close(quiver.Y, yy.ravel())
    _close(quiver.U, u.ravel())
    _close(quiver.V, v.ravel())
    assert (quiver.scale, quiver.scale_units, quiver.angles) == (1.0, "xy", "xy")
    assert (ax.get_xlim(), ax.get_ylim()) == ((0.0, 10.0), (0.0, 10.0))


def test_fig_4_9_code_is_the_thesis_codes_panels(tmp_path, drawn):
    toy_figure("4.9", tmp_path, source="code")
    a = _npz(tmp_path / "fig4_9_a.npz")
    panel_a = np.sin(X + Y)  # 5.0: no factor 0.3
    _close(a["x"], GRID)
    _close(a["y"], GRID)
    _close(a["loss"], panel_a)
    _close(a["contour_levels"], _reference_levels(panel_a))
    (fig,) = drawn
    axes = _plane_axes(fig)
    assert len(axes) == 4
    filled = _only(axes[0].collections, ContourSet)
    _close(filled.levels, _reference_levels(panel_a))
    for ax, w in zip(axes[1:], (1, 6, 10)):
        f = _npz(tmp_path / f"fig4_9_b_fixed{w}.npz")
        ref = np.sin(0.3 * Y * (w + X))  # 5.1: X = w2 (horizontal), Z = w3 (vertical), y = w1 fixed
        _close(f["x"], GRID)
        _close(f["y"], GRID)
        _close(f["loss"], ref)
        mesh = _only(ax.collections, QuadMesh)
        _close(np.asarray(mesh.get_array()).reshape(200, 200), ref)
        assert (mesh.norm.vmin, mesh.norm.vmax) == (-1.0, 1.0) and mesh.get_cmap().name == "magma"


def test_gspace_4_9_code_is_panels_b_to_d_in_gspace():
    window = toys.gspace_4_9_window(source="code")
    _close(window.x, GRID)
    _close(window.y, GRID)
    v1, v2 = np.meshgrid(GRID, GRID)
    _close(window.loss, np.sin(0.3 * (v1 + v2)))  # sin(0.3 w3 (w1 + w2)) with v = w w3, w3 > 0
    (g,) = toys.gspace_4_9_surfaces(source="code", steps=7)
    for i, w in enumerate((1.0, 6.0, 10.0)):
        outline = g.extras[f"outline_{i}"]  # the code's window w2, w3 in [0, 10] of the plane w1 = w, as (w w3, w2 w3)
        assert outline[:, 0].min() == 0.0 and outline[:, 0].max() == pytest.approx(10 * w)
        assert outline[:, 1].max() == pytest.approx(100.0)


@pytest.mark.parametrize("figure", ["1.5", "1.6", "4.9", "gspace-4.9"])
def test_captions_say_what_each_source_draws(tmp_path, drawn, figure):
    """The code's captions name the code's files; the text's say what the text leaves open and what was chosen."""
    for source in ("code", "text"):
        toy_figure(figure, tmp_path / source, source=source, steps=7)
        caption = " ".join(drawn[-1]._supxlabel.get_text().split())
        assert toys.SOURCE_LABELS[source] in caption
        assert " ".join(toys.NOTES[figure][source].split())[1:] in caption
        if source == "text" and figure != "gspace-4.9":
            assert "open; chosen here:" in caption
        if source == "code" and figure != "gspace-4.9":
            assert "thesis code (experiments/" in caption.lower()


def test_the_toolkits_own_chart_takes_no_code_source(tmp_path, drawn):
    with pytest.raises(ValueError, match="gspace-1.5 is the toolkit's own chart"):
        toys.check_source("gspace-1.5", "code")
    toy_figure("gspace-1.5", tmp_path, steps=7)
    caption = " ".join(drawn[-1]._supxlabel.get_text().split())
    assert "not a thesis figure" in caption and " ".join(toys.NOTES["gspace-1.5"]["text"].split())[1:] in caption
    assert [toys.check_source(f, None) for f in toys.SOURCE_FIGURES] == ["code"] * len(toys.SOURCE_FIGURES)
