"""The operations the graph R-operator (`sharpness.products._rop_graph`) walks: layers bilinear in (input,
parameters), tables read at integer ids (`_Embedding`), and fixed linear maps.

With a tangent ``v`` (``V``, ``c`` for an affine layer's weight and bias, ``G``, ``B`` for a BatchNorm's), the
first-order errors ``delta = dL/dz`` and the tangent errors ``ddot``::

    affine     zdot = A(hdot; W) + A(h; V) + c      (Hv)_W = A_W^T(h, ddot) + A_W^T(hdot, delta), (Hv)_b = sum ddot
               input tangent error = A_h^T(ddot; W) + A_h^T(delta; V)
    BatchNorm  zdot = gamma a hdot + G xhat + B     (Hv)_gamma = sum(xhat ddot + a hdot delta),   (Hv)_beta = sum ddot
               input tangent error = gamma a ddot + G a delta,   a = 1 / sqrt(var + eps)
    P          zdot = P hdot                        input tangent error = P^T ddot

An affine layer whose only user is a BatchNorm is merged with it (`_Layer`). Among the maps ``P`` (`_Map`), the
reshapes of attention's heads: an axis permutation (``P^T`` the inverse permutation), and a piece of a tensor (basic
indexing, or one piece of ``unbind``/``chunk``/``split``; ``P^T`` puts the error in place, zero elsewhere: `_Part`),
``expand`` (``P^T`` sums the error back) and ``masked_fill`` by a number (``P`` and ``P^T`` zero the masked
entries).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from sharpness.products._layout import layout
from sharpness.products._rop import _Affine


# ------------------------------------------------------------------------------------------------
# operations: layers with parameters (_Layer) and fixed linear maps (_Map). Each computes its output and what
# the products keep of it (forward), its output's tangent from its inputs' (tangent), and its inputs' errors
# from its output's (errors / adjoint; backward for the tangent errors, adding the layer's blocks of H v).
# No operation writes into a tensor it was given: tangents and errors may be shared between users.
@dataclass(frozen=True)
class _Layer:
    """A layer bilinear in (input, parameters): ``Linear`` / ``ConvNd`` (``affine``), eval-mode BatchNorm
    (``norm``), or an affine layer whose only user is a BatchNorm, fused (both).

    The fused layer ``z = gamma * xhat + beta``, ``xhat = a (A(h; W) + b - mu)``, with gain ``g = gamma a`` per
    output channel, never forms the affine layer's output, its errors or tangents: the BatchNorm's factors move
    onto the weights, ``z = g A(h; W) + g (b - mu) + beta``. With ``delta`` the error at ``z``,
    ``Hz = A_W^T(h, delta)`` (kept with it), ``Wz = A_W^T(hdot, delta)``, ``T = A_W^T(h, ddot) + Wz`` and the
    gain's tangent ``m = G a``::

        zdot = A(hdot; g W) + A(h; g V + m W) + g c + B + m (b - mu)
        (Hv)_W = g T + m Hz,          (Hv)_b = g sum ddot + m sum delta,          (Hv)_beta = sum ddot
        (Hv)_gamma = a (<W, T> + <V, Hz> + c sum delta + (b - mu) sum ddot)
        input tangent error = A_h^T(ddot; g W) + A_h^T(delta; g V + m W)

    (sums and inner products per output channel). ``xhat`` is never formed either: ``G xhat`` is the weight
    ``m W`` and bias ``m (b - mu)``, and ``sum(xhat ddot) = a (<W, A_W^T(h, ddot)> + (b - mu) sum ddot)``. Only a
    fused ``Linear`` layer keeps ``xhat``, for the data-span products (`span_tangent`), which never form
    its weight's blocks.
    """

    affine: _Affine | None = None
    norm: _Norm | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for layer in (self.affine, self.norm) if layer for n in (layer.weight, layer.bias) if n)

    def needs_error(self, input_moves: bool) -> bool:
        """Whether the products read the first-order error at the output."""
        return bool(self.names) and (input_moves or (self.affine is not None and self.norm is not None
                                                      and self.norm.weight is not None))  # fmt: skip

    def forward(self, h: Tensor, params: Mapping[str, Tensor]) -> tuple[Tensor, object]:
        a, n = self.affine, self.norm
        if n is None:
            return a.apply(h, params[a.weight], params[a.bias] if a.bias else None), h
        if a is None:
            return n.forward(h, params)
        if not a.dims:  # the data-span products read xhat
            z, xhat = n.forward(a.apply(h, params[a.weight], params[a.bias] if a.bias else None), params)
            return z, (h, xhat)
        # The BatchNorm in one pass after the layer, not folded into its weights: convolving with the folded
        # weights rounds the outputs (and so the masks) less like the model's own BatchNorm; in float32 on a
        # ResNet-20 the top eigenvalue's error grew fivefold.
        gain = n.gain(params).reshape(-1)
        shift = self._shift(params, gain, params)
        return torch.addcmul(n._channel(shift), a.apply(h, params[a.weight], None), n._channel(gain)), (h, None)

    def _shift(self, params: Mapping[str, Tensor], factor: Tensor, beta: Mapping[str, Tensor] | None) -> Tensor:
        """``factor * (b - mu)`` per output channel of the fused layer (``b`` the affine layer's bias parameter,
        or 0), plus the BatchNorm's bias read in ``beta`` (the parameters, or a tangent) where given."""
        a, n = self.affine, self.norm
        mean = n.mean.reshape(-1)
        shift = factor * (params[a.bias] - mean) if a.bias else factor * -mean
        return shift if beta is None or n.bias is None else shift.add_(beta[n.bias])

    def errors(self, g: Tensor, saved, params: Mapping[str, Tensor], need: bool) -> tuple[object, Tensor | None]:
        """What the products keep of the error ``g`` at the output, and the input's error (if ``need``)."""
        a, n = self.affine, self.norm
        if n is None:
            return g, (a.input_adjoint(g, saved, params[a.weight]) if need else None)
        if a is None:
            return g, (g * n.gain(params) if need else None)
        h = saved[0]
        weight = params[a.weight]
        kept = (g, a.weight_adjoint(h, g, weight), a.bias_adjoint(g)) if n.weight is not None else (g, None, None)
        return kept, (a.input_adjoint(g, h, _rows(weight, n.gain(params))) if need else None)

    def tangent(self, saved, hdot: Tensor | None, params, v) -> Tensor:
        a, n = self.affine, self.norm
        if n is None:
            z = a.apply(saved, v[a.weight], v[a.bias] if a.bias else None)
            return z if hdot is None else a.add_apply(z, hdot, params[a.weight])
        if a is None:
            return n.tangent(hdot, saved, params, v)
        gain = n.gain(params).reshape(-1)
        weight, bias = self._tangent_weights(params, v, gain)
        z = a.apply(saved[0], weight, bias)
        return z if hdot is None else a.add_apply(z, hdot, _rows(params[a.weight], gain))

    def _tangent_weights(self, params, v, gain: Tensor) -> tuple[Tensor, Tensor | None]:
        """The fused layer's weight ``g V + m W`` and bias ``g c + B + m (b - mu)`` that map its input to its
        output's tangent (``m = G a``, the gain's tangent)."""
        a, n = self.affine, self.norm
        weight, bias = _rows(v[a.weight], gain), None
        if n.weight is not None:
            moved = v[n.weight] * n.scale.reshape(-1)
            weight.add_(_rows(params[a.weight], moved))
            bias = self._shift(params, moved, v)
        if a.bias:
            bias = gain * v[a.bias] if bias is None else bias.addcmul_(gain, v[a.bias])
        return weight, bias

    def span_tangent(self, saved, params, v, first_dot: Tensor) -> Tensor:
        """`tangent` of a ``Linear`` layer of the data (alone or fused with a BatchNorm) whose weight is in
        data-span coordinates (`sharpness.products._data_span`): ``first_dot`` ``(n, h)`` is ``X V^T``, the
        image of the weight's tangent (the weight itself is not read in ``v``). Alone, the layer adds its bias
        tangent into ``first_dot`` and returns it; fused, ``first_dot`` is left as it is (`span_backward`
        reads it)."""
        a, n = self.affine, self.norm
        if n is None:
            return first_dot if not a.bias else first_dot.add_(v[a.bias])
        gain = n.gain(params).reshape(-1)
        z = first_dot * gain
        if a.bias:
            z.add_(gain * v[a.bias])
        if n.bias is not None:
            z.add_(v[n.bias])
        if n.weight is not None:
            z.addcmul_(saved[1], n._channel(v[n.weight]))
        return z

    def span_backward(self, g_dot: Tensor, kept, saved, params, v, into, first_dot: Tensor, errors: Tensor) -> None:
        """`backward` of the same layer: writes the tangent errors ``E`` ``(n, h)`` of the weight's image into
        ``errors`` (the weight's block of ``H v`` is ``E^T X``, which the caller forms in span coordinates) and adds
        the other blocks to ``into``. Fused, ``E = g ddot + G a delta`` and ``<V, Hz> = sum(delta * X V^T)`` per
        channel (see the class docstring)."""
        a, n = self.affine, self.norm
        if n is None:
            errors.copy_(g_dot)
            if a.bias:
                into[a.bias].add_(a.bias_adjoint(g_dot))
            return
        delta, _, delta_sum = kept if kept is not None else (None, None, None)
        gain = n.gain(params).reshape(-1)
        torch.mul(g_dot, gain, out=errors)
        moved = inner = None
        if n.weight is not None:
            moved = v[n.weight] * n.scale.reshape(-1)
            errors.addcmul_(delta, moved)
            inner = (delta * first_dot).sum(0)
            into[n.weight].add_(n._sum(g_dot * saved[1]))
        self._add_gain_blocks(into, v, a.bias_adjoint(g_dot), gain, moved, inner, delta_sum)

    def _add_gain_blocks(self, into, v, g_sum: Tensor, gain: Tensor, moved: Tensor | None, inner: Tensor | None,
                         delta_sum: Tensor | None) -> None:  # fmt: skip
        """The fused layer's blocks of ``H v`` but its weight's, from ``g_sum = sum ddot``: ``(Hv)_beta``, ``(Hv)_b``
        and the part ``a (inner + c sum delta)`` of ``(Hv)_gamma`` (the bias term added here). ``moved`` (``m``)
        and ``inner`` are ``None`` where the BatchNorm has no weight."""
        a, n = self.affine, self.norm
        if n.weight is not None:
            if a.bias:
                inner.addcmul_(v[a.bias], delta_sum)
            into[n.weight].addcmul_(inner, n.scale.reshape(-1))
        if a.bias:
            into[a.bias].addcmul_(g_sum, gain)
            if moved is not None:
                into[a.bias].addcmul_(delta_sum, moved)
        if n.bias is not None:
            into[n.bias].add_(g_sum)

    def backward(self, g_dot: Tensor, kept, hdot: Tensor | None, saved, params, v, into, need: bool) -> Tensor | None:
        """Add the layer's blocks of ``H v`` to ``into``; the input's tangent error (if ``need``)."""
        a, n = self.affine, self.norm
        if n is None:
            weight = params[a.weight]
            a.add_weight_adjoint(into[a.weight], saved, g_dot, weight)
            if hdot is not None:
                a.add_weight_adjoint(into[a.weight], hdot, kept, weight)
            if a.bias:
                into[a.bias].add_(a.bias_adjoint(g_dot))
            return a.input_adjoints(g_dot, saved, weight, kept, v[a.weight]) if need else None
        if a is None:
            n.products(g_dot, kept, hdot, saved, into)
            return n.input_adjoints(g_dot, kept, params, v) if need else None
        h = saved[0]
        delta, hz, delta_sum = kept if kept is not None else (None, None, None)
        weight, gain = params[a.weight], n.gain(params).reshape(-1)
        total = a.weight_adjoint(h, g_dot, weight)  # T
        if hdot is not None:
            total.add_(a.weight_adjoint(hdot, delta, weight))
        into[a.weight].add_(_rows(total, gain))
        g_sum = a.bias_adjoint(g_dot)
        moved = inner = None  # m = G a: the gain's tangent
        if n.weight is not None:
            moved = v[n.weight] * n.scale.reshape(-1)
            into[a.weight].add_(_rows(hz, moved))
            inner = _channel_dot(v[a.weight], hz).add_(_channel_dot(weight, total))
            inner.add_(self._shift(params, g_sum, None))  # (b - mu) sum ddot
        self._add_gain_blocks(into, v, g_sum, gain, moved, inner, delta_sum)
        if not need:
            return None
        return a.input_adjoints(g_dot, h, _rows(weight, gain), delta, self._tangent_weights(params, v, gain)[0])


@dataclass(frozen=True)
class _Embedding:
    """A table read at integer ids (``nn.Embedding``, ``F.embedding``): ``z = W[ids]``, ``W`` stored ``(V, D)``.
    Linear in ``W`` and the ids never move, so ``zdot = V[ids]`` and the table's block of ``H v`` is the tangent error
    ``ddot`` added back into the rows the ids read (a row read twice gets both); the first-order error is never read.
    With ``padding_idx``, the padding row is held fixed as autograd holds it (its gradient is zero): the positions
    reading it get no tangent and give no error, so the products are those of the Hessian in the other rows, and of
    the padding row only through other layers reading the same tensor. Saved: the ids, and where the padding
    positions are (or ``None``)."""

    weight: str
    padding_idx: int | None = None
    call = None  # nothing of the original call is replayed (the graph reader's protocol)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.weight,)

    def needs_error(self, input_moves: bool) -> bool:
        return False

    def forward(self, ids: Tensor, params: Mapping[str, Tensor]) -> tuple[Tensor, tuple[Tensor, Tensor | None]]:
        pad = None if self.padding_idx is None else (ids == self.padding_idx % params[self.weight].shape[0])
        return F.embedding(ids, params[self.weight]), (ids, pad if pad is not None and bool(pad.any()) else None)

    def errors(self, g: Tensor, saved, params: Mapping[str, Tensor], need: bool) -> tuple[object, None]:
        return g, None

    def tangent(self, saved, hdot: Tensor | None, params, v) -> Tensor:
        ids, pad = saved
        z = F.embedding(ids, v[self.weight])
        return z if pad is None else z.masked_fill_(pad.unsqueeze(-1), 0.0)

    def backward(self, g_dot: Tensor, kept, hdot: Tensor | None, saved, params, v, into, need: bool) -> None:
        (ids, pad), table = saved, into[self.weight]
        if pad is not None:
            g_dot = g_dot.masked_fill(pad.unsqueeze(-1), 0.0)
        table.index_add_(0, ids.reshape(-1), g_dot.reshape(-1, table.shape[1]))
        return None


def _rows(weight: Tensor, factors: Tensor) -> Tensor:
    """``weight`` with each output channel (row) multiplied by its factor (a fresh tensor)."""
    return weight * factors.reshape(-1, *([1] * (weight.dim() - 1)))


def _channel_dot(a: Tensor, b: Tensor) -> Tensor:
    """``<a_c, b_c>`` per output channel ``c`` of two weight-shaped tensors."""
    return (a * b).reshape(a.shape[0], -1).sum(1)


@dataclass(frozen=True)
class _Norm:
    """Eval-mode BatchNorm: ``z = gamma * xhat + beta``, ``xhat = (h - mu) * a`` per channel (axis 1)."""

    weight: str | None
    bias: str | None
    mean: Tensor  # (1, C, 1, ...)
    scale: Tensor  # a = 1 / sqrt(var + eps), (1, C, 1, ...)

    def _channel(self, t: Tensor) -> Tensor:
        return t.view(self.mean.shape)

    def _sum(self, t: Tensor) -> Tensor:
        return t.sum(dim=[0, *range(2, t.dim())])

    def forward(self, h: Tensor, params: Mapping[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        xhat = (h - self.mean).mul_(self.scale)
        if self.weight is None:
            out = xhat if self.bias is None else xhat + self._channel(params[self.bias])
            return out, None
        out = torch.addcmul(self._channel(params[self.bias]) if self.bias else torch.zeros_like(self.mean), xhat,
                            self._channel(params[self.weight]))  # fmt: skip
        return out, xhat

    def gain(self, params: Mapping[str, Tensor]) -> Tensor:
        """``gamma * a``, the map's factor on its input."""
        return self.scale if self.weight is None else self._channel(params[self.weight]) * self.scale

    def tangent(self, hdot: Tensor | None, xhat: Tensor | None, params, v) -> Tensor | None:
        out = None if hdot is None else hdot * self.gain(params)
        if self.weight is not None:
            term = xhat * self._channel(v[self.weight])
            out = term if out is None else out.add_(term)
        if self.bias is not None:
            bias = self._channel(v[self.bias])
            out = bias.expand_as(xhat if xhat is not None else hdot).clone() if out is None else out.add_(bias)
        return out

    def products(self, g_dot: Tensor, delta: Tensor | None, hdot: Tensor | None, xhat, into) -> None:
        if self.weight is not None:
            total = self._sum(g_dot * xhat)
            if hdot is not None:
                total += self._sum(hdot * delta).mul_(self.scale.reshape(-1))
            into[self.weight].add_(total)
        if self.bias is not None:
            into[self.bias].add_(self._sum(g_dot))

    def input_adjoints(self, g_dot: Tensor, delta: Tensor | None, params, v) -> Tensor:
        out = g_dot * self.gain(params)
        if self.weight is not None:
            out.addcmul_(delta, self._channel(v[self.weight]) * self.scale)
        return out


@dataclass(frozen=True)
class _Map:
    """A parameter-free operation that is, at the current point, a fixed linear map of its tensor inputs."""

    kind: str  # "slope", "maxpool", "linear", "relay", "view", "scale", "sum", "cat", "stack", "permute", "piece",
    # "index", "clamp" (``impl``: the bounds; slope 1 between them, bounds included, as torch's),
    # "expand", "masked", "cast" (a change of dtype: tangents and errors cast too), "gather" (rows of the first axis
    # picked by an integer tensor no parameter moves, ``call`` reading it among the call's inputs: BEiT's relative
    # position table read at its index; the error adds up over rows picked several times)
    # _Slope / _MaxPool, the linear function (pools, means), the axes' order ("permute"), (unbind/chunk/split, the
    # piece taken) of a cut along axis ``dim`` ("piece"), a basic index (ints, slices, None, ...; "index", or with
    # numbers computed from shapes: ``call`` fills them in), or the
    # slot of the mask among the call's inputs ("masked"), or (the slot of a factor computed from shapes among the
    # call's inputs, whether it divides) ("scale")
    impl: object = None
    # the forward for "view", "scale", "expand", "masked", "cast" and "relay" (an affine call whose other arguments may
    # be numbers computed from shapes: Swin's padding to whole windows; ``impl`` is (the tensor's slot among the call's
    # inputs, the call of its linear part), which tangents and errors go through), the cut for "piece" (the original
    # call, its other
    # arguments bound), the index for "index" where it has numbers computed from shapes, and for "gather" (read among
    # the call's inputs)
    call: Callable | None = None
    factors: tuple[float, ...] = (1.0,)  # "scale": (factor,), "sum": the sign of each input
    dim: int = 1  # "cat", "stack"
    means: tuple[int, ...] = ()  # "linear" by a mean over these axes (non-negative): its adjoint in closed form
    # "view" of a tensor the data reach that changes its first axis (Swin's windows folded into the batch axis and
    # back): that axis's size per sample before and after, which every pass checks (`sharpness.products._rop_graph`)
    folds: tuple[int, int] | None = None

    def forward(self, xs: list[Tensor], args: list) -> tuple[Tensor, object]:
        """``xs``: the tensor inputs; ``args``: the values of every input of the original call (for ``call``)."""
        kind = self.kind
        if kind in ("slope", "maxpool"):
            return self.impl.forward(xs[0])
        if kind == "linear":
            return self.impl(xs[0]), (xs[0].shape, layout(xs[0]))
        if kind == "relay":  # the call's other inputs kept (numbers), not the tensor itself
            return self.call(args), (xs[0].shape, layout(xs[0]), _placed(args, self.impl[0], None))
        if kind == "view":
            x, fmt = xs[0], layout(xs[0])
            if fmt is torch.channels_last:  # channels-last strides may admit no view: the call sees standard order
                args = [a.contiguous() if a is x else a for a in args]
            out = self.call(args)
            return out, (x.shape, out.shape, fmt)
        if kind == "scale":
            out = xs[0] if self.call is None else self.call(args)
            if self.impl is None:
                return out, None
            factor = float(args[self.impl[0]])  # a number computed from shapes, among the call's inputs
            return out, (1.0 / factor if factor else math.inf) if self.impl[1] else factor
        if kind == "permute":
            return xs[0].permute(self.impl), None
        if kind == "expand":
            out = self.call(args)
            return out, (xs[0].shape, out.shape)
        if kind == "masked":  # the mask, among the call's inputs
            return self.call(args), args[self.impl]
        if kind == "clamp":  # (min, max), numbers or None: the entries outside have no slope
            lo, hi = self.impl
            x = xs[0]
            outside = (x < lo) if hi is None else (x > hi) if lo is None else (x < lo) | (x > hi)
            return torch.clamp(x, lo, hi), outside
        if kind == "cast":
            out = self.call(args)
            return out, (xs[0].dtype, out.dtype)
        if kind == "stack":
            return torch.stack(xs, dim=self.dim), None
        if kind == "index":  # the index, with its numbers computed from shapes filled in where it has some
            index = self.impl if self.call is None else self.call(args)
            return xs[0][index], (xs[0].shape, index)
        if kind == "gather":
            index = self.call(args)
            return xs[0][index], (xs[0].shape, index)
        if kind == "piece":  # the original cut replayed, one piece taken
            pieces, (name, index) = self.call(args), self.impl
            start = index if name == "unbind" else sum(p.shape[self.dim] for p in pieces[:index])
            return pieces[index], (xs[0].shape, start, None if name == "unbind" else pieces[index].shape[self.dim])
        if kind == "sum":
            out = xs[0] if self.factors[0] == 1.0 else xs[0] * self.factors[0]
            for x, f in zip(xs[1:], self.factors[1:]):
                # integer tensors (positions, token[:, None] - token[None, :]) take an integer alpha only
                whole = not (out.is_floating_point() or x.is_floating_point()) and float(f).is_integer()
                out = out.add(x, alpha=int(f) if whole else f)
            # a parameter broadcast over the samples (fewer axes): each input's shape, for its error's sum
            shapes = None if all(x.shape == out.shape for x in xs) else (out.shape, *(x.shape for x in xs))
            # inputs of other dtypes (a float32 tensor plus a float64 constant): the tangent takes the sum's dtype,
            # as the value does, and each input's error its input's
            dtypes = None if all(x.dtype == out.dtype for x in xs) else (out.dtype, *(x.dtype for x in xs))
            return out, (shapes, dtypes)
        return torch.cat(xs, dim=self.dim), [x.shape[self.dim] for x in xs]

    def tangent(self, xdots: list[Tensor | None], saved) -> Tensor:
        """The output's tangent from the inputs' (``None`` for inputs that do not move; at least one moves)."""
        kind = self.kind
        if kind == "sum":
            shapes, dtypes = saved
            terms = [(t, f) for t, f in zip(xdots, self.factors) if t is not None]
            (t, f), rest = terms[0], terms[1:]
            if dtypes is not None:
                terms = [(t.to(dtypes[0]), f) for t, f in terms]
                (t, f), rest = terms[0], terms[1:]
            if shapes is not None and t.shape != shapes[0] and not rest:
                return t.mul(f).expand(shapes[0]).contiguous()
            if not rest:
                return t if f == 1.0 else t * f
            out = torch.add(t, rest[0][0], alpha=rest[0][1]) if f == 1.0 else torch.add(t * f, rest[0][0],
                                                                                          alpha=rest[0][1])
            for t, f in rest[1:]:
                out.add_(t, alpha=f)
            return out
        if kind == "cat":
            like, parts = next(t for t in xdots if t is not None), []
            for t, size in zip(xdots, saved):
                if t is None:
                    shape = list(like.shape)
                    shape[self.dim] = size
                    t = torch.empty(shape, dtype=like.dtype, device=like.device, memory_format=layout(like)).zero_()
                parts.append(t)
            return torch.cat(parts, dim=self.dim)
        if kind == "stack":
            like = next(t for t in xdots if t is not None)
            return torch.stack([torch.zeros_like(like) if t is None else t for t in xdots], dim=self.dim)
        h = xdots[0]
        if kind == "cast":
            return h.to(saved[1])
        if kind in ("slope", "maxpool"):
            return self.impl.tangent(h, saved)
        if kind == "linear":
            return self.impl(h)
        if kind == "relay":
            return self.impl[1](_placed(saved[2], self.impl[0], h))
        if kind == "view":
            return h.reshape(saved[1])
        if kind == "permute":
            return h.permute(self.impl)
        if kind == "expand":
            return h.expand(saved[1])
        if kind in ("masked", "clamp"):
            return h.masked_fill(saved, 0.0)
        if kind in ("index", "gather"):
            return h[saved[1]]
        if kind == "piece":
            return _narrow(h, self.dim, *saved[1:])
        factor = self.factors[0] if self.impl is None else saved
        return h * factor if factor != 1.0 else h

    def adjoint(self, g: Tensor, saved, need: list[bool]) -> list[Tensor | None]:
        kind = self.kind
        if kind == "sum":
            shapes, dtypes = saved
            shapes = shapes[1:] if shapes is not None else (g.shape,) * len(need)
            dtypes = dtypes[1:] if dtypes is not None else (g.dtype,) * len(need)
            return [(g if f == 1.0 else g * f).sum_to_size(shape).to(dtype) if n else None
                    for n, f, shape, dtype in zip(need, self.factors, shapes, dtypes)]  # fmt: skip
        if kind == "cat":
            parts = torch.split(g, saved, dim=self.dim)
            return [p if n else None for p, n in zip(parts, need)]
        if kind == "stack":
            return [p if n else None for p, n in zip(g.unbind(self.dim), need)]
        if kind == "cast":
            return [g.to(saved[0])]
        if kind in ("slope", "maxpool"):
            return [self.impl.adjoint(g, saved)]
        if kind == "linear" and self.means:  # the error spread evenly over the averaged axes
            shape, fmt = saved
            count = math.prod(shape[d] for d in self.means)
            if g.dim() != len(shape):  # the axes were dropped (no keepdim)
                g = g.reshape([1 if d in self.means else size for d, size in enumerate(shape)])
            return [(g / count).expand(shape).contiguous(memory_format=fmt)]
        if kind in ("linear", "relay"):  # the input's error in the input's memory layout (channels-last stays so)
            with torch.enable_grad():
                x = torch.empty(saved[0], dtype=g.dtype, device=g.device, memory_format=saved[1])
                x = x.zero_().requires_grad_()
                out = self.impl(x) if kind == "linear" else self.impl[1](_placed(saved[2], self.impl[0], x))
                return [torch.autograd.grad(out, x, g)[0]]
        if kind == "view":
            return [g.reshape(saved[0]).contiguous(memory_format=saved[2])]
        if kind == "expand":
            return [g.sum_to_size(saved[0])]
        if kind in ("masked", "clamp"):
            return [g.masked_fill(saved, 0.0)]
        if kind == "permute":  # the inverse permutation
            return [g.permute(sorted(range(len(self.impl)), key=self.impl.__getitem__))]
        if kind == "index":  # the error of a piece: zero outside it
            return [_Part(saved[0], g, lambda t: t[saved[1]])]
        if kind == "gather":  # rows picked several times add up their errors
            return [g.new_zeros(saved[0]).index_put_((saved[1],), g, accumulate=True)]
        if kind == "piece":
            return [_Part(saved[0], g, lambda t: _narrow(t, self.dim, *saved[1:]))]
        factor = self.factors[0] if self.impl is None else saved
        return [g * factor if factor != 1.0 else g]


def _placed(args: list, slot: int, t: Tensor | None) -> list:
    """``args`` with ``t`` at ``slot``."""
    return [t if i == slot else a for i, a in enumerate(args)]


@dataclass(frozen=True)
class _Part:
    """An error zero outside one piece of its tensor: ``value`` at ``place(t)`` (a view of a tensor ``t`` of ``shape``).
    The graph sums the parts of a tensor cut into pieces into one buffer instead of zero-filling each."""

    shape: torch.Size
    value: Tensor
    place: Callable[[Tensor], Tensor]

    def dense(self) -> Tensor:
        out = self.value.new_zeros(self.shape)
        self.place(out).copy_(self.value)
        return out

    def add_to(self, t: Tensor) -> None:
        self.place(t).add_(self.value)


def _narrow(t: Tensor, dim: int, start: int, length: int | None) -> Tensor:
    """The view of a piece ``"piece"`` keeps in ``t``: at ``start`` along ``dim``, of ``length`` (``None``: the single
    index ``start`` of ``unbind``)."""
    return t.select(dim, start) if length is None else t.narrow(dim, start, length)
