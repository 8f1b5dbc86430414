"""Exact Hessian-vector products of networks that branch and merge (residual, concatenating, with BatchNorm) by
the R-operator over their traced graph.

`sharpness.products._rop` writes Pearlmutter's R-operator out for chains; here the same passes walk the
model's traced ``torch.fx`` graph, a directed acyclic graph, in topological order (forward, tangent forward)
and in reverse (errors, tangent errors), errors of a tensor used several times summed over its users. Every
operation is, at the current point, either

- a table read at integer ids (``nn.Embedding``, ``F.embedding``; `_Embedding`), linear in its parameter, or
- a layer bilinear in (its input, its parameters): ``Linear`` and zero-padded ``Conv1d/2d/3d``
  ``z = A(h; W) + b``, and eval-mode ``BatchNorm1d/2d/3d`` ``z = gamma * xhat + beta`` with
  ``xhat = (h - mu) / sqrt(var + eps)`` per channel from the fixed running statistics (without ``affine``, a
  fixed per-channel affine map), or
- a fixed linear map ``P`` of its tensor inputs: ``ReLU``/``LeakyReLU`` (a mask or slope), ``MaxPool`` (a
  selection), average and adaptive average pooling, means and sums over non-batch axes, flatten/view/reshape/unflatten
  (also folding the samples' axis with others and back: Swin's windows in the batch axis), constant padding
  (``F.pad``, by amounts that may be computed from shapes) and ``torch.roll`` along axes other than the samples',
  ``torch.clamp`` by numbers (a slope of one between the bounds, bounds included, as torch's), identity,
  ``contiguous`` and dropout (eval mode), multiplication by a number, addition of a number, residual sums
  and differences, concatenation, axis permutations (``transpose``, ``permute``), basic indexing (integers,
  slices), the pieces of ``unbind``/``chunk``/``split`` (a fused projection cut into queries, keys and values),
  ``expand`` (a class token), ``repeat_interleave``/``repeat`` along axes other than the samples' (grouped-query
  key/value heads), multiplication by a number computed from shapes, ``masked_fill`` by a number
  with a mask that no parameter moves, casts between floating dtypes (tangents and errors cast too), rows picked by an
  integer tensor (a table read at an index buffer; errors added back over repeated picks). Its second derivative
  vanishes (almost everywhere), or
- a smooth operation with a second derivative (`sharpness.products._rop_smooth`): LayerNorm, ``F.normalize`` over the
  last axis (SwinV2's cosine attention), exact GELU, tanh,
  batch-first self-attention by ``nn.MultiheadAttention``, and a parameter used outside a module (a position
  table added to every sample); and the pieces of attention written by hand
  (`sharpness.products._rop_attention`): the product of two activations (``@``, ``matmul``, ``bmm``, or a
  two-operand ``einsum`` that is one matrix product per batch entry, read as permutes and a ``matmul``:
  `manifolds._einsum`), the
  softmax over any axis but the samples' (also in a dtype of its own, ``softmax(s, dim=-1, dtype=...)``), and
  ``F.scaled_dot_product_attention`` without dropout (a constant ``attn_mask`` allowed, or a floating one the
  parameters move: BEiT's learned relative position bias, a table read at an index buffer), so any composition of
  them (timm's, HuggingFace's or nanoGPT's attention) is covered;
  and the log-softmax over any axis but the samples' (a classifier's, read by ``NLLLoss``: a loss linear in its
  input, whose curvature all comes through the log-softmax).

Other calls are read only where no parameter moves their inputs (the data cut into patches, say); buffers, frozen
parameters (a frozen table among them) and the tensors fx computes from them while tracing are constants. A parameter
tied under several module paths (an output layer sharing the token table) is one parameter, under the name the
objective holds it by (`parameter_keys`): every layer reading it adds its part of the products there.

Each operation's tangent and adjoint are in `sharpness.products._rop_ops`. The errors of a tensor cut into pieces are
written into one buffer, piece by piece (`_Part`), not summed from zero-filled copies.

Tensors that depend on no parameter (the data, and whatever is computed from them alone) have no tangent, and
neither pass goes into them: first-order errors are formed only downstream of a layer whose input moves, and
the data's input gradient never. What the products share (layer inputs, the normalized inputs of BatchNorms
not merged into a layer, masks, pooling indices, errors, the loss's curvature) is one forward and one backward
pass per data chunk, kept across products when it fits in memory; a product is then the tangent passes alone:
about one gradient where the layer that sees the data dominates the work, about two where inner convolutions do
(each is applied six times, against a gradient's three).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from manifolds._einsum import as_matrix_products
from manifolds._graph import floating_cast, is_metadata, linear_arguments, target_name
from manifolds._same_forward import channel_layer_norm, norm_then_activation, read_as
from sharpness.products._rop import (
    _CONVS,
    ChunkState,
    _affine,
    _has_hooks,
    _Identity,
    _MaxPool,
    _piecewise_linear,
    _Reshape,
    _Slope,
    loss_state,
    parameter_keys,
)
from sharpness.products._rop_attention import _Affine, _Attend, _MatMul, _Softmax
from sharpness.products._rop_ops import _Embedding, _Layer, _Map, _Norm, _Part
from sharpness.products._rop_smooth import (
    POINTWISE_FUNCTIONS,
    _Attention,
    _LayerNorm,
    _LogSoftmax,
    _Normalize,
    _Param,
    _Pointwise,
    _Product,
    _Smooth,
)

_LAYERS = (_Layer, _LayerNorm, _Attention, _Embedding)  # operations with parameters and one tensor input
_MAPS = (_Map, _Smooth)  # parameter-free operations of their tensor inputs
_SECOND = (_LayerNorm, _Attention)  # layers whose backward reads inner tangents of their forward

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_AVG_POOLS = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
              nn.AdaptiveAvgPool3d)  # fmt: skip
_AVG_POOL_FUNCTIONS = {"avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
                       "adaptive_avg_pool3d"}  # fmt: skip
# elementwise modules with a second derivative (`_Pointwise`), by the kind they are
_POINTWISE_MODULES = {nn.Tanh: "tanh", nn.Sigmoid: "sigmoid", nn.SiLU: "silu", nn.Hardsigmoid: "hardsigmoid",
                      nn.Hardswish: "hardswish"}  # fmt: skip
_INPLACE_OPTION = {"silu", "hardsigmoid", "hardswish"}  # functions with an ``inplace`` argument
_IDENTITY_FUNCTIONS = {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "contiguous"}
_VIEWS = {"view", "reshape", "flatten", "unflatten", "unsqueeze"}
_ADD = {operator.add, operator.iadd, torch.add, "add", "add_", "iadd"}
_SUB = {operator.sub, operator.isub, torch.sub, "sub", "sub_", "isub"}


# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Step:
    """One node of the graph: ``op`` (``None`` for the input, a `_Layer`, a `_Map`, or a callable
    computing a non-tensor value such as ``x.size(0)``), the slots of its tensor inputs, and whether its value
    depends on the parameters (``moving``)."""

    op: object
    inputs: tuple[int, ...]
    moving: bool
    meta: tuple[int, ...] = ()  # slots of the non-tensor values its call reads


@dataclass(frozen=True)
class RopGraph:
    """A network read off its traced graph as `_Step` s in topological order (step 0 the input), its
    output at step ``output``, with, per step, whether its first-order error (``errors``) is needed and which
    steps' values the products keep (``kept``)."""

    steps: tuple[_Step, ...]
    output: int
    errors: frozenset[int]  # steps whose first-order error is formed: downstream of a layer whose input moves
    users: tuple[tuple[int, ...], ...]

    def _forward(self, params: Mapping[str, Tensor], x: Tensor) -> tuple[Tensor, list]:
        """The output and every step's saved map or layer input (``None`` where nothing is kept).

        Raises:
            ValueError: a view folding the samples' axis gives it another size than the traced pass's per sample
                (its shape is no fold of the batch, `_folding`).
        """
        steps = self.steps
        values: list = [None] * len(steps)
        left = [len(u) for u in self.users]
        saved: list = [None] * len(steps)
        values[0] = x
        for i in range(1, len(steps)):
            step = steps[i]
            xs = [values[j] for j in step.inputs]
            op = step.op
            if isinstance(op, _LAYERS):
                values[i], saved[i] = op.forward(xs[0], params)
            elif isinstance(op, _Param):
                values[i] = params[op.name]
            elif isinstance(op, _MAPS):
                values[i], s = op.forward(xs, [values[j] for j in step.meta])
                if step.moving:
                    saved[i] = s
                if getattr(op, "folds", None) is not None \
                        and (xs[0].shape[0], values[i].shape[0]) != tuple(f * len(x) for f in op.folds):  # fmt: skip
                    raise ValueError(f"a view of step {i} does not fold the samples' axis as the traced pass did")
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
        grads: dict[int, object] = {self.output: out_grad}
        for i in range(len(self.steps) - 1, 0, -1):
            if i not in self.errors or i not in grads:
                continue
            g = _dense(grads.pop(i))
            step = self.steps[i]
            need = [j in self.errors for j in step.inputs]
            if isinstance(step.op, _LAYERS):
                kept, error = step.op.errors(g, saved[i], params, need[0])
                if i in self._kept_errors:
                    deltas[i] = kept
                errs = [error]
            elif isinstance(step.op, _Smooth):
                deltas[i], errs = step.op.errors(g, saved[i], need)
            else:
                errs = step.op.adjoint(g, saved[i], need)
            _accumulate(grads, step.inputs, errs, need)
        return deltas

    def first_linear(self, states: list[ChunkState]) -> tuple[str, list[Tensor]] | None:
        """The weight name of the first ``Linear`` layer of the data (its input depends on no parameter; alone or
        fused with a BatchNorm) and its inputs per chunk, or ``None`` where there is none."""
        i = self._first_linear
        if i is None:
            return None
        fused = self.steps[i].op.norm is not None  # its saved state is (input, normalized output)
        return self.steps[i].op.affine.weight, [s.saved[i][0] if fused else s.saved[i] for s in states]

    @cached_property
    def _kept_errors(self) -> frozenset[int]:
        """The layers whose first-order errors the products read (read off the graph once)."""
        return frozenset(i for i in self.errors if isinstance(self.steps[i].op, _LAYERS)
                         and self.steps[i].op.needs_error(self.steps[self.steps[i].inputs[0]].moving))  # fmt: skip

    @cached_property
    def _first_linear(self) -> int | None:
        """The step of `first_linear`'s layer (found once)."""
        layers = [(i, s.op) for i, s in enumerate(self.steps) if isinstance(s.op, _Layer)]
        for i, op in layers:
            if op.affine is not None and op.affine.dims == 0 and not op.affine.tokens \
                    and not self.steps[self.steps[i].inputs[0]].moving:  # fmt: skip
                # the weight read by any other step too (another layer, or a parameter read directly: a tied
                # `x @ self.inp.weight`): its products need the whole weight, not its part in the data's span
                shared = any(j != i and op.affine.weight in getattr(s.op, "names", ())
                             for j, s in enumerate(self.steps))  # fmt: skip
                return None if shared else i
        return None

    def add_products(self, params: Mapping[str, Tensor], state: ChunkState, v: Mapping[str, Tensor],
                     into: Mapping[str, Tensor], first_layer: tuple[Tensor, Tensor] | None = None) -> None:  # fmt: skip
        """Add the chunk's ``H v`` to ``into`` (``{name: tensor}`` like ``params``), in place.

        ``first_layer = (first_dot, first_errors)``: as for chains (`sharpness.products._rop.add_products`),
        for the layer `first_linear` names: the image ``X V^T`` of its weight's tangent (alone, the layer adds
        its bias tangent in place) and where the tangent errors of that image are written (see
        `_Layer.span_backward`); its weight is neither read in ``v`` nor written in ``into``.
        """
        steps, saved, deltas = self.steps, state.saved, state.deltas
        first = self._first_linear if first_layer is not None else None
        dots: list = [None] * len(steps)
        inner: dict[int, object] = {}  # the inner tangents of LayerNorms, softmaxes and attentions, for their backward
        for i in range(1, len(steps)):
            step = steps[i]
            if not step.moving:
                continue
            op = step.op
            xdots = [dots[j] for j in step.inputs]
            if i == first:
                dots[i] = op.span_tangent(saved[i], params, v, first_layer[0])
            elif isinstance(op, _SECOND):
                dots[i], inner[i] = op.tangent(saved[i], xdots[0], params, v)
            elif isinstance(op, _LAYERS):
                dots[i] = op.tangent(saved[i], xdots[0], params, v)
            elif isinstance(op, _Param):
                dots[i] = v[op.name]
            elif isinstance(op, _Smooth) and op.inner:
                dots[i], inner[i] = op.tangent(xdots, saved[i])
            else:
                dots[i] = op.tangent(xdots, saved[i])
        grads: dict[int, object] = {self.output: state.loss_hvp(dots[self.output])}
        for i in range(len(steps) - 1, 0, -1):
            step = steps[i]
            if not step.moving or i not in grads:
                continue
            g_dot = _dense(grads.pop(i))
            need = [steps[j].moving for j in step.inputs]
            op = step.op
            if i == first:
                op.span_backward(g_dot, deltas.get(i), saved[i], params, v, into, *first_layer)
                errs = [None]
            elif isinstance(op, _SECOND):
                errs = [op.backward(g_dot, deltas.get(i), dots[step.inputs[0]], saved[i], params, v, into, need[0],
                                    inner.pop(i))]  # fmt: skip
            elif isinstance(op, _LAYERS):
                errs = [op.backward(g_dot, deltas.get(i), dots[step.inputs[0]], saved[i], params, v, into, need[0])]
            elif isinstance(op, _Param):
                into[op.name].add_(g_dot.sum_to_size(into[op.name].shape))
                errs = []
            elif isinstance(op, _Smooth):
                errs = op.backward(g_dot, deltas[i], [dots[j] for j in step.inputs], saved[i], need, inner.pop(i, None))
            else:
                errs = op.adjoint(g_dot, saved[i], need)
            _accumulate(grads, step.inputs, errs, need)

    def state_sizes(self, params: Mapping[str, Tensor], x: Tensor) -> tuple[int, int]:
        """Bytes per sample of the cached state and of its largest tensor: the saved layer inputs and maps, each
        tensor counted once, the first-order errors and the outputs' curvature, measured by one forward and
        backward pass of ``x[:1]``. Not counted: what a chunk keeps whatever its size, at most one parameter
        vector (the errors' weight adjoints of merged BatchNorm layers)."""
        out, saved = self._forward(params, x[:1])
        errors = self._errors(params, saved, torch.ones_like(out))
        # a merged BatchNorm's errors hold parameter-sized sums besides the error itself; the others, activations
        deltas = [d[0] if isinstance(self.steps[i].op, _Layer) and isinstance(d, tuple) else d
                  for i, d in errors.items()]  # fmt: skip
        tensors = {id(t): t for s in [*saved, *deltas] for t in (s if isinstance(s, tuple) else (s,))
                   if isinstance(t, Tensor)}  # fmt: skip
        sizes = [t.numel() * t.element_size() for t in tensors.values()]
        return out.numel() * out.element_size() + sum(sizes), max(sizes, default=0)


def _accumulate(grads: dict[int, object], inputs: tuple[int, ...], errs: list, need: list[bool]) -> None:
    """Add each needed input's error to ``grads`` (a tensor used twice gets the sum; a tensor an operation gave is
    never written in place). An error may be a `_Part` (zero outside a piece): the parts of one tensor are written
    into one buffer of its own (`_Owned`), read by `_dense`."""
    for j, e, n in zip(inputs, errs, need):
        if n and e is not None:
            grads[j] = e if j not in grads else _sum(grads[j], e)


@dataclass(frozen=True)
class _Owned:
    """A sum of errors in a buffer the graph allocated, so written in place."""

    tensor: Tensor


def _sum(old: object, e: Tensor | _Part) -> object:
    if isinstance(old, Tensor) and isinstance(e, Tensor):
        return old + e
    if isinstance(old, _Owned):
        total = old.tensor
    else:
        total = old.dense() if isinstance(old, _Part) else old.clone()
    if isinstance(e, _Part):
        e.add_to(total)
    else:
        total.add_(e)
    return _Owned(total)


def _dense(g: object) -> Tensor:
    """An accumulated error as a tensor."""
    return g.tensor if isinstance(g, _Owned) else g.dense() if isinstance(g, _Part) else g


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


# Python's augmented assignments (``x += y``), which fx records as calls of these
_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor,
                      operator.ilshift, operator.irshift}  # fmt: skip


def _mutates(node: fx.Node, model: nn.Module) -> bool:
    """Whether ``node`` writes into its first argument: ``x += y``, a method or function named with a trailing
    underscore (``x.mul_(2)``, ``torch.relu_``), a call with ``inplace=True``, or a module built with it."""
    if node.op == "call_module":
        return bool(getattr(model.get_submodule(str(node.target)), "inplace", False))
    if node.op not in ("call_function", "call_method"):
        return False
    if node.target in _INPLACE_OPERATORS or node.kwargs.get("inplace") is True:
        return True
    name = str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.startswith("_")


# Calls whose result may share its input's memory (views, pieces, and what returns its input itself)
_ALIASING = {"view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "transpose", "permute", "squeeze",
             "unsqueeze", "expand", "expand_as", "contiguous", "getitem", "narrow", "select", "t", "swapaxes",
             "swapdims", "movedim", "unbind", "chunk", "split", "tensor_split", "detach", "as_strided", "diagonal",
             "dropout", "identity", "T", "mT"}  # fmt: skip
_ALIASING_MODULES = (nn.Flatten, nn.Unflatten, nn.Identity, nn.Dropout)


def _aliases(write: fx.Node, model: nn.Module) -> set[fx.Node]:
    """The nodes whose tensors may share the memory that the in-place call ``write`` writes into, other than ``write``
    and what is computed from it: up from its input through views (and earlier in-place calls, which return their
    input) to the tensor they all view, then down through every view of that tensor not taken through ``write``."""

    def aliasing(n: fx.Node) -> bool:
        if not n.args or not isinstance(n.args[0], fx.Node):
            return False
        if n.op == "call_module":
            return isinstance(model.get_submodule(str(n.target)), _ALIASING_MODULES) or _mutates(n, model)
        return n.op in ("call_function", "call_method") and (target_name(n) in _ALIASING or _mutates(n, model))

    base = write.args[0]
    while aliasing(base):
        base = base.args[0]
    found, todo = set(), [base]
    while todo:
        n = todo.pop()
        if n not in found:
            found.add(n)
            todo.extend(u for u in n.users if u is not write and aliasing(u) and u.args[0] is n)
    return found


def _read_after_mutation(nodes: list[fx.Node], model: nn.Module) -> bool:
    """Whether the memory an in-place call writes into is read again after it other than through the call's result:
    its first argument, or any tensor sharing its memory (``att.masked_fill_(m, -inf)`` followed by
    ``att.softmax(-1)``, an alias of ``x`` read after ``x += y``, ``h`` read after an in-place activation of
    ``h.view(...)``). The products read every call out of place, so such a reader would see the value before the
    write; a reader before it sees what the model sees."""
    position = {n: i for i, n in enumerate(nodes)}
    for node in nodes:
        if node.args and isinstance(node.args[0], fx.Node) and _mutates(node, model):
            if any(position[u] > position[node] for alias in _aliases(node, model) for u in alias.users
                   if u is not node and not is_metadata(u)):  # fmt: skip
                return True
    return False


def _single_user(node: fx.Node) -> bool:
    """An in-place call is read as its out-of-place twin only where nothing else reads its input."""
    return len(node.args[0].users) == 1 if isinstance(node.args[0], fx.Node) else False


def _module_op(node: fx.Node, module: nn.Module, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor],
               keys: Mapping[str, str]):  # fmt: skip
    """A module call as a `_Layer` or `_Map`, or ``None`` where it is not supported. ``keys``: `parameter_keys`."""
    name, kind, shape = str(node.target), node.meta.get(_READ_AS) or read_as(module), node.args[0].meta["shape"]
    if kind is nn.Linear or kind in _CONVS:
        affine = _affine(name, module, params, keys)
        if affine is not None and kind is nn.Linear and len(shape) != 2:
            affine = dataclasses.replace(affine, tokens=True) if len(shape) > 2 else None
        return None if affine is None else _Layer(affine=affine)
    if kind is nn.Embedding:
        weight = keys.get(f"{name}.weight", f"{name}.weight")
        return _embedding(weight, params, module.padding_idx, module.max_norm, module.scale_grad_by_freq,
                          module.sparse)  # fmt: skip
    if kind is nn.LayerNorm:
        return _layer_norm(name, module, params)
    if kind is nn.GELU:
        return _Pointwise("gelu" if module.approximate == "none" else "gelu_tanh")
    if kind in _POINTWISE_MODULES:
        return _Pointwise(_POINTWISE_MODULES[kind])
    if kind is nn.Softplus:
        return _Pointwise("softplus", (float(module.beta), float(module.threshold)))
    if kind is getattr(nn, "RMSNorm", None):
        return _layer_norm(name, module, params, rms=True)
    if kind in (nn.Softmax, nn.LogSoftmax):
        return _normalization("softmax" if kind is nn.Softmax else "log_softmax", module.dim, len(shape))
    if kind in _BATCH_NORMS:
        return _batch_norm(name, module, params, buffers, len(shape))
    if kind in _AVG_POOLS:
        return _Map("linear", module)
    piece = _piecewise_linear(module)  # what a chain supports, as graph nodes
    if isinstance(piece, _Slope):  # an in-place activation must not overwrite an input another node still reads
        return _Map("slope", piece) if not module.inplace or _single_user(node) else None
    if isinstance(piece, _MaxPool):
        return _Map("maxpool", piece)
    if isinstance(piece, _Reshape):
        return _Map("view", call=lambda args: module(args[0]))
    if isinstance(piece, _Identity):
        return _Map("scale")
    return None


def _embedding(weight: str, params: Mapping[str, Tensor], padding_idx: object, max_norm: object,
               scale_grad_by_freq: object, sparse: object) -> _Embedding | None:  # fmt: skip
    """A table read at ids, its weight trainable (among ``params``), or ``None`` where an option changes what
    autograd differentiates beyond a fixed padding row: ``max_norm`` rewrites the table in the forward,
    ``scale_grad_by_freq`` scales the gradient by the ids' counts in the batch (no function's gradient), and
    ``sparse`` gradients are autograd's."""
    if weight not in params or max_norm is not None or scale_grad_by_freq or sparse:
        return None
    if padding_idx is not None and not isinstance(padding_idx, int):
        return None
    return _Embedding(weight, padding_idx)


def _embedding_call(node: fx.Node, params: Mapping[str, Tensor], keys: Mapping[str, str]):
    """``F.embedding(ids, W)`` with ``W`` a trainable parameter (``get_attr``) as `_Embedding` and its tensor input
    (the ids), or ``None``."""
    options = dict(zip(("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse"),
                       node.args), **node.kwargs)  # fmt: skip
    ids, weight = options.pop("input", None), options.pop("weight", None)
    if not isinstance(ids, fx.Node) or not isinstance(weight, fx.Node) or weight.op != "get_attr":
        return None
    options.pop("norm_type", None)  # read only with max_norm
    if any(isinstance(o, fx.Node) for o in options.values()):
        return None
    op = _embedding(keys.get(str(weight.target), str(weight.target)), params, options.get("padding_idx"),
                    options.get("max_norm"), options.get("scale_grad_by_freq"), options.get("sparse"))  # fmt: skip
    return None if op is None else (op, [ids])


def _layer_norm(name: str, module: nn.Module, params: Mapping[str, Tensor], rms: bool = False) -> _LayerNorm | None:
    """LayerNorm (``rms``: RMSNorm) over the last axis, its affine parameters trainable (or absent)."""
    weight = f"{name}.weight" if module.weight is not None else None
    bias = f"{name}.bias" if getattr(module, "bias", None) is not None else None
    if len(module.normalized_shape) != 1 or any(n is not None and n not in params for n in (weight, bias)):
        return None
    return _LayerNorm(weight, bias, None if module.eps is None else float(module.eps), rms)


def _attention(name: str, node: fx.Node, module: nn.MultiheadAttention, params: Mapping[str, Tensor]):
    """``nn.MultiheadAttention`` called as self-attention (one input node as query, key and value; no masks), batch
    first, with packed projections, no added key/value biases or zero attention, every parameter trainable; else
    ``None``."""
    x = node.args[0] if node.args else None
    if len(node.args) != 3 or any(a is not x for a in node.args) or not isinstance(x, fx.Node):
        return None
    if set(node.kwargs) - {"need_weights"} or not module.batch_first or not module._qkv_same_embed_dim:
        return None
    if module.bias_k is not None or module.add_zero_attn or len(x.meta.get("shape", ())) != 3:
        return None
    names = (f"{name}.in_proj_weight", f"{name}.in_proj_bias" if module.in_proj_bias is not None else None,
             f"{name}.out_proj.weight", f"{name}.out_proj.bias" if module.out_proj.bias is not None else None)
    if any(n is not None and n not in params for n in names):
        return None
    return _Attention(*names, heads=module.num_heads)


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
    """A function or method call as a `_Map` and its tensor inputs, or ``None`` where not supported."""
    name = target_name(node)
    target = node.target if node.op == "call_function" else name
    args = node.args
    tensors = [a for a in node.all_input_nodes if a in shapes]
    first = args[0] if args and isinstance(args[0], fx.Node) and args[0] in shapes else None
    found = _attention_op(node, name, shapes)
    if found is not None:
        return found
    if name in ("relu", "relu_", "leaky_relu", "leaky_relu_") and first is not None and len(tensors) == 1:
        inplace = name.endswith("_") or bool(_argument(node, 2 if name.startswith("leaky") else 1, "inplace", False))
        if inplace and not _single_user(node):
            return None
        slope = float(_argument(node, 1, "negative_slope", 0.01)) if name.startswith("leaky") else 0.0
        return _Map("slope", _Slope(slope)), [first]
    if name in _IDENTITY_FUNCTIONS and first is not None and len(tensors) == 1:
        # contiguous is called, so a view after it sees the strides it sees in the model (its tangents reshape)
        return _Map("scale", call=_caller(node) if name == "contiguous" else None), [first]
    if first is not None and len(tensors) == 1 and len(args) == 1:
        approximate = node.kwargs.get("approximate", "none")
        if name == "gelu" and set(node.kwargs) <= {"approximate"} and approximate in ("none", "tanh"):
            return _Pointwise("gelu" if approximate == "none" else "gelu_tanh"), [first]
        if name in POINTWISE_FUNCTIONS and (not node.kwargs or (name in _INPLACE_OPTION
                                                                and node.kwargs == {"inplace": False})):  # fmt: skip
            return _Pointwise(POINTWISE_FUNCTIONS[name]), [first]
    if name == "softplus" and first is not None and len(tensors) == 1 and len(args) <= 3 \
            and set(node.kwargs) <= {"beta", "threshold"}:  # fmt: skip
        beta, threshold = _argument(node, 1, "beta", 1.0), _argument(node, 2, "threshold", 20.0)
        if _number(beta) and _number(threshold) and beta > 0:
            return _Pointwise("softplus", (float(beta), float(threshold))), [first]
    if target in (operator.pow, torch.pow, "pow") and first is not None and len(tensors) == 1 and len(args) == 2 \
            and not node.kwargs and _number(args[1]):  # fmt: skip
        return _Pointwise("power", float(args[1])), [first]
    if target in (operator.mul, torch.mul, "mul") and len(args) == 2 and not node.kwargs \
            and all(isinstance(a, fx.Node) and a in shapes for a in args):  # fmt: skip
        return _Product(), [args[0], args[1]]
    if node.op == "call_function" and node.target in _MAX_POOL_FUNCTIONS and first is not None and len(tensors) == 1:
        return _max_pool(node, first)
    if name in _AVG_POOL_FUNCTIONS | {"mean", "sum"} and first is not None and len(tensors) == 1:
        if any(isinstance(a, fx.Node) for a in (*args[1:], *node.kwargs.values())):
            return None
        if name in ("mean", "sum"):  # over axes other than the samples' (a sum's adjoint is read by autograd)
            dims = _argument(node, 1, "dim", None)
            dims = (dims,) if isinstance(dims, int) else dims
            if dims is None or any(d % len(shapes[first]) == 0 for d in dims) or node.kwargs.get("dtype"):
                return None
        rest, kwargs = args[1:], dict(node.kwargs)
        fn = getattr(F, name) if name not in ("mean", "sum") else getattr(torch, name)
        means = tuple(sorted(d % len(shapes[first]) for d in dims)) if name == "mean" else ()
        return _Map("linear", lambda t: fn(t, *rest, **kwargs), means=means), [first]
    if name in ("repeat_interleave", "repeat") and first is not None and len(tensors) == 1:
        # copies along axes other than the samples' (grouped-query attention's key/value heads), with numbers given
        # as constants: a fixed linear map whose adjoint sums the copies back (by autograd)
        before, after = shapes[first], shapes[node]
        if node.all_input_nodes != [first] or len(before) != len(after) or before[:1] != after[:1]:
            return None  # numbers computed in the graph (nested in a list too), or the samples' axis copied
        call = _caller(node)
        return _Map("linear", lambda t, call=call: call([t])), [first]
    if name in ("clamp", "clip") and first is not None and len(tensors) == 1 and len(args) <= 3 \
            and set(node.kwargs) <= {"min", "max"}:  # fmt: skip
        bounds = (_argument(node, 1, "min", None), _argument(node, 2, "max", None))
        if all(b is None or _number(b) for b in bounds) and bounds != (None, None):
            return _Map("clamp", tuple(None if b is None else float(b) for b in bounds)), [first]
        return None
    if name == "normalize" and first is not None and len(tensors) == 1 and len(args) <= 4 \
            and set(node.kwargs) <= {"p", "dim", "eps", "out"} and node.kwargs.get("out") is None:  # fmt: skip
        p, dim, eps = (_argument(node, i, key, default) for i, key, default in ((1, "p", 2.0), (2, "dim", 1),
                                                                                 (3, "eps", 1e-12)))  # fmt: skip
        ndim = len(shapes[first])
        if p == 2 and _axis(dim, ndim) == ndim - 1 and ndim > 1 and _number(eps) and eps > 0:
            return _Normalize(float(eps)), [first]
        return None
    if name in ("pad", "roll") and first is not None and len(tensors) == 1:
        return _shifted(node, name, first, len(shapes[first]))
    if name in _VIEWS and first is not None and len(tensors) == 1:
        # also where it folds the samples' axis with others (Swin's windows into the batch) and back (`_folding`)
        return _Map("view", call=_caller(node)), [first]
    if name in ("type_as", "to") and first is not None and _cast_only(node, shapes):
        return _Map("cast", call=_caller(node)), [first]
    if name == "stack":  # along a new axis other than the samples' (timm's rotary maps interleave pairs so)
        parts, dim = _argument(node, 0, "tensors", None), _argument(node, 1, "dim", 0)
        if len(args) > 2 or set(node.kwargs) - {"tensors", "dim"} or not isinstance(parts, (list, tuple)) \
                or not parts or not isinstance(dim, int) \
                or not all(isinstance(p, fx.Node) and p in shapes for p in parts):  # fmt: skip
            return None
        dim %= len(shapes[parts[0]]) + 1
        return (_Map("stack", dim=dim), list(parts)) if dim else None
    if name == "cat":
        parts, dim = _argument(node, 0, "tensors", None), _argument(node, 1, "dim", 0)
        if not isinstance(parts, (list, tuple)) or not parts or not isinstance(dim, int) or \
                not all(isinstance(p, fx.Node) and p in shapes for p in parts):  # fmt: skip
            return None
        dim %= len(shapes[parts[0]])
        if dim == 0 and not all(p.op == "get_attr" for p in parts):  # the samples' axis, unless no part has one
            return None  # (parameters and buffers joined: BEiT's and EVA's qkv bias)
        return _Map("cat", dim=dim), list(parts)
    if target in _ADD | _SUB and len(args) == 2 and not node.kwargs.keys() - {"alpha"}:
        sign = -1.0 if target in _SUB else 1.0
        alpha = node.kwargs.get("alpha", 1)
        if not _number(alpha) or float(alpha) != alpha:  # an integer a float does not hold exactly is not read
            return None
        if all(isinstance(a, fx.Node) and a in shapes for a in args):
            out = shapes[node]
            if any(not _broadcasts(shapes[a], out) for a in args):
                return None  # an operand broadcast to a larger shape than the sum's is not a sum of its entries
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
        divide = target in (operator.truediv, torch.div, "div")
        if len(others) == 1 and isinstance(others[0], fx.Node) and _shape_number(others[0], shapes) and \
                target not in (operator.neg, torch.neg, "neg") and (args[0] is tensors[0] or not divide):  # fmt: skip
            # a number computed from shapes (1 / sqrt(k.size(-1))): the factor is read where the call runs
            return _Map("scale", (node.all_input_nodes.index(others[0]), divide), call=_caller(node)), tensors
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


_MAX_POOL_FUNCTIONS = (F.max_pool1d, F.max_pool2d, F.max_pool3d)
_MAX_POOL_OPTIONS = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")


def _max_pool(node: fx.Node, first: fx.Node):
    """``F.max_pool1d/2d/3d(x, ...)`` as the selection ``nn.MaxPool1d/2d/3d`` is read as, or ``None`` where an option
    is computed in the graph or the indices are returned."""
    options = dict(zip(_MAX_POOL_OPTIONS, node.args[1:]), **node.kwargs)
    inputs: list[fx.Node] = []
    fx.node.map_arg(list(options.values()), inputs.append)
    if len(node.args) > len(_MAX_POOL_OPTIONS) + 1 or set(options) - set(_MAX_POOL_OPTIONS) or inputs \
            or "kernel_size" not in options or options.get("return_indices"):  # fmt: skip
        return None
    pool = _MaxPool(node.target, options["kernel_size"], options.get("stride"), options.get("padding", 0),
                    options.get("dilation", 1), bool(options.get("ceil_mode", False)))  # fmt: skip
    return _Map("maxpool", pool), [first]


def _axis(d: object, ndim: int) -> int | None:
    """An axis argument made non-negative, or ``None`` where it is not an axis of a tensor of ``ndim`` axes."""
    return d % ndim if isinstance(d, int) and not isinstance(d, bool) and -ndim <= d < ndim else None


# Arithmetic of numbers that fx records as graph nodes where one operand is a size (``x.size(-1) // 2``)
_NUMBER_FUNCTIONS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod,
                     operator.pow, operator.neg, math.sqrt, math.floor, math.ceil, int, float}  # fmt: skip


def _cast_only(node: fx.Node, shapes: Mapping[fx.Node, tuple]) -> bool:
    """Whether ``node`` changes at most its floating tensor's floating dtype (`manifolds._graph.floating_cast`) and,
    for ``x.type_as(y)``, ``y`` is a tensor the products hold. A cast to integers or booleans, whose derivative is
    zero, is not one (its tangent would be rounded, not dropped)."""
    if floating_cast(node) is None:
        return False
    return node.target != "type_as" or node.args[1] in shapes


def _shape_number(node: object, shapes: Mapping[fx.Node, tuple]) -> bool:
    """Whether ``node`` (a graph node or a literal) is a number computed from the sizes of a tensor's axes other than
    the samples' (``k.size(-1)``, ``x.shape[-1] // 2``, ``1 / math.sqrt(q.size(-1))``): the same for every chunk of
    the data. A number read off the samples' axis (``x.shape[0]``) depends on the chunk, and a slice of a shape is a
    ``torch.Size``, not a number: neither is one."""
    if not isinstance(node, fx.Node):
        return _number(node)
    if node in shapes or node.kwargs:
        return False
    args = node.args
    if node.op == "call_method" and node.target == "size" and len(args) == 2 and args[0] in shapes:
        axis = _axis(args[1], len(shapes[args[0]]))
        return axis is not None and axis != 0
    if node.op == "call_function" and node.target is operator.getitem and len(args) == 2 \
            and isinstance(args[0], fx.Node) and args[0].args and args[0].args[0] in shapes \
            and ((args[0].op == "call_function" and args[0].target is getattr and args[0].args[1:] == ("shape",))
                 or (args[0].op == "call_method" and args[0].target == "size" and len(args[0].args) == 1)):  # fmt: skip
        axis = _axis(args[1], len(shapes[args[0].args[0]]))
        return axis is not None and axis != 0
    if node.op == "call_function" and node.target in _NUMBER_FUNCTIONS:
        return all(_shape_number(a, shapes) for a in args)
    return False


def _basic_index(index: object, shapes: Mapping[fx.Node, tuple] | None = None) -> bool:
    """Whether ``index`` selects by basic indexing alone (ints, slices of ints, ``None``, ``...``, tuples of those): a
    view, each entry of the tensor taken at most once. Given ``shapes``, a number computed from the sizes of
    non-sample axes (``x.shape[-1] // 2``, `_shape_number`) stands for an int too (checked to be one where it is
    read)."""

    def whole(e: object) -> bool:
        return (isinstance(e, int) and not isinstance(e, bool)) or (
            shapes is not None and isinstance(e, fx.Node) and _shape_number(e, shapes))

    parts = index if isinstance(index, tuple) else (index,)
    return all(p is None or p is Ellipsis or whole(p)
               or (isinstance(p, slice) and all(e is None or whole(e) for e in (p.start, p.stop, p.step)))
               for p in parts)  # fmt: skip


def _index_caller(node: fx.Node) -> Callable[[list], object]:
    """The index of a ``getitem`` ``node`` with the numbers computed from shapes filled in, fed the values of
    ``node.all_input_nodes`` in that order (its tensor first)."""
    inputs = node.all_input_nodes

    def index(values: list) -> object:
        env = dict(zip(inputs, values))
        filled = fx.node.map_arg(node.args[1], env.__getitem__)
        if not _basic_index(filled):  # a size that is no int (a float from a division): not the view it was read as
            raise ValueError(f"the index {filled!r} of graph node '{node.name}' is not a basic index of ints")
        return filled

    return index


def _folding(op: _Map, before: tuple[int, ...], after: tuple[int, ...], batch: int) -> _Map | None:
    """A view of a tensor the data reach (traced on ``batch`` samples) that keeps its first axis; or folds it with
    others and back, so that its size before and after is a whole number per sample (Swin's windows in the batch
    axis), the view then marked with those numbers, which every pass checks at its own batch size; else ``None``. The
    objective has checked that the model keeps the samples apart; a view whose first axis does not grow with the
    batch is read by neither."""
    if before[:1] == after[:1]:
        return op
    if not before or not after or before[0] % batch or after[0] % batch:
        return None
    return dataclasses.replace(op, folds=(before[0] // batch, after[0] // batch))


def _shifted(node: fx.Node, name: str, first: fx.Node, ndim: int):
    """Constant padding (``F.pad``, constant mode; negative amounts crop) and ``torch.roll`` along axes other than
    the samples', by amounts that may be computed from shapes (Swin's windows): a fixed affine map, whose linear part
    (padding by zeros) the tangents and errors go through; else ``None``."""
    linear = _caller(node)  # roll: linear
    if name == "pad":
        amounts, mode = _argument(node, 1, "pad", None), _argument(node, 2, "mode", "constant")
        value = _argument(node, 3, "value", None)
        if mode != "constant" or not (value is None or _number(value)) or not isinstance(amounts, (tuple, list)) \
                or len(amounts) % 2 or len(amounts) // 2 >= ndim \
                or set(node.kwargs) - {"pad", "mode", "value"}:  # fmt: skip
            return None  # another mode (reflect, replicate: other adjoints), or the samples' axis padded too
        linear = _zero_padded(node)  # a non-zero constant is the map's offset: its linear part pads by zeros
    else:
        dims = _argument(node, 2, "dims", None)
        dims = (dims,) if isinstance(dims, int) else dims
        if not isinstance(dims, (tuple, list)) or not dims or set(node.kwargs) - {"shifts", "dims"} \
                or any(_axis(d, ndim) in (None, 0) for d in dims):  # fmt: skip
            return None  # the flattened tensor rolled (no dims), or the samples' axis
    return _Map("relay", (node.all_input_nodes.index(first), linear), call=_caller(node)), [first]


def _zero_padded(node: fx.Node) -> Callable[[list], Tensor]:
    """The ``F.pad`` call of ``node`` padding by zeros, fed the values of ``node.all_input_nodes`` in that order."""
    inputs = node.all_input_nodes

    def pad(values: list) -> Tensor:
        env = dict(zip(inputs, values))
        x, amounts = (fx.node.map_arg(_argument(node, i, key, None), env.__getitem__)
                      for i, key in ((0, "input"), (1, "pad")))  # fmt: skip
        return F.pad(x, amounts)

    return pad


def _attention_op(node: fx.Node, name: str, shapes: dict[fx.Node, tuple]):
    """The operations of attention written by hand (`sharpness.products._rop_attention`) and the reshapes around it
    (axis permutations, basic indexing, ``expand``, ``masked_fill`` by a number) as an operation and its tensor
    inputs; ``None`` where ``node`` is none of them or is called in a way not supported (a dtype, a mask, dropout,
    operands of ``matmul`` with fewer than two axes)."""
    args, kwargs = node.args, node.kwargs
    if name == "linear":  # by position or by name (timm's BEiT and EVA: F.linear(input=x, weight=W, bias=b))
        given = linear_arguments(node)
        tensors = [] if given is None else [a for a in given if a is not None]
        if given is None or not all(isinstance(a, fx.Node) and a in shapes for a in tensors):
            return None
        x, weight, bias = (shapes[a] if a is not None else None for a in given)
        if len(x) >= 2 and len(weight) == 2 and bias in (None, (weight[0],)):  # a vector input is refused: no batch
            return _Affine(linear=True), tensors
        return None
    first = args[0] if args and isinstance(args[0], fx.Node) and args[0] in shapes else None
    if first is None:
        return None
    if name == "expand" and not kwargs:  # (a class token over the samples): the error summed back
        return _Map("expand", call=_caller(node)), [first]
    if any(isinstance(a, fx.Node) and a not in shapes for a in (*args, *kwargs.values())):
        return None  # the rules below read no number computed from shapes
    ndim = len(shapes[first])
    if name in ("transpose", "swapaxes") and len(args) == 3 and not kwargs:
        a, b = _axis(args[1], ndim), _axis(args[2], ndim)
        if a is None or b is None:
            return None
        dims = list(range(ndim))
        dims[a], dims[b] = b, a
        return _Map("permute", tuple(dims)), [first]
    if not kwargs and ((name == "t" and len(args) == 1) or (node.target is getattr and args[1:] in (("T",), ("mT",)))):
        if ndim < 2 or (ndim != 2 and args[1:] != ("mT",)):  # .T of more axes reverses them all: not read
            return None
        dims = (*range(ndim - 2), ndim - 1, ndim - 2)  # W.T, W.t(), W.mT: the last two axes swapped
        return _Map("permute", dims), [first]
    if name == "permute" and not kwargs:
        dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
        dims = tuple(_axis(d, ndim) for d in dims)
        return (_Map("permute", dims), [first]) if None not in dims and sorted(dims) == list(range(ndim)) else None
    if name == "masked_fill" and len(args) == 3 and not kwargs and _number(args[2]) and args[1] in shapes \
            and shapes[first] == shapes[node]:  # a mask larger than the tensor broadcasts it: its error is not summed
        # entries set to a number (-inf in the scores): the tangent and the error vanish there
        return _Map("masked", node.all_input_nodes.index(args[1]), call=_caller(node)), [first]
    if name == "getitem" and len(args) == 2 and not isinstance(args[1], fx.Node) and _basic_index(args[1]):
        return _Map("index", args[1]), [first]
    index = args[1] if name == "getitem" and len(args) == 2 else None
    if isinstance(index, fx.Node) and index in shapes and index.meta.get("dtype") in (torch.int64, torch.int32) \
            and first is not None and not kwargs:  # fmt: skip
        # rows picked by an integer tensor (BEiT's relative position table at its index buffer): an integer index
        # carries no tangent, so the map is linear in the tensor whatever computed the index; rows of the data's
        # samples axis picked across samples are refused with the model (`check_samples_apart`)
        slot = node.all_input_nodes.index(index)
        return _Map("gather", call=lambda values, i=slot: values[i]), [first]
    if name == "getitem" and len(args) == 2 and not isinstance(args[1], fx.Node) and _basic_index(args[1], shapes):
        # bounds computed from shapes (HuggingFace's rotate_half: x[..., : x.shape[-1] // 2]), read where it runs
        return _Map("index", call=_index_caller(node)), [first]
    if name in ("matmul", "bmm") and len(args) == 2 and not kwargs and args[1] in shapes:
        return (_MatMul(), [first, args[1]]) if min(ndim, len(shapes[args[1]])) >= 2 else None
    if name == "addmm" and len(args) == 3 and not kwargs and all(a in shapes for a in args[1:]):
        bias, x, weight = (shapes[a] for a in args)
        if len(x) == 2 and len(weight) == 2 and bias == (weight[1],):  # a 2-D bias is not one per output feature
            return _Affine(linear=False), [args[1], args[2], args[0]]
    if name in ("softmax", "log_softmax"):
        dtype = kwargs.get("dtype")
        if len(args) > 2 or set(kwargs) - {"dim", "_stacklevel", "dtype"} or \
                not (dtype is None or name == "softmax" and isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            return None  # fmt: skip
        op = _normalization(name, _argument(node, 1, "dim", None), ndim, dtype)
        return None if op is None else (op, [first])
    if name == "scaled_dot_product_attention":
        tensors = args[:3]
        options = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"), args[3:]), **kwargs)
        if len(tensors) != 3 or not all(t in shapes for t in tensors) or len(args) > 8 or \
                set(options) - {"attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"}:  # fmt: skip
            return None
        q, k, v = (shapes[t] for t in tensors)
        scale, causal = options.get("scale"), options.get("is_causal", False)
        mask, gqa = options.get("attn_mask"), options.get("enable_gqa", False)
        repeat = 1
        if gqa is True and len(q) >= 3 and k[:-3] == v[:-3] == q[:-3] and k[-3] == v[-3] and q[-3] % k[-3] == 0:
            repeat = q[-3] // k[-3]  # each key/value head read by `repeat` consecutive query heads
            k, v = (*k[:-3], q[-3], *k[-2:]), (*v[:-3], q[-3], *v[-2:])
        if options.get("dropout_p", 0.0) != 0 or gqa not in (False, True) \
                or not isinstance(causal, bool) or not (scale is None or _number(scale)) or len(q) < 2 \
                or not q[:-2] == k[:-2] == v[:-2] or k[-2] != v[-2] or q[-1] != k[-1]:  # fmt: skip
            return None
        if mask is not None and (causal or not isinstance(mask, fx.Node) or mask not in shapes
                                 or not _broadcasts(shapes[mask], (*q[:-1], k[-2]))):  # fmt: skip
            return None  # a mask and is_causal together, or a mask that does not broadcast to the scores
        slot = None if mask is None else node.all_input_nodes.index(mask)
        return _Attend(None if scale is None else float(scale), causal, slot, repeat), list(tensors)
    return None


def _normalization(
    name: str, dim: object, ndim: int, dtype: torch.dtype | None = None
) -> _Softmax | _LogSoftmax | None:
    """``softmax`` (computed in ``dtype`` where given) or ``log_softmax`` along the axis ``dim`` of a tensor of ``ndim``
    axes, or ``None`` where ``dim`` is not an axis other than the samples' (``None``, torch's implicit axis, is
    refused: which one it takes depends on the number of axes)."""
    axis = _axis(dim, ndim)
    if axis is None or axis == 0:
        return None
    axis = -1 if axis == ndim - 1 else axis
    return _Softmax(axis, dtype) if name == "softmax" else _LogSoftmax(axis)


def _broadcasts(shape: tuple[int, ...], to: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``to`` without growing it."""
    return len(shape) <= len(to) and all(a in (1, b) for a, b in zip(reversed(shape), reversed(to)))


def _pieces(nodes: list[fx.Node], shapes: dict[fx.Node, tuple]) -> dict[fx.Node, tuple]:
    """Each ``unbind``, ``chunk`` or ``split`` of a tensor (a tuple, which fx records without a shape) along a fixed
    axis whose every user takes one piece by an integer ``getitem``: the call as ``(None, [], [])`` (read by nothing)
    and each ``getitem`` as ``(_Map("piece"), [the tensor], [the call's inputs])``, the cut replayed."""
    found: dict[fx.Node, tuple] = {}
    for node in nodes:
        name = target_name(node)
        if node.op not in ("call_function", "call_method") or name not in ("unbind", "chunk", "split") \
                or node in shapes or not node.args or node.args[0] not in shapes:  # fmt: skip
            continue
        dim = _argument(node, 1 if name == "unbind" else 2, "dim", 0)
        users = list(node.users)
        if _axis(dim, len(shapes[node.args[0]])) is None or not users or any(
                u.target is not operator.getitem or not isinstance(u.args[1], int) or u not in shapes
                for u in users):  # fmt: skip
            continue
        found[node] = (None, [], [])
        for u in users:
            piece = _Map("piece", (name, u.args[1]), call=_caller(node), dim=_axis(dim, len(shapes[node.args[0]])))
            found[u] = (piece, [node.args[0]], node.all_input_nodes)
    return found


def _merged_affines(nodes: list[fx.Node], shapes: dict[fx.Node, tuple]) -> dict[fx.Node, tuple]:
    """HuggingFace's ``Conv1D`` on token sequences: ``x.view(-1, nx)``, ``torch.addmm(b, ., W)`` and a view back to
    ``x``'s leading axes, which merges the samples with the tokens on the way (a view the products refuse alone). The
    view back is read as one `_Affine` of ``x`` itself, ``x W + b`` on the last axis, and the other two as read by
    nothing (``(None, [], [])``)."""
    found: dict[fx.Node, tuple] = {}
    for node in nodes:
        if node.op != "call_function" or target_name(node) != "addmm" or len(node.args) != 3 or node.kwargs:
            continue
        bias, flat, weight = node.args
        if not all(isinstance(a, fx.Node) and a in shapes for a in node.args) or flat.op != "call_method" \
                or target_name(flat) not in _VIEWS or not flat.args or flat.args[0] not in shapes:  # fmt: skip
            continue
        x, readers = flat.args[0], list(node.users)
        lead, (nx, nf) = tuple(shapes[x][:-1]), shapes[weight]
        if len(shapes[weight]) != 2 or shapes[bias] != (nf,) or len(readers) != 1 or len(lead) < 2 \
                or shapes[x][-1] != nx or shapes[flat] != (math.prod(lead), nx) \
                or list(flat.users) != [node]:  # fmt: skip (a reader of its shape would need it computed)
            continue
        (back,) = readers
        if back.op not in ("call_function", "call_method") or target_name(back) not in _VIEWS or back not in shapes \
                or shapes[back] != (*lead, nf) or not back.args or back.args[0] is not node:  # fmt: skip
            continue
        found[flat], found[node] = (None, [], []), (None, [], [])
        found[back] = (_Affine(linear=False), [x, weight, bias], [])
    return found


def _stacked_sums(nodes: list[fx.Node], shapes: dict[fx.Node, tuple]) -> dict[fx.Node, tuple]:
    """``torch.stack(parts).sum(0)`` (timm's parallel blocks add their branches so): the stack along a new first axis,
    read by that sum alone, as nothing (``(None, [], [])``) and the sum as the sum of the parts (a stack along the
    first axis is refused alone: it would be read as the samples')."""
    found: dict[fx.Node, tuple] = {}
    for node in nodes:
        if target_name(node) != "sum" or node.op not in ("call_function", "call_method") or node not in shapes:
            continue
        stack = node.args[0] if node.args else None
        dims = _argument(node, 1, "dim", None)
        if not isinstance(stack, fx.Node) or target_name(stack) != "stack" or stack.op != "call_function" \
                or list(stack.users) != [node] or dims not in (0, (0,), [0]) or len(node.args) > 2 \
                or set(node.kwargs) - {"dim"} or _argument(stack, 1, "dim", 0) != 0 \
                or set(stack.kwargs) - {"tensors", "dim"} or len(stack.args) > 2:  # fmt: skip
            continue
        parts = _argument(stack, 0, "tensors", None)
        if not isinstance(parts, (list, tuple)) or not parts or \
                not all(isinstance(p, fx.Node) and shapes.get(p) == shapes[node] for p in parts):  # fmt: skip
            continue
        found[stack], found[node] = (None, [], []), (_Map("sum", factors=(1.0,) * len(parts)), list(parts), [])
    return found


def _constant(model: nn.Module, name: str) -> Tensor | None:
    """The tensor fx kept on ``model`` under ``name`` while tracing (``_tensor_constant0``: one computed from buffers
    alone, ``3.0 * self.mask`` say), or ``None``."""
    try:
        t = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        value = getattr(t, name.rpartition(".")[2], None)
    except AttributeError:
        return None
    return value if isinstance(value, Tensor) and not isinstance(value, nn.Parameter) else None


def _attention_outputs(model: nn.Module, nodes: list[fx.Node], shapes: dict,
                       params: Mapping[str, Tensor]) -> dict[fx.Node, tuple]:  # fmt: skip
    """Each ``nn.MultiheadAttention`` call (a tuple, which fx records without a shape) as ``(_Attention, [input])``
    and the one ``getitem`` taking its output as the identity of it (``(None, [])`` where either is not read). The
    call gets its output's shape."""
    found: dict[fx.Node, tuple] = {}
    for node in nodes:
        if node.op != "call_module" or type(model.get_submodule(str(node.target))) is not nn.MultiheadAttention:
            continue
        module = model.get_submodule(str(node.target))
        users = list(node.users)
        op = None if _has_hooks(module) else _attention(str(node.target), node, module, params)
        if len(users) != 1 or users[0].target is not operator.getitem or users[0].args[1] != 0 \
                or users[0] not in shapes or op is None:  # fmt: skip
            found[node] = (None, [])
            continue
        shapes[node] = shapes[users[0]]
        found[node] = (op, [node.args[0]])
        found[users[0]] = (_Map("scale"), [node])
    return found


def _fuse_batch_norms(read: dict[fx.Node, tuple], output: fx.Node) -> None:
    """Merge each BatchNorm whose input is an affine layer's output used by nothing else into that layer, where the
    layer's channels are the axis the BatchNorm normalizes (axis 1: not a Linear of token sequences, whose features
    are the last axis)."""
    for node, (op, tensors, _) in list(read.items()):
        if isinstance(op, _Layer) and op.affine is None and op.norm is not None:
            (source,) = tensors
            before = read[source][0]
            if isinstance(before, _Layer) and before.norm is None and before.affine is not None \
                    and not before.affine.tokens and len(source.users) == 1 and source is not output:  # fmt: skip
                read[node] = (_Layer(affine=before.affine, norm=op.norm), read[source][1], [])


# A module call the graph reader reads as another class (`_split_norms`)
_READ_AS = "rop_read_as"


def _split_norms(model: nn.Module, graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` (nodes' ``meta`` copied) in which timm's ``BatchNormAct2d`` is a ``BatchNorm2d`` call
    followed by its activation module's, and timm's ``LayerNorm2d`` a ``LayerNorm`` of the input moved to
    channels-last and moved back, where each computes exactly that on its input
    (`manifolds._same_forward.norm_then_activation`, `manifolds._same_forward.channel_layer_norm`); ``graph`` itself
    where neither is called."""
    found = {}
    for node in graph.nodes:
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
            continue
        module, shape = model.get_submodule(str(node.target)), node.args[0].meta.get("shape")
        if shape is None or _has_hooks(module):
            continue
        if norm_then_activation(module, shape) is not None:
            found[node] = "act"
        elif isinstance(module, nn.LayerNorm) and read_as(module) is not nn.LayerNorm and channel_layer_norm(module,
                                                                                                             shape):
            found[node] = "channels"
    if not found:
        return graph
    copy, mapping = fx.Graph(), {}
    copy.output(copy.graph_copy(graph, mapping))
    for old, how in found.items():
        node = mapping[old]
        shape = node.meta["shape"]
        if how == "act":  # the normalization, then the activation (its ``drop`` is the identity in eval mode)
            node.meta[_READ_AS] = nn.BatchNorm2d
            with copy.inserting_after(node):
                out = copy.call_module(f"{node.target}.act", (node,))
        else:  # over the channels: moved to the last axis and back
            n, c, h, w = shape
            with copy.inserting_before(node):
                moved = copy.call_method("permute", (node.args[0], 0, 2, 3, 1))
            moved.meta.update(node.meta, shape=(n, h, w, c))
            node.args, node.meta["shape"], node.meta[_READ_AS] = (moved,), (n, h, w, c), nn.LayerNorm
            with copy.inserting_after(node):
                out = copy.call_method("permute", (node, 0, 3, 1, 2))
        out.meta.update({k: v for k, v in node.meta.items() if k != _READ_AS}, shape=shape)
        node.replace_all_uses_with(out, delete_user_cb=lambda user, out=out: user is not out)
    return copy


def rop_graph(
    model: nn.Module, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], graph: fx.Graph | None
) -> RopGraph | None:
    """Read ``model``'s traced ``graph`` (`manifolds.TracedNetwork.graph`, with shapes) for the R-operator
    products, or ``None`` where one of its operations is not supported (see the module docstring), a module
    has hooks, a layer's parameters are not all trainable (among ``params``), or nothing has parameters.
    ``buffers``: the BatchNorm running statistics, in the products' dtype and device."""
    if graph is None or _has_hooks(model):
        return None
    graph = as_matrix_products(graph)  # einsum products (attention written so) read as the matmuls they are
    graph = _split_norms(model, graph)  # timm's BatchNormAct2d and LayerNorm2d read as what they compute
    nodes = list(graph.nodes)
    if _read_after_mutation(nodes, model):
        return None
    shapes = {n: n.meta["shape"] for n in nodes if "shape" in n.meta}
    keys = parameter_keys(model, params)
    attention = _attention_outputs(model, nodes, shapes, params)
    pieces = _pieces(nodes, shapes) | _merged_affines(nodes, shapes) | _stacked_sums(nodes, shapes)
    read: dict[fx.Node, tuple] = {}  # node -> (op, tensor input nodes, call input nodes)
    fixed: set[fx.Node] = set()  # calls read only where no parameter moves their inputs
    output = None
    for node in nodes:
        if node in attention:  # nn.MultiheadAttention's call, or the output taken from it
            op, tensors = attention[node]
            if op is None:
                return None
            read[node] = (op, tensors, [])
        elif node in pieces:  # a piece of a tensor cut by unbind, chunk or split, the cut itself read by none; or a
            # Conv1D's three nodes, the last read as one
            if pieces[node][0] is not None:
                read[node] = pieces[node]
        elif node.op == "placeholder":
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
            table = buffers.get(f"{node.target}.weight") if type(module) is nn.Embedding else None
            if table is not None and module.max_norm is None:  # a frozen table: a call of the data alone
                read[node] = (lambda values, t=table: F.embedding(values[0], t), [], [node.args[0]])
                fixed.add(node)
                continue
            op = _module_op(node, module, params, buffers, keys)
            if op is None:
                return None
            read[node] = (op, [node.args[0]], [node.args[0]] if getattr(op, "call", None) else [])
        elif node.op in ("call_function", "call_method"):
            found = _embedding_call(node, params, keys) if node.target is F.embedding else _function_op(node, shapes)
            if found is None:  # any call of the data alone (reshaping it into patches, say): checked below
                read[node] = (_caller(node), [], node.all_input_nodes)
                fixed.add(node)
                continue
            op, tensors = found
            read[node] = (op, tensors, node.all_input_nodes if op.call is not None else [])
        elif keys.get(str(node.target), str(node.target)) in params:  # get_attr of a trainable parameter
            read[node] = (_Param(keys.get(str(node.target), str(node.target))), [], [])
        elif node in shapes and (str(node.target) in buffers or _constant(model, str(node.target)) is not None):
            # a buffer, frozen parameter or a tensor fx computed while tracing: a constant (a mask, say)
            t = buffers.get(str(node.target))
            if t is None:  # in its own dtype, as the model's forward reads it (a table kept in float32 on purpose)
                t = _constant(model, str(node.target)).to(next(iter(params.values())).device)
            read[node] = (lambda values, t=t: t, [], [])
        else:
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
    steps, moving, fed = [], [], []  # fed: whether the data reach the tensor (not only numbers read off its shape)
    for node in order:
        op, tensors, meta = read[node]
        fed.append(node.op == "placeholder" or any(fed[slot[t]] for t in (*tensors, *meta) if t in shapes))
        if isinstance(op, _Map) and op.kind == "view" and fed[-1]:
            op = _folding(op, shapes[tensors[0]], shapes[node], shapes[order[0]][0])
            if op is None:
                return None
        if node in fixed and any(moving[slot[m]] for m in meta):
            return None  # an unsupported operation of something the parameters move
        if isinstance(op, _Attend) and op.mask is not None and moving[slot[meta[op.mask]]]:
            mask = meta[op.mask]
            if mask.meta.get("floating") is not True:
                return None  # a boolean mask the parameters move: not a sum
            # a floating mask the parameters move (a learned position bias): a fourth input added to the scores
            op, tensors, meta = dataclasses.replace(op, mask=None, added=True), [*tensors, mask], []
        moves = bool(getattr(op, "names", ())) or any(moving[slot[t]] for t in tensors)
        moving.append(moves)
        steps.append(_Step(op, tuple(slot[t] for t in tensors), moves, tuple(slot[m] for m in meta)))
    if not any(moving):  # no parameter moves anything
        return None
    users: list[list[int]] = [[] for _ in steps]
    for i, s in enumerate(steps):
        for j in (*s.inputs, *s.meta):
            users[j].append(i)
    errors: set[int] = set()
    for i, s in enumerate(steps):  # downstream of every layer whose products read its error
        if i in errors or (isinstance(s.op, _LAYERS) and s.op.needs_error(moving[s.inputs[0]])) \
                or (isinstance(s.op, _Smooth) and moving[i]):  # fmt: skip
            errors.add(i)
            errors.update(u for u in users[i] if isinstance(steps[u].op, (*_LAYERS, *_MAPS)))
    return RopGraph(tuple(steps), slot[output], frozenset(errors), tuple(tuple(u) for u in users))


__all__ = ["RopGraph", "rop_graph"]
