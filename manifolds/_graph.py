"""One traced graph of a network, with the shape of every tensor in it.

[`trace_network`][manifolds.trace_network] reads a model once with `torch.fx` (modules and functional calls alike:
``F.relu``, ``torch.flatten``, ``x.view(x.size(0), -1)``, ``torch.cat``, ``+``) and records the shape of
every node from one forward pass on a two-sample input. Symmetry discovery and the chain view of the
layers both read this graph instead of inspecting the model themselves.

When fx cannot trace a forward (data-dependent control flow), an ``nn.Sequential`` is read as the chain of
its children; any other model has no graph (``TracedNetwork.graph is None``, with the reason).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, fx, nn

from manifolds._modules import eval_mode, hooked, input_check, kept_buffers

# Modules read as single nodes: their forward is known, so the tracer must not inline it.
_LEAF_TYPES: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LayerNorm,
    nn.GroupNorm,
)

# Spatial sizes tried, in order, when no example input is given and the first layer is a convolution.
_SPATIAL_GUESSES = tuple(dict.fromkeys((32, 28, 224, 64, 96, *range(1, 129))))


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if type(m) is nn.Identity and not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                                           or m._backward_pre_hooks):  # fmt: skip
            return False  # traced through (no node): a placeholder for an optional layer (timm's q_norm, ls1, norm)
        return isinstance(m, _LEAF_TYPES) or super().is_leaf_module(m, module_qualified_name)


@dataclass(frozen=True)
class TracedNetwork:
    """A model's fx graph with every data tensor's shape (``node.meta["shape"]``).

    Attributes:
        model: the traced model (never modified).
        graph: the graph, or ``None`` when fx cannot trace the model and it is no ``nn.Sequential``.
        failure: why the graph or its shapes are missing (one sentence), else ``None``.
        sequential: whether the graph was built from the children of an ``nn.Sequential`` because fx
            could not trace it.
    """

    model: nn.Module
    graph: fx.Graph | None
    failure: str | None = None
    sequential: bool = False

    @property
    def has_shapes(self) -> bool:
        """Whether every data node of ``graph`` carries its shape."""
        return self.graph is not None and self.failure is None


def sequential_calls(seq: nn.Sequential) -> list[tuple[str, nn.Module]]:
    """The modules a Sequential's forward calls, in order (nested Sequentials flattened), each under its first
    name: a child used twice (``s.b2 = s.a``) is called twice, as the same module."""
    first = {id(m): name for name, m in seq.named_modules()}
    calls: list[tuple[str, nn.Module]] = []

    def walk(module: nn.Sequential) -> None:
        for child in module._modules.values():  # named_children() would skip a repeated child
            if isinstance(child, nn.Sequential):
                walk(child)
            elif child is not None:
                calls.append((first[id(child)], child))

    walk(seq)
    return calls


def _sequential_graph(seq: nn.Sequential) -> fx.Graph:
    """The chain ``x -> child_1 -> child_2 -> ...`` of a Sequential (see `sequential_calls`)."""
    graph = fx.Graph()
    node = graph.placeholder("x")
    for name, _ in sequential_calls(seq):
        node = graph.call_module(name, (node,))
    graph.output(node)
    return graph


def _runs_whole(model: nn.Module, example_input: Tensor, used: Tensor) -> bool:
    """Whether the forward runs on the whole ``example_input`` where the trace used fewer samples of it (``used``)."""
    if used.shape[:1] == example_input.shape[:1] or used.is_meta:  # meta tensors run any forward
        return False
    try:
        with eval_mode(model), torch.no_grad():
            model(input_like(model, example_input, None))
    except Exception:  # the forward fails either way: the sample count is not the reason
        return False
    return True


def _unread_behaviour(model: nn.Module, graph: fx.Graph) -> str | None:
    """What the graph cannot show of ``model``'s calls, else ``None``: fx traces the root's class ``forward`` (neither
    the root's forward hooks nor a ``forward`` set on the instance), and the readers of the graph read a module called
    whole (a ``call_module`` node: ``nn.Linear``, ``nn.LayerNorm``...) by its class, so a ``forward`` set on such an
    instance (as accelerate's ``add_hook_to_module`` sets it) would be read as the class's."""
    hooks = torch.nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return ("forward hooks are registered for every module (torch.nn.modules.module.register_module_forward_hook), "
                "which the graph's readers do not see; remove them")  # fmt: skip
    if hooked(model):
        return (f"{type(model).__name__} has forward hooks on the model itself, which torch.fx does not trace; remove "
                "them or wrap the model in a module without hooks")  # fmt: skip
    called = {"": model} | {str(n.target): model.get_submodule(str(n.target)) for n in graph.nodes
                            if n.op == "call_module"}  # fmt: skip
    for name, module in called.items():
        own = vars(module).get("forward")
        if own is not None and not (
            getattr(own, "__func__", None) is type(module).forward and getattr(own, "__self__", None) is module
        ):  # `m.forward = m.forward` is none
            where = f"module '{name}'" if name else f"the model ({type(model).__name__})"
            return (
                f"{where} has its forward replaced on the instance (as accelerate's hooks replace it), which is "
                "read as its class's forward; remove the replacement (accelerate.hooks.remove_hook_from_module)"
            )
    return None


class _Run(fx.Interpreter):
    """``graph`` run on ``model`` itself (its modules called as the forward calls them, ``""`` a bare layer), recording
    every tensor's shape in ``node.meta["shape"]``, its dtype in ``node.meta["dtype"]`` and whether that is a floating
    one in ``node.meta["floating"]``
    where ``shapes``."""

    def __init__(self, model: nn.Module, graph: fx.Graph, shapes: bool = False):
        super().__init__(model, graph=graph)
        self.model, self.shapes = model, shapes

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if self.shapes and isinstance(out, Tensor):
            n.meta["shape"] = tuple(out.shape)
            n.meta["floating"] = out.is_floating_point()
            n.meta["dtype"] = out.dtype
        return out

    def call_module(self, target, args, kwargs):
        return self.model.get_submodule(str(target))(*args, **kwargs)


@contextmanager
def _swapped(model: nn.Module, values: Mapping[str, Tensor]) -> Iterator[None]:
    """``model``'s parameters named in ``values`` (by any of their names) hold those tensors inside the block, in every
    module holding them (a module reached under two names, a tensor tied between modules), and are put back after it.
    Written out, not `torch.func.functional_call`, whose restoring leaves a module registered twice holding the
    replacement."""
    by_id = {id(p): values[name] for name, p in model.named_parameters(remove_duplicate=False) if name in values}
    slots = []
    for module in model.modules():  # each module once
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) in by_id:
                slots.append((module, name, p))
                module._parameters[name] = by_id[id(p)]
    try:
        yield
    finally:
        for module, name, p in reversed(slots):
            module._parameters[name] = p


_UNFAITHFUL = (
    "the graph torch.fx traced from the forward of {name} computes something else than the forward itself (fx records "
    "an in-place update such as `x += y` out of place, so an alias of x read after it sees the old value, and keeps "
    "as a constant what the forward makes anew, such as a random generator); write the update out of place "
    "(`x = x + y`)"
)


def _seeded(x: Tensor):
    """A block in which the random generators (CPU and ``x``'s GPU) are those of before it (``fork_rng``)."""
    return torch.random.fork_rng(devices=[x.device.index or 0] if x.device.type == "cuda" else [])


def _record_shapes(model: nn.Module, graph: fx.Graph, x: Tensor) -> str | None:
    """Record every node's shape from one pass of ``graph`` on ``x``; returns why the graph does not compute what the
    model's own forward does on ``x`` (see `_same_outputs`), here or at moved parameters (`_moved_failure`), else
    ``None``. Both passes draw the same random numbers (a forward adding noise is compared as one function)."""
    with eval_mode(model):  # as the objectives evaluate
        with torch.no_grad(), _seeded(x):
            torch.manual_seed(0)
            traced = _Run(model, graph, shapes=True).run(x.clone())
            torch.manual_seed(0)
            eager = model(x.clone())
        if not _same_outputs(traced, eager):
            return _UNFAITHFUL.format(name=type(model).__name__)
        stopped = _gradient_failure(model, graph, x)
        if stopped is not None:
            return stopped
        with torch.no_grad():
            return _moved_failure(model, graph, x, _finite(eager))


def _gradient_failure(model: nn.Module, graph: fx.Graph, x: Tensor) -> str | None:
    """Why the graph's derivatives are not the forward's, else ``None``: the gradients of one fixed random combination
    of the outputs with respect to the trainable parameters, through the forward and through the graph. fx does not
    record ``torch.no_grad()`` (nor ``set_grad_enabled``) inside a forward: the graph differentiates what the forward
    holds constant, and products read from it would be those of another function than autograd's. Caller: eval
    mode."""
    params = [p for p in model.parameters() if p.requires_grad and p.is_floating_point() and not p.is_meta]
    if not params:
        return None
    gradients = []
    with _seeded(x), torch.enable_grad():
        for run in (model, _Run(model, graph).run):
            torch.manual_seed(0)
            leaves = [t for t in torch.utils._pytree.tree_leaves(run(x.clone()))
                      if isinstance(t, Tensor) and t.is_floating_point()]  # fmt: skip
            generator = torch.Generator(device=x.device).manual_seed(1)
            total = sum((t * torch.randn(t.shape, generator=generator, device=t.device, dtype=t.dtype)).sum()
                        for t in leaves if t.requires_grad)  # fmt: skip
            if not isinstance(total, Tensor):  # no output depends on a parameter
                return None
            try:
                grads = torch.autograd.grad(total, params, allow_unused=True)
            except RuntimeError as err:  # an in-place update of a tensor its backward needs: the graph has none
                return _UNDIFFERENTIABLE.format(name=type(model).__name__, error=str(err).splitlines()[0])
            gradients.append([None if g is None else g.detach() for g in grads])
    for eager, traced in zip(*gradients):
        if (eager is None) != (traced is None):
            return _STOPPED.format(name=type(model).__name__)
        if eager is not None and not _same_outputs(traced, eager):
            return _STOPPED.format(name=type(model).__name__)
    return None


_STOPPED = (
    "the graph torch.fx traced from the forward of {name} computes something else than the forward itself: other "
    "derivatives (fx records an in-place update such as `h *= w` out of place, so an alias of h read after it sees the "
    "old value, and does not record `torch.no_grad()` inside a forward); write updates out of place (`h = h * w`) and "
    "hold constants with `.detach()`, which the graph keeps"
)
_UNDIFFERENTIABLE = (
    "the graph torch.fx traced from the forward of {name} computes something else than the forward itself: autograd "
    "cannot differentiate the forward ({error}) and can the graph (fx records an in-place update such as `h *= w` out "
    "of place); write updates out of place (`h = h * w`)"
)


def _finite(outputs: object) -> bool:
    """Whether every floating-point tensor among ``outputs`` is finite."""
    leaves = torch.utils._pytree.tree_leaves(outputs)
    return all(bool(torch.isfinite(t).all()) for t in leaves if isinstance(t, Tensor) and t.is_floating_point())


# Elements of the non-constant parameters `_moved_failure` moves (a copy of that size is made; constant ones are moved
# as one value broadcast, no copy).
_MOVED_ELEMENTS = 1 << 20


def _moved_failure(model: nn.Module, graph: fx.Graph, x: Tensor, finite: bool) -> str | None:
    """Why the graph does not compute the forward once floating-point parameters are moved, else ``None``. Moved: every
    one holding one value throughout (a norm's ones, a zero bias or zero-initialized layer; shifted as a whole, a
    broadcast value), then the others from the smallest up while they hold at most `_MOVED_ELEMENTS` elements together
    (vectors first: norms' scales and biases a few steps from their constants; random values added). fx records
    ``h *= w`` as ``h * w``: where ``h`` is a view of a tensor read elsewhere, the forward changes that tensor too and
    the graph does not, which no comparison shows while ``w`` is all ones, or within rounding of them. A move under
    which the forward fails, or is not finite where it is at the model's own values (``finite``), is tried again 50
    times smaller; where that fails too the graph cannot be checked and is refused. Caller: eval mode, no gradients,
    and `_kept_attributes` around it (a weight a hook computes from the moved parameters is put back)."""
    params = [(name, p) for name, p in model.named_parameters()
              if p.numel() and p.is_floating_point() and not p.is_meta]  # fmt: skip
    if not params:
        return None
    constant = {name for name, p in params if bool((p == p.flatten()[0]).all())}
    chosen, budget = [], _MOVED_ELEMENTS
    for name, p in sorted(params, key=lambda item: (item[0] not in constant, item[1].numel())):
        if name in constant or p.numel() <= budget:
            chosen.append((name, p))
            budget -= 0 if name in constant else p.numel()
    generators: dict[torch.device, torch.Generator] = {}
    noise = {}
    for name, p in chosen:  # drawn once, in the parameter's own dtype and device
        g = generators.setdefault(p.device, torch.Generator(device=p.device).manual_seed(0))
        shape = () if name in constant else p.shape
        noise[name] = torch.randn(shape, generator=g, device=p.device, dtype=p.dtype)
    for scale in (0.5, 0.01):
        moved = {}
        for name, p in chosen:
            size = scale * max(1.0, float(p.detach().abs().mean()))
            base = p.detach().flatten()[0] if name in constant else p.detach()
            value = base + size * noise[name]
            moved[name] = value.expand(p.shape) if name in constant else value
        with _seeded(x), _swapped(model, moved):  # what hooks compute from them: put back by `trace_network`
            torch.manual_seed(0)
            try:
                eager = model(x.clone())
            except Exception:  # the forward refuses these values (a check on them): a smaller move
                continue
            if finite and not _finite(eager):
                continue  # NaN compares equal to NaN: no comparison
            torch.manual_seed(0)
            try:
                traced = _Run(model, graph).run(x.clone())
            except Exception:  # the forward runs and its graph does not: not the same computation
                return _UNFAITHFUL.format(name=type(model).__name__)
        return None if _same_outputs(traced, eager) else _UNFAITHFUL.format(name=type(model).__name__)
    return (f"the forward of {type(model).__name__} fails or is not finite once its parameters are moved from their "
            "values, so its traced graph cannot be checked against it")  # fmt: skip


@contextmanager
def _kept_attributes(model: nn.Module) -> Iterator[None]:
    """Every module's plain tensor attributes (a weight a forward pre-hook computes from other parameters, as the old
    ``weight_norm`` and ``spectral_norm`` do) are the same objects after the block as before it."""
    kept = [(m, {k: v for k, v in vars(m).items() if isinstance(v, Tensor)}) for m in model.modules()]
    try:
        yield
    finally:
        for m, attributes in kept:
            m.__dict__.update(attributes)


def _plain(value: object) -> object:
    """``value`` with every mapping as a plain ``dict`` and every list or tuple as a ``list`` (fx returns its
    ``immutable_list``/``immutable_dict`` for a forward's list, dict, ``OrderedDict`` or HuggingFace ``ModelOutput``):
    the same leaves in the same places compare as the same outputs."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _same_outputs(traced: object, eager: object) -> bool:
    """Whether the graph's outputs equal the forward's, to rounding. fx records ``x += y`` as ``x + y``, so a
    forward that reads an alias of ``x`` after it (``r = x; x += y; r @ ...``) has a graph that computes something
    else; such a graph must not stand for the model."""
    detached = partial(torch.utils._pytree.tree_map, lambda t: t.detach() if isinstance(t, Tensor) else t)
    traced_leaves, traced_spec = torch.utils._pytree.tree_flatten(detached(_plain(traced)))
    eager_leaves, eager_spec = torch.utils._pytree.tree_flatten(detached(_plain(eager)))
    if traced_spec != eager_spec:
        return False
    for a, b in zip(traced_leaves, eager_leaves):
        if isinstance(a, Tensor) != isinstance(b, Tensor):
            return False
        if isinstance(a, Tensor) and a.is_floating_point():
            if a.shape != b.shape or a.dtype != b.dtype or not _close(a, b):
                return False
        elif isinstance(a, Tensor):
            if not torch.equal(a, b):
                return False
    return True


def _close(a: Tensor, b: Tensor) -> bool:
    """``torch.allclose(a, b, rtol=1e-5, atol=1e-5 * max|b|, equal_nan=True)`` (``atol=1e-5`` where ``b`` is empty or
    not finite). Finite tensors take one pass of few temporaries, a tenth of allclose's time on the CPU (the gradients
    of a 100M-parameter model are compared once per trace); anything else, allclose itself."""
    if a.dtype != b.dtype:
        return torch.allclose(a, b)  # raises, as allclose does: the outputs' dtypes differ
    magnitude = b.abs()
    top = magnitude.max() if b.numel() else None
    if top is not None and bool(torch.isfinite(top)):  # max propagates nan and inf: b is finite
        slack = (a - b).abs_().sub_(magnitude.mul_(1e-5)).max()  # nan or inf where a is not finite
        if bool(slack <= 1e-5 * top):
            return True
    scale = float(top) if top is not None and bool(torch.isfinite(top)) else 1.0
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5 * scale, equal_nan=True)


def _first_layer(model: nn.Module, graph: fx.Graph) -> nn.Module | None:
    for node in graph.nodes:
        if node.op == "call_module":
            module = model.get_submodule(str(node.target))
            if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
                return module
    return None


def _guesses(model: nn.Module, graph: fx.Graph) -> list[tuple[int, ...]]:
    first = _first_layer(model, graph)
    if isinstance(first, nn.Linear):
        return [(2, first.in_features)]
    if isinstance(first, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        dims = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}[type(first)]
        return [(2, first.in_channels, *([s] * dims)) for s in _SPATIAL_GUESSES]
    return []


def input_like(model: nn.Module, example: Tensor, samples: int | None = 2) -> Tensor:
    """``samples`` samples of ``example`` (two, for shape passes; ``None``: all) on the model's device, floating inputs
    in its dtype."""
    x = example if samples is None else example[:samples]
    floating = next((p for p in model.parameters() if p.is_floating_point()), None)
    if floating is not None:
        x = x.to(floating.device, floating.dtype if x.is_floating_point() else None)
    return x


def trace_network(model: nn.Module, example_input: Tensor | None = None) -> TracedNetwork:
    """Trace ``model`` once and record the shape of every tensor on a forward pass (eval mode, no gradients).

    Args:
        model: the network (not modified: its modes, and buffers a forward updates in place, are restored).
        example_input: one input batch (the first two samples are used). Without it, an input is guessed
            from the first Linear or convolution (its input features, or square spatial sizes tried in turn
            for a convolution).

    Returns:
        The `TracedNetwork`; ``failure`` says why when the model cannot be traced (``graph is None``)
            or the shapes are unknown (no input shape fits, or the forward fails on ``example_input``).

    Raises:
        ValueError: the model's own check refuses the input (`manifolds._modules.input_check`: the toolkit's
            language models and encoders name what does not fit, an id outside the vocabulary, a sequence longer
            than the positions; its vision transformers an image of another size).
    """
    check = input_check(model)
    if example_input is not None and check is not None:  # a model saying which inputs it takes: its sentence first
        check(example_input)
    # fx's tracing, the shape pass and the forward it is checked against all run the forward: one that updates
    # its buffers in place (a step counter, say) would leave them moved, so they are put back
    device = next((t.device for t in model.parameters() if t.device.type == "cuda"), torch.device("cpu"))
    # the random generators as they were (a forward drawing numbers, a bare first pass)
    with kept_buffers(model), _seeded(torch.empty(0, device=device)), _kept_attributes(model):
        return _trace(model, example_input)


def _defaults(model: nn.Module) -> dict[str, object] | None:
    """The forward's arguments after the input that have defaults (timm's ``attn_mask=None, is_causal=False``), at
    those defaults: the toolkit calls ``model(x)``, so the graph is traced for that call; as placeholders they would
    stand for values no pass gives (and ``attn_mask is not None`` would be true of one while tracing)."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read: traced as it is
        return None
    defaults = {p.name: p.default for p in parameters[1:]
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is not p.empty}  # fmt: skip
    return defaults or None


def _traced_at_defaults(model: nn.Module) -> fx.Graph:
    """fx's graph of ``model(x)``: the other arguments at their defaults where fx takes them so (`_defaults`), else as
    placeholders (a default fx cannot hold as a constant)."""
    defaults = _defaults(model)
    if defaults:
        try:
            return _without_specialized(_Tracer().trace(model, concrete_args=defaults))
        except Exception:  # tracing runs arbitrary user code: without the defaults, it may still trace
            pass
    return _Tracer().trace(model)


def _without_specialized(graph: fx.Graph) -> fx.Graph:
    """``graph`` without the placeholders of the arguments traced at their defaults (`_defaults`) and the checks fx
    adds on them (``_assert_is_none``, ``_assert``): nothing else reads them, and the passes give the input alone."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"][1:]
    for placeholder in placeholders:
        dependents, frontier = {placeholder}, [placeholder]
        while frontier:
            for user in frontier.pop().users:
                if user not in dependents:
                    dependents.add(user)
                    frontier.append(user)
        if any(n.op == "output" or not set(n.users) <= dependents for n in dependents):
            continue  # read by the computation: kept (a pass without it fails, as the forward would)
        for node in reversed(list(graph.nodes)):  # users before what they read
            if node in dependents:
                graph.erase_node(node)
    return graph


def _trace(model: nn.Module, example_input: Tensor | None) -> TracedNetwork:
    """`trace_network` itself, the buffers left to the caller."""
    try:
        graph = _traced_at_defaults(model)
        sequential = False
    except Exception as err:  # tracing runs arbitrary user code; any failure means "no fx graph"
        if not isinstance(model, nn.Sequential):
            return TracedNetwork(
                model,
                None,
                f"torch.fx cannot trace the forward of {type(model).__name__} ({type(err).__name__}: {err})",
            )
        graph, sequential = _sequential_graph(model), True
    if isinstance(model, _LEAF_TYPES):  # a bare layer is traced as its own single call
        graph = fx.Graph()
        graph.output(graph.call_module("", (graph.placeholder("x"),)))
    unread = _unread_behaviour(model, graph)
    if unread is not None:
        return TracedNetwork(model, None, unread)
    candidates = [input_like(model, example_input)] if example_input is not None else []
    if example_input is None:
        param = next(model.parameters(), None)
        dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
        device = param.device if param is not None else None
        candidates = [torch.zeros(shape, dtype=dtype, device=device) for shape in _guesses(model, graph)]
    error: Exception | None = None
    for x in candidates:
        try:
            unfaithful = _record_shapes(model, graph, x)
        except Exception as err:  # a wrong guess of the input shape; try the next one
            error = err
            continue
        if unfaithful is not None:
            for node in graph.nodes:
                node.meta.pop("shape", None)
            return TracedNetwork(model, None, unfaithful)
        return TracedNetwork(model, graph, None, sequential)
    for node in graph.nodes:  # no partial shapes from a failed pass
        node.meta.pop("shape", None)
    if example_input is not None and error is not None:
        failure = f"the forward of {type(model).__name__} fails on the example input ({type(error).__name__}: {error})"
        if _runs_whole(model, example_input, candidates[0]):
            failure = (f"the forward of {type(model).__name__} fails on the first two samples of the example input but "
                       f"not on all {len(example_input)}: every model must take any number of samples "
                       f"({type(error).__name__}: {error})")  # fmt: skip
    else:
        failure = f"the input shape of {type(model).__name__} is unknown; pass example_input=<one input batch>"
    return TracedNetwork(model, graph, failure, sequential)


# ------------------------------------------------------------------------------------------------
# views of the graph for the fast product and grid paths

_RELU_FUNCTIONS = {"relu", "relu_"}

# Calls whose result describes a tensor (its shape) rather than carrying its values.
_METADATA_METHODS = {"size", "dim", "numel"}
_METADATA_ATTRIBUTES = {"shape", "ndim", "dtype", "device"}


_LIBRARIES = {"torch", "operator", "_operator", "builtins", "math"}


def target_name(node: fx.Node) -> str:
    """The name of what a graph node calls: a method's name, or a function's without leading underscores; a function
    from outside torch and Python's own modules (e.g. one the user wrapped with ``torch.fx.wrap``) keeps its module
    as a prefix (``mymodule.relu``), so no rule meant for torch's function of the same name reads it."""
    if node.op == "call_method":
        return str(node.target)
    name = getattr(node.target, "__name__", str(node.target)).lstrip("_")
    module = getattr(node.target, "__module__", None)
    if node.op == "call_function" and module and module.split(".")[0] not in _LIBRARIES:
        return f"{module}.{name}"
    return name


def linear_arguments(node: fx.Node) -> tuple[object, object, object] | None:
    """The input, weight and bias (``None`` where there is none) of an ``F.linear`` call, given by position or by name
    (timm's BEiT and EVA call ``F.linear(input=x, weight=W, bias=b)``); ``None`` for other arguments."""
    names = ("input", "weight", "bias")
    if len(node.args) > 3 or set(node.kwargs) - set(names[len(node.args) :]):
        return None
    given = dict(zip(names, node.args)) | dict(node.kwargs)
    if "input" not in given or "weight" not in given:
        return None
    return given["input"], given["weight"], given.get("bias")


def reads_metadata_only(user: fx.Node, node: fx.Node) -> bool:
    """Whether ``user`` reads only the shape, dtype or device of ``node``: a metadata read (`is_metadata`), or the
    tensor whose dtype ``x.type_as(node)`` takes (timm's rotary attention casts the rotated query to the value's)."""
    if is_metadata(user):
        return True
    return (user.op == "call_method" and user.target == "type_as" and len(user.args) == 2 and not user.kwargs
            and user.args[1] is node and user.args[0] is not node)  # fmt: skip


def floating_cast(node: fx.Node) -> fx.Node | None:
    """The tensor ``node`` casts to a floating dtype, else ``None``: ``x.type_as(y)`` (``y`` a tensor, read for its
    dtype only), or ``x.to(dtype)`` / ``x.to(dtype=...)`` with the dtype given or read off a tensor (``x.to(q.dtype)``),
    the output recorded floating (`_Run`). Read as the identity it is in exact arithmetic (what holds through it holds
    to the rounding of the narrower dtype). A cast to integers or booleans is not one: it rounds to whole numbers."""
    if node.op != "call_method" or node.meta.get("floating") is not True or not node.args:
        return None
    source = node.args[0]
    if not isinstance(source, fx.Node):
        return None
    if node.target == "type_as":
        return source if len(node.args) == 2 and not node.kwargs and isinstance(node.args[1], fx.Node) else None
    if node.target != "to":
        return None
    given = [*node.args[1:], *node.kwargs.values()]
    if len(given) != 1 or set(node.kwargs) - {"dtype"}:
        return None
    dtype = given[0]
    if isinstance(dtype, torch.dtype):
        return source if dtype.is_floating_point else None
    read_off = isinstance(dtype, fx.Node) and dtype.op == "call_function" and dtype.target is getattr \
        and dtype.args[1:] == ("dtype",)  # fmt: skip (floating: the node's own output is, as recorded)
    return source if read_off else None


def is_metadata(node: fx.Node) -> bool:
    """Whether the node reads a tensor's shape, dtype or device (``x.size(0)``, ``x.shape``) and not its values."""
    if node.op == "call_method":
        return node.target in _METADATA_METHODS
    return (
        node.op == "call_function"
        and node.target is getattr
        and len(node.args) > 1
        and node.args[1] in _METADATA_ATTRIBUTES
    )


def _as_module(node: fx.Node, model: nn.Module) -> tuple[str, nn.Module] | None:
    """A chain step as ``(name, module)``: a module call, or a functional ReLU / flatten as its module."""
    if node.op == "call_module" and len(node.args) == 1 and not node.kwargs:
        return str(node.target), model.get_submodule(str(node.target))
    name = target_name(node)
    if node.op in ("call_function", "call_method") and name in _RELU_FUNCTIONS and len(node.args) == 1:
        return "", nn.ReLU()
    # flatten(x, 1) / x.flatten(1) only: without a start dimension the batch axis is flattened too
    if name == "flatten" and node.op in ("call_function", "call_method") and not node.kwargs and node.args[1:] == (1,):
        return "", nn.Flatten()
    return None


def module_chain(graph: fx.Graph, model: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """The graph as a chain ``input -> step_1 -> ... -> output``, each step one module (functional ReLU and
    ``flatten(x, 1)`` as their modules, with the name ``""``), or ``None`` when it branches or calls anything
    else.
    """
    steps: list[tuple[str, nn.Module]] = []
    current: fx.Node | None = None
    for node in graph.nodes:
        if node.op == "placeholder":
            if current is not None:
                return None
            current = node
            continue
        if node.op == "output":
            return steps if node.args[0] is current and steps else None
        if is_metadata(node) or current is None or node.args[:1] != (current,) or len(current.users) != 1:
            return None
        step = _as_module(node, model)
        if step is None:
            return None
        steps.append(step)
        current = node
    return None


@dataclass(frozen=True)
class FirstLayerSplit:
    """A model cut at its first parameterized module: ``model(x) = rest(act(layer(prefix(x))))``.

    Attributes:
        prefix: the parameter-free operations before the layer (a ``GraphModule``; the identity if none).
        name: the layer's qualified name (its parameters are ``name.weight``, ``name.bias``).
        layer: the layer module.
        relu_first: whether ``act`` is a ReLU that is the layer's only consumer (else the identity).
        rest: everything after (a ``GraphModule`` keeping the model's parameter names).
        chain: ``rest`` as ``(name, module)`` steps when it is a plain chain (see `module_chain`).
    """

    prefix: nn.Module
    name: str
    layer: nn.Module
    relu_first: bool
    rest: nn.Module
    chain: tuple[tuple[str, nn.Module], ...] | None

    def layer_among(self, names) -> bool:
        """Whether every parameter of the layer is among ``names`` (the parameters that are differentiated or
        moved): the paths that treat the first layer apart need all of them."""
        return all(f"{self.name}.{p}" in names for p, _ in self.layer.named_parameters())


def _reused(graph: fx.Graph, model: nn.Module, first: fx.Node, tensors: set[int]) -> bool:
    """Whether a node other than ``first`` uses any of ``tensors`` (by identity): the layer called again
    (``s.b2 = s.a``), a module sharing one of its tensors (tied weights), or the forward reading one directly."""
    for node in graph.nodes:
        if node is first:
            continue
        if node.op == "call_module":
            module = model.get_submodule(str(node.target))
            if any(id(t) in tensors for t in (*module.parameters(), *module.buffers())):
                return True
        elif node.op == "get_attr":
            owner, _, attr = str(node.target).rpartition(".")
            if id(getattr(model.get_submodule(owner), attr, None)) in tensors:
                return True
    return False


def split_first_layer(
    graph: fx.Graph, model: nn.Module, kinds: tuple[type[nn.Module], ...], fold_relu: bool = False
) -> FirstLayerSplit | None:
    """Cut ``model`` after its first parameterized module, or ``None`` when it does not have that shape.

    The first node using parameters or buffers must be a call of a module of one of ``kinds`` on a tensor
    computed from the input by parameter-free operations only, and nothing after it may use the input or
    those operations again (no connection skips the layer), nor the layer's tensors (a second call of the
    layer, a weight tied to another module's).

    Args:
        graph: the model's fx graph ([`TracedNetwork.graph`][manifolds.TracedNetwork]).
        model: the model.
        kinds: the module types the first layer may have.
        fold_relu: also cut after a ReLU that is the layer's only consumer (``relu_first``).
    """
    nodes = list(graph.nodes)
    before: list[fx.Node] = []
    first = None
    for node in nodes:
        if node.op == "get_attr":
            return None
        if node.op == "call_module":
            module = model.get_submodule(str(node.target))
            if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
                first = node
                break
        if node.op == "output":
            return None
        before.append(node)
    if first is None or len(first.args) != 1 or first.kwargs or not isinstance(first.args[0], fx.Node):
        return None
    layer = model.get_submodule(str(first.target))
    if type(layer) not in kinds or sum(n.op == "placeholder" for n in before) != 1:
        return None
    if _reused(graph, model, first, {id(t) for t in (*layer.parameters(), *layer.buffers())}):
        return None
    inside = set(before)
    if any(user not in inside and user is not first for node in before for user in node.users):
        return None
    cut, relu_first = first, False
    if fold_relu and len(first.users) == 1:
        (user,) = first.users
        step = _as_module(user, model) if user.args[:1] == (first,) else None
        if step is not None and type(step[1]) is nn.ReLU:
            cut, relu_first = user, True

    prefix_graph = fx.Graph()
    remap: dict[fx.Node, fx.Node] = {}
    for node in before:
        remap[node] = prefix_graph.node_copy(node, lambda n: remap[n])
    prefix_graph.output(remap[first.args[0]])

    rest_graph = fx.Graph()
    remap = {cut: rest_graph.placeholder("h")}
    started = False
    for node in nodes:
        if node is cut:
            started = True
            continue
        if started:
            if any(n not in remap for n in node.all_input_nodes):
                return None
            remap[node] = rest_graph.node_copy(node, lambda n: remap[n])
    chain = module_chain(rest_graph, model)
    return FirstLayerSplit(
        prefix=fx.GraphModule(model, prefix_graph),
        name=str(first.target),
        layer=layer,
        relu_first=relu_first,
        rest=fx.GraphModule(model, rest_graph),
        chain=tuple(chain) if chain is not None else None,
    )
