"""The graph R-operator's smooth operations (`sharpness.products._rop_graph`): the pieces of a transformer.

Unlike the fixed linear maps and bilinear layers of `sharpness.products._rop_ops`, these operations have a second
derivative in their input, so the tangent error at their input gains a term from the first-order error ``delta``
at their output: for ``z = f(x)`` with Jacobian ``J(x)``, ``xdot`` the input's tangent and ``ddot`` the output's
tangent error, the input's tangent error is ``J^T ddot + (d/dt J(x + t xdot)^T) delta``. Each one writes both in
closed form:

- a parameter used outside a module (``self.pos``): tangent ``v``, product ``(Hv) += ddot`` (`_Param`);
- pointwise GELU (exact, erf form) and tanh: ``f'(x) ddot + f''(x) xdot delta`` (`_Pointwise`);
- LayerNorm over the last axis, ``z = gamma xhat + beta``, ``xhat = (x - mean x) / s``, ``s = sqrt(var x + eps)``
  per row of ``D`` features. Its Jacobian ``J = (I - 1 1^T / D - xhat xhat^T / D) / s`` is symmetric; with
  ``a = mean(xhat xdot)``, ``xhat' = J xdot`` and ``b = mean(xhat e)``, the second-order term of an error ``e``
  at ``xhat`` is ``-(a J e + xhat' b + xhat mean(xhat' e)) / s`` (`_LayerNorm`);
- ``nn.MultiheadAttention`` (self-attention, packed projections), ``out = merge(softmax(c q k^T) v) W_o^T + b_o``
  with ``(q, k, v) = x W^T + b`` split into heads and ``c = 1 / sqrt(head size)``: the projections are affine
  layers, ``q k^T`` and ``A v`` bilinear (each factor's tangent error gains the other factor's tangent times the
  first-order error), and the row softmax ``A`` has the symmetric Jacobian ``J g = A (g - <A, g>)`` and the
  second-order term ``Adot (delta - <A, delta>) - A <Adot, delta>`` with ``Adot = J Sdot`` (`_Attention`).

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
    """A parameter-free operation with a second derivative, of one tensor input; see the module docstring.
    ``forward`` keeps what ``tangent``, ``adjoint`` and ``backward`` read; ``backward`` is the input's tangent
    error from the output's tangent error ``g_dot`` and first-order error ``delta``."""

    call = None  # no original call to replay (the graph reader's protocol for maps)


@dataclass(frozen=True)
class _Pointwise(_Smooth):
    """Exact GELU (``x Phi(x)``) or tanh, elementwise: keeps ``f'(x)`` and ``f''(x)``."""

    kind: str  # "gelu" or "tanh"

    def forward(self, xs: list[Tensor], args: list) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        x = xs[0]
        if self.kind == "tanh":
            t = torch.tanh(x)
            d1 = 1 - t * t
            return t, (d1, -2 * t * d1)
        pdf = torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
        return x * cdf, (cdf + x * pdf, pdf * (2 - x * x))

    def tangent(self, xdots: list[Tensor | None], saved) -> Tensor:
        return xdots[0] * saved[0]

    def adjoint(self, g: Tensor, saved, need: list[bool]) -> list[Tensor]:
        return [g * saved[0]]

    def backward(self, g_dot: Tensor, delta: Tensor, xdots: list[Tensor | None], saved, need: list[bool]) -> list:
        return [torch.addcmul(g_dot * saved[0], xdots[0] * saved[1], delta)]


# ------------------------------------------------------------------------------------------------
def _norm_jacobian(xhat: Tensor, rstd: Tensor, t: Tensor) -> Tensor:
    """``J t`` (= ``J^T t``) of the normalization ``xhat`` over the last axis, ``rstd = 1 / s`` per row."""
    return (t - t.mean(-1, keepdim=True) - xhat * (xhat * t).mean(-1, keepdim=True)).mul_(rstd)


def _norm_backward(xhat: Tensor, rstd: Tensor, xhat_dot: Tensor, a: Tensor, e_dot: Tensor, e: Tensor) -> Tensor:
    """``J e_dot + (d/dt J(x + t xdot)) e`` of the same normalization, with ``xhat_dot = J xdot`` and
    ``a = mean(xhat xdot)``: the second-order term ``-(a J e + xhat_dot b + xhat mean(xhat_dot e)) / s``
    (``b = mean(xhat e)``) merged with the first, ``J (e_dot - a e / s) - (xhat mean(xhat_dot e) + xhat_dot b) / s``."""
    f = torch.addcmul(e_dot, e, a * rstd, value=-1.0)
    b = (xhat * e).mean(-1, keepdim=True)
    c = (xhat_dot * e).mean(-1, keepdim=True)
    out = f.sub_(f.mean(-1, keepdim=True)).sub_(xhat * (xhat * f).mean(-1, keepdim=True).add_(c))
    return out.sub_(xhat_dot * b).mul_(rstd)


@dataclass(frozen=True)
class _LayerNorm:
    """``nn.LayerNorm`` over the last axis: ``z = gamma xhat + beta`` (either parameter may be absent)."""

    weight: str | None
    bias: str | None
    eps: float

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.weight, self.bias) if n)

    def needs_error(self, input_moves: bool) -> bool:
        return input_moves

    def _sum(self, t: Tensor) -> Tensor:
        return t.reshape(-1, t.shape[-1]).sum(0)

    def forward(self, h: Tensor, params: Mapping[str, Tensor]) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        var, mean = torch.var_mean(h, dim=-1, keepdim=True, correction=0)
        rstd = torch.rsqrt(var + self.eps)
        xhat = (h - mean).mul_(rstd)
        z = xhat * params[self.weight] if self.weight else xhat
        return (z + params[self.bias] if self.bias else z), (xhat, rstd)

    def _error_at_xhat(self, g: Tensor, params) -> Tensor:
        return g * params[self.weight] if self.weight else g

    def errors(self, g: Tensor, saved, params, need: bool) -> tuple[Tensor, Tensor | None]:
        xhat, rstd = saved
        return g, (_norm_jacobian(xhat, rstd, self._error_at_xhat(g, params)) if need else None)

    def tangent(self, saved, hdot: Tensor | None, params, v) -> tuple[Tensor, tuple | None]:
        """The output's tangent, and what the products read of the normalized input's: ``J hdot`` and
        ``mean(xhat hdot)``."""
        xhat, _ = saved
        out = inner = None
        if hdot is not None:
            inner = (_norm_jacobian(*saved, hdot), (xhat * hdot).mean(-1, keepdim=True))
            out = self._error_at_xhat(inner[0], params)
        if self.weight:
            out = xhat * v[self.weight] if out is None else out.addcmul_(xhat, v[self.weight])
        if self.bias:
            out = v[self.bias].expand_as(xhat).clone() if out is None else out.add_(v[self.bias])
        return out, inner

    def backward(self, g_dot: Tensor, delta, hdot: Tensor | None, saved, params, v, into, need: bool,
                 inner: Tensor | None) -> Tensor | None:  # fmt: skip
        xhat, rstd = saved
        if self.weight:
            total = g_dot * xhat
            if hdot is not None:
                total.addcmul_(delta, inner[0])
            into[self.weight].add_(self._sum(total))
        if self.bias:
            into[self.bias].add_(self._sum(g_dot))
        if not need:
            return None
        e_dot = self._error_at_xhat(g_dot, params)
        if self.weight:
            e_dot = e_dot.addcmul_(delta, v[self.weight])
        return _norm_backward(xhat, rstd, *inner, e_dot, self._error_at_xhat(delta, params))


# ------------------------------------------------------------------------------------------------
def _softmax_jacobian(a: Tensor, t: Tensor) -> Tensor:
    """``J t`` (= ``J^T t``) of the softmax over the last axis, probabilities ``a``."""
    return a * (t - (a * t).sum(-1, keepdim=True))


@dataclass(frozen=True)
class _Attention:
    """``nn.MultiheadAttention`` as self-attention on ``(N, T, D)`` inputs (``batch_first``), packed input
    projection ``W`` ``(3D, D)``, ``heads`` heads; see the module docstring. Biases may be absent.

    Heads are kept as ``(3, N, heads, T, hd)`` contiguous blocks (queries, keys, values), so that the batched
    products of the ``T x T`` attention matrices read them without copies."""

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

    def _split(self, t: Tensor, parts: int) -> Tensor:
        """``(N, T, parts * D)`` -> ``(parts, N, heads, T, hd)``, contiguous."""
        n, tokens, width = t.shape
        return t.view(n, tokens, parts, self.heads, width // (parts * self.heads)).permute(2, 0, 3, 1, 4).contiguous()

    @staticmethod
    def _join(*parts: Tensor) -> Tensor:
        """Heads ``(N, heads, T, hd)`` back to ``(N, T, len(parts) * heads * hd)``, the parts side by side."""
        n, heads, tokens, size = parts[0].shape
        out = parts[0].new_empty(n, tokens, len(parts), heads, size)
        for i, p in enumerate(parts):
            out[:, :, i].copy_(p.transpose(1, 2))
        return out.view(n, tokens, -1)

    def forward(self, x: Tensor, params: Mapping[str, Tensor]) -> tuple[Tensor, tuple]:
        qkv = self._split(F.linear(x, params[self.weight], params[self.bias] if self.bias else None), 3)
        q, k, v = qkv
        a = torch.softmax((q @ k.transpose(-2, -1)).mul_(1.0 / math.sqrt(q.shape[-1])), dim=-1)
        o = self._join(a @ v)
        out = F.linear(o, params[self.out_weight], params[self.out_bias] if self.out_bias else None)
        return out, (x, qkv, a, o)

    def errors(self, g: Tensor, saved, params, need: bool) -> tuple[tuple, Tensor | None]:
        """Keeps the first-order errors at the output, at ``A v`` (heads), at ``A`` (less its mean under ``A``), at
        ``S`` and at ``x W^T``."""
        _, (q, k, v), a, _ = saved
        c = 1.0 / math.sqrt(q.shape[-1])
        d_o = self._split(g @ params[self.out_weight], 1)[0]
        e_a = d_o @ v.transpose(-2, -1)
        e_a.sub_((a * e_a).sum(-1, keepdim=True))  # the error at A less its mean under A: d_s = A e_a
        d_s = a * e_a
        d_p = self._join((d_s @ k).mul_(c), (d_s.transpose(-2, -1) @ q).mul_(c), a.transpose(-2, -1) @ d_o)
        return (g, d_o, e_a, d_s, d_p), (d_p @ params[self.weight] if need else None)

    def tangent(self, saved, hdot: Tensor | None, params, v) -> tuple[Tensor, tuple]:
        """The output's tangent, and the inner tangents the products read (those of q, k, v, of ``A``, of ``A v``)."""
        x, (q, k, vv), a, o = saved
        p_dot = F.linear(x, v[self.weight], v[self.bias] if self.bias else None)
        if hdot is not None:
            p_dot.add_(F.linear(hdot, params[self.weight]))
        dots = self._split(p_dot, 3)
        qd, kd, vd = dots
        s_dot = (qd @ k.transpose(-2, -1)).add_(q @ kd.transpose(-2, -1)).mul_(1.0 / math.sqrt(q.shape[-1]))
        a_dot = _softmax_jacobian(a, s_dot)
        o_dot = self._join((a_dot @ vv).add_(a @ vd))
        out = F.linear(o_dot, params[self.out_weight])
        out.add_(F.linear(o, v[self.out_weight], v[self.out_bias] if self.out_bias else None))
        return out, (dots, a_dot, o_dot)

    def backward(self, g_dot: Tensor, kept, hdot: Tensor | None, saved, params, v, into, need: bool,
                 inner: tuple) -> Tensor | None:  # fmt: skip
        x, (q, k, vv), a, o = saved
        g, d_o, e_a, d_s, d_p = kept
        (qd, kd, vd), a_dot, o_dot = inner
        c = 1.0 / math.sqrt(q.shape[-1])
        rows, width = g_dot.shape[-1], o.shape[-1]
        into[self.out_weight].addmm_(g_dot.reshape(-1, rows).T, o.reshape(-1, width))
        into[self.out_weight].addmm_(g.reshape(-1, rows).T, o_dot.reshape(-1, width))
        if self.out_bias:
            into[self.out_bias].add_(g_dot.reshape(-1, rows).sum(0))
        gd_o = self._split((g_dot @ params[self.out_weight]).add_(g @ v[self.out_weight]), 1)[0]
        gd_a = (gd_o @ vv.transpose(-2, -1)).add_(d_o @ vd.transpose(-2, -1))
        gd_v = (a.transpose(-2, -1) @ gd_o).add_(a_dot.transpose(-2, -1) @ d_o)
        # J gd_a + Adot e_a - A <Adot, e_a> (the second-order term; <Adot, 1> = 0 lets e_a stand for the error)
        second = a_dot * e_a
        gd_s = gd_a.sub_((a * gd_a).sum(-1, keepdim=True).add_(second.sum(-1, keepdim=True))).mul_(a).add_(second)
        gd_q = (gd_s @ k).add_(d_s @ kd).mul_(c)
        gd_k = (gd_s.transpose(-2, -1) @ q).add_(d_s.transpose(-2, -1) @ qd).mul_(c)
        gd_p = self._join(gd_q, gd_k, gd_v)
        width, rows = x.shape[-1], gd_p.shape[-1]
        into[self.weight].addmm_(gd_p.reshape(-1, rows).T, x.reshape(-1, width))
        if hdot is not None:
            into[self.weight].addmm_(d_p.reshape(-1, rows).T, hdot.reshape(-1, width))
        if self.bias:
            into[self.bias].add_(gd_p.reshape(-1, rows).sum(0))
        if not need:
            return None
        return (gd_p @ params[self.weight]).add_(d_p @ v[self.weight])


__all__: list[str] = []
