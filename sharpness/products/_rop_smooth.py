"""The graph R-operator's smooth operations (`sharpness.products._rop_graph`): the pieces of a transformer.

Unlike the fixed linear maps and bilinear layers of `sharpness.products._rop_ops`, these operations have a second
derivative in their input, so the tangent error at their input gains a term from the first-order error ``delta``
at their output: for ``z = f(x)`` with Jacobian ``J(x)``, ``xdot`` the input's tangent and ``ddot`` the output's
tangent error, the input's tangent error is ``J^T ddot + (d/dt J(x + t xdot)^T) delta``. Each one writes both in
closed form:

- a parameter used outside a module (``self.pos``): tangent ``v``, product ``(Hv) += ddot`` (`_Param`);
- elementwise functions (GELU exact or tanh-approximated, tanh, sigmoid, SiLU, softplus, exp, log, powers, the hard
  sigmoid ``clamp(x + 3, 0, 6) / 6`` and hard swish ``x`` times it, second derivatives zero and ``1/3`` between the
  kinks):
  ``f'(x) ddot + f''(x) xdot delta`` (`_Pointwise`); the elementwise product of two tensors, bilinear (`_Product`);
- ``F.normalize`` over the last axis, ``y = x / max(|x|, eps)``: ``J = (I - y y^T) / |x|`` and the second-order
  term ``-(a J delta + ydot (y . delta) + y (ydot . delta)) / |x|``, ``a = y . xdot`` (`_Normalize`);
- the log-softmax ``z = x - log sum exp(x)`` along an axis, ``p = exp(z)``: ``ddot - p (sum(ddot) + zdot sum(delta))``
  (`_LogSoftmax`);
- LayerNorm over the last axis, ``z = gamma xhat + beta``, ``xhat = (x - mean x) / s``, ``s = sqrt(var x + eps)``
  per row of ``D`` features. Its Jacobian ``J = (I - 1 1^T / D - xhat xhat^T / D) / s`` is symmetric; with
  ``a = mean(xhat xdot)``, ``xhat' = J xdot`` and ``b = mean(xhat e)``, the second-order term of an error ``e``
  at ``xhat`` is ``-(a J e + xhat' b + xhat mean(xhat' e)) / s`` (`_LayerNorm`). RMSNorm, ``xhat = x / s`` with
  ``s = sqrt(mean(x^2) + eps)``, is the same without the centring: ``J = (I - xhat xhat^T / D) / s`` and the same
  second-order term;
- ``nn.MultiheadAttention`` (self-attention, packed projections), ``out = merge(softmax(c q k^T) v) W_o^T + b_o``
  with ``(q, k, v) = x W^T + b`` split into heads and ``c = 1 / sqrt(head size)``: the projections are affine
  layers, ``q k^T`` and ``A v`` bilinear (each factor's tangent error gains the other factor's tangent times the
  first-order error), and the row softmax ``A`` has the symmetric Jacobian ``J g = A (g - <A, g>)`` and the
  second-order term ``Adot (delta - <A, delta>) - A <Adot, delta>`` with ``Adot = J Sdot`` (`_Attention`).

The rules for attention written by hand (products of two activations, softmax, ``F.scaled_dot_product_attention``)
follow the same protocol (`_Smooth`) in `sharpness.products._rop_attention`.

Every operation keeps what its products read (its input or normalized input, the attention's factors and
probabilities) and, where its input moves, its first-order errors; no operation writes into a tensor it was
given.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from sharpness.products._rop import _flat_rows, add_outer


# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Param:
    """A trainable parameter read by the forward outside a module (``self.pos``): a step without inputs."""

    name: str

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,)


# ------------------------------------------------------------------------------------------------
class _Smooth:
    """A parameter-free operation with a second derivative, of one or more tensor inputs; see the module docstring.
    ``forward`` keeps what ``tangent``, ``adjoint`` and ``backward`` read; ``errors`` is what the products keep of the
    first-order error ``delta`` at the output (``delta`` itself unless an operation keeps more) and the inputs'
    errors; ``backward`` is the inputs' tangent errors from the output's tangent error ``g_dot``, that kept error,
    and, for an operation with ``inner`` set, the inner tangents its ``tangent`` returned beside the output's."""

    call = None  # no original call to replay (the graph reader's protocol for maps)
    inner = False  # whether ``tangent`` returns ``(output tangent, inner tangents)`` for ``backward``

    def errors(self, g: Tensor, saved, need: list[bool]) -> tuple[object, list[Tensor | None]]:
        return g, self.adjoint(g, saved, need)


def _derivatives(kind: str, x: Tensor, p: object) -> tuple[Tensor, Tensor, Tensor]:
    """``(f(x), f'(x), f''(x))`` of the elementwise function ``kind`` (``p``: its number, where it has one)."""
    if kind == "tanh":
        t = torch.tanh(x)
        d1 = 1 - t * t
        return t, d1, -2 * t * d1
    if kind == "gelu":  # exact, x Phi(x)
        pdf = torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
        return x * cdf, cdf + x * pdf, pdf * (2 - x * x)
    if kind == "gelu_tanh":  # 0.5 x (1 + tanh(u)), u = c (x + k x^3)
        c, k = math.sqrt(2 / math.pi), 0.044715
        t = torch.tanh(c * (x + k * x * x * x))
        du, ddu = c * (1 + 3 * k * x * x), 6 * c * k * x
        sech2 = 1 - t * t
        return 0.5 * x * (1 + t), 0.5 * (1 + t) + 0.5 * x * sech2 * du, sech2 * (du + 0.5 * x * (ddu - 2 * t * du * du))
    if kind in ("sigmoid", "silu"):
        s = torch.sigmoid(x)
        d = s * (1 - s)
        if kind == "sigmoid":
            return s, d, d * (1 - 2 * s)
        return x * s, s + x * d, d * (2 + x * (1 - 2 * s))
    if kind == "softplus":  # log(1 + exp(beta x)) / beta, linear where beta x > threshold (p = (beta, threshold))
        beta, threshold = p
        linear = beta * x > threshold
        s = torch.sigmoid(beta * x)
        return F.softplus(x, beta, threshold), s.masked_fill(linear, 1.0), (beta * s * (1 - s)).masked_fill(linear, 0.0)
    if kind == "exp":
        e = torch.exp(x)
        return e, e, e
    if kind in ("hardsigmoid", "hardswish"):  # clamp(x + 3, 0, 6) / 6 (and x times it), as torch's kernels compute
        # (a mask times a number would take torch's default dtype, not x's)
        gate, inner = torch.clamp(x + 3, 0, 6) / 6, ((x > -3) & (x < 3)).to(x.dtype)
        if kind == "hardsigmoid":  # piecewise linear: no second derivative
            return gate, inner * (1 / 6), torch.zeros_like(x)
        # torch's own slope at the kinks: 0 below -3, x / 3 + 1/2 up to 3 inclusive, 1 above
        slope = torch.where(x < -3, 0.0, torch.where(x <= 3, x / 3 + 0.5, 1.0))
        return x * gate, slope, inner * (1 / 3)
    if kind == "log":
        r = 1 / x
        return torch.log(x), r, -r * r
    # powers: x ** p (sqrt p = 1/2, rsqrt p = -1/2, square p = 2); p = 0 and 1 exactly, where 0 * inf would be NaN
    if p in (0.0, 1.0):
        zero = torch.zeros_like(x)
        return (torch.ones_like(x), zero, zero) if p == 0.0 else (x.clone(), torch.ones_like(x), zero)
    return x**p, p * x ** (p - 1), p * (p - 1) * x ** (p - 2)


# Elementwise functions with a second derivative the products read (`_Pointwise`): the name of the call, and the kind
POINTWISE_FUNCTIONS = {"tanh": "tanh", "sigmoid": "sigmoid", "silu": "silu", "exp": "exp", "log": "log",
                       "sqrt": "sqrt", "rsqrt": "rsqrt", "square": "square", "hardsigmoid": "hardsigmoid",
                       "hardswish": "hardswish"}  # fmt: skip
_POWERS = {"sqrt": 0.5, "rsqrt": -0.5, "square": 2.0}


@dataclass(frozen=True)
class _Pointwise(_Smooth):
    """An elementwise function with a second derivative (``kind``: exact or tanh-approximated GELU, tanh, sigmoid,
    SiLU, softplus, exp, log, the hard sigmoid and hard swish (MobileNetV3's), or a power ``x ** p``; ``p`` is the
    power, or softplus's ``(beta, threshold)``): keeps ``f'(x)`` and ``f''(x)``."""

    kind: str
    p: object = None

    def forward(self, xs: list[Tensor], args: list) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        kind, p = ("power", _POWERS[self.kind]) if self.kind in _POWERS else (self.kind, self.p)
        f, d1, d2 = _derivatives(kind, xs[0], p)
        return f, (d1, d2)

    def tangent(self, xdots: list[Tensor | None], saved) -> Tensor:
        return xdots[0] * saved[0]

    def adjoint(self, g: Tensor, saved, need: list[bool]) -> list[Tensor]:
        return [g * saved[0]]

    def backward(self, g_dot: Tensor, delta: Tensor, xdots: list[Tensor | None], saved, need: list[bool],
                 inner: None = None) -> list:  # fmt: skip
        second = xdots[0] * saved[1]
        if self.kind == "power" and 1.0 < self.p < 2.0:  # f''(0) is infinite: no second-order term where xdot is 0
            second = torch.where(xdots[0] == 0, 0.0, second)
        return [torch.addcmul(g_dot * saved[0], second, delta)]


@dataclass(frozen=True)
class _Product(_Smooth):
    """The elementwise product ``a * b`` of two tensors, broadcast (a parameter, a ``(N, T, 1)`` scale, a constant):
    bilinear, ``zdot = adot b + a bdot``; the errors ``g b`` and ``g a`` (summed back to each operand's shape), each
    operand's tangent error gaining the other's tangent times the first-order error: ``g_dot b + delta bdot``."""

    def forward(self, xs: list[Tensor], args: list) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        return xs[0] * xs[1], (xs[0], xs[1])

    def tangent(self, xdots: list[Tensor | None], saved) -> Tensor:
        (a, b), (a_dot, b_dot) = saved, xdots
        if a_dot is None or b_dot is None:
            return a_dot * b if b_dot is None else a * b_dot
        return (a_dot * b).addcmul_(a, b_dot)  # both terms have the output's shape

    def adjoint(self, g: Tensor, saved, need: list[bool]) -> list[Tensor | None]:
        a, b = saved
        return [_summed(g * b, a.shape) if need[0] else None, _summed(g * a, b.shape) if need[1] else None]

    def backward(self, g_dot: Tensor, delta: Tensor, xdots: list[Tensor | None], saved, need: list[bool],
                 inner: None = None) -> list[Tensor | None]:  # fmt: skip
        (a, b), (a_dot, b_dot) = saved, xdots
        errs: list[Tensor | None] = [None, None]
        if need[0]:
            out = g_dot * b
            errs[0] = _summed(out if b_dot is None else out + delta * b_dot, a.shape)
        if need[1]:
            out = g_dot * a
            errs[1] = _summed(out if a_dot is None else out + delta * a_dot, b.shape)
        return errs


def _summed(t: Tensor, shape: torch.Size) -> Tensor:
    """``t`` summed over the axes along which an operand of ``shape`` was broadcast (``t`` where none was)."""
    return t if t.shape == shape else t.sum_to_size(shape)


# ------------------------------------------------------------------------------------------------
def _row_sum(t: Tensor) -> Tensor:
    """``t.sum(-1, keepdim=True)`` as the product with a column of ones: on the short last axes here (16 to 64
    entries) torch's reduction takes about twice as long as the matrix-vector product (one pass either way)."""
    return torch.matmul(t, t.new_ones(t.shape[-1], 1))


def _row_mean(t: Tensor) -> Tensor:
    """``t.mean(-1, keepdim=True)`` by `_row_sum`."""
    return _row_sum(t).div_(t.shape[-1])


def _row_dot_mean(a: Tensor, b: Tensor) -> Tensor:
    """``(a * b).mean(-1, keepdim=True)`` of two tensors of one shape, as a batch of ``1 x D`` by ``D x 1``
    products: no product-sized temporary, and about two thirds of the time of the product and its reduction."""
    width = a.shape[-1]
    dots = torch.bmm(a.reshape(-1, 1, width), b.reshape(-1, width, 1))
    return dots.view(*a.shape[:-1], 1).div_(width)


# Dtypes whose LayerNorm statistics torch keeps in the input's own dtype: there its fused LayerNorm backward kernel
# takes the per-row zeros and ones `_centred` passes (half-precision inputs keep them in float32 on some devices).
_FUSED_NORM_DTYPES = (torch.float32, torch.float64)


def _centred(xhat: Tensor, t: Tensor, rms: bool = False) -> Tensor:
    """``s J t = t - mean(t) - xhat mean(xhat t)`` per row of the last axis, in a new tensor (``t - xhat mean(xhat t)``
    for an RMS normalization, which does not centre). Where the dtype allows, by torch's fused LayerNorm backward
    kernel (one pass over ``t`` and ``xhat``; about half the time of the four separate passes on T1's (500, 16, 32)
    activations on the CPU): ``J`` is symmetric, so the backward of the normalization of ``xhat`` itself (mean 0 and
    ``1 / s = 1`` per row, no affine) is exactly this."""
    if rms:
        t = t.expand_as(xhat)
        return t.addcmul(xhat, _row_dot_mean(xhat, t), value=-1.0)
    if xhat.dtype in _FUSED_NORM_DTYPES:
        t = t.expand_as(xhat)  # the kernel reads t as xhat's shape: a smaller t would be read out of bounds
        rows = (*xhat.shape[:-1], 1)
        return torch.ops.aten.native_layer_norm_backward(
            t, xhat, xhat.shape[-1:], xhat.new_zeros(rows), xhat.new_ones(rows), None, None, [True, False, False]
        )[0]
    return torch.sub(t, _row_mean(t)).addcmul_(xhat, _row_dot_mean(xhat, t), value=-1.0)


def _norm_jacobian(xhat: Tensor, rstd: Tensor, t: Tensor, rms: bool = False) -> Tensor:
    """``J t`` (= ``J^T t``) of the normalization ``xhat`` over the last axis, ``rstd = 1 / s`` per row."""
    return _centred(xhat, t, rms).mul_(rstd)


def _norm_backward(xhat: Tensor, rstd: Tensor, xhat_dot: Tensor, a: Tensor, e_dot: Tensor, e: Tensor,
                   b: Tensor, rms: bool = False) -> Tensor:  # fmt: skip
    """``J e_dot + (d/dt J(x + t xdot)) e`` of the same normalization, with ``xhat_dot = J xdot``,
    ``a = mean(xhat xdot)`` and ``b = mean(xhat e)``: the second-order term
    ``-(a J e + xhat_dot b + xhat mean(xhat_dot e)) / s`` merged with the first,
    ``J (e_dot - a e / s) - (xhat mean(xhat_dot e) + xhat_dot b) / s`` (the same for LayerNorm and for an RMS
    normalization: the centring is linear and moves nothing). Writes into ``e_dot``."""
    f = e_dot.addcmul_(e, a * rstd, value=-1.0)
    c = _row_dot_mean(xhat_dot, e)
    out = _centred(xhat, f, rms).addcmul_(xhat, c, value=-1.0)
    return out.addcmul_(xhat_dot, b, value=-1.0).mul_(rstd)


@dataclass(frozen=True)
class _LayerNorm:
    """``nn.LayerNorm`` over the last axis: ``z = gamma xhat + beta`` (either parameter may be absent); with ``rms``,
    ``nn.RMSNorm``: ``xhat = x / s``, ``s = sqrt(mean(x^2) + eps)``, not centred (``eps`` ``None``: the rounding unit
    of the input's dtype, as torch's), and no ``beta``.

    Keeps ``xhat`` and ``1 / s`` and, where its input moves, the error ``delta`` at its output, the error
    ``e = gamma delta`` at ``xhat`` and ``mean(xhat e)`` per row: the products' primal factors, formed once."""

    weight: str | None
    bias: str | None
    eps: float | None
    rms: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.weight, self.bias) if n)

    def needs_error(self, input_moves: bool) -> bool:
        return input_moves

    def forward(self, h: Tensor, params: Mapping[str, Tensor]) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        if self.rms:
            eps = torch.finfo(h.dtype).eps if self.eps is None else self.eps
            rstd = torch.rsqrt(_row_dot_mean(h, h).add_(eps))
            xhat = h * rstd
        else:
            # torch's fused kernel (one pass; a reduction by var_mean over a short last axis is several times slower)
            xhat, _, rstd = torch.native_layer_norm(h, h.shape[-1:], None, None, self.eps)
            rstd = rstd.to(xhat.dtype)  # the kernel may keep the statistics of half-precision inputs in float32
        if self.weight:
            z = torch.addcmul(params[self.bias], xhat, params[self.weight]) if self.bias else xhat * params[self.weight]
        else:
            z = xhat + params[self.bias] if self.bias else xhat
        return z, (xhat, rstd)

    def _error_at_xhat(self, g: Tensor, params) -> Tensor:
        return g * params[self.weight] if self.weight else g

    def errors(self, g: Tensor, saved, params, need: bool) -> tuple[tuple, Tensor | None]:
        xhat, rstd = saved
        e = self._error_at_xhat(g, params)
        b = _row_dot_mean(xhat, e)
        return (g, e, b), (_norm_jacobian(xhat, rstd, e, self.rms) if need else None)

    def tangent(self, saved, hdot: Tensor | None, params, v) -> tuple[Tensor, tuple | None]:
        """The output's tangent, and what the products read of the normalized input's: ``J hdot`` and
        ``mean(xhat hdot)``."""
        xhat, rstd = saved
        out = inner = None
        if hdot is not None:
            a = _row_dot_mean(xhat, hdot)
            inner = (_norm_jacobian(xhat, rstd, hdot, self.rms), a)
            if self.weight:
                out = torch.addcmul(v[self.bias], inner[0], params[self.weight]) if self.bias \
                    else inner[0] * params[self.weight]  # fmt: skip
                return out.addcmul_(xhat, v[self.weight]), inner
            out = inner[0] + v[self.bias] if self.bias else inner[0].clone()
            return out, inner
        if self.weight:
            out = torch.addcmul(v[self.bias], xhat, v[self.weight]) if self.bias else xhat * v[self.weight]
        elif self.bias:
            out = v[self.bias].expand_as(xhat).clone()
        return out, inner

    def backward(self, g_dot: Tensor, kept, hdot: Tensor | None, saved, params, v, into, need: bool,
                 inner: tuple | None) -> Tensor | None:  # fmt: skip
        xhat, rstd = saved
        if self.weight:
            total = g_dot * xhat
            if hdot is not None:
                total.addcmul_(kept[0], inner[0])
            into[self.weight].add_(_flat_rows(total).sum(0))
        if self.bias:
            into[self.bias].add_(_flat_rows(g_dot).sum(0))
        if not need:
            return None
        delta, e, b = kept
        e_dot = g_dot * params[self.weight] if self.weight else g_dot.clone()
        if self.weight:
            e_dot.addcmul_(delta, v[self.weight])
        return _norm_backward(xhat, rstd, *inner, e_dot, e, b, self.rms)


# ------------------------------------------------------------------------------------------------
def _axis_sum(t: Tensor, dim: int) -> Tensor:
    """``t.sum(dim, keepdim=True)``, by `_row_sum` where ``dim`` is the last axis (``-1`` or its index)."""
    return _row_sum(t) if dim in (-1, t.dim() - 1) else t.sum(dim, keepdim=True)


def _softmax_jacobian(a: Tensor, t: Tensor, dim: int = -1) -> Tensor:
    """``J t`` (= ``J^T t``) of the softmax along ``dim``, probabilities ``a``: ``a t - a <a, t>``. Outside float64
    by torch's fused softmax backward kernel (one pass; on T1's (4, 500, 16, 16) attention matrices on the CPU about
    half the time of the three separate passes, while in float64 it takes twice their time)."""
    if a.dtype != torch.float64:
        return torch._softmax_backward_data(t.expand_as(a), a, dim, a.dtype)
    at = a * t
    return at.addcmul_(a, _axis_sum(at, dim), value=-1.0)


@dataclass(frozen=True)
class _Normalize(_Smooth):
    """``F.normalize(x, p=2, dim=-1, eps)`` (SwinV2's cosine attention): ``y = x / s`` per row of the last axis,
    ``s = max(|x|, eps)``. Where ``|x| >= eps`` (``f = 1``) the Jacobian ``J = (I - y y^T) / s`` is symmetric, and
    with ``a = y . xdot`` and ``ydot = J xdot`` the second-order term of an error ``delta`` at ``y`` is
    ``-(a J delta + ydot (y . delta) + y (ydot . delta)) / s``; on a row shorter than ``eps`` (``f = 0``) the map is
    ``x / eps``, linear. Keeps ``y``, ``s`` and ``f``."""

    eps: float

    def forward(self, xs: list[Tensor], args: list) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
        x = xs[0]
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        s = norm.clamp_min(self.eps)  # as F.normalize divides; clamp_min's slope passes at eps itself
        y = x / s
        return y, (y, s, (norm >= self.eps).to(x.dtype))

    @staticmethod
    def _jacobian(saved, t: Tensor) -> Tensor:
        y, s, free = saved
        return t.addcmul(y, _row_sum(y * t) * free, value=-1.0).div_(s)

    def tangent(self, xdots: list[Tensor | None], saved) -> Tensor:
        return self._jacobian(saved, xdots[0])

    def adjoint(self, g: Tensor, saved, need: list[bool]) -> list[Tensor]:
        return [self._jacobian(saved, g)]

    def backward(self, g_dot: Tensor, delta: Tensor, xdots: list[Tensor | None], saved, need: list[bool],
                 inner: None = None) -> list[Tensor]:  # fmt: skip
        y, s, free = saved
        if xdots[0] is None:
            return [self._jacobian(saved, g_dot)]
        y_dot = self._jacobian(saved, xdots[0])
        a = _row_sum(y * xdots[0]) * free
        first = self._jacobian(saved, g_dot - delta * (a / s))
        second = torch.addcmul(y_dot * _row_sum(y * delta), y, _row_sum(y_dot * delta)).mul_(free / s)
        return [first.sub_(second)]


@dataclass(frozen=True)
class _LogSoftmax(_Smooth):
    """``z = x - log sum exp(x)`` along ``dim`` (a classifier's log-probabilities, read by ``NLLLoss``): keeps the
    probabilities ``p = exp(z)``. The Jacobian is ``J t = t - <p, t>`` (the sum along ``dim``, broadcast back), its
    adjoint ``J^T g = g - p sum(g)``; along a tangent ``p`` moves by ``pdot = p zdot``, so the second-order term of
    the error ``delta`` at the output is ``-pdot sum(delta)``, and the input's tangent error
    ``g_dot - p (sum(g_dot) + zdot sum(delta))``. Keeps ``sum(delta)`` of the first-order error."""

    dim: int

    inner = True  # zdot, the output's tangent, read by backward

    def forward(self, xs: list[Tensor], args: list) -> tuple[Tensor, Tensor]:
        z = torch.log_softmax(xs[0], dim=self.dim)
        return z, z.exp()

    def tangent(self, xdots: list[Tensor | None], saved: Tensor) -> tuple[Tensor, Tensor]:
        x_dot = xdots[0]
        z_dot = x_dot - _axis_sum(saved * x_dot, self.dim)
        return z_dot, z_dot

    def adjoint(self, g: Tensor, saved: Tensor, need: list[bool]) -> list[Tensor]:
        return [torch.addcmul(g, saved, _axis_sum(g, self.dim), value=-1.0)]

    def errors(self, g: Tensor, saved: Tensor, need: list[bool]) -> tuple[Tensor, list[Tensor | None]]:
        total = _axis_sum(g, self.dim)
        return total, [torch.addcmul(g, saved, total, value=-1.0) if need[0] else None]

    def backward(self, g_dot: Tensor, total: Tensor, xdots: list[Tensor | None], saved: Tensor, need: list[bool],
                 inner: Tensor) -> list[Tensor]:  # fmt: skip
        moved = torch.addcmul(_axis_sum(g_dot, self.dim), inner, total)
        return [torch.addcmul(g_dot, saved, moved, value=-1.0)]


def _batched(t: Tensor) -> Tensor:
    """``(..., m, k)`` as ``(batch, m, k)`` for ``bmm`` (a view of blocks of heads and their transposes)."""
    return t.flatten(0, -3)


def _products(a: Tensor, b: Tensor, c: Tensor, d: Tensor, out: Tensor | None = None) -> Tensor:
    """``a @ b + c @ d`` batched over the leading axes; written into the contiguous ``out`` where given. The second
    product is accumulated in place (``baddbmm_``) where the contraction is the short one (the head size: scores);
    where it is the longer (the tokens: ``T x T`` attention matrices times ``T x hd`` blocks) that accumulation costs
    more than a second ``bmm`` and an addition (on T1's CPU about 0.79 against 0.66 ms a pair), so those take that
    way."""
    shape = (*a.shape[:-1], b.shape[-1])
    result = torch.bmm(_batched(a), _batched(b), out=None if out is None else out.view(-1, *shape[-2:]))
    if a.shape[-1] > b.shape[-1]:
        return result.add_(torch.bmm(_batched(c), _batched(d))).view(shape)
    return result.baddbmm_(_batched(c), _batched(d)).view(shape)


def _blocks(heads: Tensor) -> Tensor:
    """Blocks of heads ``(parts, heads, N, T, hd)`` as ``(parts * heads, N * T, hd)``: one matrix per head of each
    part, its rows the samples' tokens (a view)."""
    return heads.flatten(0, 1).flatten(1, 2)


def _merged(blocks: Tensor, weight: Tensor, out: Tensor | None = None) -> Tensor:
    """``join(blocks) @ weight`` ``(N * T, F)`` for `_blocks` ``(B, N * T, hd)`` and ``weight`` ``(B * hd, F)`` (its
    rows in the blocks' order), as the sum of the blocks' products with their rows of ``weight``: no copy joins the
    heads. Added into ``out`` where given."""
    rows = weight.view(blocks.shape[0], blocks.shape[2], -1)
    if out is None:
        out = torch.mm(blocks[0], rows[0])
    else:
        out.addmm_(blocks[0], rows[0])
    for block, w in zip(blocks[1:], rows[1:]):
        out.addmm_(block, w)
    return out


def _block_outer(blocks: Tensor, h: Tensor, out: Tensor | None = None) -> Tensor:
    """``join(blocks)^T h`` ``(B * hd, F)`` for ``blocks`` ``(B, N * T, hd)`` and rows ``h`` ``(N * T, F)``: one batched
    product of each block with the same rows (broadcast, not copied). Added into ``out`` (``(B * hd, F)``) where
    given."""
    rows = h.expand(blocks.shape[0], *h.shape)
    if out is None:
        return torch.bmm(blocks.transpose(1, 2), rows).view(-1, h.shape[1])
    out.view(blocks.shape[0], blocks.shape[2], -1).baddbmm_(blocks.transpose(1, 2), rows)
    return out


@dataclass(frozen=True)
class _Attention:
    """``nn.MultiheadAttention`` as self-attention on ``(N, T, D)`` inputs (``batch_first``), packed input
    projection ``W`` ``(3D, D)``, ``heads`` heads; see the module docstring. Biases may be absent.

    The passes run in scaled projections ``p' = x W'^T + b'``, ``W'`` and ``b'`` the packed weight and bias with their
    query and key rows times ``r = c^(1/2)``, so that ``S = q' k'^T`` and every product of two factors of the scores
    (their tangents, errors) carries its ``c`` without another pass over the heads; only the parameter-sized blocks
    ``(Hv)_W`` and ``(Hv)_b`` are scaled back. Heads are kept as ``(3, heads, N, T, hd)`` contiguous blocks (queries,
    keys, values), so that the batched products of the ``T x T`` attention matrices read them without copies; the
    errors at ``p'`` stay in those blocks, their products with the packed weight summed block by block
    (`_merged`, `_block_outer`) instead of joined by a copy first."""

    weight: str
    bias: str | None
    out_weight: str
    out_bias: str | None
    heads: int

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.weight, self.bias, self.out_weight, self.out_bias) if n)

    def needs_error(self, input_moves: bool) -> bool:
        return True  # q k^T is bilinear in the query and key weights: their products read the errors

    def _scaled(self, t: Tensor | None, inplace: bool = False) -> Tensor | None:
        """``t`` (``(3D, ...)``: the packed weight or bias, a tangent of one, or a block of ``H v``) with its query and
        key rows times ``r = hd^(-1/4)``; a copy unless ``inplace``."""
        if t is None:
            return None
        out = t if inplace else t.clone()
        width = t.shape[0] // 3
        out[: 2 * width].mul_((width // self.heads) ** -0.25)
        return out

    def _packed(self, params: Mapping[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        """``W'`` and ``b'`` (``None`` without a bias) of the parameters, or of a tangent."""
        return self._scaled(params[self.weight]), self._scaled(params[self.bias] if self.bias else None)

    def _split(self, t: Tensor, parts: int, bias: Tensor | None = None) -> Tensor:
        """``(N, T, parts * D)`` -> ``(parts, heads, N, T, hd)``, contiguous, with ``bias`` ``(parts * D,)`` added on
        the way (the copy's one pass instead of another before it)."""
        n, tokens, width = t.shape
        shape = (parts, self.heads, width // (parts * self.heads))
        heads = t.view(n, tokens, *shape).permute(2, 3, 0, 1, 4)
        if bias is None:
            return heads.contiguous()
        return torch.add(heads, bias.view(*shape[:2], 1, 1, shape[2]), out=t.new_empty(heads.shape))

    @staticmethod
    def _join(parts: Tensor) -> Tensor:
        """Blocks of heads ``(parts, heads, N, T, hd)`` back to ``(N, T, parts * heads * hd)``, the parts side by
        side (one copy)."""
        _, _, n, tokens, _ = parts.shape
        return parts.permute(2, 3, 0, 1, 4).reshape(n, tokens, -1)

    def forward(self, x: Tensor, params: Mapping[str, Tensor]) -> tuple[Tensor, tuple]:
        weight, bias = self._packed(params)
        qkv = self._split(x @ weight.T, 3, bias)
        q, k, v = qkv
        a = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
        o = self._join((a @ v).unsqueeze(0))
        out = F.linear(o, params[self.out_weight], params[self.out_bias] if self.out_bias else None)
        return out, (x, qkv, a, o)

    def errors(self, g: Tensor, saved, params, need: bool) -> tuple[tuple, Tensor | None]:
        """Keeps the first-order errors at the output, at ``A v`` (heads), at ``A`` (less its mean under ``A``), at
        ``S`` and at ``p'`` (blocks of heads)."""
        _, (q, k, v), a, _ = saved
        d_o = self._split(g @ params[self.out_weight], 1)[0]
        e_a = d_o @ v.transpose(-2, -1)
        e_a.sub_(_row_sum(a * e_a))  # the error at A less its mean under A: d_s = A e_a
        d_s = a * e_a
        parts = q.new_empty(3, *q.shape)
        torch.matmul(d_s, k, out=parts[0])
        torch.matmul(d_s.transpose(-2, -1), q, out=parts[1])
        torch.matmul(a.transpose(-2, -1), d_o, out=parts[2])
        error = _merged(_blocks(parts), self._scaled(params[self.weight])).view_as(g) if need else None
        return (g, d_o, e_a, d_s, parts), error

    def tangent(self, saved, hdot: Tensor | None, params, v) -> tuple[Tensor, tuple]:
        """The output's tangent, and the inner tangents the products read (those of q', k', v, of ``A``, of
        ``A v``)."""
        x, (q, k, vv), a, o = saved
        weight, bias = self._packed(v)
        p_dot = x @ weight.T
        if hdot is not None:
            _flat_rows(p_dot).addmm_(_flat_rows(hdot), self._scaled(params[self.weight]).T)
        dots = self._split(p_dot, 3, bias)
        qd, kd, vd = dots
        a_dot = _softmax_jacobian(a, _products(qd, k.transpose(-2, -1), q, kd.transpose(-2, -1)))
        o_dot = self._join(_products(a_dot, vv, a, vd).unsqueeze(0))
        out = F.linear(o, v[self.out_weight], v[self.out_bias] if self.out_bias else None)
        _flat_rows(out).addmm_(_flat_rows(o_dot), params[self.out_weight].T)
        return out, (dots, a_dot, o_dot)

    def backward(self, g_dot: Tensor, kept, hdot: Tensor | None, saved, params, v, into, need: bool,
                 inner: tuple) -> Tensor | None:  # fmt: skip
        x, (q, k, vv), a, o = saved
        g, d_o, e_a, d_s, d_p = kept
        (qd, kd, vd), a_dot, o_dot = inner
        add_outer(into[self.out_weight], g_dot, o)
        add_outer(into[self.out_weight], g, o_dot)
        if self.out_bias:
            into[self.out_bias].add_(_flat_rows(g_dot).sum(0))
        gd_o = g_dot @ params[self.out_weight]
        _flat_rows(gd_o).addmm_(_flat_rows(g), v[self.out_weight])
        gd_o = self._split(gd_o, 1)[0]
        parts = q.new_empty(3, *q.shape)  # the tangent errors at q', k', v
        gd_a = _products(gd_o, vv.transpose(-2, -1), d_o, vd.transpose(-2, -1))
        _products(a.transpose(-2, -1), gd_o, a_dot.transpose(-2, -1), d_o, out=parts[2])
        # J gd_a + Adot e_a - A <Adot, e_a> (the second-order term; <Adot, 1> = 0 lets e_a stand for the error):
        # with t = A gd_a + Adot e_a, that is t - A <t, 1>
        t = gd_a.mul_(a).addcmul_(a_dot, e_a)
        gd_s = t.addcmul_(a, _row_sum(t), value=-1.0)
        _products(gd_s, k, d_s, kd, out=parts[0])
        _products(gd_s.transpose(-2, -1), q, d_s.transpose(-2, -1), qd, out=parts[1])
        gd_p, d_p = _blocks(parts), _blocks(d_p)
        block = _block_outer(gd_p, _flat_rows(x))  # (Hv)_W' , then scaled back to W's rows
        if hdot is not None:
            _block_outer(d_p, _flat_rows(hdot), out=block)
        into[self.weight].add_(self._scaled(block, inplace=True))
        if self.bias:
            into[self.bias].add_(self._scaled(gd_p.sum(1).view(-1), inplace=True))
        if not need:
            return None
        out = _merged(gd_p, self._scaled(params[self.weight]))
        return _merged(d_p, self._scaled(v[self.weight]), out=out).view_as(x)


__all__: list[str] = []
