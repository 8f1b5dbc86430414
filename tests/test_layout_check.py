"""The figure reviewer itself: it passes a clean figure and fails clipped, overlapping and badly scaled ones."""

import numpy as np
import pytest
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from landscape import LayoutError, check_layout, layout_problems


def _clean() -> Figure:
    fig = Figure(figsize=(4, 3), layout="constrained")
    ax = fig.add_subplot()
    ax.plot([0, 1, 2], [1.0, 2.0, 3.0], label="a line")
    ax.set(title="a title", xlabel="x", ylabel="y")
    ax.legend()
    return fig


def test_a_clean_figure_passes():
    check_layout(_clean())


def test_a_title_beyond_the_edge_fails():
    fig = Figure(figsize=(3, 2))
    fig.add_subplot().set_title("a title much too long for a figure three inches wide, reaching past its edges")
    problems = layout_problems(fig)
    assert any("title" in p and "clipped at the figure's left" in p and "right" in p for p in problems), problems
    with pytest.raises(LayoutError, match="clipped"):
        check_layout(fig)


def test_overlapping_texts_fail():
    fig = _clean()
    ax = fig.axes[0]
    ax.text(1, 2, "a note on the line", ha="center")
    ax.annotate("another note", (1, 2), ha="center")
    (problem,) = layout_problems(fig)
    assert "overlaps" in problem and "a note on the line" in problem and "another note" in problem


def test_a_title_over_the_panel_below_fails():
    fig = Figure(figsize=(4, 4))  # no layout engine: the second title runs into the first panel's tick labels
    fig.add_subplot(2, 1, 1).plot([0, 1], [0, 1])
    fig.add_subplot(2, 1, 2).set_title("title\nof three\nlines")
    assert any("overlaps" in p and "tick label" in p for p in layout_problems(fig))


def test_touching_texts_pass_and_tolerance_counts():
    fig = Figure(figsize=(4, 3))
    ax = fig.add_subplot()
    a = ax.text(0.2, 0.5, "left", ha="right", va="center")
    ax.text(0.2, 0.5, "right", ha="left", va="center")
    assert layout_problems(fig) == []
    a.set_x(0.25)  # now 'left' runs 0.05 axes widths into 'right'
    assert len(layout_problems(fig)) == 1
    assert layout_problems(fig, tolerance=100) == []


def test_a_contour_label_cut_at_the_axes_edge_fails():
    fig = Figure(figsize=(3, 3))
    ax = fig.add_subplot()
    x = np.linspace(-1, 1, 21)
    cs = ax.contour(x, x, np.add.outer(x, x), levels=[0.0])
    (label,) = ax.clabel(cs, manual=[(0.0, 0.0)])
    label.set_position((1.0, -1.0))  # on the corner: half of it is cut away
    assert any("cut at the edge of its axes" in p for p in layout_problems(fig))


def test_a_linear_axis_over_five_decades_fails_and_log_passes():
    fig = Figure(figsize=(4, 3), layout="constrained")
    ax = fig.add_subplot()
    values = np.geomspace(1.0, 1e5, 50)
    ax.plot(np.arange(50), values)
    (problem,) = layout_problems(fig)
    assert "y axis" in problem and "linear scale over 5.0 decades" in problem
    ax.set_yscale("log")
    assert layout_problems(fig) == []


def test_signed_data_and_grids_near_zero_pass():
    fig = Figure(figsize=(4, 3), layout="constrained")
    ax = fig.add_subplot()
    t = np.linspace(0, 2, 2001)  # a fine grid: 1e-3 next to 0 is not data spanning decades
    ax.plot(t, np.sin(10 * t))
    ax.plot(t, 1 + t)
    assert layout_problems(fig) == []


def test_a_linear_colour_scale_over_decades_fails():
    fig = Figure(figsize=(4, 3), layout="constrained")
    ax = fig.add_subplot()
    z = np.geomspace(1e-2, 1e3, 100).reshape(10, 10)
    mesh = ax.pcolormesh(z)
    fig.colorbar(mesh, ax=ax)
    problems = layout_problems(fig)
    assert any("colour bar" in p for p in problems) and any("colour scale" in p for p in problems)
    mesh.set_norm(LogNorm(1e-2, 1e3))
    assert layout_problems(fig) == []


def test_a_linear_3d_surface_over_decades_fails():
    fig = Figure(figsize=(4, 4), layout="constrained")
    ax = fig.add_subplot(projection="3d")
    x = np.linspace(-1, 1, 11)
    xx, yy = np.meshgrid(x, x)
    ax.plot_surface(xx, yy, 10.0 ** (5 * (xx**2 + yy**2) / 2 - 2), cmap="viridis")
    assert any("z axis" in p for p in layout_problems(fig))


def test_rotated_texts_are_compared_as_rotated_boxes():
    """Two 45-degree labels side by side: their axis-aligned boxes overlap, the texts themselves do not."""
    fig = Figure(figsize=(4, 3))
    ax = fig.add_subplot()
    ax.set_axis_off()
    for x in (0.4, 0.48):
        ax.text(x, 0.5, "a long rotated label", rotation=45, ha="center", va="center", rotation_mode="anchor")
    assert layout_problems(fig) == []
    ax.text(0.44, 0.5, "a long crossing label", rotation=-45, ha="center", va="center", rotation_mode="anchor")
    assert len(layout_problems(fig)) == 2
