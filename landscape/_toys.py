"""The thesis's toy networks (Figs. 1.5, 1.6, 4.9), their exact gradients and their G-space charts.

All inputs are fixed to 1 and the loss is ``L(y) = sin(y)`` of the scalar output ``y``, as in the thesis.

Networks (``relu(t) = max(t, 0)``):

* Fig. 1.5 a: ``y = relu(w)``; b: ``y = w2 relu(w1)``. Network b has one hidden unit, so the
  rescaling ``(w1, w2) -> (alpha w1, w2 / alpha)``, ``alpha > 0``, keeps ``y``: the invariant lines
  are the hyperbolas ``w1 w2 = c`` (for ``w1 > 0``; all of ``w1 <= 0`` computes ``y = 0``).
* Fig. 1.6: the gradient of network b's loss,
  ``dL/dw1 = cos(y) w2 [w1 > 0]``, ``dL/dw2 = cos(y) relu(w1)``,
  is normal to the invariant line through the point and, moving along that line by ``alpha``,
  its ``w1`` component scales by ``1/alpha`` and its ``w2`` component by ``alpha`` (thesis eq. 1.20).
* Fig. 4.9 a: ``y = relu(w1 + w2)``; b: ``y = w3 relu(w1 + w2)``, drawn over ``(w2, w3)`` with
  ``w1`` set to a value ``b``. This is reading (a) of the fixed weights (docs/math.md, "Fixed
  weights"): setting ``w1 = b`` changes the network function, and each ``b`` gives a different
  surface ``sin(w3 (b + w2))`` (for ``b + w2 > 0``).

G-space (docs/math.md, "G-space"; thesis ch. 2). Each hidden unit has one designated outgoing
("skeleton") edge; a coordinate is the value of a basis path (product of its weights), and the
signs of the skeleton weights label the chart.

* Network b: the skeleton edge is ``w2``; the single basis path gives ``v = w1 w2`` (``m - H =
  2 - 1 = 1`` coordinate). With ``s = sign(w2)``, ``y = s relu(s v)``, so for ``w2 > 0`` the loss is
  ``sin(relu(v))`` -- exactly network a's curve: the hyperbolas collapse to points and the 1/alpha
  gradient distortion is gone.
* Fig. 4.9 network b: the hidden unit's only outgoing edge ``w3`` is the skeleton edge; the two
  basis paths (input 1 -> h -> out, input 2 -> h -> out) give ``v1 = w1 w3``, ``v2 = w2 w3``
  (``m - H = 3 - 1 = 2`` coordinates). With ``s = sign(w3)``, ``y = s relu(s (v1 + v2))``, so for
  ``w3 > 0`` the loss is ``sin(relu(v1 + v2))`` -- network a's surface of Fig. 4.9 (a), the
  undistorted picture the thesis hoped to recover. A fixed-``w1`` plane ``{w1 = b}`` maps onto the
  part of this one surface with ``v1 = b w3``, ``v2 = w2 w3``: every panel of Fig. 4.9 b is the same
  G-space surface seen through a different, distorted chart.

Text and code. The thesis's plotting code (the public repository
``chris-je/ScaleInvariantParameterSpaces``, folder ``experiments/``) draws every toy figure; its text
defines the networks and the loss but no windows, grids or arrow positions. Each thesis figure takes
``source="code"`` (the default: what the plotting code draws, on its own windows and grids) or
``source="text"`` (the text's definitions; where the text leaves a choice open, the choice made is
stated in `NOTES` and in the figure's caption):

* Fig. 1.5 (``2.0 sin 1D.py``, ``2.1 loss 2D colors.py``): the code draws (a) ``sin(w)`` for ``w > 0``,
  else 0, at 400 points over ``[-10, 10]``, and (b) ``sin(w1 w2)`` on a 200 x 200 grid over ``[0, 10]^2``
  (``= sin(w2 relu(w1))`` there) with 25 automatic filled-contour levels.
* Fig. 1.6 (``2.2 loss 2D arrows.py``): no loss; the zero lines of ``sin(0.5 w1 w2)``, i.e.
  ``w1 w2 = 2 pi k``, contoured on the 200 x 200 grid over ``[0, 10]^2``, and the arrows
  ``-0.1 (w2, w1) = -grad(0.1 w1 w2)`` (not the gradient of ``L``) at the points ``{0, 2, ..., 10}^2``,
  at scale 1. On a line ``w1 w2 = c`` (``w1 > 0``) the true gradient is ``cos(c) (w2, w1)``: both arrows
  are parallel and rescale alike, and differ by the factor ``-0.1 / cos(c)``.
* Fig. 4.9 (``5.0 parametrization plane.py``, ``5.1 3D contour planes.py``): (a) ``sin(w1 + w2)`` and
  (b)-(d) ``sin(0.3 w3 (w1 + w2))`` for ``w1 = 1, 6, 10``, each on a 200 x 200 grid over ``[0, 10]^2``:
  the 0.3 is in panels (b)-(d) only. The text gives ``L = sin(y)`` for all four.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from landscape._surface import Surface

FIG_4_9_FIXED = (1.0, 6.0, 10.0)

SOURCES = ("text", "code")  # the thesis's text, or its plotting code
SOURCE_FIGURES = ("1.5", "1.6", "4.9", "gspace-4.9")  # the thesis's figures (and the chart built on 4.9)
DEFAULT_SOURCE = "code"
SOURCE_LABELS = {"text": "after the thesis text", "code": "as the thesis's plotting code draws it"}

# The thesis's plotting code: every 2-D panel is a 200 x 200 grid over [0, 10]^2, Fig. 1.5 a 400 points over
# [-10, 10]; filled contours with matplotlib's levels=25 (Figs. 1.5 b, 4.9 a), the magma colormap.
CODE_LIM = (0.0, 10.0)
CODE_STEPS = 200
CODE_LIM_1_5_A = (-10.0, 10.0)
CODE_LEVELS = 25
CODE_CMAP = "magma"
CODE_GAIN_4_9 = 0.3  # Fig. 4.9 (b)-(d) in the thesis code: L = sin(0.3 y); panel (a) has no factor
CODE_LINES_1_6 = 0.5  # Fig. 1.6 in the thesis code: the zero lines of sin(0.5 w1 w2)
CODE_ARROWS_1_6 = 0.1  # Fig. 1.6 in the thesis code: arrows -grad(0.1 w1 w2)
CODE_ARROW_SPACING_1_6 = 2.0  # ... at the points {0, 2, ..., 10}^2

# The text's figures: grids of 201 steps; the windows are choices (the text gives none). Figs. 1.5/1.6
# show the dead half-plane w1 < 0 too; Fig. 4.9 positive weights only, as the text says.
TEXT_STEPS = 201
LIM_1_5_A = (-4.0, 12.0)
LIM_1_5_B = (-4.0, 4.0)
LIM_4_9 = (0.0, 3.0)

# Fig. 1.6 after the text: invariant lines w1 w2 = c and the rescaling factors alpha at which arrows are
# drawn. |cos(c)| is near 1 on these lines, so the arrows are long enough to read.
FIG_1_6_LEVELS = (-3.0, -0.5, 0.5, 3.0)
FIG_1_6_ALPHAS = (0.5, 2**-0.5, 1.0, 2**0.5, 2.0)

# What the --source code figures still do differently from the thesis code (the reproductions page).
CODE_DIFFERENCES = {
    "1.5": "the thesis code's formulas, windows, grids, contour levels and colours; only sizes, fonts, titles and "
           "axis labels are the toolkit's",
    "1.6": "the thesis code's lines, arrow points, arrow vectors and arrow scale on its window; only sizes, fonts, "
           "the title and the legend are the toolkit's",
    "4.9": "the thesis code's formulas, windows, grids, levels and colours; panels (b)-(d) are drawn flat over "
           "(w2, w3), where the code paints the same colours on the plane w1 = b in 3-D axes; sizes, fonts, titles "
           "and labels are the toolkit's",
}

# What each source draws; for the text, the choices it leaves open and the ones made (captions and the
# reproductions page).
NOTES = {
    "1.5": {
        "code": "thesis code (experiments/2.0 sin 1D.py, 2.1 loss 2D colors.py): (a) sin(w) for w > 0, else 0, "
                "at 400 points over [-10, 10]; (b) sin(w1 w2) = sin(w2 relu(w1)) on a 200 x 200 grid over "
                "[0, 10]^2, filled contours at 25 automatic levels",
        "text": "the text fixes x = 1, L = sin(y), y = relu(w) (a) and y = w2 relu(w1) (b), and leaves the "
                "windows, grids and levels open; chosen here: (a) [-4, 12], (b) [-4, 4]^2 (to show the dead "
                "half-plane w1 < 0), 201 x 201 points, contours 0.2 apart, and a 3-D view of (b)",
    },
    "1.6": {
        "code": "thesis code (experiments/2.2 loss 2D arrows.py): no loss drawn; the zero lines of "
                "sin(0.5 w1 w2), i.e. w1 w2 = 2 pi k, contoured on a 200 x 200 grid over [0, 10]^2, and the "
                "arrows -0.1 (w2, w1) = -grad(0.1 w1 w2) (not the gradient of L; parallel to it on each line, "
                "-0.1 / cos(w1 w2) times it) at the 36 points {0, 2, ..., 10}^2, at scale 1",
        "text": "the text says only that the lines are invariant lines of network b and that the arrows show "
                "how its gradients scale, and leaves the window, the lines and the arrow positions open; chosen "
                "here: L = sin(w2 relu(w1)) over [-4, 4]^2, lines w1 w2 = -3, -0.5, 0.5, 3, the exact "
                "gradient of L at the rescalings alpha = 1/2, 1/sqrt(2), 1, sqrt(2), 2 of each line's "
                "balanced point, on one common scale",
    },
    "4.9": {
        "code": "thesis code (experiments/5.0 parametrization plane.py, 5.1 3D contour planes.py): (a) "
                "sin(w1 + w2), filled contours at 25 automatic levels; (b)-(d) sin(0.3 w3 (w1 + w2)) for "
                "w1 = 1, 6, 10 in continuous colours on [-1, 1] (the code paints them on the plane w1 = b in "
                "3-D axes; drawn flat here); each on a 200 x 200 grid over [0, 10]^2. The 0.3, in (b)-(d) "
                "only, is not in the thesis's panel captions",
        "text": "the text fixes x1 = x2 = 1, positive weights, L = sin(y), sin(w1 + w2) (a) and "
                "sin(w3 (b + w2)) for w1 = b = 1, 6, 10 (b-d), and leaves the window, grid and levels open; "
                "chosen here: [0, 3]^2 (on [0, 10]^2 panel d would show about 32 stripes), 201 x 201 points, "
                "contours 0.2 apart, and a 3-D view of each panel",
    },
    "gspace-1.5": {
        "code": "the toolkit's chart, not a thesis figure: no thesis code draws it, and `--source code` is refused",
        "text": "the toolkit's chart, not a thesis figure: network b of Fig. 1.5 over the window [-4, 4]^2 chosen for "
                "Fig. 1.5 after the text",
    },
    "gspace-4.9": {
        "code": "the toolkit's chart, not a thesis figure: Fig. 4.9's network b with the thesis code's loss of "
                "panels (b)-(d), sin(0.3 y), and window [0, 10]^2",
        "text": "the toolkit's chart, not a thesis figure: Fig. 4.9's network b with the text's loss sin(y) and "
                "the window [0, 3]^2 chosen for Fig. 4.9 after the text",
    },
}


def _t(x) -> Tensor:
    return torch.as_tensor(x, dtype=torch.float64)


def _step(t: Tensor) -> Tensor:
    """Derivative of relu, 0 at 0 (what autograd uses)."""
    return (t > 0).to(t.dtype)


# ---------------------------------------------------------------------------------------------
# the networks' losses and exact gradients (all inputs 1, L = sin(y))
def loss_a(w) -> Tensor:
    """Fig. 1.5 a: ``sin(relu(w))``."""
    return torch.sin(torch.relu(_t(w)))


def grad_a(w) -> Tensor:
    """``dL/dw`` of `loss_a`: ``cos(relu(w)) [w > 0]``."""
    w = _t(w)
    return torch.cos(torch.relu(w)) * _step(w)


def loss_b(w1, w2) -> Tensor:
    """Fig. 1.5 b: ``sin(w2 relu(w1))``."""
    return torch.sin(_t(w2) * torch.relu(_t(w1)))


def grad_b(w1, w2) -> tuple[Tensor, Tensor]:
    """``(dL/dw1, dL/dw2)`` of `loss_b`: ``(cos(y) w2 [w1 > 0], cos(y) relu(w1))``."""
    w1, w2 = _t(w1), _t(w2)
    c = torch.cos(w2 * torch.relu(w1))
    return c * w2 * _step(w1), c * torch.relu(w1)


def loss_a2(w1, w2, gain: float = 1.0) -> Tensor:
    """Fig. 4.9 a: ``sin(gain relu(w1 + w2))`` (``gain`` 1 in the thesis text, 0.3 in its code)."""
    return torch.sin(gain * torch.relu(_t(w1) + _t(w2)))


def grad_a2(w1, w2, gain: float = 1.0) -> tuple[Tensor, Tensor]:
    """``(dL/dw1, dL/dw2)`` of `loss_a2` (both ``gain cos(gain y) [w1 + w2 > 0]``)."""
    s = _t(w1) + _t(w2)
    g = gain * torch.cos(gain * torch.relu(s)) * _step(s)
    return g, g.clone()


def loss_b2(w1, w2, w3, gain: float = 1.0) -> Tensor:
    """Fig. 4.9 b: ``sin(gain w3 relu(w1 + w2))`` (``gain`` 1 in the thesis text, 0.3 in its code)."""
    return torch.sin(gain * _t(w3) * torch.relu(_t(w1) + _t(w2)))


def grad_b2(w1, w2, w3, gain: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """``(dL/dw1, dL/dw2, dL/dw3)`` of `loss_b2`."""
    w3, s = _t(w3), _t(w1) + _t(w2)
    c = gain * torch.cos(gain * w3 * torch.relu(s))
    g = c * w3 * _step(s)
    return g, g.clone(), c * torch.relu(s)


def check_source(figure: str, source: str | None) -> str:
    """The source a toy figure is drawn from: ``source``, or `DEFAULT_SOURCE` (the thesis code's figure)
    for the thesis's figures, ``"text"`` for the toolkit's own chart ``gspace-1.5``; refused where it does not
    apply."""
    if source is not None and source not in SOURCES:
        raise ValueError(f"source must be 'text' or 'code', got {source!r}")
    if figure not in SOURCE_FIGURES:
        if source not in (None, "text"):
            raise ValueError(f"--source code applies to figures {', '.join(SOURCE_FIGURES)} only, which the "
                             f"thesis's plotting code draws; figure {figure} is the toolkit's own chart")
        return "text"
    return DEFAULT_SOURCE if source is None else source


def grid_steps(source: str, steps: int | None) -> int:
    """Grid points per axis: ``steps``, or by default the thesis code's 200 (``"code"``) or 201 (``"text"``)."""
    steps = (CODE_STEPS if source == "code" else TEXT_STEPS) if steps is None else steps
    _check_steps(steps)
    return steps


def window_4_9(source: str) -> tuple[float, float]:
    """The weight window of Fig. 4.9: ``[0, 10]`` in the thesis code, ``[0, 3]`` chosen for the text (which gives
    none)."""
    return CODE_LIM if source == "code" else LIM_4_9


def gain_4_9(source: str) -> float:
    """The factor in the loss ``sin(gain y)`` of Fig. 4.9's network b (panels b-d): 1 in the thesis text, 0.3 in
    its code. Panel (a) has no factor in either."""
    return CODE_GAIN_4_9 if source == "code" else 1.0


def _sin_of(gain: float, inner: str) -> str:
    """``sin(inner)`` or ``sin(gain inner)``, as metadata text."""
    return f"sin({inner})" if gain == 1.0 else f"sin({gain:g} {inner})"


def loss_label(gain: float) -> str:
    """The loss axis label of Figs. 4.9 and gspace-4.9: ``L = sin(y)`` or ``L = sin(gain·y)``."""
    return "L = sin(y)" if gain == 1.0 else f"L = sin({gain:g}·y)"


def gspace_4_9_loss(source: str) -> str:
    """Fig. 4.9's network b in G-space (``w3 > 0``) as text: ``sin(relu(v₁ + v₂))``, with the code's gain."""
    return _sin_of(gain_4_9(source), "relu(v₁ + v₂)")


# ---------------------------------------------------------------------------------------------
# G-space charts
def gspace_b(w1, w2) -> tuple[Tensor, Tensor]:
    """Network b in G-space: ``(v, s) = (w1 w2, sign(w2))`` (basis-path value, skeleton sign)."""
    w1, w2 = _t(w1), _t(w2)
    return w1 * w2, torch.sign(w2)


def loss_b_gspace(v, sign=1.0) -> Tensor:
    """Network b's loss in G-space: ``sin(s relu(s v))``; ``sin(relu(v))`` for ``w2 > 0``."""
    s = _t(sign)
    return torch.sin(s * torch.relu(s * _t(v)))


def gspace_b2(w1, w2, w3) -> tuple[Tensor, Tensor, Tensor]:
    """Fig. 4.9 network b in G-space: ``(v1, v2, s) = (w1 w3, w2 w3, sign(w3))``."""
    w3 = _t(w3)
    return _t(w1) * w3, _t(w2) * w3, torch.sign(w3)


def loss_b2_gspace(v1, v2, sign=1.0, gain: float = 1.0) -> Tensor:
    """Fig. 4.9 network b's loss in G-space: ``sin(gain s relu(s (v1 + v2)))``; network a's for ``w3 > 0``."""
    s = _t(sign)
    return torch.sin(gain * s * torch.relu(s * (_t(v1) + _t(v2))))


# ---------------------------------------------------------------------------------------------
# Fig. 1.6: invariant lines and gradient arrows
def invariant_line_b(c: float, alphas) -> Tensor:
    """Points ``(w1, w2)`` on network b's invariant line ``w1 w2 = c`` (``w1 > 0``), ``(len(alphas), 2)``.

    ``alpha = 1`` is the balanced point ``|w1| = |w2| = sqrt(|c|)``; ``alpha`` multiplies ``w1`` and
    divides ``w2``, the rescaling that keeps the network function.
    """
    a, r = _t(alphas), math.sqrt(abs(c))
    return torch.stack([r * a, math.copysign(r, c) / a], dim=-1)


def fig_1_6_arrows(
    levels=FIG_1_6_LEVELS, alphas=FIG_1_6_ALPHAS
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Gradient arrows of Fig. 1.6.

    Returns:
        ``(points, gradients, level, alpha)``: ``(m, 2)`` points ``(w1, w2)`` on the invariant lines
            ``w1 w2 = level`` at rescaling ``alpha``, the exact gradient ``(dL/dw1, dL/dw2)`` of
            ``L = sin(w2 relu(w1))`` there, and ``(m,)`` level and alpha of each point.
    """
    points, level, alpha = [], [], []
    for c in levels:
        points.append(invariant_line_b(c, alphas))
        level += [c] * len(alphas)
        alpha += list(alphas)
    pts = torch.cat(points)
    g1, g2 = grad_b(pts[:, 0], pts[:, 1])
    return pts.numpy(), torch.stack([g1, g2], dim=-1).numpy(), np.asarray(level), np.asarray(alpha)


# ---------------------------------------------------------------------------------------------
# surfaces of the figures
def _axis(lim: tuple[float, float], steps: int) -> np.ndarray:
    """``steps`` evenly spaced points over ``lim``; a grid point that should be 0 is exactly 0."""
    x = np.linspace(lim[0], lim[1], steps)
    if lim[0] < 0 < lim[1]:
        j = int(np.argmin(np.abs(x)))
        if abs(x[j]) < 1e-9 * (lim[1] - lim[0]):
            x[j] = 0.0
    return x


def _plane(fn, xlim, ylim, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x, y = _axis(xlim, steps), _axis(ylim, steps)
    yy, xx = torch.meshgrid(_t(y), _t(x), indexing="ij")
    return x, y, fn(xx, yy).numpy()


def _check_steps(steps: int) -> None:
    if steps < 3:
        raise ValueError(f"the toy grids need at least 3 steps per axis, got {steps}")


TITLE_A = "network a: y = relu(w)"
TITLE_B = "network b: y = w₂·relu(w₁)"


def fig_1_5_surfaces(steps: int | None = None, source: str = DEFAULT_SOURCE) -> list[Surface]:
    """Thesis Fig. 1.5: network a's curve and network b's surface (``L = sin(y)``, ``x = 1``).

    ``source="code"`` (default): the thesis code's windows, ``[-10, 10]`` at ``2 steps`` points (400) and
    ``[0, 10]^2`` at ``steps`` (200) per axis; ``"text"``: ``[-4, 12]`` at ``8 steps + 1`` points and
    ``[-4, 4]^2`` at ``steps`` (201) per axis, windows the text leaves open (`NOTES`).
    """
    source = check_source("1.5", source)
    steps = grid_steps(source, steps)
    lim_a, lim_b = (CODE_LIM_1_5_A, CODE_LIM) if source == "code" else (LIM_1_5_A, LIM_1_5_B)
    wa = _axis(lim_a, 2 * steps if source == "code" else 8 * steps + 1)
    curve = Surface(
        x=wa, y=None, loss=loss_a(_t(wa)).numpy(), x_label="w", title=TITLE_A, z_label="L = sin(y)",
        metadata={"figure": "1.5", "network": "a", "function": "sin(relu(w))", "source": source,
                  "window": list(lim_a)},
    )  # fmt: skip
    x, y, z = _plane(loss_b, lim_b, lim_b, steps)
    plane = Surface(
        x=x, y=y, loss=z, x_label="w₁", y_label="w₂", title=TITLE_B, z_label="L = sin(y)",
        metadata={"figure": "1.5", "network": "b", "function": "sin(w2 relu(w1))", "source": source,
                  "window": list(lim_b)},
    )  # fmt: skip
    return [curve, plane]


ARROWS_1_6 = {
    "text": "(cos(y) w2 [w1>0], cos(y) relu(w1)), y = w2 relu(w1): the gradient of L (thesis text)",
    "code": "-0.1 (w2, w1) = -grad(0.1 w1 w2): the thesis code's arrows, parallel to grad L on each line",
}


def fig_1_6_code_arrows() -> tuple[np.ndarray, np.ndarray]:
    """The thesis code's arrows of Fig. 1.6: ``(points, vectors)``, each ``(36, 2)``.

    The points ``(w1, w2)`` of the grid ``{0, 2, ..., 10}^2`` (``w1`` fastest, as a ``meshgrid`` flattens),
    the vectors ``-0.1 (w2, w1)``: the descent direction of ``0.1 w1 w2``.
    """
    lo, hi = CODE_LIM
    axis = np.arange(lo, hi + CODE_ARROW_SPACING_1_6, CODE_ARROW_SPACING_1_6)
    w2, w1 = np.meshgrid(axis, axis, indexing="ij")
    pts = np.stack([w1.ravel(), w2.ravel()], axis=-1)
    return pts, -CODE_ARROWS_1_6 * pts[:, ::-1]


def fig_1_6_code_levels() -> np.ndarray:
    """The constants ``c = 2 pi k`` of the lines ``w1 w2 = c`` the thesis code draws in Fig. 1.6 (the zeros of
    ``sin(0.5 w1 w2)`` with ``0 < c <= 100`` in ``[0, 10]^2``)."""
    top = CODE_LIM[1] ** 2
    k = np.arange(1, math.floor(top * CODE_LINES_1_6 / math.pi) + 1)
    return math.pi * k / CODE_LINES_1_6


def fig_1_6_surface(steps: int | None = None, source: str = DEFAULT_SOURCE) -> Surface:
    """Thesis Fig. 1.6: network b's surface with its invariant lines and the arrows.

    ``extras`` hold ``arrow_points`` ``(m, 2)``, ``arrow_vector`` ``(m, 2)`` (the drawn arrows: for ``"text"``
    the true gradient of the loss at rescaled points of the lines, also ``arrow_alpha`` ``(m,)``; for
    ``"code"`` the thesis code's ``-grad(0.1 w1 w2)`` on its grid of spacing 2), ``arrow_gradient``
    ``(m, 2)`` (the true gradient, either way), ``arrow_level`` ``(m,)`` (``w1 w2`` at each point) and
    ``invariant_levels`` (the ``c`` of the drawn lines ``w1 w2 = c``). For ``"code"`` also ``line_field``
    (``sin(0.5 w1 w2)`` on the grid; the code draws its zero contour, ``line_levels``) -- the code draws no
    loss, and ``loss`` holds network b's loss on the code's window for reference.
    """
    source = check_source("1.6", source)
    steps = grid_steps(source, steps)
    lim = CODE_LIM if source == "code" else LIM_1_5_B
    x, y, z = _plane(loss_b, lim, lim, steps)
    if source == "code":
        pts, drawn = fig_1_6_code_arrows()
        field = _plane(lambda w1, w2: torch.sin(CODE_LINES_1_6 * w1 * w2), lim, lim, steps)[2]
        extras = {"line_field": field, "line_levels": np.zeros(1), "invariant_levels": fig_1_6_code_levels(),
                  "arrow_level": pts[:, 0] * pts[:, 1]}  # fmt: skip
    else:
        pts, _, level, alpha = fig_1_6_arrows()
        extras = {"arrow_alpha": alpha, "arrow_level": level, "invariant_levels": np.asarray(FIG_1_6_LEVELS)}
    g1, g2 = grad_b(_t(pts[:, 0]), _t(pts[:, 1]))
    grads = torch.stack([g1, g2], dim=-1).numpy()
    if source == "text":
        drawn = grads
    return Surface(
        x=x, y=y, loss=z, x_label="w₁", y_label="w₂", z_label="L = sin(y)",
        title="network b: invariant lines w₁w₂ = c and " + ("the gradient ∇L" if source == "text" else
                                                             "the thesis code's arrows −∇(0.1 w₁w₂)"),
        extras={"arrow_points": pts, "arrow_vector": drawn, "arrow_gradient": grads, **extras},
        metadata={"figure": "1.6", "network": "b", "function": "sin(w2 relu(w1))", "source": source,
                  "window": list(lim), "arrows": ARROWS_1_6[source],
                  "gradient": "(cos(y) w2 [w1>0], cos(y) relu(w1)), y = w2 relu(w1)"},
    )  # fmt: skip


def fixed_title(b: float) -> str:
    return f"network b′, w₁ set to {b:g}\nreading (a): the function changes with w₁"


def fig_4_9_surfaces(fixed=FIG_4_9_FIXED, steps: int | None = None, source: str = DEFAULT_SOURCE) -> list[Surface]:
    """Thesis Fig. 4.9: network a over ``(w1, w2)`` and network b over ``(w2, w3)`` for each fixed ``w1``.

    Reading (a) of the fixed-weight planes: ``w1`` is set to each value ``b`` and the function changes.
    Each fixed-weight surface carries ``extras["fixed"] = b``. ``source="code"`` (default) draws what the
    thesis code does: (a) ``sin(w1 + w2)``, (b) ``sin(0.3 w3 (b + w2))`` on ``[0, 10]^2`` at ``steps`` (200)
    per axis; ``"text"`` the text's ``L = sin(y)`` for both, on ``[0, 3]^2`` (a window the text leaves open)
    at ``steps`` (201).
    """
    source = check_source("4.9", source)
    steps = grid_steps(source, steps)
    if len(fixed) == 0:
        raise ValueError("give at least one fixed value for w1")
    lim, gain = window_4_9(source), gain_4_9(source)
    z_label = loss_label(gain)
    common = {"figure": "4.9", "source": source, "window": list(lim)}
    x, y, z = _plane(loss_a2, lim, lim, steps)
    out = [
        Surface(
            x=x, y=y, loss=z, x_label="w₁", y_label="w₂", z_label=loss_label(1.0),
            title="network a′: y = relu(w₁ + w₂)",
            metadata={**common, "gain": 1.0, "network": "a", "function": "sin(relu(w1 + w2))"},
        )
    ]  # fmt: skip
    for b in fixed:
        x, y, z = _plane(lambda w2, w3, b=b: loss_b2(b, w2, w3, gain), lim, lim, steps)
        out.append(
            Surface(
                x=x, y=y, loss=z, x_label="w₂", y_label="w₃", z_label=z_label, title=fixed_title(b),
                extras={"fixed": np.asarray(float(b))},
                metadata={**common, "gain": gain, "network": "b", "function": _sin_of(gain, f"w3 relu({b:g} + w2)"),
                          "reading": "a", "fixed_weight": "w1", "fixed": float(b)},
            )
        )  # fmt: skip
    return out


def gspace_b_surfaces(steps: int | None = None) -> list[Surface]:
    """Network b in weight space and in G-space.

    Returns ``[weight-space plane over (w1, w2), G-space curve for w2 > 0, G-space curve for w2 < 0]``;
    the ``w2 > 0`` curve ``sin(relu(v))`` is network a's curve of Fig. 1.5. Windows as Fig. 1.5 after the text.
    """
    steps = grid_steps("text", steps)
    x, y, z = _plane(loss_b, LIM_1_5_B, LIM_1_5_B, steps)
    plane = Surface(
        x=x, y=y, loss=z, x_label="w₁", y_label="w₂", z_label="L = sin(y)",
        title="network b in weight space: lines of constant v = w₁w₂",
        metadata={"figure": "gspace-1.5", "network": "b", "chart": "weights"},
    )  # fmt: skip
    r = LIM_1_5_B[1] ** 2
    v = _axis((-r, r), 8 * steps + 1)
    curves = [
        Surface(
            x=v, y=None, loss=loss_b_gspace(_t(v), s).numpy(), x_label="v = w₁w₂", z_label="L = sin(y)",
            title=f"G-space of network b, w₂ {'>' if s > 0 else '<'} 0: L = sin({'' if s > 0 else '−'}"
                  f"relu({'' if s > 0 else '−'}v))",
            extras={"sign": np.asarray(float(s))},
            metadata={"figure": "gspace-1.5", "network": "b", "chart": "gspace", "skeleton_weight": "w2",
                      "sign": float(s)},
        )
        for s in (1.0, -1.0)
    ]  # fmt: skip
    return [plane, *curves]


def fixed_plane_outline(b: float, lim=LIM_4_9, n: int = 200) -> np.ndarray:
    """Boundary of the window ``w2, w3 in lim`` of the plane ``{w1 = b}`` in G-space, ``(4n, 2)`` ``(v1, v2)``."""
    lo, hi = lim
    t = np.linspace(lo, hi, n)
    edges = [
        (t, np.full(n, lo)),  # w3 = lo
        (np.full(n, hi), t),  # w2 = hi
        (t[::-1], np.full(n, hi)),  # w3 = hi
        (np.full(n, lo), t[::-1]),  # w2 = lo
    ]
    w2 = np.concatenate([e[0] for e in edges])
    w3 = np.concatenate([e[1] for e in edges])
    v1, v2, _ = gspace_b2(b, _t(w2), _t(w3))
    return np.stack([v1.numpy(), v2.numpy()], axis=-1)


def gspace_4_9_surfaces(
    fixed=FIG_4_9_FIXED, steps: int | None = None, source: str = DEFAULT_SOURCE
) -> list[Surface]:
    """Fig. 4.9's network b in G-space (``w3 > 0``): one surface ``sin(gain relu(v1 + v2))`` for every ``w1``.

    Returns one G-space surface whose ``extras`` hold ``outline_<i>`` (the image of the plotted
    ``(w2, w3)`` window of the plane ``w1 = fixed[i]``) and ``fixed`` (the values). ``source`` picks
    Fig. 4.9's window and the loss of its network b (`fig_4_9_surfaces`).
    """
    source = check_source("gspace-4.9", source)
    steps = grid_steps(source, steps)
    if len(fixed) == 0:
        raise ValueError("give at least one fixed value for w1")
    lim, gain = window_4_9(source), gain_4_9(source)
    lo, hi = lim
    outlines = {f"outline_{i}": fixed_plane_outline(b, lim) for i, b in enumerate(fixed)}
    pts = np.concatenate(list(outlines.values()))
    v1_lim = (min(0.0, pts[:, 0].min()), max(hi, pts[:, 0].max()))
    v2_lim = (min(0.0, pts[:, 1].min()), max(hi, pts[:, 1].max()))
    x, y, z = _plane(lambda v1, v2: loss_b2_gspace(v1, v2, 1.0, gain), v1_lim, v2_lim, steps)
    loss = gspace_4_9_loss(source)
    return [
        Surface(
            x=x, y=y, loss=z, x_label="v₁ = w₁w₃", y_label="v₂ = w₂w₃",
            z_label=loss_label(gain),
            title=f"network b′ in G-space (w₃ > 0): L = {loss} for every w₁",
            extras={**outlines, "fixed": np.asarray([float(b) for b in fixed])},
            metadata={"figure": "gspace-4.9", "network": "b", "chart": "gspace", "skeleton_weight": "w3",
                      "coordinates": "v1 = w1 w3, v2 = w2 w3", "fixed_planes": [float(b) for b in fixed],
                      "window": [lo, hi], "source": source, "gain": gain},
        )
    ]  # fmt: skip


def gspace_4_9_window(steps: int | None = None, source: str = DEFAULT_SOURCE) -> Surface:
    """The G-space surface of Fig. 4.9's network b over Fig. 4.9 (a)'s window: network a's surface in ``v`` (with
    the code's factor 0.3 for ``source="code"``, which the code's panel (a) does not have)."""
    source = check_source("gspace-4.9", source)
    steps = grid_steps(source, steps)
    lim, gain = window_4_9(source), gain_4_9(source)
    x, y, z = _plane(lambda v1, v2: loss_b2_gspace(v1, v2, 1.0, gain), lim, lim, steps)
    return Surface(
        x=x, y=y, loss=z, x_label="v₁ = w₁w₃", y_label="v₂ = w₂w₃",
        z_label=loss_label(gain),
        title=(f"G-space over [{lim[0]:g}, {lim[1]:g}]²: network a′ of Fig. 4.9 (a)\nwith (w₁, w₂) renamed (v₁, v₂)"
               if gain == 1.0 else f"G-space over [{lim[0]:g}, {lim[1]:g}]²: sin({gain:g} (v₁ + v₂)),\n"
               f"Fig. 4.9 (a) with the factor {gain:g} of (b)-(d)"),
        metadata={"figure": "gspace-4.9", "network": "b", "chart": "gspace", "window": list(lim),
                  "source": source, "gain": gain},
    )  # fmt: skip
