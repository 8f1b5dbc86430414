"""Exact Hessian-vector products of networks that branch and merge (residual, concatenating, with BatchNorm) by
the R-operator over their traced graph.

:mod:`sharpness.products._rop` writes Pearlmutter's R-operator out for chains; here the same passes walk the
model's traced ``torch.fx`` graph, a directed acyclic graph, in topological order (forward, tangent forward)
and in reverse (errors, tangent errors), errors of a tensor used several times summed over its users. Every
operation is, at the current point, either

- a layer bilinear in (its input, its parameters): ``Linear`` and zero-padded ``Conv1d/2d/3d``
  ``z = A(h; W) + b``, and eval-mode ``BatchNorm1d/2d/3d`` ``z = gamma * xhat + beta`` with
  ``xhat = (h - mu) / sqrt(var + eps)`` per channel from the fixed running statistics (without ``affine``, a
  fixed per-channel affine map), or
- a fixed linear map ``P`` of its tensor inputs: ``ReLU``/``LeakyReLU`` (a mask or slope), ``MaxPool`` (a
  selection), average and adaptive average pooling and means over non-batch axes, flatten/view/reshape,
  identity and dropout (eval mode), multiplication by a number, addition of a number, residual sums and
  differences, and concatenation. Its second derivative vanishes (almost everywhere).

With a tangent ``v`` (``V``, ``c`` for an affine layer's weight and bias, ``G``, ``B`` for a BatchNorm's), the
first-order errors ``delta = dL/dz`` and the tangent errors ``ddot``::

    affine     zdot = A(hdot; W) + A(h; V) + c      (Hv)_W = A_W^T(h, ddot) + A_W^T(hdot, delta), (Hv)_b = sum ddot
               input tangent error = A_h^T(ddot; W) + A_h^T(delta; V)
    BatchNorm  zdot = gamma a hdot + G xhat + B     (Hv)_gamma = sum(xhat ddot + a hdot delta),   (Hv)_beta = sum ddot
               input tangent error = gamma a ddot + G a delta,   a = 1 / sqrt(var + eps)
    P          zdot = P hdot                        input tangent error = P^T ddot

Tensors that depend on no parameter (the data, and whatever is computed from them alone) have no tangent, and
neither pass goes into them: first-order errors are formed only downstream of a layer whose input moves, and
the data's input gradient never. What the products share (layer inputs, normalized BatchNorm inputs, masks,
pooling indices, errors, the loss's curvature) is one forward and one backward pass per data chunk, kept
across products when it fits in memory, so a product costs about one gradient.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from manifolds._graph import is_metadata, target_name
from sharpness.products._rop import (
    _CONVS,
    _DROPOUTS,
    _POOLS,
    ChunkState,
    _Affine,
    _affine,
    _has_hooks,
    _MaxPool,
    _Slope,
    loss_state,
)

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_AVG_POOLS = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
              nn.AdaptiveAvgPool3d)  # fmt: skip
_AVG_POOL_FUNCTIONS = {"avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
                       "adaptive_avg_pool3d"}  # fmt: skip
_IDENTITY_FUNCTIONS = {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "contiguous"}
_VIEWS = {"view", "reshape", "flatten"}
_ADD = {operator.add, operator.iadd, torch.add, "add", "add_", "iadd"}
_SUB = {operator.sub, operator.isub, torch.sub, "sub", "sub_", "isub"}


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
    onto the weights. With ``delta`` the error at ``z``, ``Hz = A_W^T(h, delta)`` (kept with it) and
    ``Wz = A_W^T(hdot, delta)``::

        zdot = A(hdot; g W) + A(h; g V) + g c + B + G xhat
        (Hv)_W = g (A_W^T(h, ddot) + Wz) + G a Hz,          (Hv)_b = g sum ddot + G a sum delta
        (Hv)_gamma = sum(xhat ddot) + a (<W, Wz> + <V, Hz> + c sum delta),   (Hv)_beta = sum ddot
        input tangent error = A_h^T(ddot; g W) + A_h^T(delta; G a W + g V)

    (sums and inner products per output channel).
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
        z, xhat = n.forward(a.apply(h, params[a.weight], params[a.bias] if a.bias else None), params)
        return z, (h, xhat)

    def errors(self, g: Tensor, saved, params: Mapping[str, Tensor], need: bool) -> tuple[object, Tensor | None]:
        """What the products keep of the error ``g`` at the output, and the input's error (if ``need``)."""
        a, n = self.affine, self.norm
        if n is None:
            return g, (a.input_adjoint(g, saved, params[a.weight]) if need else None)
        if a is None:
            return g, (g * n.gain(params) if need else None)
        h = saved[0]
        weight = params[a.weight]
        kept = (g, _weight_adjoint(a, h, g, weight), a.bias_adjoint(g)) if n.weight is not None else (g, None, None)
        return kept, (a.input_adjoint(g, h, _rows(weight, n.gain(params))) if need else None)

    def tangent(self, saved, hdot: Tensor | None, params, v) -> Tensor:
        a, n = self.affine, self.norm
        if n is None:
            z = a.apply(saved, v[a.weight], v[a.bias] if a.bias else None)
            return z if hdot is None else z.add_(a.apply(hdot, params[a.weight], None))
        if a is None:
            return n.tangent(hdot, saved, params, v)
        h, xhat = saved
        gain = n.gain(params).reshape(-1)
        bias = gain * v[a.bias] if a.bias else None
        if n.bias is not None:
            bias = v[n.bias] if bias is None else bias.add_(v[n.bias])
        z = a.apply(h, _rows(v[a.weight], gain), bias)
        if hdot is not None:
            z.add_(a.apply(hdot, _rows(params[a.weight], gain), None))
        if n.weight is not None:
            z.addcmul_(xhat, n._channel(v[n.weight]))
        return z

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
        h, xhat = saved
        delta, hz, delta_sum = kept if kept is not None else (None, None, None)
        weight, gain = params[a.weight], n.gain(params).reshape(-1)
        total = _weight_adjoint(a, h, g_dot, weight)
        wz = _weight_adjoint(a, hdot, delta, weight) if hdot is not None else None
        if wz is not None:
            total.add_(wz)
        into[a.weight].add_(_rows(total, gain))
        g_sum = a.bias_adjoint(g_dot)
        moved = None  # G a: the gain's tangent
        if n.weight is not None:
            moved = v[n.weight] * n.scale.reshape(-1)
            into[a.weight].add_(_rows(hz, moved))
            inner = _channel_dot(v[a.weight], hz)
            if wz is not None:
                inner.add_(_channel_dot(weight, wz))
            if a.bias:
                inner.addcmul_(v[a.bias], delta_sum)
            into[n.weight].add_(n._sum(g_dot * xhat)).addcmul_(inner, n.scale.reshape(-1))
        if a.bias:
            into[a.bias].addcmul_(g_sum, gain)
            if moved is not None:
                into[a.bias].addcmul_(delta_sum, moved)
        if n.bias is not None:
            into[n.bias].add_(g_sum)
        if not need:
            return None
        tangent = _rows(v[a.weight], gain)
        if moved is not None:
            tangent = tangent.add_(_rows(weight, moved))
        return a.input_adjoints(g_dot, h, _rows(weight, gain), delta, tangent)


def _rows(weight: Tensor, factors: Tensor) -> Tensor:
    """``weight`` with each output channel (row) multiplied by its factor (a fresh tensor)."""
    return weight * factors.reshape(-1, *([1] * (weight.dim() - 1)))


def _channel_dot(a: Tensor, b: Tensor) -> Tensor:
    """``<a_c, b_c>`` per output channel ``c`` of two weight-shaped tensors."""
    return (a * b).reshape(a.shape[0], -1).sum(1)


def _weight_adjoint(affine: _Affine, h: Tensor, g: Tensor, weight: Tensor) -> Tensor:
    """``A_W^T(h, g)`` as a fresh tensor."""
    if not affine.dims:
        return g.T @ h
    return affine._conv_backward(g, h, weight, [False, True, False])[1]


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

    kind: str  # "slope", "maxpool", "linear", "view", "scale", "sum", "cat"
    impl: object = None  # _Slope / _MaxPool, or the linear function (pools, means)
    call: Callable | None = None  # the forward for "view" and "scale" (the original call, its other arguments bound)
    factors: tuple[float, ...] = (1.0,)  # "scale": (factor,), "sum": the sign of each input
    dim: int = 1  # "cat"

    def forward(self, xs: list[Tensor], args: list) -> tuple[Tensor, object]:
        """``xs``: the tensor inputs; ``args``: the values of every input of the original call (for ``call``)."""
        kind = self.kind
        if kind in ("slope", "maxpool"):
            return self.impl.forward(xs[0])
        if kind == "linear":
            return self.impl(xs[0]), xs[0].shape
        if kind == "view":
            out = self.call(args)
            return out, (xs[0].shape, out.shape)
        if kind == "scale":
            return (xs[0] if self.call is None else self.call(args)), None
        if kind == "sum":
            out = xs[0] if self.factors[0] == 1.0 else xs[0] * self.factors[0]
            for x, f in zip(xs[1:], self.factors[1:]):
                out = out.add(x, alpha=f)
            return out, None
        return torch.cat(xs, dim=self.dim), [x.shape[self.dim] for x in xs]

    def tangent(self, xdots: list[Tensor | None], saved) -> Tensor:
        """The output's tangent from the inputs' (``None`` for inputs that do not move; at least one moves)."""
        kind = self.kind
        if kind == "sum":
            terms = [(t, f) for t, f in zip(xdots, self.factors) if t is not None]
            (t, f), rest = terms[0], terms[1:]
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
                    t = like.new_zeros(shape)
                parts.append(t)
            return torch.cat(parts, dim=self.dim)
        h = xdots[0]
        if kind in ("slope", "maxpool"):
            return self.impl.tangent(h, saved)
        if kind == "linear":
            return self.impl(h)
        if kind == "view":
            return h.reshape(saved[1])
        return h * self.factors[0] if self.factors[0] != 1.0 else h

    def adjoint(self, g: Tensor, saved, need: list[bool]) -> list[Tensor | None]:
        kind = self.kind
        if kind == "sum":
            return [(g if f == 1.0 else g * f) if n else None for n, f in zip(need, self.factors)]
        if kind == "cat":
            parts = torch.split(g, saved, dim=self.dim)
            return [p if n else None for p, n in zip(parts, need)]
        if kind in ("slope", "maxpool"):
            return [self.impl.adjoint(g, saved)]
        if kind == "linear":
            with torch.enable_grad():
                x = g.new_zeros(saved, requires_grad=True)
                return [torch.autograd.grad(self.impl(x), x, g)[0]]
        if kind == "view":
            return [g.reshape(saved[0])]
        return [g * self.factors[0] if self.factors[0] != 1.0 else g]


# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Step:
    """One node of the graph: ``op`` (``None`` for the input, a :class:`_Layer`, a :class:`_Map`, or a callable
    computing a non-tensor value such as ``x.size(0)``), the slots of its tensor inputs, and whether its value
    depends on the parameters (``moving``)."""

    op: object
    inputs: tuple[int, ...]
    moving: bool
    meta: tuple[int, ...] = ()  # slots of the non-tensor values its call reads


@dataclass(frozen=True)
class RopGraph:
    """A network read off its traced graph as :class:`_Step` s in topological order (step 0 the input), its
    output at step ``output``, with, per step, whether its first-order error (``errors``) is needed and which
    steps' values the products keep (``kept``)."""

    steps: tuple[_Step, ...]
    output: int
    errors: frozenset[int]  # steps whose first-order error is formed: downstream of a layer whose input moves
    users: tuple[tuple[int, ...], ...]

    def _forward(self, params: Mapping[str, Tensor], x: Tensor) -> tuple[Tensor, list]:
        """The output and every step's saved map or layer input (``None`` where nothing is kept)."""
        steps = self.steps
        values: list = [None] * len(steps)
        left = [len(u) for u in self.users]
        saved: list = [None] * len(steps)
        values[0] = x
        for i in range(1, len(steps)):
            step = steps[i]
            xs = [values[j] for j in step.inputs]
            op = step.op
            if isinstance(op, _Layer):
                values[i], saved[i] = op.forward(xs[0], params)
            elif isinstance(op, _Map):
                values[i], s = op.forward(xs, [values[j] for j in step.meta])
                if step.moving:
                    saved[i] = s
            else:  # a non-tensor value (x.size(0), x.shape[0], ...)
                values[i] = op([values[j] for j in step.meta])
            for j in (*step.inputs, *step.meta):
                left[j] -= 1
                if left[j] == 0 and j != self.output:
                    values[j] = None
        return values[self.output], saved

    def forward_state(self, params: Mapping[str, Tensor], x: Tensor, y: Tensor, loss_fn: Callable,
                      weight: float) -> ChunkState:  # fmt: skip
        """One chunk's forward and backward pass; ``weight * loss_fn(out, y)`` is the chunk's share of the loss."""
        out, saved = self._forward(params, x)
        return loss_state(out, y, loss_fn, weight, lambda g: self._errors(params, saved, g), saved)

    def _errors(self, params: Mapping[str, Tensor], saved: list, out_grad: Tensor) -> dict[int, Tensor]:
        """First-order errors ``dL/dz`` at the outputs of the layers whose input moves (summed over users)."""
        deltas: dict[int, Tensor] = {}
        if not self.errors:
            return deltas
        grads: dict[int, Tensor] = {self.output: out_grad}
        for i in range(len(self.steps) - 1, 0, -1):
            if i not in self.errors or i not in grads:
                continue
            g = grads.pop(i)
            step = self.steps[i]
            need = [j in self.errors for j in step.inputs]
            if isinstance(step.op, _Layer):
                kept, error = step.op.errors(g, saved[i], params, need[0])
                if step.op.needs_error(self.steps[step.inputs[0]].moving):
                    deltas[i] = kept
                errs = [error]
            else:
                errs = step.op.adjoint(g, saved[i], need)
            _accumulate(grads, step.inputs, errs, need)
        return deltas

    def first_linear(self, states: list[ChunkState]) -> tuple[str, list[Tensor]] | None:
        """The weight name of the first ``Linear`` layer of the data (its input depends on no parameter; not merged
        with a BatchNorm) and its inputs per chunk, or ``None`` where there is none."""
        i = self._first_linear()
        return None if i is None else (self.steps[i].op.affine.weight, [s.saved[i] for s in states])

    def _first_linear(self) -> int | None:
        layers = [(i, s.op) for i, s in enumerate(self.steps) if isinstance(s.op, _Layer)]
        for i, op in layers:
            if op.norm is None and op.affine.dims == 0 and not self.steps[self.steps[i].inputs[0]].moving:
                shared = any(j != i and other.affine is not None and other.affine.weight == op.affine.weight
                             for j, other in layers)  # fmt: skip
                return None if shared else i
        return None

    def add_products(self, params: Mapping[str, Tensor], state: ChunkState, v: Mapping[str, Tensor],
                     into: Mapping[str, Tensor], first_layer: tuple[Tensor, Tensor] | None = None) -> None:  # fmt: skip
        """Add the chunk's ``H v`` to ``into`` (``{name: tensor}`` like ``params``), in place.

        ``first_layer = (first_dot, first_errors)``: as for chains (:func:`sharpness.products._rop.add_products`),
        for the layer :meth:`first_linear` names: its output tangent from its weight (its bias tangent is added
        in place) and where its tangent errors are written; its weight is neither read in ``v`` nor written in
        ``into``.
        """
        steps, saved, deltas = self.steps, state.saved, state.deltas
        first = self._first_linear() if first_layer is not None else None
        dots: list = [None] * len(steps)
        for i in range(1, len(steps)):
            step = steps[i]
            if not step.moving:
                continue
            op = step.op
            xdots = [dots[j] for j in step.inputs]
            if i == first:
                bias = op.affine.bias
                dots[i] = first_layer[0] if bias is None else first_layer[0].add_(v[bias])
            elif isinstance(op, _Layer):
                dots[i] = op.tangent(saved[i], xdots[0], params, v)
            else:
                dots[i] = op.tangent(xdots, saved[i])
        grads: dict[int, Tensor] = {self.output: state.loss_hvp(dots[self.output])}
        for i in range(len(steps) - 1, 0, -1):
            step = steps[i]
            if not step.moving or i not in grads:
                continue
            g_dot = grads.pop(i)
            need = [steps[j].moving for j in step.inputs]
            op = step.op
            if i == first:
                first_layer[1].copy_(g_dot)
                if op.affine.bias:
                    into[op.affine.bias].add_(op.affine.bias_adjoint(g_dot))
                errs = [None]
            elif isinstance(op, _Layer):
                errs = [op.backward(g_dot, deltas.get(i), dots[step.inputs[0]], saved[i], params, v, into, need[0])]
            else:
                errs = op.adjoint(g_dot, saved[i], need)
            _accumulate(grads, step.inputs, errs, need)

    def state_bytes_per_sample(self, params: Mapping[str, Tensor], x: Tensor) -> int:
        """Bytes one sample's cached state takes (the saved layer inputs and maps, each tensor counted once, the
        first-order errors and the outputs' curvature), measured by one forward and backward pass of ``x[:1]``.
        Not counted: what a chunk keeps whatever its size, at most one parameter vector (the errors' weight
        adjoints of merged BatchNorm layers)."""
        out, saved = self._forward(params, x[:1])
        errors = self._errors(params, saved, torch.ones_like(out)).values()
        deltas = [d[0] if isinstance(d, tuple) else d for d in errors]
        tensors = {id(t): t for s in [*saved, *deltas] for t in (s if isinstance(s, tuple) else (s,))
                   if isinstance(t, Tensor)}  # fmt: skip
        return out.numel() * out.element_size() + sum(t.numel() * t.element_size() for t in tensors.values())


def _accumulate(grads: dict[int, Tensor], inputs: tuple[int, ...], errs: list, need: list[bool]) -> None:
    """Add each needed input's error to ``grads`` (a tensor used twice gets the sum, never written in place)."""
    for j, e, n in zip(inputs, errs, need):
        if n and e is not None:
            grads[j] = e if j not in grads else grads[j] + e


# ------------------------------------------------------------------------------------------------
# reading the graph
def _caller(node: fx.Node) -> Callable[[list], object]:
    """``node``'s own call, fed the values of ``node.all_input_nodes`` in that order."""
    inputs = node.all_input_nodes

    def call(values: list) -> object:
        env = dict(zip(inputs, values))
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        if node.op == "call_method":
            return getattr(args[0], str(node.target))(*args[1:], **kwargs)
        return node.target(*args, **kwargs)

    return call


def _number(a: object) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool)


def _argument(node: fx.Node, index: int, name: str, default: object) -> object:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _single_user(node: fx.Node) -> bool:
    """An in-place call is read as its out-of-place twin only where nothing else reads its input."""
    return len(node.args[0].users) == 1 if isinstance(node.args[0], fx.Node) else False


def _module_op(node: fx.Node, module: nn.Module, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor]):
    """A module call as a :class:`_Layer` or :class:`_Map`, or ``None`` where it is not supported."""
    name, kind, shape = str(node.target), type(module), node.args[0].meta["shape"]
    if kind is nn.Linear or kind in _CONVS:
        if kind is nn.Linear and len(shape) != 2:
            return None
        affine = _affine(name, module, params)
        return None if affine is None else _Layer(affine=affine)
    if kind in _BATCH_NORMS:
        return _batch_norm(name, module, params, buffers, len(shape))
    if kind in (nn.ReLU, nn.LeakyReLU):
        if module.inplace and not _single_user(node):
            return None
        return _Map("slope", _Slope(0.0 if kind is nn.ReLU else float(module.negative_slope)))
    if kind in _POOLS:
        if module.return_indices:
            return None
        return _Map("maxpool", _MaxPool(_POOLS[kind], module.kernel_size, module.stride, module.padding,
                                        module.dilation, module.ceil_mode))  # fmt: skip
    if kind in _AVG_POOLS:
        return _Map("linear", module)
    if kind is nn.Flatten:
        return _Map("view", call=lambda args: module(args[0]))
    if kind is nn.Identity or kind in _DROPOUTS:
        return _Map("scale")
    return None


def _batch_norm(name, module, params, buffers, dims: int) -> _Layer | None:
    """Eval-mode BatchNorm with running statistics, its affine parameters trainable (or absent)."""
    mean, var = buffers.get(f"{name}.running_mean"), buffers.get(f"{name}.running_var")
    if not module.track_running_stats or mean is None or var is None:
        return None  # batch statistics even in eval mode
    weight, bias = (f"{name}.weight", f"{name}.bias") if module.affine else (None, None)
    if module.affine and (weight not in params or bias not in params):
        return None
    view = (1, -1) + (1,) * (dims - 2)
    scale = torch.rsqrt(var + module.eps).reshape(view)
    return _Layer(norm=_Norm(weight, bias, mean.reshape(view), scale))


def _function_op(node: fx.Node, shapes: dict[fx.Node, tuple]):
    """A function or method call as a :class:`_Map` and its tensor inputs, or ``None`` where not supported."""
    name = target_name(node)
    target = node.target if node.op == "call_function" else name
    args = node.args
    tensors = [a for a in node.all_input_nodes if a in shapes]
    first = args[0] if args and isinstance(args[0], fx.Node) and args[0] in shapes else None
    if name in ("relu", "relu_", "leaky_relu", "leaky_relu_") and first is not None and len(tensors) == 1:
        inplace = name.endswith("_") or bool(_argument(node, 2 if name.startswith("leaky") else 1, "inplace", False))
        if inplace and not _single_user(node):
            return None
        slope = float(_argument(node, 1, "negative_slope", 0.01)) if name.startswith("leaky") else 0.0
        return _Map("slope", _Slope(slope)), [first]
    if name in _IDENTITY_FUNCTIONS and first is not None and len(tensors) == 1:
        return _Map("scale"), [first]
    if name in _AVG_POOL_FUNCTIONS | {"mean"} and first is not None and len(tensors) == 1:
        if any(isinstance(a, fx.Node) for a in (*args[1:], *node.kwargs.values())):
            return None
        if name == "mean":
            dims = _argument(node, 1, "dim", None)
            dims = (dims,) if isinstance(dims, int) else dims
            if dims is None or any(d % len(shapes[first]) == 0 for d in dims) or node.kwargs.get("dtype"):
                return None
        rest, kwargs = args[1:], dict(node.kwargs)
        fn = getattr(F, name) if name != "mean" else torch.mean
        return _Map("linear", lambda t: fn(t, *rest, **kwargs)), [first]
    if name in _VIEWS and first is not None and len(tensors) == 1:
        before, after = shapes[first], shapes[node]
        if before[:1] != after[:1] or torch.Size(before[1:]).numel() != torch.Size(after[1:]).numel():
            return None  # the samples must stay apart
        return _Map("view", call=_caller(node)), [first]
    if name == "cat":
        parts, dim = args[0], _argument(node, 1, "dim", 0)
        if not isinstance(parts, (list, tuple)) or not isinstance(dim, int) or \
                not all(isinstance(p, fx.Node) and p in shapes for p in parts):  # fmt: skip
            return None
        dim %= len(shapes[parts[0]])
        return (_Map("cat", dim=dim), list(parts)) if dim else None
    if target in _ADD | _SUB and len(args) == 2 and not node.kwargs.keys() - {"alpha"}:
        sign = -1.0 if target in _SUB else 1.0
        alpha = node.kwargs.get("alpha", 1)
        if not _number(alpha):
            return None
        if all(isinstance(a, fx.Node) and a in shapes for a in args):
            if shapes[args[0]] != shapes[args[1]]:
                return None  # broadcasting
            return _Map("sum", factors=(1.0, sign * float(alpha))), [args[0], args[1]]
        if len(tensors) == 1 and "alpha" not in node.kwargs:
            # a tensor plus or minus a number (or a shape entry): the map is the identity, or minus it
            factor = sign if args[1] is tensors[0] else 1.0
            return _Map("scale", call=_caller(node), factors=(factor,)), tensors
        if len(tensors) == 1:  # a tensor and a shape entry, with alpha
            return None
    if target in (operator.mul, operator.imul, torch.mul, "mul", "mul_", operator.truediv, torch.div, "div",
                  operator.neg, torch.neg, "neg") and len(tensors) == 1 and not node.kwargs:  # fmt: skip
        others = [a for a in args if a is not tensors[0]]
        if len(others) != len(args) - 1 or not all(_number(a) for a in others):
            return None
        if target in (operator.neg, torch.neg, "neg"):
            factor = -1.0
        elif target in (operator.truediv, torch.div, "div"):
            if args[0] is not tensors[0] or others[0] == 0:
                return None
            factor = 1.0 / others[0]
        else:
            factor = float(others[0])
        return _Map("scale", call=_caller(node), factors=(factor,)), tensors
    return None


def _fuse_batch_norms(read: dict[fx.Node, tuple], output: fx.Node) -> None:
    """Merge each BatchNorm whose input is an affine layer's output used by nothing else into that layer."""
    for node, (op, tensors, _) in list(read.items()):
        if isinstance(op, _Layer) and op.affine is None and op.norm is not None:
            (source,) = tensors
            before = read[source][0]
            if isinstance(before, _Layer) and before.norm is None and len(source.users) == 1 and source is not output:
                read[node] = (_Layer(affine=before.affine, norm=op.norm), read[source][1], [])


def rop_graph(
    model: nn.Module, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], graph: fx.Graph | None
) -> RopGraph | None:
    """Read ``model``'s traced ``graph`` (:attr:`manifolds.TracedNetwork.graph`, with shapes) for the R-operator
    products, or ``None`` where one of its operations is not supported (see the module docstring), a module
    has hooks, a layer's parameters are not all trainable (among ``params``), or nothing has parameters.
    ``buffers``: the BatchNorm running statistics, in the products' dtype and device."""
    if graph is None or _has_hooks(model):
        return None
    nodes = list(graph.nodes)
    shapes = {n: n.meta["shape"] for n in nodes if "shape" in n.meta}
    read: dict[fx.Node, tuple] = {}  # node -> (op, tensor input nodes, call input nodes)
    output = None
    for node in nodes:
        if node.op == "placeholder":
            if read or node not in shapes:
                return None
            read[node] = (None, [], [])
        elif node.op == "output":
            output = node.args[0]
            if not isinstance(output, fx.Node) or output not in shapes:
                return None
        elif node not in shapes:  # a non-tensor value: x.size(0), x.shape[0], arithmetic on those
            if not is_metadata(node) and (node.op != "call_function" or any(a in shapes for a in node.all_input_nodes)):
                return None
            read[node] = (_caller(node), [], node.all_input_nodes)
        elif node.op == "call_module":
            module = model.get_submodule(str(node.target))
            if _has_hooks(module) or len(node.args) != 1 or node.kwargs or node.args[0] not in shapes:
                return None
            op = _module_op(node, module, params, buffers)
            if op is None:
                return None
            read[node] = (op, [node.args[0]], [node.args[0]] if getattr(op, "call", None) else [])
        elif node.op in ("call_function", "call_method"):
            found = _function_op(node, shapes)
            if found is None:
                return None
            op, tensors = found
            read[node] = (op, tensors, node.all_input_nodes if op.call is not None else [])
        else:  # get_attr: a parameter or buffer used outside a module
            return None
    if output is None:
        return None
    _fuse_batch_norms(read, output)
    live, stack = set(), [output]  # what the output depends on
    while stack:
        node = stack.pop()
        if node not in live:
            live.add(node)
            stack.extend(read[node][1] + read[node][2])
    order = [n for n in nodes if n in live]
    if order[0].op != "placeholder":
        return None
    slot = {n: i for i, n in enumerate(order)}
    steps, moving = [], []
    for node in order:
        op, tensors, meta = read[node]
        moves = isinstance(op, _Layer) and bool(op.names) or any(moving[slot[t]] for t in tensors)
        moving.append(moves)
        steps.append(_Step(op, tuple(slot[t] for t in tensors), moves, tuple(slot[m] for m in meta)))
    if not any(isinstance(s.op, _Layer) and s.op.names for s in steps):
        return None
    users: list[list[int]] = [[] for _ in steps]
    for i, s in enumerate(steps):
        for j in (*s.inputs, *s.meta):
            users[j].append(i)
    errors: set[int] = set()
    for i, s in enumerate(steps):  # downstream of every layer whose products read its error
        if i in errors or (isinstance(s.op, _Layer) and s.op.needs_error(moving[s.inputs[0]])):
            errors.add(i)
            errors.update(u for u in users[i] if isinstance(steps[u].op, (_Layer, _Map)))
    return RopGraph(tuple(steps), slot[output], frozenset(errors), tuple(tuple(u) for u in users))


__all__ = ["RopGraph", "rop_graph"]
