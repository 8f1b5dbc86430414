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

Text and code. The thesis's plotting code differs from its text in two figures, and the printed
figures follow the code. Each figure that differs takes ``source="text"`` or ``source="code"``
(default ``"code"``, the printed figure):

* Fig. 4.9: the text defines ``L = sin(y)`` on ``[0, 3]^2``; the code draws ``sin(0.3 w3 (w1 + w2))``
  on ``[0, 10]^2``, i.e. ``L = sin(0.3 y)``. Network a gets the same loss ``sin(0.3 y)`` here, so the
  panels stay comparable, and so does the G-space chart of ``"gspace-4.9"``.
* Fig. 1.6: the text's arrows show the gradient of ``L``; the code draws the descent direction
  ``-grad(0.1 w1 w2) = -0.1 (w2, w1)`` of another function. On an invariant line ``w1 w2 = c`` (``w1 > 0``)
  the true gradient is ``cos(c) (w2, w1)``, so both arrows are parallel and rescale alike (by ``1/alpha``
  in ``w1``, ``alpha`` in ``w2``); they differ by the factor ``-0.1 / cos(c)``: sign and length per line.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from landscape._surface import Surface

FIG_4_9_FIXED = (1.0, 6.0, 10.0)

SOURCES = ("text", "code")  # the thesis's text, or its plotting code (the printed figures)
SOURCE_FIGURES = ("1.6", "4.9", "gspace-4.9")  # the figures whose code differs from the text
DEFAULT_SOURCE = "code"
SOURCE_LABELS = {"text": "as defined in the thesis text", "code": "as printed, from the thesis code"}
CODE_GAIN_4_9 = 0.3  # Fig. 4.9 in the thesis code: L = sin(0.3 y)
CODE_ARROWS_1_6 = 0.1  # Fig. 1.6 in the thesis code: arrows -grad(0.1 w1 w2)

# Plot windows: Fig. 1.5/1.6 show the dead half-plane w1 < 0 too; Fig. 4.9 uses positive weights
# only, as in the thesis.
LIM_1_5_A = (-4.0, 12.0)
LIM_1_5_B = (-4.0, 4.0)
LIM_4_9 = (0.0, 3.0)
LIM_4_9_CODE = (0.0, 10.0)

# Fig. 1.6: invariant lines w1 w2 = c and the rescaling factors alpha at which arrows are drawn.
# |cos(c)| is near 1 on these lines, so the arrows are long enough to read.
FIG_1_6_LEVELS = (-3.0, -0.5, 0.5, 3.0)
FIG_1_6_ALPHAS = (0.5, 2**-0.5, 1.0, 2**0.5, 2.0)


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
    """The source a toy figure is drawn from: ``source``, or `DEFAULT_SOURCE` (the printed figure) for the
    figures whose code differs from the text, ``"text"`` for the others; refused where it does not apply."""
    if source is not None and source not in SOURCES:
        raise ValueError(f"source must be 'text' or 'code', got {source!r}")
    if figure not in SOURCE_FIGURES:
        if source not in (None, "text"):
            raise ValueError(f"--source code applies to figures {', '.join(SOURCE_FIGURES)} only, where the "
                             f"thesis's plotting code differs from its text; figure {figure} has one definition")
        return "text"
    return DEFAULT_SOURCE if source is None else source


def window_4_9(source: str) -> tuple[float, float]:
    """The weight window of Fig. 4.9: ``[0, 3]`` in the thesis text, ``[0, 10]`` in its code."""
    return LIM_4_9_CODE if source == "code" else LIM_4_9


def gain_4_9(source: str) -> float:
    """The factor in Fig. 4.9's loss ``sin(gain y)``: 1 in the thesis text, 0.3 in its code."""
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


def fig_1_5_surfaces(steps: int = 201) -> list[Surface]:
    """Thesis Fig. 1.5: network a's curve and network b's surface (``L = sin(y)``, ``x = 1``)."""
    _check_steps(steps)
    wa = _axis(LIM_1_5_A, 8 * steps + 1)
    curve = Surface(
        x=wa, y=None, loss=loss_a(_t(wa)).numpy(), x_label="w", title=TITLE_A, z_label="L = sin(y)",
        metadata={"figure": "1.5", "network": "a", "function": "sin(relu(w))"},
    )  # fmt: skip
    x, y, z = _plane(loss_b, LIM_1_5_B, LIM_1_5_B, steps)
    plane = Surface(
        x=x, y=y, loss=z, x_label="w₁", y_label="w₂", title=TITLE_B, z_label="L = sin(y)",
        metadata={"figure": "1.5", "network": "b", "function": "sin(w2 relu(w1))"},
    )  # fmt: skip
    return [curve, plane]


ARROWS_1_6 = {
    "text": "(cos(y) w2 [w1>0], cos(y) relu(w1)), y = w2 relu(w1): the gradient of L (thesis text)",
    "code": "-0.1 (w2, w1) = -grad(0.1 w1 w2): the thesis code's arrows, parallel to grad L on each line",
}


def fig_1_6_surface(steps: int = 201, source: str = DEFAULT_SOURCE) -> Surface:
    """Thesis Fig. 1.6: network b's surface with its invariant lines and gradient arrows.

    ``extras`` hold ``arrow_points`` ``(m, 2)``, ``arrow_vector`` ``(m, 2)`` (the drawn arrows: the true
    gradient of the plotted loss for ``source="text"``, the thesis code's ``-grad(0.1 w1 w2)`` for
    ``"code"``), ``arrow_gradient`` ``(m, 2)`` (the true gradient, either way), ``arrow_level`` and
    ``arrow_alpha`` ``(m,)``, and ``invariant_levels`` (the ``c`` of the drawn lines ``w1 w2 = c``).
    """
    _check_steps(steps)
    source = check_source("1.6", source)
    x, y, z = _plane(loss_b, LIM_1_5_B, LIM_1_5_B, steps)
    pts, grads, level, alpha = fig_1_6_arrows()
    drawn = grads if source == "text" else -CODE_ARROWS_1_6 * pts[:, ::-1].copy()
    return Surface(
        x=x, y=y, loss=z, x_label="w₁", y_label="w₂", z_label="L = sin(y)",
        title="network b: invariant lines w₁w₂ = c and " + ("the gradient ∇L" if source == "text" else
                                                             "the thesis code's arrows −∇(0.1 w₁w₂)"),
        extras={
            "arrow_points": pts, "arrow_vector": drawn, "arrow_gradient": grads, "arrow_level": level,
            "arrow_alpha": alpha, "invariant_levels": np.asarray(FIG_1_6_LEVELS),
        },
        metadata={"figure": "1.6", "network": "b", "function": "sin(w2 relu(w1))", "source": source,
                  "arrows": ARROWS_1_6[source],
                  "gradient": "(cos(y) w2 [w1>0], cos(y) relu(w1)), y = w2 relu(w1)"},
    )  # fmt: skip


def fixed_title(b: float) -> str:
    return f"network b′, w₁ set to {b:g}\nreading (a): the function changes with w₁"


def fig_4_9_surfaces(fixed=FIG_4_9_FIXED, steps: int = 201, source: str = DEFAULT_SOURCE) -> list[Surface]:
    """Thesis Fig. 4.9: network a over ``(w1, w2)`` and network b over ``(w2, w3)`` for each fixed ``w1``.

    Reading (a) of the fixed-weight planes: ``w1`` is set to each value ``b`` and the function changes.
    Each fixed-weight surface carries ``extras["fixed"] = b``. ``source="code"`` (the printed figure) draws
    ``L = sin(0.3 y)`` on ``[0, 10]^2``, ``"text"`` the text's ``L = sin(y)`` on ``[0, 3]^2``.
    """
    _check_steps(steps)
    source = check_source("4.9", source)
    if len(fixed) == 0:
        raise ValueError("give at least one fixed value for w1")
    lim, gain = window_4_9(source), gain_4_9(source)
    z_label = loss_label(gain)
    common = {"figure": "4.9", "source": source, "window": list(lim), "gain": gain}
    x, y, z = _plane(lambda w1, w2: loss_a2(w1, w2, gain), lim, lim, steps)
    out = [
        Surface(
            x=x, y=y, loss=z, x_label="w₁", y_label="w₂", z_label=z_label,
            title="network a′: y = relu(w₁ + w₂)",
            metadata={**common, "network": "a", "function": _sin_of(gain, "relu(w1 + w2)")},
        )
    ]  # fmt: skip
    for b in fixed:
        x, y, z = _plane(lambda w2, w3, b=b: loss_b2(b, w2, w3, gain), lim, lim, steps)
        out.append(
            Surface(
                x=x, y=y, loss=z, x_label="w₂", y_label="w₃", z_label=z_label, title=fixed_title(b),
                extras={"fixed": np.asarray(float(b))},
                metadata={**common, "network": "b", "function": _sin_of(gain, f"w3 relu({b:g} + w2)"),
                          "reading": "a", "fixed_weight": "w1", "fixed": float(b)},
            )
        )  # fmt: skip
    return out


def gspace_b_surfaces(steps: int = 201) -> list[Surface]:
    """Network b in weight space and in G-space.

    Returns ``[weight-space plane over (w1, w2), G-space curve for w2 > 0, G-space curve for w2 < 0]``;
    the ``w2 > 0`` curve ``sin(relu(v))`` is network a's curve of Fig. 1.5.
    """
    _check_steps(steps)
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


def gspace_4_9_surfaces(fixed=FIG_4_9_FIXED, steps: int = 201, source: str = DEFAULT_SOURCE) -> list[Surface]:
    """Fig. 4.9's network b in G-space (``w3 > 0``): one surface ``sin(gain relu(v1 + v2))`` for every ``w1``.

    Returns one G-space surface whose ``extras`` hold ``outline_<i>`` (the image of the plotted
    ``(w2, w3)`` window of the plane ``w1 = fixed[i]``) and ``fixed`` (the values). ``source`` picks
    Fig. 4.9's window and loss (`fig_4_9_surfaces`).
    """
    _check_steps(steps)
    source = check_source("gspace-4.9", source)
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


def gspace_4_9_window(steps: int = 201, source: str = DEFAULT_SOURCE) -> Surface:
    """The G-space surface of Fig. 4.9's network b over Fig. 4.9 (a)'s window: network a's surface in ``v``."""
    _check_steps(steps)
    source = check_source("gspace-4.9", source)
    lim, gain = window_4_9(source), gain_4_9(source)
    x, y, z = _plane(lambda v1, v2: loss_b2_gspace(v1, v2, 1.0, gain), lim, lim, steps)
    return Surface(
        x=x, y=y, loss=z, x_label="v₁ = w₁w₃", y_label="v₂ = w₂w₃",
        z_label=loss_label(gain),
        title=f"G-space over [{lim[0]:g}, {lim[1]:g}]²: network a′ of Fig. 4.9 (a)\n"
              "with (w₁, w₂) renamed (v₁, v₂)",
        metadata={"figure": "gspace-4.9", "network": "b", "chart": "gspace", "window": list(lim),
                  "source": source, "gain": gain},
    )  # fmt: skip
