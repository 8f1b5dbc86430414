"""Exact Hessian-vector products of feed-forward chains by the R-operator, written out by hand.

For a chain (an ``nn.Sequential``, or any forward calling modules one after the other) of affine
layers (``Linear``, ``Conv1d/2d/3d``) and piecewise-linear parameter-free modules (``ReLU``,
``LeakyReLU``, ``MaxPool1d/2d/3d``, ``Flatten``, ``Identity``, and dropout, which is the identity in
the eval mode the objective evaluates in), Pearlmutter's R-operator gives ``H v`` in closed form.
Every piecewise-linear module acts, at the current point, as a fixed linear map ``P`` (a mask, a
slope, a selection of window maxima, a reshape): its second derivative vanishes almost everywhere.
With an affine layer ``z = A(h; W, b)``, its
adjoints ``A_h^T`` (to the input) and ``A_W^T`` (to the weight), back-propagated errors
``delta = dL/dz`` and a tangent ``v = (V, c)``::

    forward  (tangent)  zdot = A(hdot; W) + A(h; V, c)     (hdot = 0 for the data)     hdot' = P zdot
    loss                gdot = (d^2 loss / d out^2) hdot_out   (closed form for cross-entropy, else autograd)
    backward (tangent)  ddot = P^T gdot;   gdot_in = A_h^T(ddot; W) + A_h^T(delta; V)
    product             (H v)_W = A_W^T(h, ddot) + A_W^T(hdot, delta),   (H v)_b = sum of ddot

Everything that does not depend on ``v`` (layer inputs, masks, pooling indices, errors, the loss's
curvature) is one forward and one backward pass per data chunk, kept across products when it fits
in memory. Neither pass goes below the first affine layer: the input gradient of the data, which
autograd's double backward of a convolution computes regardless, is never formed. A product then
costs about one gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from manifolds import module_chain
from manifolds._modules import DROPOUTS
from sharpness.products._layout import layout

_CONVS = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}
_POOLS = {nn.MaxPool1d: F.max_pool1d, nn.MaxPool2d: F.max_pool2d, nn.MaxPool3d: F.max_pool3d}
_CONV_FUNCTIONS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks)


# ------------------------------------------------------------------------------------------------
# affine layers
def _flat_rows(t: Tensor) -> Tensor:
    """``t`` ``(..., F)`` as rows ``(m, F)`` of its last axis (samples, or samples times tokens): a view of a
    contiguous ``t``."""
    return t.reshape(-1, t.shape[-1])


def add_outer(into: Tensor, g: Tensor, h: Tensor, alpha: float = 1.0) -> None:
    """``into += alpha g^T h`` over the rows of ``g`` ``(..., P)`` and ``h`` ``(..., Q)`` (every axis but the last
    summed): the weight gradient ``(P, Q)`` of ``<g, h W^T>``, accumulated without a temporary."""
    into.addmm_(_flat_rows(g).T, _flat_rows(h), alpha=alpha)


@dataclass(frozen=True)
class _Affine:
    """``Linear`` or a zero-padded ``ConvNd``: ``z = A(h; W) + b``, linear in ``h`` and in ``(W, b)``."""

    weight: str  # parameter names in the objective
    bias: str | None
    dims: int  # 0 for Linear, else the convolution's spatial dimensions
    stride: tuple[int, ...] = ()
    padding: tuple[int, ...] = ()
    dilation: tuple[int, ...] = ()
    groups: int = 1
    tokens: bool = False  # a Linear layer of (samples, ..., features) inputs (the graph products only)

    def apply(self, h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if self.tokens:
            return F.linear(h, weight, bias)
        if not self.dims:
            if h.dim() != 2:
                raise ValueError(
                    f"the R-operator HVP needs Linear layers to see (samples, features) rows, got shape "
                    f"{tuple(h.shape)}; use the 'graph', 'double_backward' or 'jvp' strategy"
                )
            return h @ weight.T if bias is None else torch.addmm(bias, h, weight.T)
        conv = _CONV_FUNCTIONS[self.dims]
        return conv(h, weight, bias, self.stride, self.padding, self.dilation, self.groups)

    def add_apply(self, out: Tensor, h: Tensor, weight: Tensor) -> Tensor:
        """``out += A(h; W)`` in place (a Linear layer without a temporary); returns ``out``."""
        if self.dims or not out.is_contiguous():
            return out.add_(self.apply(h, weight, None))
        _flat_rows(out).addmm_(_flat_rows(h), weight.T)
        return out

    def _conv_backward(self, g: Tensor, h: Tensor, weight: Tensor, mask: list[bool]) -> tuple:
        return torch.ops.aten.convolution_backward(
            g, h, weight, None, self.stride, self.padding, self.dilation, False, [0] * self.dims, self.groups, mask
        )

    def input_adjoint(self, g: Tensor, h: Tensor, weight: Tensor) -> Tensor:
        """``A_h^T g``: the error at the layer's input ``h`` from the error ``g`` at its output."""
        if not self.dims:
            return g @ weight
        return self._conv_backward(g, h, weight, [True, False, False])[0]

    def input_adjoints(self, g: Tensor, h: Tensor, weight: Tensor, delta: Tensor, tangent: Tensor) -> Tensor:
        """``A_h^T(g; W) + A_h^T(delta; V)``: the tangent error at the layer's input. An ungrouped convolution
        takes both in one call, the errors stacked along its output channels (one pass over the input
        instead of two). Not on channels-last errors: stacking their channels interleaves every pixel, which costs
        more than the second pass."""
        if not self.dims:
            out = g @ weight
            _flat_rows(out).addmm_(_flat_rows(delta), tangent)
            return out
        if self.groups == 1 and layout(g) is not torch.channels_last:
            return self.input_adjoint(torch.cat([g, delta], dim=1), h, torch.cat([weight, tangent]))
        return self.input_adjoint(g, h, weight).add_(self.input_adjoint(delta, h, tangent))

    def weight_adjoint(self, h: Tensor, g: Tensor, weight: Tensor) -> Tensor:
        """``A_W^T(h, g)``, the weight gradient of ``<g, A(h; W)>``, as a fresh tensor."""
        if not self.dims:
            return _flat_rows(g).T @ _flat_rows(h)
        return self._conv_backward(g, h, weight, [False, True, False])[1]

    def add_weight_adjoint(self, into: Tensor, h: Tensor, g: Tensor, weight: Tensor) -> None:
        """``into += A_W^T(h, g)`` (for a Linear layer without a temporary)."""
        if not self.dims:
            add_outer(into, g, h)
        else:
            into.add_(self.weight_adjoint(h, g, weight))

    def bias_adjoint(self, g: Tensor) -> Tensor:
        if not self.dims:
            return _flat_rows(g).sum(0)
        return g.sum(dim=[0, *range(2, g.dim())])


def _affine(name: str, module: nn.Module, params: Mapping[str, Tensor] | set[str],
            keys: Mapping[str, str] | None = None) -> _Affine | None:  # fmt: skip
    """``Linear`` or a zero-padded ``ConvNd`` (module path ``name``) with its trainable parameters' names, or ``None``.
    ``keys``: a tied parameter's other paths to its name among ``params`` (`parameter_keys`)."""
    keys = keys or {}
    weight = keys.get(f"{name}.weight", f"{name}.weight")
    bias = keys.get(f"{name}.bias", f"{name}.bias") if module.bias is not None else None
    if weight not in params or (bias is not None and bias not in params):
        return None  # a frozen parameter: the products here move every affine parameter
    if isinstance(module, nn.Linear):  # nn.Linear, or a subclass the caller reads as it (`manifolds.read_as`)
        return _Affine(weight, bias, 0)
    dims = _CONVS[type(module)]
    if module.padding_mode != "zeros" or isinstance(module.padding, str):
        return None
    return _Affine(weight, bias, dims, tuple(module.stride), tuple(module.padding), tuple(module.dilation),
                   module.groups)  # fmt: skip


def parameter_keys(model: nn.Module, params: Mapping[str, Tensor]) -> dict[str, str]:
    """Every module path of a parameter tied under several (a language model's output layer sharing the token
    embedding's table) to the one of its names that ``params`` holds: the products read, move and add into a tied
    tensor under that one name, from every layer that reads it."""
    paths: dict[int, list[str]] = {}
    for path, p in model.named_parameters(remove_duplicate=False):
        paths.setdefault(id(p), []).append(path)
    keys = {}
    for names in paths.values():
        held = [n for n in names if n in params]
        if held and len(names) > 1:
            keys.update((n, held[0]) for n in names)
    return keys


# ------------------------------------------------------------------------------------------------
# piecewise-linear modules: at the current point, fixed linear maps P
@dataclass(frozen=True)
class _Slope:
    """``ReLU`` (slope 0) or ``LeakyReLU``: ``P`` multiplies by 1 where ``z > 0`` and ``slope`` elsewhere
    (at 0 the negative side's, as autograd)."""

    slope: float

    def forward(self, z: Tensor) -> tuple[Tensor, Tensor]:
        if self.slope == 0.0:  # the comparison written as 1.0 / 0.0 directly: a bool mask and its cast cost 4x more
            s = torch.gt(z, 0, out=torch.empty_like(z))
        else:
            s = torch.full_like(z, self.slope).masked_fill_(z > 0, 1.0)
        return z * s, s

    def tangent(self, zdot: Tensor, s: Tensor) -> Tensor:
        return zdot * s

    def adjoint(self, g: Tensor, s: Tensor) -> Tensor:
        return g * s


@dataclass(frozen=True)
class _MaxPool:
    """``MaxPoolNd``: ``P`` picks each window's maximum (the first one among ties, as autograd)."""

    pool: Callable
    kernel_size: object
    stride: object
    padding: object
    dilation: object
    ceil_mode: bool

    def forward(self, h: Tensor) -> tuple[Tensor, tuple[Tensor, torch.Size]]:
        out, idx = self.pool(h, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode, True)
        return out, (idx, h.shape)

    def tangent(self, hdot: Tensor, saved: tuple[Tensor, torch.Size]) -> Tensor:
        idx, _ = saved
        n, c = idx.shape[:2]
        picked = hdot.reshape(n, c, -1).gather(2, idx.reshape(n, c, -1)).view(idx.shape)
        return picked.contiguous(memory_format=layout(idx))  # the layout of the pooled output

    def adjoint(self, g: Tensor, saved: tuple[Tensor, torch.Size]) -> Tensor:
        idx, shape = saved
        n, c = idx.shape[:2]
        out = g.new_zeros(n, c, shape[2:].numel())
        out = out.scatter_add_(2, idx.reshape(n, c, -1), g.reshape(n, c, -1)).view(shape)
        return out.contiguous(memory_format=layout(idx))  # the layout of the pool's input, as its output's


@dataclass(frozen=True)
class _SlopePool:
    """A slope (``ReLU``/``LeakyReLU``) followed by a ``MaxPoolNd``: ``P`` picks each window's maximum after the
    slope and multiplies it by the slope there, so the slope is applied at the pooled resolution (a quarter
    of the elements for 2 x 2 windows) and kept there, in the chunk state, instead of at full resolution."""

    slope: _Slope
    pool: _MaxPool

    def forward(self, z: Tensor) -> tuple[Tensor, tuple[Tensor, torch.Size, Tensor]]:
        h, s = self.slope.forward(z)
        out, (idx, shape) = self.pool.forward(h)
        return out, (idx, shape, self.pool.tangent(s, (idx, shape)))

    def tangent(self, zdot: Tensor, saved: tuple[Tensor, torch.Size, Tensor]) -> Tensor:
        idx, shape, s = saved
        return self.pool.tangent(zdot, (idx, shape)).mul_(s)

    def adjoint(self, g: Tensor, saved: tuple[Tensor, torch.Size, Tensor]) -> Tensor:
        idx, shape, s = saved
        return self.pool.adjoint(g * s, (idx, shape))


@dataclass(frozen=True)
class _Reshape:
    """``Flatten``: ``P`` reshapes."""

    module: nn.Module

    def forward(self, h: Tensor) -> tuple[Tensor, tuple[torch.Size, torch.memory_format]]:
        return self.module(h), (h.shape, layout(h))

    def tangent(self, hdot: Tensor, saved: tuple[torch.Size, torch.memory_format]) -> Tensor:
        return self.module(hdot)

    def adjoint(self, g: Tensor, saved: tuple[torch.Size, torch.memory_format]) -> Tensor:
        return g.reshape(saved[0]).contiguous(memory_format=saved[1])  # in the layout of the input


@dataclass(frozen=True)
class _Identity:
    """``Identity``, and dropout (the identity in the eval mode HVPs run in): ``P`` is the identity. The
    module is never called, so a model left in training mode still gets its eval-mode products."""

    def forward(self, h: Tensor) -> tuple[Tensor, None]:
        return h, None

    def tangent(self, hdot: Tensor, saved: None) -> Tensor:
        return hdot

    def adjoint(self, g: Tensor, saved: None) -> Tensor:
        return g


def _piecewise_linear(module: nn.Module) -> _Slope | _MaxPool | _Reshape | _Identity | None:
    kind = type(module)
    if kind is nn.ReLU:
        return _Slope(0.0)
    if kind is nn.LeakyReLU:
        return _Slope(float(module.negative_slope))
    if kind in _POOLS:
        if getattr(module, "return_indices", False):
            return None
        return _MaxPool(_POOLS[kind], module.kernel_size, module.stride, module.padding, module.dilation,
                        module.ceil_mode)  # fmt: skip
    if kind is nn.Flatten:
        return _Reshape(module)
    if kind is nn.Identity or kind in DROPOUTS:
        return _Identity()
    return None


# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RopChain:
    """An ``nn.Sequential`` read as parameter-free ``prefix`` modules applied to the data, then ``ops``:
    affine layers and piecewise-linear maps, the first op affine."""

    prefix: tuple
    ops: tuple

    def state_sizes(self, params: Mapping[str, Tensor], x: Tensor) -> tuple[int, int]:
        """Bytes per sample of the cached state (every op's input or map and the affine layers' errors: at most
        three activations per op) and of its largest tensor, measured by one forward pass of ``x[:1]``."""
        h = x[:1]
        for op in self.prefix:
            h = op.forward(h)[0]
        total = largest = h.numel()
        for op in self.ops:
            h = op.apply(h, params[op.weight], params[op.bias] if op.bias else None) if isinstance(op, _Affine) \
                else op.forward(h)[0]  # fmt: skip
            total += 3 * h.numel()
            largest = max(largest, h.numel())
        return total * h.element_size(), largest * h.element_size()

    def forward_state(self, params: Mapping[str, Tensor], x: Tensor, y: Tensor, loss_fn: Callable,
                      weight: float) -> ChunkState:  # fmt: skip
        """`forward_state` of this chain."""
        return forward_state(self, params, x, y, loss_fn, weight)

    def add_products(self, params: Mapping[str, Tensor], state: ChunkState, v: Mapping[str, Tensor],
                     into: Mapping[str, Tensor], first_layer: tuple[Tensor, Tensor] | None = None) -> None:  # fmt: skip
        """`add_products` of this chain."""
        add_products(self, params, state, v, into, first_layer)

    def first_linear(self, states: list[ChunkState]) -> tuple[str, list[Tensor]] | None:
        """The weight name of the first layer and its inputs per chunk, where that layer is ``Linear``."""
        first = self.ops[0]
        shared = any(isinstance(op, _Affine) and op.weight == first.weight for op in self.ops[1:])
        return (first.weight, [s.saved[0] for s in states]) if first.dims == 0 and not shared else None


def rop_chain(model: nn.Module, params: Mapping[str, Tensor], graph: fx.Graph | None) -> RopChain | None:
    """Read ``model`` as a chain the R-operator products handle, or ``None`` when it is not one.

    Its traced ``graph`` (`manifolds.TracedNetwork.graph`) must be a chain (`manifolds.module_chain`:
    an ``nn.Sequential`` or a forward calling modules one after the other, functional ReLU and flatten
    included; no hooks) of ``Linear``, zero-padded ``Conv1d/2d/3d``, ``ReLU``, ``LeakyReLU``,
    ``MaxPool1d/2d/3d``, ``Flatten``, ``Identity`` and dropout, with at least one affine layer and every affine
    layer's parameters among ``params`` (the trainable ones).
    """
    chain = module_chain(graph, model) if graph is not None and not _has_hooks(model) else None
    if chain is None:
        return None
    prefix, ops = [], []
    for name, module in chain:
        if _has_hooks(module):
            return None
        if type(module) is nn.Linear or type(module) in _CONVS:
            op = _affine(name, module, params)
        else:
            op = _piecewise_linear(module)
        if op is None:
            return None
        (ops if ops or isinstance(op, _Affine) else prefix).append(op)
    if not ops:
        return None
    return RopChain(_fuse_slope_pool(prefix), _fuse_slope_pool(ops))


def _fuse_slope_pool(ops: list) -> tuple:
    """``ops`` with every slope directly followed by a max-pool merged into one `_SlopePool`."""
    fused: list = []
    for op in ops:
        if isinstance(op, _MaxPool) and fused and isinstance(fused[-1], _Slope):
            fused[-1] = _SlopePool(fused[-1], op)
        else:
            fused.append(op)
    return tuple(fused)


# ------------------------------------------------------------------------------------------------
@dataclass
class ChunkState:
    """What a chunk's products share: each op's input or saved map, the affine layers' output errors,
    and the loss's curvature in the outputs: softmax probabilities (cross-entropy, closed form) or its
    graph."""

    saved: list  # per op: the input h (affine) or what P needs (slopes, indices, shape)
    deltas: dict[int, Tensor]  # per affine op index: dL/dz (weighted)
    loss: Tensor  # the weighted loss, detached
    probs: Tensor | None = None  # softmax of the outputs, when the loss is a plain cross-entropy (ignored rows 0)
    scale: float | Tensor = 1.0  # ... and the factor of its Hessian: chunk weight (over the counted targets for a
    # mean: a 0-dim tensor, so that counting them never waits for the device)
    out: Tensor | None = None  # otherwise the outputs, a leaf of the loss graph,
    out_grad: Tensor | None = None  # and d(weighted loss)/d out with its graph

    def loss_hvp(self, out_dot: Tensor) -> Tensor:
        """``(d^2 loss / d out^2) out_dot`` for an output tangent."""
        if self.probs is not None:  # scale * (diag(p) - p p^T) out_dot, per sample
            p = self.probs
            pd = p * out_dot
            return pd.sub_(p * pd.sum(dim=1, keepdim=True)).mul_(self.scale)
        if not self.out_grad.requires_grad:  # a loss linear in the outputs (NLLLoss of log-probabilities)
            return torch.zeros_like(out_dot)
        with torch.enable_grad():
            return torch.autograd.grad(self.out_grad, self.out, grad_outputs=out_dot, retain_graph=True)[0]


def _plain_cross_entropy(loss_fn: Callable, out: Tensor, y: Tensor) -> bool:
    """Whether ``loss_fn(out, y)`` is a cross-entropy whose Hessian in ``out`` is ``diag(p) - p p^T`` per sample
    whose target is not ``ignore_index`` (0 for the others; over their count for a mean): no class weights,
    ``(n, C)`` outputs, class-index targets. Label smoothing only moves the gradient. Read off the shapes and
    types alone: nothing waits for the device."""
    return (
        type(loss_fn) is nn.CrossEntropyLoss
        and loss_fn.weight is None
        and loss_fn.reduction in ("mean", "sum")
        and out.dim() == 2
        and not y.is_floating_point()
        and y.dim() == 1
    )


def forward_state(
    chain: RopChain,
    params: Mapping[str, Tensor],
    x: Tensor,
    y: Tensor,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    weight: float,
) -> ChunkState:
    """One chunk's forward and backward pass; ``weight * loss_fn(out, y)`` is the chunk's share of the loss."""
    h = x
    for op in chain.prefix:
        h = op.forward(h)[0]
    saved: list = []
    for op in chain.ops:
        if isinstance(op, _Affine):
            saved.append(h)
            h = op.apply(h, params[op.weight], params[op.bias] if op.bias else None)
        else:
            h, s = op.forward(h)
            saved.append(s)
    return loss_state(h, y, loss_fn, weight, lambda g: _output_errors(chain, params, saved, g), saved)


def loss_state(
    h: Tensor, y: Tensor, loss_fn: Callable, weight: float, errors: Callable[[Tensor], dict[int, Tensor]], saved: list
) -> ChunkState:
    """The chunk state from the outputs ``h``: the weighted loss, its curvature in ``h``, and the first-order
    ``errors`` back-propagated from ``d(weight * loss)/dh``."""
    if _plain_cross_entropy(loss_fn, h, y):
        # Closed form: no autograd graph (its engine costs more than a small chunk's loss itself).
        probs = torch.softmax(h, dim=1)
        counted = (y != loss_fn.ignore_index).to(h.dtype)
        scale = weight / counted.sum() if loss_fn.reduction == "mean" else weight
        value = weight * loss_fn(h, y)
        out_grad = _cross_entropy_gradient(probs, y, counted, loss_fn.label_smoothing, scale)
        return ChunkState(saved, errors(out_grad), value, probs=probs.mul_(counted[:, None]), scale=scale)
    with torch.enable_grad():
        out = h.detach().requires_grad_(True)
        value = weight * loss_fn(out, y)
        (out_grad,) = torch.autograd.grad(value, out, create_graph=True)
    return ChunkState(saved, errors(out_grad.detach()), value.detach(), out=out, out_grad=out_grad)


def _cross_entropy_gradient(probs: Tensor, y: Tensor, counted: Tensor, smoothing: float,
                            scale: float | Tensor) -> Tensor:  # fmt: skip
    """``scale * (p - t)``: the gradient in the outputs of ``scale`` times the summed cross-entropy, with
    softmax ``probs`` (n, C) and target distribution ``t = (1 - smoothing) onehot(y) + smoothing / C``; 0 in
    the rows where ``counted`` (n,) is 0 (an ignored target, read there as class 0)."""
    g = probs - smoothing / probs.shape[1]
    g[torch.arange(g.shape[0], device=g.device), torch.where(counted > 0, y, 0)] -= 1.0 - smoothing
    return g.mul_(counted[:, None]).mul_(scale)


def _output_errors(chain: RopChain, params: Mapping[str, Tensor], saved: list, out_grad: Tensor) -> dict[int, Tensor]:
    """The loss's errors ``dL/dz`` at the outputs of the affine layers, from ``dL/d out``.

    The products need the errors of every affine layer but the first (whose input, the data, has no
    tangent): back-propagation stops at the second one.
    """
    affine = [i for i, op in enumerate(chain.ops) if isinstance(op, _Affine)]
    deltas: dict[int, Tensor] = {}
    g = out_grad
    for i in range(len(chain.ops) - 1, affine[1] - 1 if len(affine) > 1 else len(chain.ops), -1):
        op = chain.ops[i]
        if isinstance(op, _Affine):
            deltas[i] = g
            if i == affine[1]:
                break
            g = op.input_adjoint(g, saved[i], params[op.weight])
        else:
            g = op.adjoint(g, saved[i])
    return deltas


def add_products(
    chain: RopChain,
    params: Mapping[str, Tensor],
    state: ChunkState,
    v: Mapping[str, Tensor],
    into: Mapping[str, Tensor],
    first_layer: tuple[Tensor, Tensor] | None = None,
) -> None:
    """Add the chunk's ``H v`` to ``into`` (``{name: tensor}`` like ``params``), in place.

    For products whose first-layer weights live in other coordinates (`sharpness.products._data_span`),
    ``first_layer = (first_dot, first_errors)``, both ``(chunk, out_features)``: the first layer's output tangent
    from its weight (its bias tangent is added to it in place), and where the tangent errors at that output
    are written; the first layer's weight is then neither read in ``v`` nor written in ``into``.
    """
    first_dot, first_errors = first_layer if first_layer is not None else (None, None)
    ops, saved, deltas = chain.ops, state.saved, state.deltas
    # tangent forward; the affine layers' input tangents are kept for the products
    input_dots: dict[int, Tensor | None] = {}
    h_dot: Tensor | None = None  # the data do not move
    for i, op in enumerate(ops):
        if isinstance(op, _Affine):
            input_dots[i] = h_dot
            if i == 0 and first_dot is not None:
                z_dot = first_dot if op.bias is None else first_dot.add_(v[op.bias])
            else:
                z_dot = op.apply(saved[i], v[op.weight], v[op.bias] if op.bias else None)
            if h_dot is not None:
                op.add_apply(z_dot, h_dot, params[op.weight])
            h_dot = z_dot
        else:
            h_dot = op.tangent(h_dot, saved[i])
    g_dot = state.loss_hvp(h_dot)
    # tangent backward, accumulating the products
    for i in range(len(ops) - 1, -1, -1):
        op = ops[i]
        if not isinstance(op, _Affine):
            g_dot = op.adjoint(g_dot, saved[i])
            continue
        weight = params[op.weight]
        if i == 0 and first_errors is not None:
            first_errors.copy_(g_dot)
        else:
            op.add_weight_adjoint(into[op.weight], saved[i], g_dot, weight)
        if input_dots[i] is not None:
            op.add_weight_adjoint(into[op.weight], input_dots[i], deltas[i], weight)
        if op.bias:
            into[op.bias].add_(op.bias_adjoint(g_dot))
        if i == 0:
            break
        g_dot = op.input_adjoints(g_dot, saved[i], weight, deltas[i], v[op.weight])


__all__ = ["ChunkState", "RopChain", "add_outer", "add_products", "forward_state", "loss_state", "rop_chain"]
