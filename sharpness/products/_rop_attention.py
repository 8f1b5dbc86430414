"""The graph R-operator's rules for attention written by hand (`sharpness.products._rop_graph`): the product of two
activations, the row softmax, and ``F.scaled_dot_product_attention``, each one operation of the traced graph, so any
composition of them (with the reshapes, transposes and pieces of `sharpness.products._rop_ops`) is covered.

As for every smooth operation (`sharpness.products._rop_smooth`), with ``delta`` the first-order error at the output,
``g_dot`` its tangent error and dots the inputs' tangents:

- ``z = a @ b`` (``torch.matmul``, ``@``, ``bmm``), batched over the leading axes (an operand broadcast over them
  gets its errors summed back to its shape): bilinear, ``zdot = adot b + a bdot``; the errors are
  ``g b^T`` and ``a^T g``, and each factor's tangent error gains the other factor's tangent times the first-order
  error: ``g_dot b^T + delta bdot^T`` and ``a^T g_dot + adot^T delta`` (`_MatMul`);
- ``z = x W + b`` (``torch.addmm``, HuggingFace's ``Conv1D``) and ``z = x W^T + b`` (``F.linear``) with parameters
  read directly: the same bilinear rule in ``(x, W)``, the bias's errors summed over the leading axes (`_Affine`);
- ``A = softmax(S)`` over the last axis (or another, but the samples'): the symmetric Jacobian
  ``J g = A (g - <A, g>)`` (per row), and the input's tangent error ``J g_dot + Adot (delta - <A, delta>) -
  A <Adot, delta>`` with ``Adot = J Sdot``; with the kept centred error ``e = delta - <A, delta>`` and
  ``t = A g_dot + Adot e`` (``<Adot, 1> = 0`` lets ``e`` stand for ``delta``) that is ``t - A <t, 1>`` (`_Softmax`);
- ``F.scaled_dot_product_attention(q, k, v)`` without dropout, causal or not, with a constant ``attn_mask`` or
  none, as ``softmax(c q k^T) v``
  (``c`` its scale, ``1 / sqrt(head size)`` by default; the causal mask sets the scores above the diagonal to
  ``-inf``, so ``A`` and ``Adot`` vanish there and the same formulas hold; with ``enable_gqa`` each key/value head is
  repeated for the query heads reading it, and its errors are summed back): the three rules above composed in one
  operation, which keeps ``A``, the error ``e_A = delta v^T`` at ``A`` centred under ``A``, and ``d_S = A e_A``
  (`_Attend`).

No operation writes into a tensor it was given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sharpness.products._rop_smooth import _Smooth, _softmax_jacobian, _summed


def _ready(t: Tensor | None) -> Tensor | None:
    """``t`` as batched matrix products read it without a copy: itself where it or its transpose (the last two axes) is
    contiguous, else a contiguous copy (a head cut from a fused projection by ``permute``/``unbind``, whose leading
    axes do not merge). Factors read several times per product are made so once."""
    return t if t is None or t.is_contiguous() or t.mT.is_contiguous() else t.contiguous()


def _rows_product(a: Tensor, b: Tensor) -> Tensor:
    """``a^T b`` summed over the leading axes, ``(..., m, p)`` and ``(..., m, q)`` to ``(p, q)``: one matrix product of
    the rows stacked (a batched product and a sum over its batch take twice as long on token sequences)."""
    return a.reshape(-1, a.shape[-1]).mT @ b.reshape(-1, b.shape[-1])


def _right_error(a: Tensor, g: Tensor, shape: torch.Size) -> Tensor:
    """``a^T g`` summed back to the right factor's ``shape``: one stacked product where that factor is a matrix
    broadcast over ``a``'s leading axes (``x @ W`` on token sequences), else batched."""
    if len(shape) == 2 and a.dim() > 2:
        return _rows_product(a, g)
    return _summed(torch.matmul(a.mT, g), shape)


def _add(out: Tensor | None, t: Tensor | None) -> Tensor | None:
    """``out + t`` (in place into ``out``, a fresh tensor of the caller's), either may be ``None``."""
    if t is None:
        return out
    return t if out is None else out.add_(t)


def _centred(a: Tensor, g: Tensor, dim: int = -1) -> Tensor:
    """``g - <A, g>`` along ``dim`` of the probabilities ``a`` (a fresh tensor)."""
    return g - (a * g).sum(dim, keepdim=True)


def _softmax_backward(a: Tensor, a_dot: Tensor | None, t: Tensor, e: Tensor, dim: int = -1) -> Tensor:
    """The softmax input's tangent error ``J g_dot + Adot e - A <Adot, e>`` from ``t = A g_dot`` (``g_dot`` the output's
    tangent error; a fresh tensor, overwritten) and the centred error ``e`` (see the module docstring), along
    ``dim``."""
    if a_dot is not None:
        t.addcmul_(a_dot, e)
    return t.addcmul_(a, t.sum(dim, keepdim=True), value=-1.0)


@dataclass(frozen=True)
class _MatMul(_Smooth):
    """``a @ b`` of two tensors of at least two axes each, batched over the leading ones; keeps both factors (and
    passes their tangents to ``backward``), `_ready` for the products."""

    inner = True  # the factors' tangents, made ready once

    def forward(self, xs: list[Tensor], args: list) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        return torch.matmul(xs[0], xs[1]), (_ready(xs[0]), _ready(xs[1]))

    def tangent(self, xdots: list[Tensor | None], saved) -> tuple[Tensor, tuple]:
        (a, b), (a_dot, b_dot) = saved, [_ready(t) for t in xdots]
        out = None if a_dot is None else torch.matmul(a_dot, b)
        return _add(out, None if b_dot is None else torch.matmul(a, b_dot)), (a_dot, b_dot)

    def adjoint(self, g: Tensor, saved, need: list[bool]) -> list[Tensor | None]:
        a, b = saved
        return [_summed(torch.matmul(g, b.mT), a.shape) if need[0] else None,
                _right_error(a, g, b.shape) if need[1] else None]  # fmt: skip

    def backward(self, g_dot: Tensor, delta: Tensor, xdots: list[Tensor | None], saved, need: list[bool],
                 inner: tuple) -> list[Tensor | None]:  # fmt: skip
        (a, b), (a_dot, b_dot) = saved, inner
        errs: list[Tensor | None] = [None, None]
        if need[0]:
            out = torch.matmul(g_dot, b.mT)
            errs[0] = _summed(_add(out, None if b_dot is None else torch.matmul(delta, b_dot.mT)), a.shape)
        if need[1]:
            out = _right_error(a, g_dot, b.shape)
            errs[1] = _add(out, None if a_dot is None else _right_error(a_dot, delta, b.shape))
        return errs


@dataclass(frozen=True)
class _Affine(_Smooth):
    """A linear layer of the last axis written as a function of its parameters: ``x W + b`` (``torch.addmm(b, x, W)``,
    HuggingFace's ``Conv1D``; ``W`` stored ``(in, out)``) or ``x W^T + b`` (``F.linear``, ``W`` stored ``(out, in)``,
    ``linear``). Inputs ``[x, W]`` or ``[x, W, b]``. Bilinear in ``(x, W)`` as `_MatMul` is (with ``W`` read through its
    transpose for ``F.linear``), plus the bias, whose errors are the output's summed over the leading axes."""

    linear: bool

    inner = True  # the tangents of x and of W as the product reads it, made ready once

    def _matrix(self, w: Tensor | None) -> Tensor | None:
        """``W`` as the right factor of the product: ``(in, out)``."""
        return w if w is None or not self.linear else w.mT

    def forward(self, xs: list[Tensor], args: list) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        x, w = xs[0], self._matrix(xs[1])
        out = torch.matmul(x, w)
        return (out.add_(xs[2]) if len(xs) == 3 else out), (_ready(x), _ready(w))

    def tangent(self, xdots: list[Tensor | None], saved) -> tuple[Tensor, tuple]:
        (a, w), a_dot, w_dot = saved, _ready(xdots[0]), _ready(self._matrix(xdots[1]))
        out = None if a_dot is None else torch.matmul(a_dot, w)
        out = _add(out, None if w_dot is None else torch.matmul(a, w_dot))
        b_dot = xdots[2] if len(xdots) == 3 else None
        if b_dot is not None:  # never handed on as it is: the bias's own tangent is the caller's
            out = b_dot.expand(*a.shape[:-1], w.shape[-1]).clone() if out is None else out.add_(b_dot)
        if out is None:
            out = a.new_zeros(*a.shape[:-1], w.shape[-1])
        return out, (a_dot, w_dot)

    def _weight_error(self, g: Tensor, a: Tensor) -> Tensor:
        """The error of ``W`` as stored, ``a^T g`` summed over the leading axes (``g^T a`` for ``F.linear``)."""
        return _rows_product(g, a) if self.linear else _rows_product(a, g)

    def adjoint(self, g: Tensor, saved, need: list[bool]) -> list[Tensor | None]:
        a, w = saved
        errs = [torch.matmul(g, w.mT) if need[0] else None, self._weight_error(g, a) if need[1] else None]
        return errs + ([g.sum_to_size(g.shape[-1]) if need[2] else None] if len(need) == 3 else [])

    def backward(self, g_dot: Tensor, delta: Tensor, xdots: list[Tensor | None], saved, need: list[bool],
                 inner: tuple) -> list[Tensor | None]:  # fmt: skip
        (a, w), (a_dot, w_dot) = saved, inner
        errs: list[Tensor | None] = [None, None]
        if need[0]:
            errs[0] = _add(torch.matmul(g_dot, w.mT), None if w_dot is None else torch.matmul(delta, w_dot.mT))
        if need[1]:
            errs[1] = _add(self._weight_error(g_dot, a), None if a_dot is None else self._weight_error(delta, a_dot))
        return errs + ([g_dot.sum_to_size(g_dot.shape[-1]) if need[2] else None] if len(need) == 3 else [])


@dataclass(frozen=True)
class _Softmax(_Smooth):
    """The softmax along ``dim`` (the last axis for attention's scores; the classes' axis of a classifier's
    probabilities); keeps the probabilities ``A`` and the centred error ``delta - <A, delta>``. With ``dtype``, the
    softmax is computed in that dtype (``softmax(s, dim=-1, dtype=torch.float32)``, HuggingFace's eager attention):
    the input's tangent is cast to it, and the errors back to the input's dtype (no-ops where the two agree)."""

    dim: int = -1
    dtype: torch.dtype | None = None

    inner = True  # Adot, the output's tangent, read by backward

    def forward(self, xs: list[Tensor], args: list) -> tuple[Tensor, tuple[Tensor, torch.dtype]]:
        a = torch.softmax(xs[0], dim=self.dim, dtype=self.dtype)
        return a, (a, xs[0].dtype)

    def tangent(self, xdots: list[Tensor | None], saved: tuple) -> tuple[Tensor, Tensor]:
        a, _ = saved
        a_dot = _softmax_jacobian(a, xdots[0].to(a.dtype), self.dim)
        return a_dot, a_dot

    def adjoint(self, g: Tensor, saved: tuple, need: list[bool]) -> list[Tensor]:
        a, dtype = saved
        return [_softmax_jacobian(a, g, self.dim).to(dtype)]

    def errors(self, g: Tensor, saved: tuple, need: list[bool]) -> tuple[Tensor, list[Tensor | None]]:
        a, dtype = saved
        e = _centred(a, g, self.dim)
        return e, [(a * e).to(dtype) if need[0] else None]

    def backward(self, g_dot: Tensor, e: Tensor, xdots: list[Tensor | None], saved: tuple, need: list[bool],
                 inner: Tensor) -> list[Tensor]:  # fmt: skip
        a, dtype = saved
        return [_softmax_backward(a, inner, g_dot * a, e, self.dim).to(dtype)]


def _mask_reader(args: list) -> None:
    """A marker: `_Attend` reads its mask from the call's inputs itself (it replays no call)."""
    raise AssertionError("the attention's mask is read by its forward, not by a replayed call")


@dataclass(frozen=True)
class _Attend(_Smooth):
    """``F.scaled_dot_product_attention(q, k, v)`` of ``(..., L, E)``, ``(..., S, E)``, ``(..., S, Ev)`` inputs (the
    same leading axes) without dropout: ``softmax(c q k^T + M) v`` with ``c = scale`` (``E^(-1/2)`` where ``None``),
    the scores above the diagonal left out where ``causal``, and ``M`` an ``attn_mask`` that no parameter moves
    (boolean: ``False`` leaves a score out; floating: added), broadcast to the scores; keeps the inputs, ``A``, ``c``
    and a moved mask's shape and dtype. A constant ``M`` only shifts the scores, so the derivatives are those of the
    probabilities ``A``. With ``added``, ``M`` is a fourth tensor input that parameters move (BEiT's learned relative
    position bias), floating and added: linear in the scores, so its tangent adds to theirs and its errors are
    theirs, summed over the axes it is broadcast along (in its own dtype)."""

    scale: float | None
    causal: bool
    mask: int | None = None  # the attn_mask's slot among the call's inputs (read as `args`), if one is given
    repeat: int = 1  # enable_gqa: each key/value head read by this many consecutive query heads
    added: bool = False  # the attn_mask is the fourth tensor input, moved by parameters

    inner = True  # Adot and the inputs' tangents, made ready once

    @property
    def call(self):  # the call's inputs are passed to `forward` where there is a mask to read among them
        return None if self.mask is None else _mask_reader

    def _heads(self, t: Tensor | None) -> Tensor | None:
        """A key or value tensor (or tangent) with each head repeated for the query heads reading it."""
        return t if t is None or self.repeat == 1 else t.repeat_interleave(self.repeat, dim=-3)

    def _summed(self, e: Tensor | None) -> Tensor | None:
        """The error of a repeated key or value summed back onto its own heads."""
        return e if e is None or self.repeat == 1 else e.unflatten(-3, (-1, self.repeat)).sum(-3)

    def forward(self, xs: list[Tensor], args: list) -> tuple[Tensor, tuple]:
        q, k, v = xs[:3]
        q, k, v = _ready(q), _ready(self._heads(k)), _ready(self._heads(v))
        c = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        s = torch.matmul(q, k.mT).mul_(c)
        if self.added:
            s.add_(xs[3].to(s.dtype))
        if self.causal:  # torch's causal mask: query i sees keys 0..i
            keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril_()
            s.masked_fill_(~keep, float("-inf"))
        if self.mask is not None:
            m = args[self.mask]
            s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s.add_(m.to(s.dtype))
        a = torch.softmax(s, dim=-1)
        return torch.matmul(a, v), (q, k, v, a, c, (xs[3].shape, xs[3].dtype) if self.added else None)

    def tangent(self, xdots: list[Tensor | None], saved) -> tuple[Tensor, tuple]:
        (q, k, v, a, c, _), m_dot = saved, xdots[3] if self.added else None
        q_dot, k_dot, v_dot = [_ready(t) for t in (xdots[0], *map(self._heads, xdots[1:3]))]
        s_dot = None if q_dot is None else torch.matmul(q_dot, k.mT)
        s_dot = _add(s_dot, None if k_dot is None else torch.matmul(q, k_dot.mT))
        if s_dot is not None:
            s_dot.mul_(c)
        if m_dot is not None:  # the moved mask's tangent, broadcast to the scores
            s_dot = m_dot.to(a.dtype).expand(a.shape).clone() if s_dot is None else s_dot.add_(m_dot.to(a.dtype))
        a_dot = None if s_dot is None else _softmax_jacobian(a, s_dot)
        out = None if a_dot is None else torch.matmul(a_dot, v)
        return _add(out, None if v_dot is None else torch.matmul(a, v_dot)), (a_dot, q_dot, k_dot, v_dot)

    def errors(self, g: Tensor, saved, need: list[bool]) -> tuple[tuple, list[Tensor | None]]:
        q, k, v, a, c, mask = saved
        e_a = _centred(a, torch.matmul(g, v.mT))
        d_s = a * e_a
        errs = [torch.matmul(d_s, k).mul_(c) if need[0] else None,
                self._summed(torch.matmul(d_s.mT, q).mul_(c)) if need[1] else None,
                self._summed(torch.matmul(a.mT, g)) if need[2] else None]  # fmt: skip
        if self.added:  # the error at the scores, summed over the mask's broadcast axes, in the mask's dtype
            errs.append(d_s.sum_to_size(mask[0]).to(mask[1]) if need[3] else None)
        return (g, e_a, d_s), errs

    def adjoint(self, g: Tensor, saved, need: list[bool]) -> list[Tensor | None]:
        return self.errors(g, saved, need)[1]

    def backward(self, g_dot: Tensor, kept: tuple, xdots: list[Tensor | None], saved, need: list[bool],
                 inner: tuple) -> list[Tensor | None]:  # fmt: skip
        (q, k, v, a, c, mask), (a_dot, q_dot, k_dot, v_dot), (delta, e_a, d_s) = saved, inner, kept
        errs: list[Tensor | None] = [None] * len(need)
        if need[2]:
            out = torch.matmul(a.mT, g_dot)
            errs[2] = self._summed(_add(out, None if a_dot is None else torch.matmul(a_dot.mT, delta)))
        if not (need[0] or need[1] or (self.added and need[3])):
            return errs
        gd_a = torch.matmul(g_dot, v.mT)
        gd_a = _add(gd_a, None if v_dot is None else torch.matmul(delta, v_dot.mT))
        gd_s = _softmax_backward(a, a_dot, gd_a.mul_(a), e_a)
        if self.added and need[3]:
            errs[3] = gd_s.sum_to_size(mask[0]).to(mask[1])
        if need[0]:
            out = torch.matmul(gd_s, k)
            errs[0] = _add(out, None if k_dot is None else torch.matmul(d_s, k_dot)).mul_(c)
        if need[1]:
            out = torch.matmul(gd_s.mT, q)
            errs[1] = self._summed(_add(out, None if q_dot is None else torch.matmul(d_s.mT, q_dot)).mul_(c))
        return errs


__all__: list[str] = []
