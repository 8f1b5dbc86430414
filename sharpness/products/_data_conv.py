"""A convolution applied to the data, with a second derivative that skips the input gradient.

PyTorch's double backward of a convolution (``_convolution_double_backward``) computes the gradient
with respect to the convolution's input whenever a weight tangent is given, whether or not the
input needs one. For the first convolution of a network the input is the data, so each Hessian-vector
product pays for a transposed convolution whose result is thrown away; on CPU, with one input
channel, that is the slowest convolution of the whole product (about 40% of an HVP on the flatness
paper's small CNN). `DataConvolution` computes the same function and the same derivatives of
every order that HVPs use, without it.

`split_data_convolution` finds where it applies, on the model's traced graph: any model (a
chain, a ResNet) whose first parameterized module is a ``Conv1d/2d/3d`` with zero padding given as
integers, reached from the input by operations without parameters or buffers, with nothing else using
the input.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from manifolds import split_first_layer, tensor_aliases
from sharpness.products._boundary import functional_call

_CONV_FUNCTIONS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


@dataclass(frozen=True)
class _ConvArgs:
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int

    def conv(self, x: Tensor, weight: Tensor) -> Tensor:
        return _CONV_FUNCTIONS[weight.dim() - 2](x, weight, None, self.stride, self.padding, self.dilation, self.groups)


class _WeightGradient(torch.autograd.Function):
    """``d<out_grad, conv(x, W)>/dW`` as a function of ``out_grad`` alone (``x`` is data, constant)."""

    generate_vmap_rule = True  # batched HVPs (is_grads_batched) run the backward under vmap

    @staticmethod
    def forward(out_grad: Tensor, x: Tensor, weight: Tensor, args: _ConvArgs) -> Tensor:
        zeros = [0] * (weight.dim() - 2)
        return torch.ops.aten.convolution_backward(
            out_grad, x, weight, None, args.stride, args.padding, args.dilation, False, zeros, args.groups,
            [False, True, False],
        )[1]  # fmt: skip

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, x, _, args = inputs
        ctx.save_for_backward(x)
        ctx.args = args

    @staticmethod
    def backward(ctx, weight_tangent: Tensor):
        # Linear in out_grad: its derivative along a weight tangent is the convolution of the data with it.
        (x,) = ctx.saved_tensors
        return ctx.args.conv(x, weight_tangent), None, None, None


class _Convolution(torch.autograd.Function):
    """``conv(x, W)`` whose backward gives the weight gradient only, through `_WeightGradient`."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, weight: Tensor, args: _ConvArgs) -> Tensor:
        return args.conv(x, weight)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, args = inputs
        ctx.save_for_backward(x, weight)
        ctx.args = args

    @staticmethod
    def backward(ctx, out_grad: Tensor):
        x, weight = ctx.saved_tensors
        return None, _WeightGradient.apply(out_grad, x, weight.detach(), ctx.args), None


@dataclass(frozen=True)
class DataConvolution:
    """A model cut at its first (data-facing) convolution.

    Attributes:
        prefix: the parameter-free operations before the convolution (e.g. a reshape).
        name: the convolution's name in the model (its parameters are ``name.weight``, ``name.bias``).
        args: stride, padding, dilation, groups of the convolution.
        rest: everything after it (a ``GraphModule`` keeping the model's parameter names).
    """

    prefix: nn.Module
    name: str
    args: _ConvArgs
    rest: nn.Module

    def __call__(self, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], x: Tensor) -> Tensor:
        """The model's output for inputs ``x`` at ``params`` (same names as the model's)."""
        x = self.prefix(x)
        if x.requires_grad:
            raise ValueError("the data-facing convolution path needs inputs that do not require gradients")
        out = _Convolution.apply(x, params[f"{self.name}.weight"], self.args)
        bias = params.get(f"{self.name}.bias")
        if bias is not None:
            out = out + bias.reshape(1, -1, *([1] * (out.dim() - 2)))
        # only what ``rest`` holds: the trace leaves out the convolution and any module the forward never calls;
        # attention in the rest through the math kernel, the one with second derivatives (a ViT's patch embedding)
        inner = {k: v for k, v in {**params, **buffers}.items() if k in self._rest_aliases}
        return functional_call(self.rest, inner, (out,), aliases=self._rest_aliases)

    @cached_property
    def _rest_aliases(self) -> dict[str, tuple[str, ...]]:
        return tensor_aliases(self.rest)


def split_data_convolution(
    model: nn.Module, names: Mapping[str, Tensor] | list[str], graph: fx.Graph | None
) -> DataConvolution | None:
    """The `DataConvolution` cut of ``model``, or ``None`` when it does not have that shape.

    Args:
        model: the network.
        names: the names of the parameters that are differentiated (the convolution's must be among them).
        graph: the model's traced graph ([`manifolds.TracedNetwork.graph`][manifolds.TracedNetwork]); ``None``: no cut.
    """
    if graph is None:
        return None
    split = split_first_layer(graph, model, (nn.Conv1d, nn.Conv2d, nn.Conv3d))
    if split is None:
        return None
    conv = split.layer
    if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        return None
    if not split.layer_among(names):
        return None
    args = _ConvArgs(tuple(conv.stride), tuple(conv.padding), tuple(conv.dilation), conv.groups)
    return DataConvolution(prefix=split.prefix, name=split.name, args=args, rest=split.rest)
