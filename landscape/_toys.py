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
  ``w1`` set to a value ``b``. This is reading (a) of DESIGN.md section 1: setting ``w1 = b`` changes
  the network function, and each ``b`` gives a different surface ``sin(w3 (b + w2))`` (for
  ``b + w2 > 0``).

G-space (DESIGN.md section 2; thesis ch. 2). Each hidden unit has one designated outgoing
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
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from landscape._surface import Surface

FIG_4_9_FIXED = (1.0, 6.0, 10.0)

# Plot windows: Fig. 1.5/1.6 show the dead half-plane w1 < 0 too; Fig. 4.9 uses positive weights
# only, as in the thesis.
LIM_1_5_A = (-4.0, 12.0)
LIM_1_5_B = (-4.0, 4.0)
LIM_4_9 = (0.0, 3.0)

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
    """``dL/dw`` of :func:`loss_a`: ``cos(relu(w)) [w > 0]``."""
    w = _t(w)
    return torch.cos(torch.relu(w)) * _step(w)


def loss_b(w1, w2) -> Tensor:
    """Fig. 1.5 b: ``sin(w2 relu(w1))``."""
    return torch.sin(_t(w2) * torch.relu(_t(w1)))


def grad_b(w1, w2) -> tuple[Tensor, Tensor]:
    """``(dL/dw1, dL/dw2)`` of :func:`loss_b`: ``(cos(y) w2 [w1 > 0], cos(y) relu(w1))``."""
    w1, w2 = _t(w1), _t(w2)
    c = torch.cos(w2 * torch.relu(w1))
    return c * w2 * _step(w1), c * torch.relu(w1)


def loss_a2(w1, w2) -> Tensor:
    """Fig. 4.9 a: ``sin(relu(w1 + w2))``."""
    return torch.sin(torch.relu(_t(w1) + _t(w2)))


def grad_a2(w1, w2) -> tuple[Tensor, Tensor]:
    """``(dL/dw1, dL/dw2)`` of :func:`loss_a2` (both ``cos(y) [w1 + w2 > 0]``)."""
    s = _t(w1) + _t(w2)
    g = torch.cos(torch.relu(s)) * _step(s)
    return g, g.clone()


def loss_b2(w1, w2, w3) -> Tensor:
    """Fig. 4.9 b: ``sin(w3 relu(w1 + w2))``."""
    return torch.sin(_t(w3) * torch.relu(_t(w1) + _t(w2)))


def grad_b2(w1, w2, w3) -> tuple[Tensor, Tensor, Tensor]:
    """``(dL/dw1, dL/dw2, dL/dw3)`` of :func:`loss_b2`."""
    w3, s = _t(w3), _t(w1) + _t(w2)
    c = torch.cos(w3 * torch.relu(s))
    g = c * w3 * _step(s)
    return g, g.clone(), c * torch.relu(s)


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


def loss_b2_gspace(v1, v2, sign=1.0) -> Tensor:
    """Fig. 4.9 network b's loss in G-space: ``sin(s relu(s (v1 + v2)))``; network a's for ``w3 > 0``."""
    s = _t(sign)
    return torch.sin(s * torch.relu(s * (_t(v1) + _t(v2))))


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


def fig_1_6_surface(steps: int = 201) -> Surface:
    """Thesis Fig. 1.6: network b's surface with its invariant lines and exact gradient arrows.

    ``extras`` hold ``arrow_points`` ``(m, 2)``, ``arrow_gradient`` ``(m, 2)`` (the true gradient of
    the plotted loss at those points), ``arrow_level`` and ``arrow_alpha`` ``(m,)``, and
    ``invariant_levels`` (the ``c`` of the drawn lines ``w1 w2 = c``).
    """
    _check_steps(steps)
    x, y, z = _plane(loss_b, LIM_1_5_B, LIM_1_5_B, steps)
    pts, grads, level, alpha = fig_1_6_arrows()
    return Surface(
        x=x, y=y, loss=z, x_label="w₁", y_label="w₂", z_label="L = sin(y)",
        title="network b: invariant lines w₁w₂ = c and the gradient ∇L",
        extras={
            "arrow_points": pts, "arrow_gradient": grads, "arrow_level": level, "arrow_alpha": alpha,
            "invariant_levels": np.asarray(FIG_1_6_LEVELS),
        },
        metadata={"figure": "1.6", "network": "b", "function": "sin(w2 relu(w1))",
                  "gradient": "(cos(y) w2 [w1>0], cos(y) relu(w1)), y = w2 relu(w1)"},
    )  # fmt: skip


def fixed_title(b: float) -> str:
    return f"network b′, w₁ set to {b:g}\nreading (a): the function changes with w₁"


def fig_4_9_surfaces(fixed=FIG_4_9_FIXED, steps: int = 201) -> list[Surface]:
    """Thesis Fig. 4.9: network a over ``(w1, w2)`` and network b over ``(w2, w3)`` for each fixed ``w1``.

    Reading (a) of DESIGN.md section 1: ``w1`` is set to each value ``b`` and the function changes.
    Each fixed-weight surface carries ``extras["fixed"] = b``.
    """
    _check_steps(steps)
    if len(fixed) == 0:
        raise ValueError("give at least one fixed value for w1")
    x, y, z = _plane(loss_a2, LIM_4_9, LIM_4_9, steps)
    out = [
        Surface(
            x=x, y=y, loss=z, x_label="w₁", y_label="w₂", z_label="L = sin(y)",
            title="network a′: y = relu(w₁ + w₂)",
            metadata={"figure": "4.9", "network": "a", "function": "sin(relu(w1 + w2))"},
        )
    ]  # fmt: skip
    for b in fixed:
        x, y, z = _plane(lambda w2, w3, b=b: loss_b2(b, w2, w3), LIM_4_9, LIM_4_9, steps)
        out.append(
            Surface(
                x=x, y=y, loss=z, x_label="w₂", y_label="w₃", z_label="L = sin(y)", title=fixed_title(b),
                extras={"fixed": np.asarray(float(b))},
                metadata={"figure": "4.9", "network": "b", "function": f"sin(w3 relu({b:g} + w2))",
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


def gspace_4_9_surfaces(fixed=FIG_4_9_FIXED, steps: int = 201) -> list[Surface]:
    """Fig. 4.9's network b in G-space (``w3 > 0``): one surface ``sin(relu(v1 + v2))`` for every ``w1``.

    Returns one G-space surface whose ``extras`` hold ``outline_<i>`` (the image of the plotted
    ``(w2, w3)`` window of the plane ``w1 = fixed[i]``) and ``fixed`` (the values).
    """
    _check_steps(steps)
    if len(fixed) == 0:
        raise ValueError("give at least one fixed value for w1")
    lo, hi = LIM_4_9
    outlines = {f"outline_{i}": fixed_plane_outline(b) for i, b in enumerate(fixed)}
    pts = np.concatenate(list(outlines.values()))
    v1_lim = (min(0.0, pts[:, 0].min()), max(hi, pts[:, 0].max()))
    v2_lim = (min(0.0, pts[:, 1].min()), max(hi, pts[:, 1].max()))
    x, y, z = _plane(loss_b2_gspace, v1_lim, v2_lim, steps)
    return [
        Surface(
            x=x, y=y, loss=z, x_label="v₁ = w₁w₃", y_label="v₂ = w₂w₃", z_label="L = sin(y)",
            title="network b′ in G-space (w₃ > 0): L = sin(relu(v₁ + v₂)) for every w₁",
            extras={**outlines, "fixed": np.asarray([float(b) for b in fixed])},
            metadata={"figure": "gspace-4.9", "network": "b", "chart": "gspace", "skeleton_weight": "w3",
                      "coordinates": "v1 = w1 w3, v2 = w2 w3", "fixed_planes": [float(b) for b in fixed],
                      "window": [lo, hi]},
        )
    ]  # fmt: skip


def gspace_4_9_window(steps: int = 201) -> Surface:
    """The G-space surface of Fig. 4.9's network b over Fig. 4.9 (a)'s window: network a's surface in ``v``."""
    _check_steps(steps)
    x, y, z = _plane(loss_b2_gspace, LIM_4_9, LIM_4_9, steps)
    return Surface(
        x=x, y=y, loss=z, x_label="v₁ = w₁w₃", y_label="v₂ = w₂w₃", z_label="L = sin(y)",
        title=f"G-space over [{LIM_4_9[0]:g}, {LIM_4_9[1]:g}]²: network a′ of Fig. 4.9 (a)\n"
              "with (w₁, w₂) renamed (v₁, v₂)",
        metadata={"figure": "gspace-4.9", "network": "b", "chart": "gspace", "window": list(LIM_4_9)},
    )  # fmt: skip
