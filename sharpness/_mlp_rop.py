"""Exact Hessian-vector products of multilayer perceptrons by the R-operator, written out by hand.

For a chain of ``Linear`` layers and piecewise-linear activations (``ReLU``, ``LeakyReLU``,
``Identity``), Pearlmutter's R-operator gives ``H v`` in closed form. With layer inputs ``h_{l-1}``,
pre-activations ``z_l = h_{l-1} W_l^T + b_l``, activation slopes ``s_l = phi'(z_l)`` (``phi'' = 0``
almost everywhere), back-propagated errors ``delta_l = dL/dz_l`` and a tangent ``v = (V_l, c_l)``::

    forward  (tangent)  zdot_l = hdot_{l-1} W_l^T + h_{l-1} V_l^T + c_l,   hdot_l = zdot_l * s_l,  hdot_0 = 0
    loss                  gdot = (d^2 loss / d out^2) hdot_L                (autograd on the loss alone)
    backward (tangent)  ddot_l = gdot_l * s_l,   gdot_{l-1} = ddot_l W_l + delta_l V_l
    product             (H v)_{W_l} = ddot_l^T h_{l-1} + delta_l^T hdot_{l-1},   (H v)_{b_l} = sum ddot_l

Everything that does not depend on ``v`` (``h``, ``s``, ``delta`` and the loss's derivative graph) is
one forward and one backward pass per data chunk, kept across products when it fits in memory. A
product then costs about one gradient: on the first layer, which holds most of an MLP's work, one
product ``X V_1^T`` and one ``ddot_1^T X``, where autograd's double backward also forms the first
layer's gradient and differentiates through it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

# Modules that may come before the first Linear layer: they reshape the data and hold no parameters.
_PREFIX_MODULES = (nn.Flatten, nn.Identity)


@dataclass(frozen=True)
class _Layer:
    weight: str  # parameter names in the objective
    bias: str | None
    slope: float | None  # activation after the layer: None (none or Identity), 0.0 (ReLU), LeakyReLU's slope


@dataclass(frozen=True)
class MLPChain:
    """An ``nn.Sequential`` read as ``prefix`` (reshapes of the data) and Linear layers with activations."""

    prefix: tuple[nn.Module, ...]
    layers: tuple[_Layer, ...]

    def features(self, x: Tensor) -> Tensor:
        """The first layer's input, ``(n, features)``, from a chunk of data."""
        for module in self.prefix:
            x = module(x)
        if x.dim() != 2:
            raise ValueError(
                f"the R-operator HVP needs the first Linear layer to see (samples, features) rows, got shape "
                f"{tuple(x.shape)}; use the 'graph', 'double_backward' or 'jvp' strategy"
            )
        return x

    def state_bytes_per_sample(self, params: Mapping[str, Tensor]) -> int:
        """Bytes one sample's cached state takes: each layer's input, slopes and errors."""
        widths = [params[layer.weight].shape for layer in self.layers]
        elem = params[self.layers[0].weight].element_size()
        return elem * (widths[0][1] + 3 * sum(out for out, _ in widths))


def _has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks)


def mlp_chain(model: nn.Module, params: Mapping[str, Tensor]) -> MLPChain | None:
    """Read ``model`` as an MLP chain, or ``None`` when it is not one.

    It must be an ``nn.Sequential`` of ``Flatten``/``Identity`` modules, then ``Linear`` layers each
    optionally followed by one ``ReLU``, ``LeakyReLU`` or ``Identity``, every Linear parameter among
    ``params`` (the trainable ones), and no hooks (this path does not call the modules).
    """
    if not isinstance(model, nn.Sequential) or _has_hooks(model):
        return None
    children = list(model.named_children())
    prefix: list[nn.Module] = []
    while children and type(children[0][1]) in _PREFIX_MODULES:
        prefix.append(children.pop(0)[1])
    layers: list[_Layer] = []
    for name, module in children:
        if _has_hooks(module):
            return None
        kind = type(module)
        if kind is nn.Linear:
            weight, bias = f"{name}.weight", f"{name}.bias" if module.bias is not None else None
            if weight not in params or (bias is not None and bias not in params):
                return None
            layers.append(_Layer(weight, bias, None))
            continue
        if not layers or layers[-1].slope is not None:
            return None  # an activation must follow a Linear layer directly
        if kind is nn.ReLU:
            slope = 0.0
        elif kind is nn.LeakyReLU:
            slope = float(module.negative_slope)
        elif kind is nn.Identity:
            continue
        else:
            return None
        layers[-1] = _Layer(layers[-1].weight, layers[-1].bias, slope)
    if not layers:
        return None
    return MLPChain(tuple(prefix), tuple(layers))


@dataclass
class _ChunkState:
    """What a chunk's products share: layer inputs ``h``, slopes ``s``, errors ``delta``, and the loss's
    curvature in the outputs: softmax probabilities (cross-entropy, in closed form) or its graph."""

    inputs: list[Tensor]  # h_0 .. h_{L-1}
    slopes: list[Tensor | None]  # s_1 .. s_L (None: no activation)
    deltas: list[Tensor]  # dL/dz_1 .. dL/dz_L (weighted)
    loss: Tensor  # the weighted loss, detached
    probs: Tensor | None = None  # softmax of the outputs, when the loss is a plain cross-entropy
    scale: float = 1.0  # ... and the factor of its Hessian: chunk weight (over the chunk size for a mean)
    out: Tensor | None = None  # otherwise the outputs, a leaf of the loss graph,
    out_grad: Tensor | None = None  # and d(weighted loss)/d out with its graph

    def loss_hvp(self, out_dot: Tensor) -> Tensor:
        """``(d^2 loss / d out^2) out_dot`` for an output tangent ``(n, C)``."""
        if self.probs is not None:  # scale * (diag(p) - p p^T) out_dot, per sample
            p = self.probs
            pd = p * out_dot
            return pd.sub_(p * pd.sum(dim=1, keepdim=True)).mul_(self.scale)
        with torch.enable_grad():
            return torch.autograd.grad(self.out_grad, self.out, grad_outputs=out_dot, retain_graph=True)[0]


def _plain_cross_entropy(loss_fn: Callable, out: Tensor, y: Tensor) -> bool:
    """Whether ``loss_fn(out, y)`` is a cross-entropy whose Hessian in ``out`` is ``diag(p) - p p^T`` per sample
    (over the chunk size for a mean): no class weights, class-index targets, none ignored. Label smoothing
    only moves the gradient."""
    return (
        type(loss_fn) is nn.CrossEntropyLoss
        and loss_fn.weight is None
        and loss_fn.reduction in ("mean", "sum")
        and out.dim() == 2
        and not y.is_floating_point()
        and y.dim() == 1
        and not bool((y == loss_fn.ignore_index).any())
    )


def forward_state(
    chain: MLPChain,
    params: Mapping[str, Tensor],
    x: Tensor,
    y: Tensor,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    weight: float,
) -> _ChunkState:
    """One chunk's forward and backward pass; ``weight * loss_fn(out, y)`` is the chunk's share of the loss."""
    h = chain.features(x)
    inputs, slopes = [], []
    for layer in chain.layers:
        inputs.append(h)
        w, bias = params[layer.weight], params[layer.bias] if layer.bias else None
        z = h @ w.T if bias is None else torch.addmm(bias, h, w.T)
        if layer.slope is None:
            slopes.append(None)
            h = z
            continue
        positive = z > 0  # the slope at 0 is that of the negative side, as in autograd
        s = positive.to(z.dtype) if layer.slope == 0.0 else torch.full_like(z, layer.slope).masked_fill_(positive, 1.0)
        h = z * s
        slopes.append(s)
    closed_form = _plain_cross_entropy(loss_fn, h, y)
    with torch.enable_grad():
        out = h.detach().requires_grad_(True)
        value = weight * loss_fn(out, y)
        (out_grad,) = torch.autograd.grad(value, out, create_graph=not closed_form)
    deltas: list[Tensor] = [torch.empty(0)] * len(chain.layers)
    g = out_grad.detach()
    for i in range(len(chain.layers) - 1, -1, -1):
        delta = g if slopes[i] is None else g * slopes[i]
        deltas[i] = delta
        if i:
            g = delta @ params[chain.layers[i].weight]
    if closed_form:
        scale = weight / h.shape[0] if loss_fn.reduction == "mean" else weight
        return _ChunkState(inputs, slopes, deltas, value.detach(), probs=torch.softmax(h, dim=1), scale=scale)
    return _ChunkState(inputs, slopes, deltas, value.detach(), out=out, out_grad=out_grad)


def add_products(
    chain: MLPChain,
    params: Mapping[str, Tensor],
    state: _ChunkState,
    v: Mapping[str, Tensor],
    into: Mapping[str, Tensor],
) -> None:
    """Add the chunk's ``H v`` to ``into`` (``{name: tensor}`` like ``params``), in place."""
    layers, inputs, slopes, deltas = chain.layers, state.inputs, state.slopes, state.deltas
    # tangent forward
    h_dots: list[Tensor | None] = [None]  # hdot_0 = 0: the data do not move
    h_dot = None
    for i, layer in enumerate(layers):
        bias = v[layer.bias] if layer.bias else None
        z_dot = inputs[i] @ v[layer.weight].T if bias is None else torch.addmm(bias, inputs[i], v[layer.weight].T)
        if h_dot is not None:
            z_dot.addmm_(h_dot, params[layer.weight].T)
        h_dot = z_dot if slopes[i] is None else z_dot.mul_(slopes[i])
        h_dots.append(h_dot)
    g_dot = state.loss_hvp(h_dot)
    # tangent backward, accumulating the products
    for i in range(len(layers) - 1, -1, -1):
        layer = layers[i]
        d_dot = g_dot if slopes[i] is None else g_dot.mul_(slopes[i])
        into[layer.weight].addmm_(d_dot.T, inputs[i])
        if h_dots[i] is not None:
            into[layer.weight].addmm_(deltas[i].T, h_dots[i])
        if layer.bias:
            into[layer.bias].add_(d_dot.sum(0))
        if i:
            g_dot = d_dot @ params[layer.weight]
            g_dot.addmm_(deltas[i], v[layer.weight])


__all__ = ["MLPChain", "add_products", "forward_state", "mlp_chain"]
