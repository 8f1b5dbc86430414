"""What `analyze` reads from a model: its exact rescaling group, and its chain of layers if it is one.

The group comes from the rules of `manifolds._group_discovery` on the model's traced graph
(`manifolds._graph`); it covers residual connections, BatchNorm, concatenation and shared modules.
The chain view is what G-space and fixed weights need: Linear/Conv2d layers in forward order with only
positively homogeneous operations between them, where a hidden unit (or channel) can be rescaled by
multiplying its incoming weights and bias by ``c`` and dividing its outgoing weights by ``c``; every
reason a model is not such a chain is recorded in ``problems``, naming the module or function.

Both read the one fx graph, so they see functional calls (``F.relu``, ``torch.flatten``, ``x.view``)
and additions. When fx cannot trace a model the chain view falls back to the children of an
``nn.Sequential``, and otherwise to the call order of leaf modules recorded with forward pre-hooks on
one forward pass with ``example_input``, which cannot see functional operations or additions; there is
no group then. [`rescale_parameters`][manifolds.rescale_parameters] and friends apply chain rescalings functionally;
[`random_rescale`][manifolds.random_rescale] draws elements of the group.

Only what happens between the first and the last layer matters for the chain view: rescalings act on
hidden units only, so the output of the last layer, and everything computed from it (a Sigmoid or
Softmax head, the loss), is unchanged, and the input to the first layer is untouched.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import Tensor, fx, nn

from manifolds._graph import TracedNetwork, input_like, is_metadata, sequential_calls, target_name, trace_network
from manifolds._group import RescalingGroup, check_generator, check_scale
from manifolds._group_discovery import discover
from manifolds._modules import eval_mode, kept_buffers

_LAYER_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv2d)

# Modules that commute with a positive per-unit (per-channel) scaling of their input.
_HOMOGENEOUS_MODULES: dict[type[nn.Module], str] = {
    nn.ReLU: "ReLU",
    nn.LeakyReLU: "LeakyReLU",
    nn.Identity: "Identity",
    nn.MaxPool2d: "MaxPool2d",
    nn.AvgPool2d: "AvgPool2d",
    nn.AdaptiveAvgPool2d: "AdaptiveAvgPool2d",
    nn.AdaptiveMaxPool2d: "AdaptiveMaxPool2d",
    nn.Flatten: "Flatten",
    nn.Dropout: "Dropout",
    nn.Dropout1d: "Dropout",
    nn.Dropout2d: "Dropout",
    nn.Dropout3d: "Dropout",
}

# Functional forms (``__name__`` of the fx target, leading underscores stripped), and tensor methods.
_HOMOGENEOUS_FUNCTIONS: dict[str, str] = {
    "relu": "ReLU",
    "relu_": "ReLU",
    "leaky_relu": "LeakyReLU",
    "leaky_relu_": "LeakyReLU",
    "max_pool2d": "MaxPool2d",
    "avg_pool2d": "AvgPool2d",
    "adaptive_avg_pool2d": "AdaptiveAvgPool2d",
    "adaptive_max_pool2d": "AdaptiveMaxPool2d",
    "flatten": "Flatten",
    "view": "Flatten",
    "reshape": "Flatten",
    "dropout": "Dropout",
    "dropout1d": "Dropout",
    "dropout2d": "Dropout",
    "dropout3d": "Dropout",
    "feature_dropout": "Dropout",
}

# Multiplying or dividing by a constant number is linear, hence homogeneous.
_SCALAR_FUNCTIONS = {"mul", "truediv", "div"}


_NORM_MODULES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
)


class UnsupportedModelError(ValueError):
    """The model lacks the rescaling symmetry a computation needs, or its structure cannot be found.

    Attributes:
        short: a few words for a table cell (e.g. ``"needs a chain of layers"``); the message says the rest.
    """

    def __init__(self, message: str = "", short: str = "not supported for this model"):
        super().__init__(message)
        self.short = short


def name_list(names: list[str], limit: int = 4) -> str:
    """``a, b, c, d and 17 more``: a message names the first few of a long list of tensors, not all of them."""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


class DegeneratePointError(UnsupportedModelError):
    """A computation is undefined at these weights, not for the model: a tensor of zero norm, a dead or zero
    hidden unit, a zero weight that a chart divides by. Skipped with its reason where measures are skipped."""

    def __init__(self, message: str = "", short: str = "degenerate point"):
        super().__init__(message, short)


@dataclass(frozen=True)
class Layer:
    """One Linear or Conv2d layer of a network.

    Attributes:
        name: qualified module name, e.g. ``"0"`` or ``"features.3"``.
        module_type: ``"Linear"`` or ``"Conv2d"``.
        weight: parameter name of the weight, e.g. ``"0.weight"``.
        bias: parameter name of the bias, or ``None``.
        out_units: ``out_features`` / ``out_channels``.
        in_units: ``in_features`` / ``in_channels``.
        in_group: weight-input columns per unit of the previous layer: 1 normally; for a Linear after a
            Flatten of a conv output, the spatial size (column index ``= channel * in_group + pos``).
    """

    name: str
    module_type: str
    weight: str
    bias: str | None
    out_units: int
    in_units: int
    in_group: int


@dataclass(frozen=True)
class NetworkStructure:
    """What `analyze` finds: the network's exact rescaling group, and its chain of layers if it is one.

    Attributes:
        layers: Linear/Conv2d layers in forward order.
        operations: ``len(layers) - 1`` entries; entry ``i`` names the operations between layer ``i``
            and ``i + 1`` in order, e.g. ``("ReLU", "MaxPool2d")``.
        problems: one sentence per reason the network is not a plain chain of Linear/Conv2d layers with
            positively homogeneous operations between them (what G-space and fixed weights need), naming
            the offending module (or function). Empty for a chain.
        group: the exact diagonal rescaling group (one scale per class of channels), or ``None`` when the
            graph could not be read (see ``group_failure``).
        layer_group: its subgroup with one scale per module output (what the layer-wise metric needs).
        group_failure: why ``group`` is ``None``.
    """

    layers: tuple[Layer, ...]
    operations: tuple[tuple[str, ...], ...]
    problems: tuple[str, ...]
    group: RescalingGroup | None = field(default=None, compare=False)
    layer_group: RescalingGroup | None = field(default=None, compare=False)
    group_failure: str | None = None
    traced: TracedNetwork | None = field(default=None, compare=False, repr=False)
    example_input: Tensor | None = field(default=None, compare=False, repr=False)

    @cached_property
    def symmetry(self):
        """The whole function-preserving group (`manifolds.MatrixSymmetry`): ``group`` times the attention
        heads' ``GL(h)`` factors, the LayerNorm/RMSNorm scale trades and the token-wise ReLU units of
        `manifolds._attention` (built on first use, from the same graph), or ``None`` when ``group`` is."""
        if self.group is None:
            return None
        from manifolds._attention import symmetry_of  # the factors are found on this structure's graph

        return symmetry_of(self)

    def describe(self) -> str:
        """The whole group (`symmetry`): its dimensions, every GL and diagonal factor with the blocks it moves,
        the diagonal rescaling group and every pinned channel with its reason; or why the group is unknown."""
        if self.group is None:
            return f"symmetry group unknown, because {self.group_failure}"
        return self.symmetry.describe() + "\n" + self.group.describe()

    @property
    def rescalable(self) -> bool:
        """Whether the network is a plain chain on which every node-wise rescaling preserves the function."""
        return not self.problems

    def require_group(self, what: str) -> RescalingGroup:
        """The node-wise group, or [`UnsupportedModelError`][manifolds.UnsupportedModelError] saying why it is unknown.

        Args:
            what: the computation that needs it, e.g. ``"a function-preserving rescaling"``.
        """
        if self.group is None:
            raise UnsupportedModelError(
                f"Cannot compute {what}: the rescaling group is unknown, because {self.group_failure}.",
                short="rescaling group unknown",
            )
        return self.group

    @property
    def hidden_units(self) -> tuple[int, ...]:
        """Units (channels) of each hidden layer: ``out_units`` of every layer but the last."""
        return tuple(layer.out_units for layer in self.layers[:-1])

    @property
    def n_hidden(self) -> int:
        """Total number ``H`` of hidden units, the dimension of the node-wise rescaling group."""
        return sum(self.hidden_units)

    def require_rescalable(self, what: str) -> None:
        """Raise `UnsupportedModelError` unless the network is a plain chain (see ``problems``).

        Args:
            what: the computation that is defined for chains only, e.g. ``"the G-space parametrization"``.
        """
        if self.problems:
            raise UnsupportedModelError(
                f"Cannot build {what}, which is defined for chains of Linear/Conv2d layers with positively "
                f"homogeneous operations between them: {self.problem_summary}. The node, layer, minnorm and euclidean "
                "measures remain available for this model.",
                short="needs a chain of layers",
            )

    @property
    def problem_summary(self) -> str:
        """The first two of ``problems`` and how many more there are, for a message (empty for a plain chain)."""
        more = f" (and {len(self.problems) - 2} more reason(s))" if len(self.problems) > 2 else ""
        return "; ".join(self.problems[:2]) + more


@dataclass
class _Op:
    """A non-layer operation on the path from input to output, before its position is judged."""

    name: str  # entry for ``NetworkStructure.operations``
    segment: int  # number of layers the data has passed through when it reaches this op
    hidden_problem: str | None = None  # problem if it sits between two layers
    problem: str | None = None  # problem wherever it sits


@dataclass
class _Trace:
    """Raw discovery result shared by the fx, Sequential and hook paths."""

    layers: list[tuple[str, nn.Module]] = field(default_factory=list)
    ops: list[_Op] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    # Problems that apply only if some segment is hidden (1 <= segment <= L - 1):
    # (segments, message, whether it means the layers do not form a single chain).
    hidden_problems: list[tuple[tuple[int, ...], str, bool]] = field(default_factory=list)
    chain_broken: bool = False


def _module_label(name: str, module: nn.Module) -> str:
    return f"module '{name}' ({type(module).__name__})"


def _classify_module(name: str, module: nn.Module, segment: int) -> _Op:
    label = _module_label(name, module)
    if type(module) in _HOMOGENEOUS_MODULES:  # exact type: a subclass may change the forward
        return _Op(_HOMOGENEOUS_MODULES[type(module)], segment)
    op = _Op(type(module).__name__, segment)
    parameterized = any(True for _ in module.parameters())
    if parameterized:
        op.problem = f"{label} has parameters outside the Linear/Conv2d layers, which no rescaling describes"
    if isinstance(module, _NORM_MODULES):
        op.hidden_problem = (
            f"{label} normalizes its input, which cancels the scaling of the units feeding it while "
            "their outgoing weights are still divided"
        )
    elif not parameterized:
        op.hidden_problem = (
            f"{label} is not a known positively homogeneous operation (f(c x) = c f(x) for c > 0), so "
            "scaling the units feeding it changes the function"
        )
    return op


def _add_layer(trace: _Trace, name: str, module: nn.Module, seen: dict[str, int]) -> bool:
    """Record a layer call; returns False (and records a problem) for a repeated call."""
    seen[name] = seen.get(name, 0) + 1
    if seen[name] == 2:
        trace.problems.append(
            f"{_module_label(name, module)} is called more than once (weight sharing), so its units "
            "cannot be rescaled independently in each use"
        )
    if seen[name] > 1:
        return False
    trace.layers.append((name, module))
    return True


def _node_label(node: fx.Node, model: nn.Module) -> str:
    if node.op == "call_module":
        return _module_label(str(node.target), model.get_submodule(str(node.target)))
    if node.op == "call_method":
        return f"method '.{node.target}()' (graph node '{node.name}')"
    if node.op == "placeholder":
        return f"the input '{node.name}'"
    return f"function '{target_name(node)}' (graph node '{node.name}')"


def _is_scaling(node: fx.Node, name: str, data: fx.Node) -> bool:
    """``x * a``, ``a * x`` or ``x / a`` with a constant number ``a`` (``a / x`` is not homogeneous)."""
    if name not in _SCALAR_FUNCTIONS or node.kwargs or len(node.args) != 2:
        return False
    first, second = node.args
    if first is data:
        return isinstance(second, (int, float))
    return name == "mul" and second is data and isinstance(first, (int, float))


def _trace_fx(model: nn.Module, graph: fx.Graph) -> _Trace:
    trace = _Trace()
    seen: dict[str, int] = {}
    segment: dict[fx.Node, int] = {}  # data nodes (depending on the input) -> layers passed so far
    params: dict[fx.Node, set[str]] = {}  # non-data nodes -> parameters they are computed from
    for node in graph.nodes:
        if node.op == "placeholder":
            segment[node] = 0
            continue
        if node.op == "get_attr":
            if isinstance(_get_attr(model, node), nn.Parameter):
                params[node] = {str(node.target)}
            continue
        inputs = node.all_input_nodes
        used = set().union(*(params.get(n, set()) for n in inputs))
        data_in = list(dict.fromkeys(n for n in inputs if n in segment))
        if node.op == "output":
            trace.hidden_problems.extend(
                (
                    (segment[n],),
                    f"the model returns the output of {_node_label(n, model)}, computed between two layers, "
                    "which rescaling changes",
                    False,
                )
                for n in data_in
            )
            continue
        if not data_in:
            if used:
                params[node] = used
            continue
        if is_metadata(node):
            continue
        seg = max(segment[n] for n in data_in)
        label = _node_label(node, model)
        module = model.get_submodule(str(node.target)) if node.op == "call_module" else None
        if isinstance(module, _LAYER_TYPES):
            if _add_layer(trace, str(node.target), module, seen):
                index = len(trace.layers) - 1
                if seg != index:
                    trace.chain_broken = True
                    trace.problems.append(
                        f"{label} does not take the output of the previous layer as its input, so the "
                        "network is not a single chain"
                    )
                seg = index + 1
            segment[node] = seg
            continue
        segment[node] = seg
        if used:
            trace.problems.append(
                f"{label} uses the parameter(s) {', '.join(sorted(repr(p) for p in used))} directly, which "
                "the structure cannot describe (use nn.Linear / nn.Conv2d modules)"
            )
            trace.ops.append(_Op(target_name(node), seg))
            continue
        if len(data_in) > 1:
            trace.hidden_problems.append(
                (
                    tuple(segment[n] for n in data_in),
                    f"{label} combines several tensors computed from the input (a residual connection or "
                    "concatenation), so the units feeding it cannot be rescaled independently",
                    True,
                )
            )
            trace.ops.append(_Op(target_name(node), seg))
            continue
        if module is not None:
            trace.ops.append(_classify_module(str(node.target), module, seg))
            continue
        name = target_name(node)
        if name in _HOMOGENEOUS_FUNCTIONS:
            trace.ops.append(_Op(_HOMOGENEOUS_FUNCTIONS[name], seg))
        elif _is_scaling(node, name, data_in[0]):
            trace.ops.append(_Op("Scale", seg))
        else:
            trace.ops.append(
                _Op(
                    name,
                    seg,
                    hidden_problem=f"{label} is not a known positively homogeneous operation "
                    "(f(c x) = c f(x) for c > 0), so scaling the units feeding it changes the function",
                )
            )
    for node, seg in segment.items():
        users = [u for u in node.users if u in segment or u.op == "output"]
        if len(users) > 1:
            trace.hidden_problems.append(
                (
                    (seg,),
                    f"the output of {_node_label(node, model)} feeds {len(users)} operations "
                    f"({', '.join(u.name for u in users)}), so the network is not a single chain",
                    True,
                )
            )
    return trace


def _get_attr(model: nn.Module, node: fx.Node) -> object:
    owner, _, attr = str(node.target).rpartition(".")
    return getattr(model.get_submodule(owner), attr, None)


def _trace_modules(model: nn.Module, calls: Sequence[tuple[str, nn.Module]]) -> _Trace:
    """Structure from a plain sequence of module calls (Sequential children or hook records)."""
    trace = _Trace()
    seen: dict[str, int] = {}
    for name, module in calls:
        if isinstance(module, _LAYER_TYPES):
            _add_layer(trace, name, module, seen)
        else:
            trace.ops.append(_classify_module(name, module, len(trace.layers)))
    return trace


def _hook_calls(model: nn.Module, example_input: Tensor) -> list[tuple[str, nn.Module]]:
    # A copy, so that a forward pass in training mode (BatchNorm statistics) leaves the model untouched.
    twin = copy.deepcopy(model)
    calls: list[tuple[str, nn.Module]] = []
    handles = []
    for name, module in twin.named_modules():
        # Leaves, and any module using parameters of its own (invisible to its children's hooks).
        if not any(True for _ in module.children()) or any(True for _ in module.parameters(recurse=False)):
            handles.append(
                module.register_forward_pre_hook(
                    lambda m, args, name=name: calls.append((name, model.get_submodule(name)))
                )
            )
    try:
        with torch.no_grad():
            twin(input_like(model, example_input))  # the data may live elsewhere (a CPU batch, a CUDA model)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def _assemble(model: nn.Module, trace: _Trace) -> NetworkStructure:
    n_layers = len(trace.layers)
    problems = list(trace.problems)
    if n_layers == 0:
        problems.append("the model has no Linear or Conv2d layer")

    def hidden(seg: int) -> bool:
        return 1 <= seg <= n_layers - 1

    operations: list[list[str]] = [[] for _ in range(max(n_layers - 1, 0))]
    for op in trace.ops:
        if hidden(op.segment):
            operations[op.segment - 1].append(op.name)
            if op.hidden_problem:
                problems.append(op.hidden_problem)
                continue
        if op.problem:
            problems.append(op.problem)
    chain_broken = trace.chain_broken
    for segs, msg, breaks_chain in trace.hidden_problems:
        if any(hidden(s) for s in segs):
            problems.append(msg)
            chain_broken = chain_broken or breaks_chain

    param_names = {name for name, _ in model.named_parameters()}
    layers: list[Layer] = []
    for i, (name, module) in enumerate(trace.layers):
        label = _module_label(name, module)
        is_conv = isinstance(module, nn.Conv2d)
        prefix = f"{name}." if name else ""  # a bare Linear/Conv2d model owns "weight" and "bias"
        weight = f"{prefix}weight"
        bias = f"{prefix}bias" if module.bias is not None else None
        if weight not in param_names or (bias is not None and bias not in param_names):
            problems.append(
                f"{label} does not own its weight and bias as plain parameters (tied weights or a "
                "parametrization), which rescaling cannot address"
            )
        if is_conv and module.groups != 1:
            problems.append(f"{label} is a grouped convolution, which the structure does not support")
        in_units = module.in_channels if is_conv else module.in_features
        in_group = 1
        # Shapes of consecutive layers only need to match when they do form a chain.
        if i > 0 and not chain_broken:
            prev = layers[-1]
            prev_label = f"layer '{prev.name}' ({prev.module_type})"
            if is_conv and prev.module_type == "Linear":
                problems.append(f"{label} follows {prev_label}, which the structure does not support")
            elif not is_conv and prev.module_type == "Conv2d":
                if "Flatten" not in operations[i - 1]:
                    problems.append(f"{label} is applied to the output of {prev_label} without flattening it")
                elif in_units % prev.out_units:
                    problems.append(
                        f"{label} has {in_units} input features, not a multiple of the {prev.out_units} "
                        f"channels of {prev_label}"
                    )
                else:
                    in_group = in_units // prev.out_units
            elif in_units != prev.out_units:
                problems.append(f"{label} has {in_units} inputs but {prev_label} has {prev.out_units} outputs")
        layers.append(
            Layer(
                name=name,
                module_type="Conv2d" if is_conv else "Linear",
                weight=weight,
                bias=bias,
                out_units=module.out_channels if is_conv else module.out_features,
                in_units=in_units,
                in_group=in_group,
            )
        )
    return NetworkStructure(tuple(layers), tuple(tuple(ops) for ops in operations), tuple(dict.fromkeys(problems)))


def analyze(model: nn.Module, example_input: Tensor | None = None) -> NetworkStructure:
    """Read ``model`` once: its exact rescaling group, and its chain of layers when it is one.

    The group (``structure.group``, with ``structure.layer_group`` its one-scale-per-module subgroup) is
    found on the `torch.fx` graph with the rules of `manifolds._group_discovery`: residual
    additions tie scales, BatchNorm and non-homogeneous activations pin them, unknown operations pin their
    inputs and outputs. ``print(structure.group.describe())`` shows its dimension and every pinned channel
    with its reason.

    The chain view (``layers``, ``operations``, ``problems``) is what G-space and fixed weights need:
    Linear/Conv2d layers in forward order with only ReLU, LeakyReLU, Identity, max/average (adaptive)
    pooling, Flatten, Dropout or a constant factor between them. A residual connection, a normalization,
    a non-homogeneous activation between layers, a layer called twice or a parameterized module other than
    Linear/Conv2d is recorded in ``problems``. The model is not modified.

    Args:
        model: the network.
        example_input: one input batch, for the tensor shapes (without it the input shape is guessed from
            the first Linear or convolution); if fx cannot trace the model and it is not an
            ``nn.Sequential``, the chain is read from the call order of leaf modules recorded with hooks
            (which sees no functional operations; there is no group then).

    Returns:
        The structure.

    Raises:
        UnsupportedModelError: fx tracing fails, the model is no ``nn.Sequential`` and no
            ``example_input`` is given.
    """
    return analyze_traced(model, trace_network(model, example_input), example_input)


def analyze_traced(model: nn.Module, traced: TracedNetwork, example_input: Tensor | None = None) -> NetworkStructure:
    """`analyze` of a model already traced (``traced = trace_network(model, example_input)``), so that a caller
    which first needed only the graph does not trace it again. The analysis runs modules of the model (probes of its
    layers): their buffers are put back after it."""
    with kept_buffers(model):
        return _analyze_traced(model, traced, example_input)


def _analyze_traced(model: nn.Module, traced: TracedNetwork, example_input: Tensor | None) -> NetworkStructure:
    if isinstance(model, _LAYER_TYPES):
        chain = _trace_modules(model, [("", model)])
    elif traced.sequential:
        chain = _trace_modules(model, sequential_calls(model))
    elif traced.graph is not None:
        chain = _trace_fx(model, traced.graph)
    elif example_input is None:
        raise UnsupportedModelError(
            f"Cannot find the layers of {type(model).__name__} because {traced.failure}; pass "
            "example_input=<one input batch> or build the model as an nn.Sequential."
        )
    else:
        chain = _trace_modules(model, _hook_calls(model, example_input))
    structure = _assemble(model, chain)
    if not traced.has_shapes:
        return dataclasses.replace(structure, group_failure=traced.failure, traced=traced)
    discovery = discover(model, traced.graph)
    return dataclasses.replace(
        structure,
        group=RescalingGroup(discovery, "node"),
        layer_group=RescalingGroup(discovery, "layer"),
        traced=traced,
        example_input=example_input,
    )


def _check_factors(structure: NetworkStructure, factors: Sequence[Tensor]) -> None:
    hidden = structure.hidden_units
    if len(factors) != len(hidden):
        raise ValueError(f"expected {len(hidden)} factor tensors (one per hidden layer), got {len(factors)}")
    for i, (f, h) in enumerate(zip(factors, hidden, strict=True)):
        if tuple(f.shape) != (h,):
            raise ValueError(f"factors[{i}] must have shape ({h},), got {tuple(f.shape)}")
        if not bool((f > 0).all()) or not bool(torch.isfinite(f).all()):
            raise ValueError(f"factors[{i}] must be positive and finite")


def rescale_parameters(
    params: Mapping[str, Tensor], structure: NetworkStructure, factors: Sequence[Tensor]
) -> dict[str, Tensor]:
    """Apply a node-wise rescaling to a dictionary of parameters (functional, nothing is modified).

    Rows (output units/channels) of ``layers[i].weight`` and its bias are multiplied by ``factors[i]``,
    the matching input columns of ``layers[i + 1].weight`` (``in_group`` columns per unit for a Linear
    after Flatten, one input channel for a Conv2d) are divided by it.

    Args:
        params: ``{name: tensor}`` containing at least every layer's weight and bias.
        structure: from [`analyze`][manifolds.analyze].
        factors: ``len(structure.hidden_units)`` positive tensors, ``factors[i]`` of shape
            ``(hidden_units[i],)``; cast to each parameter's dtype and device.

    Returns:
        A new dictionary with the same keys; parameters outside the layers are passed through unchanged.
    """
    _check_factors(structure, factors)
    out = dict(params)
    for i, layer in enumerate(structure.layers):
        missing = [k for k in (layer.weight, layer.bias) if k is not None and k not in params]
        if missing:
            raise KeyError(f"params lack {', '.join(missing)} of layer '{layer.name}'")
        weight = params[layer.weight]
        shape = weight.shape
        if i < len(factors):
            row = factors[i].to(weight)
            weight = weight * row.reshape(-1, *[1] * (weight.dim() - 1))
            if layer.bias is not None:
                out[layer.bias] = params[layer.bias] * row.to(params[layer.bias])
        if i > 0:
            col = factors[i - 1].to(weight)
            # Columns grouped by unit of the previous layer: (out, prev_units, in_group * kernel size).
            weight = (weight.reshape(shape[0], col.numel(), -1) / col[:, None]).reshape(shape)
        out[layer.weight] = weight
    return out


def random_factors(
    structure: NetworkStructure,
    kind: str = "node",
    scale: float = 1.0,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
) -> list[Tensor]:
    """Random positive rescaling factors, one tensor per hidden layer.

    Args:
        structure: from [`analyze`][manifolds.analyze].
        kind: ``"node"``: an independent log-normal factor (log-std ``scale``) per hidden unit.
            ``"layer"``: per-layer multipliers ``lambda_i`` for ALL layers (last included), ``log lambda``
            drawn i.i.d. ``N(0, scale^2)`` and centred so that ``prod lambda_i = 1`` exactly, expressed as
            node factors ``c_i = lambda_1 ... lambda_i`` (constant within layer ``i``); this maps
            ``W_i -> lambda_i W_i`` and ``b_i -> (lambda_1 ... lambda_i) b_i`` (flatness paper, 2.1).
        scale: standard deviation of the log factors.
        generator: random generator (CPU), or ``None`` for the global one.
        dtype: dtype of the factors.

    Returns:
        ``factors[i]`` of shape ``(hidden_units[i],)``.

    Raises:
        ValueError: unknown ``kind``, ``scale`` not a finite number ``>= 0``, or ``generator`` no
            ``torch.Generator``.
    """
    scale = check_scale(scale)
    check_generator(generator)
    hidden = structure.hidden_units
    if kind == "node":
        return [torch.exp(scale * torch.randn(h, generator=generator, dtype=dtype)) for h in hidden]
    if kind == "layer":
        log_lambdas = scale * torch.randn(len(structure.layers), generator=generator, dtype=torch.float64)
        return layer_factors(structure, torch.exp(log_lambdas - log_lambdas.mean()).tolist(), dtype=dtype)
    raise ValueError(f"unknown rescaling kind {kind!r}; use 'node' or 'layer'")


def layer_factors(
    structure: NetworkStructure, lambdas: Sequence[float], dtype: torch.dtype = torch.float64
) -> list[Tensor]:
    """Node factors of the layer-wise rescaling ``W_i -> lambda_i W_i``, ``b_i -> (lambda_1...lambda_i) b_i``.

    Args:
        structure: from [`analyze`][manifolds.analyze].
        lambdas: one positive multiplier per layer (``len(structure.layers)``) with product 1
            (checked to 1e-9 relative), e.g. ``(5, 4, 1/20)`` as in the flatness paper's tables.
        dtype: dtype of the factors.

    Returns:
        ``factors[i] = lambda_1 ... lambda_{i+1}`` repeated ``hidden_units[i]`` times.
    """
    lambdas = [float(lam) for lam in lambdas]
    if len(lambdas) != len(structure.layers):
        raise ValueError(f"expected {len(structure.layers)} layer multipliers, got {len(lambdas)}")
    if any(not lam > 0 for lam in lambdas):
        raise ValueError(f"layer multipliers must be positive, got {lambdas}")
    product = math.prod(lambdas)
    if abs(product - 1.0) > 1e-9:
        raise ValueError(f"layer multipliers must have product 1 to preserve the function, got {product}")
    cumulative = [math.prod(lambdas[: i + 1]) for i in range(len(lambdas) - 1)]
    return [torch.full((h,), c, dtype=dtype) for h, c in zip(structure.hidden_units, cumulative, strict=True)]


def _rescaled_copy(model: nn.Module, structure: NetworkStructure, factors: Sequence[Tensor]) -> nn.Module:
    twin = copy.deepcopy(model)
    own = dict(twin.named_parameters())
    new = rescale_parameters({k: p.detach() for k, p in own.items()}, structure, factors)
    with torch.no_grad():
        for layer in structure.layers:
            for name in (layer.weight, layer.bias):
                if name is not None:
                    own[name].copy_(new[name])
    return twin


def rescale_model(model: nn.Module, factors: Sequence[Tensor], *, example_input: Tensor | None = None) -> nn.Module:
    """A deep copy of a chain network rescaled by node factors, computing the same function.

    For any traceable model use `random_rescale` or ``RescalingGroup.act``; this takes the factors
    of `layer_factors` / `random_factors` (one tensor per hidden layer of a chain).

    Args:
        model: a chain network (``analyze(model).rescalable``); ``model`` is untouched.
        factors: as for [`rescale_parameters`][manifolds.rescale_parameters].
        example_input: passed to [`analyze`][manifolds.analyze] (needed only when fx cannot trace the model).

    Raises:
        UnsupportedModelError: ``model`` is not a chain.
    """
    structure = analyze(model, example_input)
    structure.require_rescalable("a rescaling by per-layer node factors")
    return _rescaled_copy(model, structure, factors)


def buffer_group(model: nn.Module, example_input: Tensor | None = None) -> RescalingGroup:
    """The node-wise group when BatchNorm running statistics may scale too.

    The channels feeding an eval-mode BatchNorm are free then: scaling them by ``c`` with the running mean
    by ``c`` and the running variance by ``c^2`` leaves the output unchanged up to the layer's ``eps``.
    The sharpness measures keep buffers fixed, so their group is ``analyze(model).group``; this one is for
    random rescalings that also change what the Euclidean measure sees.

    Raises:
        UnsupportedModelError: fx cannot trace ``model`` or its shapes are unknown.
    """
    traced = trace_network(model, example_input)
    if not traced.has_shapes:
        raise UnsupportedModelError(f"Cannot find the rescaling group: {traced.failure}.")
    return RescalingGroup(discover(model, traced.graph, buffers=True), "node")


def _check_range(old: Tensor, new: Tensor, name: str) -> None:
    """Refuse a rescaled tensor that left its dtype's normal range: an entry that overflowed, or a nonzero
    entry rounded to zero or to a subnormal number (which keeps fewer significant bits)."""
    tiny = torch.finfo(new.dtype).tiny
    lost = (old != 0) & (new.abs() < tiny)
    if not bool(torch.isfinite(new).all()) or bool(lost.any()):
        raise ValueError(
            f"the rescaling takes '{name}' out of the range of {str(new.dtype).removeprefix('torch.')} (entries "
            "overflow or vanish), so the copy would not compute the same function; draw a smaller scale"
        )


def _acted_copy(model: nn.Module, group, element) -> nn.Module:
    """A deep copy of ``model`` with ``group``'s element applied (ties and sharing kept): ``exp(log_scales)`` of a
    `RescalingGroup`, or a `manifolds.SymmetryElement` of a `manifolds.MatrixSymmetry`.

    Raises:
        ValueError: a rescaled tensor leaves its dtype's normal range (see `_check_range`).
    """
    parts = (element,) if isinstance(element, Tensor) else (element.log_scales, *element.matrices)
    if not all(bool(torch.isfinite(p).all()) for p in parts):
        raise ValueError("the log-scales must be finite")
    twin = copy.deepcopy(model)
    own = dict(twin.named_parameters(remove_duplicate=False)) | dict(twin.named_buffers(remove_duplicate=False))
    names = [a.name for a in group.actions] if isinstance(group, RescalingGroup) else group.names
    new = group.act({name: own[name].detach() for name in names}, element)
    with torch.no_grad():
        for name, value in new.items():
            if name in own and value is not own[name]:
                _check_range(own[name], value, name)
                own[name].copy_(value)
    return twin


def _output_change(model: nn.Module, twin: nn.Module, traced: TracedNetwork,
                   example_input: Tensor | None = None) -> float | None:  # fmt: skip
    """Largest relative change of the outputs of ``twin`` from ``model``'s on a random input of the traced
    shape (eval mode, a fixed seed), or, where the model does not take one (integer inputs of an embedding), on
    ``example_input``; ``None`` when there is neither."""
    node = next((n for n in traced.graph.nodes if n.op == "placeholder"), None) if traced.has_shapes else None
    inputs = []
    if node is not None and "shape" in node.meta:
        inputs.append(input_like(model, torch.randn(node.meta["shape"], generator=torch.Generator().manual_seed(0))))
    if example_input is not None:
        inputs.append(input_like(model, example_input))
    out = None
    with eval_mode(model), eval_mode(twin), torch.no_grad():
        for x in inputs:
            try:
                out = model(x)
            except Exception:  # e.g. integer inputs (an embedding) given floats: try the next input
                continue
            new = twin(x)
            break
    if out is None:
        return None
    if not isinstance(out, Tensor) or not bool(torch.isfinite(out).all()):
        return None
    size = float(out.abs().max())
    change = float((new - out).abs().max()) if bool(torch.isfinite(new).all()) else math.inf
    return change / size if size > 0 else (0.0 if change == 0 else math.inf)


def random_rescale(
    model: nn.Module,
    kind: str = "node",
    scale: float = 1.0,
    generator: torch.Generator | None = None,
    *,
    example_input: Tensor | None = None,
    buffers: bool = False,
) -> nn.Module:
    """A randomly rescaled deep copy of ``model`` that computes the same function.

    The log-scales are i.i.d. ``N(0, scale^2)``, one per free class of the node-wise group (``"node"``) or of
    the layer-wise group (``"layer"``: one per module output class); see `analyze`. Works on any
    traceable model (residual connections, BatchNorm, concatenation, weight sharing). ``"group"`` draws an
    element of the whole group (``analyze(model).symmetry``, `manifolds.MatrixSymmetry.random_element`):
    per attention head a well-conditioned random ``GL(h)`` matrix for query/key and one for value/output
    (condition number at most ``exp(4 scale)``), positive scales ``exp(N(0, scale^2))`` for normalization
    trades, ReLU units and the diagonal rescalings; on a network without attention or normalization factors it
    is ``"node"``'s group.

    Args:
        model: the network.
        kind: ``"node"``, ``"layer"`` or ``"group"``.
        scale: standard deviation of the log-scales.
        generator: random generator, or ``None`` for the global one.
        example_input: passed to [`analyze`][manifolds.analyze] (for the shapes).
        buffers: (``kind="node"`` only) also scale the channels feeding each BatchNorm with its running mean
            (by ``c``) and variance (by ``c^2``): the function is preserved up to BatchNorm's ``eps``.

    Returns:
        The copy. Every rescaled tensor stays in its dtype's normal range (each entry the exact rescaling up to
            one rounding), and without ``buffers`` its outputs on a random input of the traced shape match the
            model's within ``sqrt(eps)`` of the dtype, relative to the largest output (``1.5e-8`` in float64,
            ``3.5e-4`` in float32); a draw that does not is refused, never returned.

    Raises:
        ValueError: unknown ``kind``, ``buffers=True`` with ``kind="layer"``, ``scale`` not a finite number
            ``>= 0``, ``generator`` no ``torch.Generator``, or a draw whose rescaled tensors or outputs leave
            the dtype's range (a ``scale`` too large for it).
        UnsupportedModelError: the rescaling group of ``model`` is unknown (fx cannot trace it).
    """
    if kind not in ("node", "layer", "group"):
        raise ValueError(f"unknown rescaling kind {kind!r}; use 'node', 'layer' or 'group'")
    if not isinstance(buffers, bool):
        raise ValueError(f"buffers must be True or False, got {buffers!r}")
    if example_input is not None and not isinstance(example_input, Tensor):
        raise ValueError(f"example_input must be a tensor (one input batch), got {type(example_input).__name__}")
    scale = check_scale(scale)
    check_generator(generator)
    if buffers:
        if kind != "node":
            raise ValueError("buffers=True rescales BatchNorm statistics node-wise; use kind='node'")
        group = buffer_group(model, example_input)
        return _acted_copy(model, group, group.random_log_scales(scale, generator))
    structure = analyze(model, example_input)
    structure.require_group(f"a function-preserving {kind}-wise rescaling")
    if kind == "group":
        symmetry = structure.symmetry
        twin = _acted_copy(model, symmetry, symmetry.random_element(scale, generator))
    else:
        group = structure.group if kind == "node" else structure.layer_group
        twin = _acted_copy(model, group, group.random_log_scales(scale, generator))
    floating = next((p for p in model.parameters() if p.is_floating_point()), None)
    if floating is not None and structure.traced is not None:
        limit = math.sqrt(torch.finfo(floating.dtype).eps)
        change = _output_change(model, twin, structure.traced, example_input)
        if change is not None and not change <= limit:
            raise ValueError(
                f"this draw of scale {scale:g} changes the outputs by {change:.1e} (relative, more than {limit:.1e} "
                f"in {str(floating.dtype).removeprefix('torch.')}): its activations leave the dtype's range or lose "
                "its precision (draw a smaller scale), or, if a small scale changes them too, the group found is not "
                "a symmetry of this model (please report it)"
            )
    return twin
