"""Discovery of the exact diagonal rescaling group of a traced network.

Every tensor of the graph gets one log-scale variable ``s`` per channel (dimension 1; a feature of a
flattened tensor inherits its channel's variable). A Linear applied to a ``(batch, tokens, ..., features)``
tensor acts on the last axis, so its output's channels are its last axis, and so are those of everything
computed from it feature-wise (activations, additions, a LayerNorm over the last axis, a mean over the
tokens): the channel axis is tracked per tensor. A tensor whose channels are all pinned may be read along
any axis. Each operation adds constraints between the variables
of its inputs and outputs, chosen so that scaling every channel of every tensor by ``e^s`` and the
parameters as below leaves the function unchanged:

==========================================  =====================================================================
operation                                   rule
==========================================  =====================================================================
Linear / Conv (any stride, groups)          outputs are new variables; ``W[o, i] -> W[o, i] e^{s_out(o) - s_in(i)}``,
                                            ``b[o] -> b[o] e^{s_out(o)}``
``F.linear(x, W, b)``, ``x @ W``,           the Linear rule on ``x``'s last axis, ``W`` and ``b`` parameters read
``torch.matmul(x, W)``, ``F.conv2d(...)``   directly (``x @ W`` holds ``W`` as ``(in, out)``); the Conv rule for
                                            ``F.conv1d/2d/3d``
``x + b``, ``x - b`` (``b`` a parameter)    ``b`` of shape ``(channels,)`` on ``x``'s last (channel) axis:
                                            ``b -> b e^{s(x)}``, the result shares ``x``'s variables
``x * g`` (``g`` a parameter, one entry     outputs are new variables; ``g_c -> g_c e^{s_out(c) - s_in(c)}``
per channel of ``(N, C, ...)``)             (ConvNeXt's layer scale, `channel_scale`)
ReLU, LeakyReLU, PReLU, pooling, dropout,   pass through (``f(e^s x) = e^s f(x)`` channel-wise)
identity, constant factor, spatial mean
flatten / view / reshape keeping channels   a feature inherits the variable of its channel
addition, subtraction                       all operands and the result share one variable per channel
concatenation                               along channels: variables concatenate; along other dims: shared
BatchNorm (eval), Layer/Group/InstanceNorm  input pinned; affine output channels are new variables scaling
                                            ``weight`` and ``bias``; without affine the output is pinned
BatchNorm, ``buffers=True``                 input free: ``running_mean -> e^s running_mean``,
                                            ``running_var -> e^{2 s} running_var`` (exact up to ``eps``)
timm's ``LayerNorm2d`` (over channels)      the LayerNorm rule on axis 1 (input pinned, affine channels free), where
                                            it computes exactly that (`manifolds._same_forward.channel_layer_norm`)
timm's ``BatchNormAct2d``                   the BatchNorm rule, then its activation's (ReLU, LeakyReLU, identity:
                                            output channels free; others pin them), where it computes exactly that
                                            (`manifolds._same_forward.norm_then_activation`)
GELU, SiLU, Sigmoid, Tanh, Softmax, ...     not positively homogeneous: inputs and outputs pinned
a module called twice                       one set of variables: the inputs of its calls are tied
a tensor held by several modules            its uses' variables are tied entry by entry (outputs with outputs,
                                            inputs with inputs), or pinned where the uses scale it differently
``p * q`` of two parameters (elementwise)    one new variable per entry of the product's free shape (below):
                                            ``p -> p e^{s}``, ``q -> q e^{-s}``, so ``p * q`` is unchanged; only
                                            where the product is the only use of ``p`` and of ``q``
a tensor read directly otherwise           every channel its records touch is pinned
network input, network output               pinned
anything else                               inputs and outputs pinned, and listed as unknown
==========================================  =====================================================================

Proof sketch: every rule is an identity of the operation (a linear map commutes with a channel-wise
scaling once its weights absorb the ratio of output and input scales; a positively homogeneous map
commutes with a positive scaling; a normalization's output does not depend on its input's scale, so with
its statistics fixed the input must keep its scale). Chaining identities through the graph from the
pinned input to the pinned output gives ``f(g . w) = f(w)``. Pinning is always allowed (it only shrinks
the group), which is why unknown operations are pinned rather than refused.

An elementwise product ``P = p * q`` of two parameters (``p * q``, ``torch.mul``, ``p.mul(q)``) is unchanged by
``p -> p * c``, ``q -> q / c`` for any positive ``c`` of ``P``'s shape, so whatever reads ``P`` sees the same tensor;
this is a symmetry exactly when ``p`` and ``q`` reach the output only through ``P``. With broadcasting, ``c`` must
be expressible on both sides: it may vary along an axis only where ``p``, ``q`` and ``P`` all have that axis's full
size, and is constant along the others (``p (d, 1) * q (d, k)``: one scale per row ``i``, ``q[i, :] / c_i``). The
rule is refused, with a pin saying why, when either factor is a buffer, both are one tensor (``p * p``), or either
is used anywhere else: by another operation (``p * q * p``, ``p + ...``), a module holding it, or the output; a
0-dim factor is refused too (shape ``(1,)`` broadcasts the same and is accepted).

Constraints are solved by union-find over the variables; a class containing a pinned variable is fixed.
Tensors are identified by identity and named by their first name (as in ``model.named_parameters()``), so a
module used twice or a tied weight gives one record per tensor.
"""

from __future__ import annotations

import math
import operator
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, fx, nn

from manifolds._graph import is_metadata, target_name
from manifolds._modules import hooked
from manifolds._same_forward import channel_layer_norm, norm_then_activation, read_as

_AFFINE = {nn.Linear: 0, nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}

_HOMOGENEOUS_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    nn.LeakyReLU,
    nn.PReLU,
    nn.Identity,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
)

_HOMOGENEOUS_FUNCTIONS = {
    "relu",
    "relu_",
    "leaky_relu",
    "leaky_relu_",
    "prelu",
    "max_pool1d",
    "max_pool2d",
    "max_pool3d",
    "avg_pool1d",
    "avg_pool2d",
    "avg_pool3d",
    "adaptive_avg_pool1d",
    "adaptive_avg_pool2d",
    "adaptive_avg_pool3d",
    "adaptive_max_pool1d",
    "adaptive_max_pool2d",
    "adaptive_max_pool3d",
    "dropout",
    "dropout1d",
    "dropout2d",
    "dropout3d",
    "feature_dropout",
    "alpha_dropout",
    "contiguous",
    "clone",
    "neg",
    "identity",
}
_RESHAPES = {"flatten", "view", "reshape"}
_REDUCTIONS = {"mean", "sum", "amax", "amin"}
_SCALINGS = {"mul", "truediv", "div", "imul", "itruediv"}
_ADDITIONS = {"add", "sub", "iadd", "isub", "add_", "sub_"}
_CONCATENATIONS = {"cat", "concat", "concatenate"}
# ``F.linear(x, W, b)``, ``x @ W``, ``F.conv2d(x, W, b, ...)`` with parameters read directly -> convolution dims;
# matched by identity, so a user's own function of the same name is not taken for them
_FUNCTIONAL_AFFINE = {torch.nn.functional.linear: 0, torch.matmul: 0, operator.matmul: 0, torch.conv1d: 1,
                      torch.conv2d: 2, torch.conv3d: 3}  # fmt: skip
_PRODUCTS = {"mul", "multiply"}  # elementwise products (``p * q``, ``torch.mul``, ``p.mul(q)``); not in place

_NON_HOMOGENEOUS = {
    "GELU", "SiLU", "Sigmoid", "Tanh", "Softplus", "ELU", "CELU", "SELU", "Mish", "Hardswish", "Hardsigmoid",
    "Hardtanh", "ReLU6", "Softmax", "LogSoftmax", "Softsign", "Tanhshrink", "LogSigmoid", "GLU", "Softmin",
    "gelu", "silu", "sigmoid", "tanh", "softplus", "elu", "celu", "selu", "mish", "hardswish", "hardsigmoid",
    "hardtanh", "relu6", "softmax", "log_softmax", "softsign", "tanhshrink", "logsigmoid", "glu", "exp", "log",
    "sqrt", "pow", "abs", "square",
}  # fmt: skip


@dataclass(frozen=True)
class Pin:
    """Channels whose scale is fixed, and why.

    Attributes:
        where: the tensor, e.g. ``"input of module 'layer1.0.bn1' (BatchNorm2d)"``.
        channels: how many channels of it are pinned.
        reason: one sentence.
    """

    where: str
    channels: int
    reason: str

    def __str__(self) -> str:
        return f"{self.where}: {self.channels} channel(s), {self.reason}"


@dataclass(frozen=True)
class Record:
    """How one parameter (or buffer) tensor scales: ``t -> t * exp(power * (s[plus] - s[minus]))``.

    ``plus`` / ``minus`` are int64 variable ids broadcastable to the tensor's shape (``None``: no term).
    """

    name: str
    shape: tuple[int, ...]
    plus: Tensor | None
    minus: Tensor | None
    power: int = 1
    role: str = "weight"  # "weight" (counted by the min-norm gauge), "bias" or "buffer"
    module: str = ""


@dataclass
class Discovery:
    """Variables, constraints and parameter records found on one graph (before the classes are formed)."""

    parent: list[int] = field(default_factory=list)
    pinned: list[bool] = field(default_factory=list)
    labels: list[tuple[str, int, int]] = field(default_factory=list)  # (tensor label, first id, count)
    records: list[Record] = field(default_factory=list)
    module_outputs: dict[str, Tensor] = field(default_factory=dict)  # affine module -> its output variables
    pins: list[Pin] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    products: list[tuple[str, str, str]] = field(default_factory=list)  # (p, q, where) of each product rule

    def new(self, count: int, label: str) -> Tensor:
        start = len(self.parent)
        self.parent.extend(range(start, start + count))
        self.pinned.extend([False] * count)
        self.labels.append((label, start, count))
        return torch.arange(start, start + count)

    def find(self, a: int) -> int:
        root = a
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[a] != root:
            self.parent[a], a = root, self.parent[a]
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra
            self.pinned[ra] = self.pinned[ra] or self.pinned[rb]

    def union_all(self, ids: Tensor) -> None:
        flat = ids.unique().tolist()
        for b in flat[1:]:
            self.union(flat[0], b)

    def tie(self, a: Tensor, b: Tensor) -> None:
        for x, y in zip(a.tolist(), b.tolist(), strict=True):
            self.union(x, y)

    def pin(self, ids: Tensor, where: str, reason: str) -> None:
        fresh = 0
        for a in ids.tolist():
            root = self.find(a)
            fresh += not self.pinned[root]
            self.pinned[root] = True
        if fresh:
            self.pins.append(Pin(where, int(ids.numel()), reason))

    def copy(self) -> Discovery:
        return Discovery(
            list(self.parent),
            list(self.pinned),
            self.labels,
            self.records,
            self.module_outputs,
            self.pins,
            self.unknown,
            self.products,
        )


def _channels(shape: tuple[int, ...]) -> int:
    return shape[1] if len(shape) >= 2 else 1


def _keepdim(node: fx.Node) -> bool:
    return bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))


class _Walker:
    """One pass over the graph in order, applying the rules of the module docstring."""

    def __init__(self, model: nn.Module, graph: fx.Graph, buffers: bool):
        self.model, self.graph, self.buffers = model, graph, buffers
        self.d = Discovery()
        self.ids: dict[fx.Node, Tensor] = {}
        # the axis holding a tensor's channels where it is not 1: the last axis of a Linear's token-wise output
        self.axes: dict[fx.Node, int] = {}
        # module (by identity) -> (input ids, output ids) of its first call
        self.calls: dict[int, tuple[Tensor, Tensor]] = {}
        # A tensor is named by its first name, as in ``model.named_parameters()``: a module used twice or a
        # tied weight reaches one tensor under several names, and every record of it must use the same one.
        self.param_names = {id(p): n for n, p in model.named_parameters()}
        self.buffer_names = {id(b): n for n, b in model.named_buffers()}
        self.understood: set[tuple[int, int]] = set()  # (module id, tensor id) described by a record
        self.in_products: set[int] = set()  # tensors (by id) whose one use is a product the rules describe
        # (reading node, get_attr node) pairs a record describes: a functional layer's weight or its bias
        self.described_reads: set[tuple[fx.Node, fx.Node]] = set()

    # -- labels ------------------------------------------------------------------------------------------
    def label(self, node: fx.Node) -> str:
        if node.op == "call_module":
            module = self.model.get_submodule(str(node.target))
            return f"module '{node.target}' ({type(module).__name__})"
        if node.op == "placeholder":
            return f"the network's input '{node.name}'"
        if node.op == "call_method":
            return f"method '.{node.target}()' (graph node '{node.name}')"
        return f"function '{target_name(node)}' (graph node '{node.name}')"

    def shape(self, node: fx.Node) -> tuple[int, ...] | None:
        return node.meta.get("shape")

    # -- outcomes ----------------------------------------------------------------------------------------
    def fresh_pinned(self, node: fx.Node, reason: str) -> None:
        shape = self.shape(node)
        if shape is None:
            return
        ids = self.d.new(_channels(shape), f"output of {self.label(node)}")
        self.d.pin(ids, f"output of {self.label(node)}", reason)
        self.ids[node] = ids

    def pin_around(self, node: fx.Node, data: Sequence[fx.Node], reason: str) -> None:
        for n in data:
            if n in self.ids:
                self.d.pin(self.ids[n], f"input of {self.label(node)}", reason)
        self.fresh_pinned(node, reason)

    def unknown(self, node: fx.Node, data: Sequence[fx.Node], why: str = "") -> None:
        label = self.label(node)
        self.d.unknown.append(label + (f" ({why})" if why else ""))
        self.pin_around(node, data, "an operation the rescaling rules do not know" + (f" ({why})" if why else ""))

    def axis(self, node: fx.Node) -> int:
        """The axis of ``node``'s tensor that holds its channels (1 unless a token-wise Linear made it the last)."""
        return self.axes.get(node, 1)

    def along(self, node: fx.Node, axis: int) -> Tensor | None:
        """``node``'s channel variables read along ``axis``: its own when that is its channel axis, fresh pinned
        ones when all of its own are pinned (a tensor of fixed scale has a fixed scale along every axis), else
        ``None``."""
        if node not in self.ids:
            return None
        if self.axis(node) == axis:
            return self.ids[node]
        shape = self.shape(node)
        if shape is None or not all(self.d.pinned[self.d.find(int(a))] for a in self.ids[node]):
            return None
        ids = self.d.new(shape[axis], f"{self.label(node)} along axis {axis}")
        for a in ids.tolist():
            self.d.pinned[a] = True  # already fixed: no new reason to record
        return ids

    def passthrough(self, node: fx.Node, source: fx.Node, pooled: int = 0) -> bool:
        """An operation acting on each channel alone; ``pooled``: a pooling over the last ``pooled`` axes, which must
        then be a batched input's spatial axes (channels on axis 1), not a token-wise tensor's channel axis."""
        shape, src = self.shape(node), self.shape(source)
        if shape is None or src is None or source not in self.ids:
            return False
        axis = self.axis(source)
        if pooled and (axis != 1 or len(src) != pooled + 2):
            return False
        if axis == 1:
            same = len(shape) >= 2 and len(src) >= 2 and shape[0] == src[0] and shape[1] == src[1]
        else:  # token-wise channels on the last axis: an element-wise operation keeps the shape
            same = shape == src
        if same:
            self.ids[node] = self.ids[source]
            if axis != 1:
                self.axes[node] = axis
        return same

    def reshape(self, node: fx.Node, source: fx.Node) -> bool:
        """A reshape keeping the batch axis: each new channel must lie inside one old channel (row-major)."""
        shape, src = self.shape(node), self.shape(source)
        if shape is None or src is None or source not in self.ids or len(shape) < 2 or len(src) < 2:
            return False
        if self.axis(source) != 1:  # token-wise features reshaped (e.g. into heads): no rule here
            return False
        if shape[0] != src[0] or shape[1] % src[1]:
            return False
        self.ids[node] = self.ids[source].repeat_interleave(shape[1] // src[1])
        return True

    # -- rules -------------------------------------------------------------------------------------------
    def param_name(self, tensor: object) -> str | None:
        if isinstance(tensor, nn.Parameter):
            return self.param_names.get(id(tensor))
        return None

    def reuse(self, node: fx.Node, module: nn.Module, in_ids: Tensor, out_axis: int | None = None) -> bool:
        """A later call of a module with parameters: one set of variables for every call, inputs tied. ``out_axis``:
        the axis of this call's output that holds the channels, where the caller has not set it (a normalization's:
        the last axis of a token-wise LayerNorm's output); ``-1``: this call's parameters do not act per channel."""
        if id(module) not in self.calls:
            return False
        first_in, first_out = self.calls[id(module)]
        shape = self.shape(node)
        if first_in.shape != in_ids.shape or out_axis == -1 or (out_axis is not None and (
                shape is None or shape[out_axis] != first_out.numel())):  # fmt: skip
            # called again on channels along another axis (token-wise, say)
            reason = "the module is called again on channels along another axis"
            for ids in (first_in, first_out, in_ids):
                self.d.pin(ids, f"input and output of {self.label(node)}", reason)
            self.axes.pop(node, None)
            self.fresh_pinned(node, reason)
            return True
        self.d.tie(first_in, in_ids)
        self.ids[node] = first_out
        if out_axis not in (None, 1):
            self.axes[node] = out_axis
        return True

    def affine(self, node: fx.Node, module: nn.Module, source: fx.Node) -> bool:
        dims = _AFFINE[_plain_affine(module)]
        src = self.shape(source)
        if src is None or source not in self.ids or (dims == 0 and len(src) < 2) or (dims and len(src) != dims + 2):
            return False
        # a Linear reads the last axis, token-wise on (batch, tokens, ..., features); a convolution axis 1
        in_axis = len(src) - 1 if dims == 0 else 1
        in_ids = self.along(source, in_axis)
        if in_ids is None:
            return False
        weight = self.param_name(module.weight)
        bias = self.param_name(module.bias) if module.bias is not None else None
        if weight is None or (module.bias is not None and bias is None):
            return False
        name = str(node.target)
        if in_axis != 1:
            self.axes[node] = in_axis
        if self.reuse(node, module, in_ids):
            return True
        groups = getattr(module, "groups", 1)
        out_ids = self.layer(node, name, (weight, tuple(module.weight.shape)), bias, in_ids, groups)
        self.understood.update((id(module), id(t)) for t in (module.weight, module.bias) if t is not None)
        self.calls[id(module)] = (in_ids, out_ids)
        return True

    def layer(self, node: fx.Node, name: str, weight: tuple[str, tuple[int, ...]], bias: str | None, in_ids: Tensor,
              groups: int = 1, transposed: bool = False) -> Tensor:  # fmt: skip
        """The records of one affine layer (the Linear / Conv rule): its output variables, new, along the axis its
        input's channels were read on. ``weight``: (name, shape), ``(out, in / groups, *kernel)``, or ``(in, out)``
        where ``transposed`` (``x @ W``)."""
        shape = weight[1]
        out_ids = self.d.new(shape[-1] if transposed else shape[0], f"output of {self.label(node)}")
        if transposed:
            plus, minus = out_ids.reshape(1, -1), in_ids.reshape(-1, 1)
        else:
            rest = (1,) * (len(shape) - 2)
            per_out, per_in = shape[0] // groups, shape[1]
            # Input channel of weight entry (o, j): the j-th channel of o's group.
            if groups == 1:  # every output sees every input channel: broadcast over the outputs
                cols = in_ids.reshape(1, per_in)
            else:
                cols = in_ids.reshape(groups, per_in).repeat_interleave(per_out, dim=0)
            plus, minus = out_ids.reshape(-1, 1, *rest), cols.reshape(-1, per_in, *rest)
        self.d.records.append(Record(weight[0], shape, plus, minus, 1, "weight", name))
        if bias is not None:
            self.d.records.append(Record(bias, (len(out_ids),), out_ids, None, 1, "bias", name))
        self.d.module_outputs[name] = out_ids
        self.ids[node] = out_ids
        return out_ids

    def norm(self, node: fx.Node, module: nn.Module, source: fx.Node, channels_first: bool = False) -> bool:
        """``channels_first``: a LayerNorm over the channels of an ``(N, C, ...)`` input (timm's ``LayerNorm2d``)."""
        src, shape = self.shape(source), self.shape(node)
        if src is None or shape is None or source not in self.ids or src != shape:
            return False
        name, label = str(node.target), self.label(node)
        in_ids = self.ids[source]
        channels, axis = _channels(shape), 1
        weight = getattr(module, "weight", None)
        if channels_first:
            covers = len(shape) > 2 and tuple(module.normalized_shape) == (shape[1],)
        elif isinstance(module, nn.LayerNorm):
            covers = tuple(module.normalized_shape) == tuple(shape[1:])
            if not covers and len(shape) > 2 and tuple(module.normalized_shape) == (shape[-1],):
                covers, channels, axis = True, shape[-1], len(shape) - 1  # token-wise: one scale per feature
        else:
            covers = weight is None or tuple(weight.shape) == (channels,)
        if self.reuse(node, module, in_ids, axis if covers else -1):
            return True
        batchnorm = isinstance(module, nn.modules.batchnorm._BatchNorm)
        stats = batchnorm and module.track_running_stats and module.running_mean is not None
        if self.buffers and stats:
            mean, var = self.buffer_names.get(id(module.running_mean)), self.buffer_names.get(id(module.running_var))
            if mean is None or var is None:
                return False
            self.d.records.append(Record(mean, tuple(module.running_mean.shape), in_ids, None, 1, "buffer", name))
            self.d.records.append(Record(var, tuple(module.running_var.shape), in_ids, None, 2, "buffer", name))
            self.understood.update((id(module), id(b)) for b in (module.running_mean, module.running_var))
        elif batchnorm and stats:
            self.d.pin(
                in_ids, f"input of {label}", f"{type(module).__name__} in eval mode: its running statistics are fixed"
            )
        else:
            self.d.pin(in_ids, f"input of {label}", f"{type(module).__name__} normalizes it, so its scale is lost")
        if weight is None or not covers:
            why = "it has no affine parameters" if weight is None else "its affine parameters do not act per channel"
            self.fresh_pinned(node, f"{type(module).__name__} output, {why}")
            return True
        affine = [
            (t, role)
            for t, role in ((module.weight, "weight"), (getattr(module, "bias", None), "bias"))
            if t is not None
        ]
        if any(self.param_name(t) is None for t, _ in affine):  # checked first: no record of half the pair
            self.fresh_pinned(node, f"{type(module).__name__} output, its affine tensors are not plain parameters")
            return True
        out_ids = self.d.new(channels, f"output of {label}")
        plus = out_ids.reshape((channels,) + (1,) * (weight.dim() - 1))
        for tensor, role in affine:
            self.d.records.append(Record(self.param_name(tensor), tuple(tensor.shape), plus, None, 1, role, name))
            self.understood.add((id(module), id(tensor)))
        self.d.module_outputs[name] = out_ids
        self.calls[id(module)] = (in_ids, out_ids)
        self.ids[node] = out_ids
        if axis != 1:
            self.axes[node] = axis
        return True

    def module(self, node: fx.Node, data: list[fx.Node]) -> None:
        module = self.model.get_submodule(str(node.target))
        kind = type(module)
        if hooked(module):
            return self.unknown(node, data, "it has forward hooks")
        if len(data) != 1 or len(node.args) != 1:
            return self.unknown(node, data)
        source = data[0]
        if _plain_affine(module) is not None:
            if self.affine(node, module, source):
                return None
            return self.unknown(node, data)
        if _plain_norm(module):
            if self.norm(node, module, source):
                return None
            return self.unknown(node, data)
        if channel_layer_norm(module, self.shape(source)):  # timm's LayerNorm2d: over the channels, axis 1
            if self.norm(node, module, source, channels_first=True):
                return None
            return self.unknown(node, data)
        act = norm_then_activation(module, self.shape(source))
        if act is not None:  # timm's BatchNormAct2d: the normalization's rule, then the activation's
            if not self.norm(node, module, source):
                return self.unknown(node, data)
            if type(act) not in (nn.ReLU, nn.LeakyReLU, nn.Identity):
                why = f"its activation {type(act).__name__} is not positively homogeneous (f(c x) != c f(x))"
                self.d.pin(self.ids[node], f"output of {self.label(node)}", why)
            return None
        if kind in _HOMOGENEOUS_MODULES and self.passthrough(node, source, _pooled_axes(kind.__name__)):
            return None
        if kind is nn.Flatten and self.reshape(node, source):
            return None
        if kind.__name__ in _NON_HOMOGENEOUS:
            return self.pin_around(node, data, f"{kind.__name__} is not positively homogeneous (f(c x) != c f(x))")
        return self.unknown(node, data)

    def function(self, node: fx.Node, data: list[fx.Node]) -> None:
        name = target_name(node)
        if len(data) == 1 and _functional_affine_dims(node) is not None and self.functional_affine(node, data[0]):
            return None
        if len(data) == 1 and name in _ADDITIONS and self.parameter_offset(node, data[0]):  # ``x + b``, b a parameter
            return None
        if len(data) == 1 and name in ("mul", "mul_") and self.channel_scale(node, data[0]):  # a layer scale
            return None
        if any(
            isinstance(a, fx.Node) and a.op == "get_attr" for a in node.all_input_nodes
        ):  # parameters or buffers used directly by a function: no rule describes them
            return self.unknown(node, data, "it uses a parameter or buffer directly")
        single = len(data) == 1
        source = data[0]
        if single and name in _HOMOGENEOUS_FUNCTIONS | {"to", "float", "double", "type_as", "detach"}:
            if self.passthrough(node, source, _pooled_axes(name)):
                return None
        if single and name in _RESHAPES and self.reshape(node, source):
            return None
        if single and name in _REDUCTIONS and self.reduction(node, source):
            return None
        if single and name in _SCALINGS and self.scaling(node, source):
            return None
        if single and name == "getitem" and self.getitem(node, source):
            return None
        if single and name == "pad" and self.pad(node, source):
            return None
        if name in _ADDITIONS and len(data) == 2 and self.addition(node, data):
            return None
        if name in _CONCATENATIONS and self.concatenation(node, data):
            return None
        if name in _NON_HOMOGENEOUS:
            return self.pin_around(node, data, f"'{name}' is not positively homogeneous (f(c x) != c f(x))")
        return self.unknown(node, data)

    def parameter(self, arg: object) -> tuple[fx.Node, str, Tensor] | None:
        """``arg`` as a ``get_attr`` node reading a floating-point parameter: (node, name, tensor), else ``None``."""
        if not (isinstance(arg, fx.Node) and arg.op == "get_attr"):
            return None
        tensor = self.attribute(arg)
        name = self.param_name(tensor)
        return (arg, name, tensor) if name is not None and tensor.is_floating_point() else None

    def functional_affine(self, node: fx.Node, source: fx.Node) -> bool:
        """``F.linear(x, W, b)`` (``W`` of shape ``(out, in)``), ``x @ W`` / ``torch.matmul(x, W)`` (``W`` of shape
        ``(in, out)``) or ``F.conv1d/2d/3d(x, W, b, ..., groups)`` with parameters read directly: the rule of the
        Linear (on ``x``'s last axis) or Conv module, one set of output variables per call (a weight read by several
        calls has its records tied by `shared_tensors`)."""
        name, src = target_name(node), self.shape(source)
        dims = _functional_affine_dims(node)
        slots = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
        slots = slots if dims else slots[:3] if name == "linear" else slots[:2]  # matmul: (input, other) by position
        if len(node.args) > len(slots):
            return False
        bound = dict(zip(slots, node.args)) | dict(node.kwargs)
        if bound.get("input") is not source or set(bound) - set(slots) or src is None:
            return False
        groups = bound.get("groups", 1)
        weight = self.parameter(bound.get("weight"))
        bias = self.parameter(bound["bias"]) if bound.get("bias") is not None else None
        if weight is None or (bound.get("bias") is not None and bias is None) or not isinstance(groups, int):
            return False
        shape, transposed = tuple(weight[2].shape), name == "matmul"
        if len(shape) != dims + 2:
            return False
        in_axis = len(src) - 1 if dims == 0 else 1
        n_in = shape[0] if transposed else shape[1] * groups
        if (len(src) != dims + 2 if dims else len(src) < 2) or src[in_axis] != n_in:
            return False
        n_out = shape[1] if transposed else shape[0]
        in_ids = self.along(source, in_axis)
        if in_ids is None or n_out % groups or (bias is not None and tuple(bias[2].shape) != (n_out,)):
            return False
        label = self.label(node)
        self.layer(node, label, (weight[1], shape), bias[1] if bias else None, in_ids, groups, transposed)
        self.described_reads.update((node, p[0]) for p in (weight, bias) if p is not None)
        if in_axis != 1:
            self.axes[node] = in_axis
        return True

    def parameter_offset(self, node: fx.Node, source: fx.Node) -> bool:
        """``x + b``, ``b + x``, ``x - b`` or ``b - x`` with ``b`` a parameter of shape ``(channels,)`` broadcast
        along ``x``'s last axis, its channel axis (the bias of ``x @ W + b``): ``b`` scales with ``x``'s channels."""
        if node.kwargs or len(node.args) != 2 or source not in self.ids:
            return False
        if node.args[0] is not source and target_name(node) not in ("add", "sub"):  # in place: on the data only
            return False
        other = node.args[1] if node.args[0] is source else node.args[0]
        bias, src = self.parameter(other), self.shape(source)
        if bias is None or src is None or len(src) < 2 or self.axis(source) != len(src) - 1:
            return False
        if tuple(bias[2].shape) != (src[-1],) or self.shape(node) != src:
            return False
        layer = self.label(source) if source.op != "placeholder" else self.label(node)
        self.d.records.append(Record(bias[1], (src[-1],), self.ids[source], None, 1, "bias", layer))
        self.described_reads.add((node, bias[0]))
        self.ids[node] = self.ids[source]
        if self.axis(source) != 1:
            self.axes[node] = self.axis(source)
        return True

    def channel_scale(self, node: fx.Node, source: fx.Node) -> bool:
        """``x * g`` (``x.mul(g)``, ``mul_`` on ``x``) with ``g`` a parameter of ``C`` entries, read directly or through
        one reshape read by this product alone, broadcast along the channels of a channels-first map ``x`` ``(N, C,
        ...)`` (ConvNeXt's layer scale, ``x.mul(gamma.reshape(1, -1, 1, 1))``): the output's channels are new variables
        and ``g_c -> g_c e^{s_out(c) - s_in(c)}``, the Linear rule with a diagonal weight."""
        if node.kwargs or len(node.args) != 2 or source not in self.ids or self.axis(source) != 1:
            return False
        if node.args[0] is not source and target_name(node) != "mul":  # in place: on the data only
            return False
        other = node.args[1] if node.args[0] is source else node.args[0]
        src = self.shape(source)
        if not isinstance(other, fx.Node) or src is None or len(src) < 3 or self.shape(node) != src:
            return False
        via, read = other, other
        if other.op != "get_attr":  # one reshape of the parameter, read by this product alone
            if target_name(other) not in ("view", "reshape") or other.op != "call_method" or len(other.users) != 1 \
                    or not other.args or not isinstance(other.args[0], fx.Node) or other.kwargs:  # fmt: skip
                return False
            read = other.args[0]
            if any(isinstance(a, fx.Node) for a in other.args[1:]):
                return False
        gain = self.parameter(read)
        if gain is None:
            return False
        try:  # the shape the product reads: the parameter's, or its reshape's
            shape = tuple(gain[2].shape) if via is read else tuple(gain[2].reshape(*via.args[1:]).shape)
        except (RuntimeError, TypeError):
            return False
        channels = src[1]
        aligned = (1,) * (len(src) - len(shape)) + tuple(shape)
        if len(aligned) != len(src) or aligned[1] != channels or any(n != 1 for i, n in enumerate(aligned) if i != 1) \
                or gain[2].numel() != channels:  # fmt: skip
            return False
        label = self.label(node)
        out_ids = self.d.new(channels, f"output of {label}")
        # the variables laid out as the parameter holds its channels: (C,), (C, 1, 1) or (1, C, 1, 1)
        stored = tuple(gain[2].shape)
        at = next(i for i, n in enumerate(stored) if n == channels)
        view = tuple(channels if i == at else 1 for i in range(len(stored)))
        plus, minus = out_ids.reshape(view), self.ids[source].reshape(view)
        self.d.records.append(Record(gain[1], tuple(gain[2].shape), plus, minus, 1, "weight", label))
        self.described_reads.add((via, read) if via is not read else (node, read))
        self.ids[node] = out_ids
        return True

    def reduction(self, node: fx.Node, source: fx.Node) -> bool:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        src = self.shape(source)
        if dim is None or src is None:
            return False
        dims = dim if isinstance(dim, (tuple, list)) else (dim,)
        axis = self.axis(source)
        if not all(isinstance(d, int) for d in dims) or {d % len(src) for d in dims} & {0, axis}:
            return False
        if axis == 1:
            return self.passthrough(node, source)
        # a mean over the tokens: the features move down by the number of axes dropped before them
        new = axis if _keepdim(node) else axis - sum(d % len(src) < axis for d in set(dims))
        shape = self.shape(node)
        if source not in self.ids or shape is None or len(shape) <= new or shape[new] != src[axis]:
            return False
        self.ids[node] = self.ids[source]
        if new != 1:
            self.axes[node] = new
        return True

    def scaling(self, node: fx.Node, source: fx.Node) -> bool:
        if node.kwargs or len(node.args) != 2:
            return False
        first, second = node.args
        if first is source:
            return isinstance(second, (int, float)) and self.passthrough(node, source)
        return (
            target_name(node) in ("mul", "imul") and isinstance(first, (int, float)) and self.passthrough(node, source)
        )

    def getitem(self, node: fx.Node, source: fx.Node) -> bool:
        if self.axis(source) != 1:
            return False
        index = node.args[1]
        index = index if isinstance(index, tuple) else (index,)
        full = slice(None, None, None)
        if len(index) < 2 or index[0] != full or index[1] != full:
            return False
        if any(not isinstance(i, slice) for i in index):  # an integer index drops an axis
            return False
        return self.passthrough(node, source)

    def pad(self, node: fx.Node, source: fx.Node) -> bool:
        src, shape = self.shape(source), self.shape(node)
        pads = node.args[1] if len(node.args) > 1 else node.kwargs.get("pad")
        mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
        value = node.args[3] if len(node.args) > 3 else node.kwargs.get("value", None)
        if src is None or shape is None or source not in self.ids or not isinstance(pads, (tuple, list)):
            return False
        if self.axis(source) != 1:
            return False
        if mode == "constant" and value not in (None, 0, 0.0):
            return False
        spatial = 2 * (len(src) - 2)
        if len(pads) <= spatial:
            return self.passthrough(node, source)
        if len(pads) == spatial + 2 and mode == "constant" and shape[0] == src[0]:
            before, after = pads[spatial], pads[spatial + 1]
            if not all(isinstance(n, int) and not isinstance(n, bool) for n in (before, after)) or before < 0 \
                    or after < 0:  # fmt: skip
                return False  # amounts computed from shapes (Swin's padding to whole windows): not read here
            why = "zero channels added by padding"
            head = self.d.new(before, f"output of {self.label(node)}")
            tail = self.d.new(after, f"output of {self.label(node)}")
            for ids in (head, tail):
                if ids.numel():
                    self.d.pin(ids, f"output of {self.label(node)}", why)
            self.ids[node] = torch.cat([head, self.ids[source], tail])
            return True
        return False

    def addition(self, node: fx.Node, data: list[fx.Node]) -> bool:
        shapes = [self.shape(n) for n in data]
        if any(n not in self.ids for n in data) or shapes[0] is None or shapes[0] != shapes[1]:
            return False
        if shapes[0] != self.shape(node) or len(shapes[0]) < 2:
            return False
        extra = [a for a in node.args[2:]] + [v for k, v in node.kwargs.items() if k != "alpha"]
        if extra:
            return False
        # both operands read along one channel axis (a pinned one may be read along the other's)
        axis = self.axis(data[0])
        first, second = self.ids[data[0]], self.along(data[1], axis)
        if second is None:
            axis = self.axis(data[1])
            first, second = self.along(data[0], axis), self.ids[data[1]]
        if first is None:
            return False
        self.d.tie(first, second)
        self.ids[node] = first
        if axis != 1:
            self.axes[node] = axis
        return True

    def concatenation(self, node: fx.Node, data: list[fx.Node]) -> bool:
        parts = node.args[0] if node.args else node.kwargs.get("tensors")
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if not isinstance(parts, (tuple, list)) or not all(isinstance(p, fx.Node) and p in self.ids for p in parts):
            return False
        shapes = [self.shape(p) for p in parts]
        out = self.shape(node)
        if out is None or any(s is None or len(s) < 2 for s in shapes) or not isinstance(dim, int):
            return False
        dim %= len(out)
        axis = self.axis(parts[0])
        if any(self.axis(p) != axis for p in parts):
            return False
        if axis != 1:
            self.axes[node] = axis
        if dim == axis:
            self.ids[node] = torch.cat([self.ids[p] for p in parts])
            return True
        for p in parts[1:]:
            self.d.tie(self.ids[parts[0]], self.ids[p])
        self.ids[node] = self.ids[parts[0]]
        return True

    # -- products of parameters -------------------------------------------------------------------------
    def attribute(self, node: fx.Node) -> object:
        return attribute(self.model, node)

    def uses(self) -> Counter[int]:
        """How often each tensor (by identity) is read for its values: once per argument slot of a node reading it
        directly (``p * p`` reads ``p`` twice, the output node counts), once per call of a module holding it."""
        count: Counter[int] = Counter()
        for node in self.graph.nodes:
            if node.op == "get_attr":
                tensor = self.attribute(node)
                if isinstance(tensor, Tensor):
                    for user in node.users:
                        if not is_metadata(user):
                            count[id(tensor)] += _reads(user, node)
            elif node.op == "call_module":
                module = self.model.get_submodule(str(node.target))
                count.update({id(t) for t in (*module.parameters(), *module.buffers())})
        return count

    def products(self) -> None:
        """The product rule (module docstring): ``p -> p e^s``, ``q -> q e^-s`` for each ``p * q`` of two parameters
        used nowhere else, one variable per entry of the free shape; a refused product of two tensors gets a pin
        saying why."""
        uses = None
        for node in self.graph.nodes:
            if node.op not in ("call_function", "call_method") or target_name(node) not in _PRODUCTS:
                continue
            if (
                node.kwargs
                or len(node.args) != 2
                or not all(isinstance(a, fx.Node) and a.op == "get_attr" for a in node.args)
            ):
                continue
            uses = self.uses() if uses is None else uses
            tensors = [self.attribute(a) for a in node.args]
            if not all(isinstance(t, Tensor) for t in tensors):
                continue
            where = f"product {self.label(node)}"
            names = [self.param_name(t) for t in tensors]
            reason = None
            if tensors[0] is tensors[1]:
                reason = f"'{node.args[0].target}' times itself changes under any rescaling of it"
            elif any(n is None for n in names):
                buffer = next(str(a.target) for a, n in zip(node.args, names) if n is None)
                reason = f"'{buffer}' is not a parameter (a buffer keeps its value)"
            elif not all(t.is_floating_point() for t in tensors):
                reason = "a factor is not a floating-point tensor"
            elif any(t.dim() == 0 for t in tensors):  # the group's tensors have axes; (1,) broadcasts the same
                scalar = next(n for n, t in zip(names, tensors) if t.dim() == 0)
                reason = f"'{scalar}' has no axis (0-dim); give it shape (1,) to let it trade its scale"
            else:
                shared = [n for n, t in zip(names, tensors) if uses[id(t)] != 1]
                if shared:
                    reason = f"'{shared[0]}' is also used elsewhere, where rescaling it would change the function"
            if reason is not None:
                self.d.pins.append(Pin(where, 0, f"no rescaling of its factors: {reason}"))
                continue
            free = _free_shape(*(tuple(t.shape) for t in tensors))
            ids = self.d.new(math.prod(free), where).reshape(free)
            for name, tensor, side in zip(names, tensors, ("plus", "minus")):
                index = ids.reshape(free[len(free) - tensor.dim() :])
                plus, minus = (index, None) if side == "plus" else (None, index)
                module = name.rpartition(".")[0]
                self.d.records.append(Record(name, tuple(tensor.shape), plus, minus, 1, "weight", module))
                self.in_products.add(id(tensor))
            self.d.products.append((names[0], names[1], where))

    def run(self) -> Discovery:
        self.products()
        data: set[fx.Node] = set()
        for node in self.graph.nodes:
            if node.op == "placeholder":
                data.add(node)
                shape = self.shape(node)
                if shape is not None:
                    ids = self.d.new(_channels(shape), self.label(node))
                    self.d.pin(ids, self.label(node), "the network's input is given")
                    self.ids[node] = ids
                continue
            inputs = [n for n in node.all_input_nodes if n in data]
            if node.op == "output":
                for n in inputs:
                    if n in self.ids:
                        self.d.pin(
                            self.ids[n], f"output of {self.label(n)}", "the network's output is the loss's input"
                        )
                continue
            if not inputs or is_metadata(node):
                continue
            data.add(node)
            if node.op == "call_module":
                self.module(node, inputs)
            else:
                self.function(node, inputs)
        self.shared_tensors()
        return self.d

    # -- tensors reached from several places -------------------------------------------------------------
    def opaque_tensors(self) -> dict[int, str]:
        """Tensors (by identity) used somewhere no record describes -> where: read directly by a function
        (a ``get_attr`` node) or held by a module the rules did not describe."""
        opaque: dict[int, str] = {}
        for node in self.graph.nodes:
            if node.op == "get_attr" and any(
                not is_metadata(u) and (u, node) not in self.described_reads for u in node.users
            ):
                tensor = self.attribute(node)
                if isinstance(tensor, Tensor) and id(tensor) not in self.in_products:
                    opaque.setdefault(id(tensor), f"'{node.target}' read directly by the forward")
            elif node.op == "call_module":
                module = self.model.get_submodule(str(node.target))
                for tensor in (*module.parameters(), *module.buffers()):
                    if (id(module), id(tensor)) not in self.understood:
                        opaque.setdefault(id(tensor), f"a tensor of {self.label(node)}")
        return opaque

    def shared_tensors(self) -> None:
        """Make every use of a tensor transform it the same way, then keep one record per tensor.

        A tensor with several records (a weight tied between two modules) gets its uses' channel variables
        tied entry by entry (output with output, input with input), or pinned where the uses act differently;
        a tensor also used where no rule describes it has every channel it touches pinned.
        """
        by_name: dict[str, list[Record]] = {}
        for record in self.d.records:
            by_name.setdefault(record.name, []).append(record)
        names = {**self.buffer_names, **self.param_names}  # tensor id -> name
        opaque = {names[t]: where for t, where in self.opaque_tensors().items() if t in names}
        for name, records in by_name.items():
            first = records[0]
            if name in opaque:
                for r in records:
                    for ids in (r.plus, r.minus):
                        if ids is not None:
                            self.d.pin(ids.flatten(), opaque[name], "a parameter also used by an operation the "
                                       "rescaling rules do not know keeps its scale")  # fmt: skip
                continue
            for r in records[1:]:
                same = r.power == first.power and (r.plus is None) == (first.plus is None)
                same = same and (r.minus is None) == (first.minus is None)
                if not same:
                    for ids in (first.plus, first.minus, r.plus, r.minus):
                        if ids is not None:
                            self.d.pin(
                                ids.flatten(), f"tensor '{name}'", "it is used in places that scale it differently"
                            )
                    continue
                for a, b in ((first.plus, r.plus), (first.minus, r.minus)):
                    if a is not None:
                        a, b = torch.broadcast_tensors(a.expand(first.shape), b.expand(r.shape))
                        pairs = torch.stack([a.flatten(), b.flatten()]).unique(dim=1)
                        self.d.tie(pairs[0], pairs[1])
        kept: set[str] = set()
        records = []
        for record in self.d.records:
            if record.name not in kept:
                kept.add(record.name)
                records.append(record)
        self.d.records[:] = records


def attribute(model: nn.Module, node: fx.Node) -> object:
    """The object a ``get_attr`` node of ``model``'s graph reads."""
    owner, _, attr = str(node.target).rpartition(".")
    return getattr(model.get_submodule(owner), attr, None)


def _functional_affine_dims(node: fx.Node) -> int | None:
    """The convolution dims of a functional affine layer (0 for ``F.linear`` and ``matmul``), else ``None``."""
    if node.op == "call_method":
        return 0 if node.target == "matmul" else None
    if node.op != "call_function":
        return None
    try:
        return _FUNCTIONAL_AFFINE.get(node.target)
    except TypeError:  # an unhashable target
        return None


def _pooled_axes(name: str) -> int:
    """How many trailing axes a pooling called ``name`` pools over (``max_pool2d``, ``AdaptiveAvgPool2d``: 2), or 0."""
    match = re.fullmatch(r"(adaptive_?)?(max|avg)_?pool([123])d", name.lower())
    return int(match.group(3)) if match else 0


def _reads(user: fx.Node, node: fx.Node) -> int:
    """How many argument slots of ``user`` hold ``node`` (``p * p`` reads ``p`` twice)."""
    found: list[fx.Node] = []
    fx.node.map_arg((user.args, user.kwargs), found.append)
    return sum(n is node for n in found)


def _free_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the scales ``c`` of a product ``p * q`` (shapes ``a``, ``b``; ``p -> p c``, ``q -> q / c``):
    the broadcast shape, with size 1 along every axis where ``p`` or ``q`` is broadcast (``c`` must be constant
    there, or the entries of the other factor along it would need several scales at once)."""
    out = torch.broadcast_shapes(a, b)
    a, b = (1,) * (len(out) - len(a)) + a, (1,) * (len(out) - len(b)) + b
    return tuple(n if x == y == n else 1 for x, y, n in zip(a, b, out))


_NORM_BASES = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)


def _plain_norm(module: nn.Module) -> bool:
    """Whether ``module`` is one of torch's normalization layers running torch's own forward: a subclass may override
    it (Gemma's ``(1 + weight)`` scale), and then none of a normalization's rules holds (it is an unknown operation)."""
    forward = type(module).forward
    return any(isinstance(module, base) and forward is base.forward for base in _NORM_BASES) or (
        isinstance(module, nn.SyncBatchNorm) and forward is nn.SyncBatchNorm.forward) or (
        read_as(module) is nn.LayerNorm)  # a forward of its own that is nn.LayerNorm's (timm's LayerNorm)


def _plain_affine(module: nn.Module) -> type[nn.Module] | None:
    """The Linear/Conv class whose forward ``module`` runs unchanged (a subclass may override it)."""
    for base in _AFFINE:
        if isinstance(module, base):
            kind = type(module)
            same = kind.forward is base.forward
            if base is not nn.Linear:
                same = same and kind._conv_forward is base._conv_forward
            else:  # or a forward of its own that is nn.Linear's (timm's Linear)
                same = same or read_as(module) is nn.Linear
            return base if same else None
    return None


def discover(model: nn.Module, graph: fx.Graph, buffers: bool = False) -> Discovery:
    """Variables, constraints and parameter records of ``model``'s traced ``graph`` (shapes in ``node.meta``).

    Args:
        model: the traced model.
        graph: its graph, every data node carrying ``meta["shape"]``.
        buffers: also let the running statistics of BatchNorm layers scale (so their inputs are free).
    """
    return _Walker(model, graph, buffers).run()
