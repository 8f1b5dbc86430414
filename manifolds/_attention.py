"""The non-diagonal symmetries of transformers, found on the traced graph.

What acts on what (``hd`` the head size; PyTorch stores a Linear as ``y = x W^T + b`` with ``W`` ``(out, in)``):

* **Query/key, per head** (``GL(hd)``): ``Wq_h <- A^T Wq_h``, ``bq_h <- A^T bq_h``, ``Wk_h <- A^-1 Wk_h``,
  ``bk_h <- A^-1 bk_h``. Every query row becomes ``q A`` and every key row ``k A^-T``, so every score
  ``q k^T`` and with it everything computed from the scores (the constant ``1/sqrt(hd)``, masks, softmax,
  dropout) is unchanged.
* **Value/output, per head** (``GL(hd)``): ``Wv_h <- B^T Wv_h``, ``bv_h <- B^T bv_h`` and the output
  projection's columns of head ``h`` ``<- (.) B^-T``. The head's output ``P v`` becomes ``P v B`` for the
  (unchanged) attention weights ``P``, and ``(P v B) (W_o,h B^-T)^T = P v W_o,h^T``; the output bias stays.
* **Grouped-query attention** (a key/value head read by a group of query heads: HuggingFace's ``repeat_kv``, an
  ``expand`` of size-1 axes; a ``repeat_interleave`` or ``repeat`` of whole entries along axes other than the
  samples', between the projection and the product; SDPA's ``enable_gqa``; or size-1 axes the product itself
  broadcasts, multi-query attention's ``k.unsqueeze(1)``, read as that expand): one query/key factor per key head,
  moving the rows of every query head reading it by ``A^T`` and the key head's by ``A^-1``, and one value/output factor
  per value head, ``B^T`` on its rows and ``B^-T`` on the output columns of every query head reading it. Which query
  heads read which key head is read off the replayed feature indices, not assumed.
* **Normalization affine scale** (positive diagonal, one scale per feature): ``gamma_j, beta_j <- c_j gamma_j,
  c_j beta_j`` for ``nn.LayerNorm`` / ``nn.RMSNorm`` over the last axis, and column ``j`` of every layer that
  reads the normalized output ``<- / c_j`` (q, k and v together): the consumers see the same products. The output
  may reach them through reshapes keeping the features last, row selections, rolls and zero paddings along other
  axes (Swin's shifted, padded windows folded into the batch: `keeps_features`).
* **Layer scale** (positive diagonal): ``y = h * w`` whose readers cannot take the elementwise trade below (timm's
  ``LayerScale``: ``y`` is added to the residual stream), ``h`` a linear layer's output read only by the product
  (through dropout layers): ``w_j <- c_j w_j`` and the layer's row ``j`` and bias ``j`` ``<- / c_j``.
* **Query/key normalization scales** (positive diagonal): where the query and the key are each normalized (a LayerNorm
  or RMSNorm module with affine parameters, per head or over the whole width) and reach the scores through reshapes
  and constant factors only, with feature ``j`` of every query row meeting feature ``j`` of every key row: the query
  normalization's scale and shift ``<- c (.)``, the key's ``<- (.) / c``. The query/key GL(hd) is pinned there.
* **Elementwise scale read directly** (positive diagonal): ``y = h * w`` with ``w`` a parameter vector on the last
  axis that nothing else reads (a normalization written by hand: HuggingFace's LLaMA ``RMSNorm``): ``w_j <- c_j w_j``
  and column ``j`` of every layer reading ``y`` ``<- / c_j``.
* **Token-wise ReLU MLP units** (positive diagonal): rows of a Linear and its bias ``<- c_j (.)``, the columns
  of every Linear reading it through ReLU / LeakyReLU / dropout ``<- / c_j`` (``relu(c x) = c relu(x)``), or through
  an elementwise product with a gate computed without it (SwiGLU's ``silu(w1 x) * w3 x`` frees ``w3``'s units:
  ``(c h) g = c (h g)``).
  The diagonal rescaling group of `manifolds._group_discovery` reads axis 1 as the channels, so on
  ``(batch, tokens, features)`` tensors it pins these; they are found here on the last axis instead, and
  dropped where the diagonal group already moves the same side of the same tensor (nothing is claimed twice).
* **Features read linearly** (``GL(k)``): the ``k`` outputs of a Linear that reach only other Linears through maps
  commuting with every linear map of the features (dropout, reshapes, row selections and means, rolls and zero pads
  along other axes): its rows and bias ``<- M^T (.)``, the readers' columns ``<- (.) M^-T`` (a low-rank factorization,
  LoRA's ``B A``), with the bias shift of `manifolds._absorption` where one Linear with a bias reads them directly
  (`_Finder.linear_pair`). Positive scales where a GL factor already moves the first layer's columns or a reader's rows.
  Where the diagonal group moves those layers too, its classes there are pinned (`symmetry_of`).
* **An embedding table's features read linearly** (``GL(P)``): an ``nn.Embedding``'s looked-up features read by Linears
  alone the same way: the table's columns ``<- (.) M^T``, the readers' columns ``<- (.) M^-1``; with an output layer
  tied to the table that reads a Linear's outputs alone, that Linear's rows and bias ``<- M^-T (.)``
  (`_Finder.token_table`: OPT-350m's ``project_in``, ``project_out`` and tied head).

Where it is found: every ``nn.MultiheadAttention`` call (packed ``in_proj_weight`` or separate
``q/k/v_proj_weight``, with or without bias, ``batch_first`` either way; ``add_bias_kv`` appends unprojected
key/value rows, which pins those factors), and attention written by hand: a ``matmul`` (or ``bmm``) of a
query and a transposed key, a ``matmul`` of any weights with a value, or ``F.scaled_dot_product_attention``
(a two-operand ``einsum`` that is one matrix product per batch entry is read as that ``matmul`` with permutes,
`manifolds._einsum`; any other einsum of two data tensors pins, with the reason),
where each of query, key and value is the output of a linear layer reshaped into heads by
view/reshape/transpose/permute/flatten/contiguous and constant factors only, nothing else reads those
tensors, and the value side's result reaches the output layer through such reshapes only. A linear layer
(`_Projection`) is an ``nn.Linear``, or a function of parameters no other node, name or module call reads:
``F.linear(x, W, b)``, ``x @ W``, ``x @ W + b`` (``W`` possibly read through ``W.T``, ``W.t()`` or ``W.transpose(0,
1)`` alone) or HuggingFace's GPT-2 ``Conv1D`` (``torch.addmm(b, x.view(-1, nx), W)`` and a view back); ``W`` of
``x @ W`` and ``addmm`` is stored ``(in, out)``, and its blocks say so
(`manifolds._matrix_group.Block.transposed`). A reshape merging or splitting the leading axes and keeping the
features last may sit before a layer's input (``Conv1D``'s flattening of the tokens). One Linear may
project all three (a fused qkv projection) where its output is cut into pieces each read once: ``unbind``,
``chunk``, ``split`` or ``tensor_split`` and ``getitem``, or integer indexing (``qkv[0]``, ``qkv[1]``) with distinct
indices, and the pieces hold disjoint sets of its features (replayed like the heads: a cut along the tokens, or
overlapping pieces, pins); the rows each factor moves must then be disjoint (checked on the rows themselves). The head
layout is not assumed but read: the reshapes are replayed on a tensor holding each feature's index, and the
factor exists only when every head uses a fixed, disjoint set of features for every token.

Rotary embeddings between the query (or key) projection and the product keep the subgroup of the query/key ``GL(hd)``
that commutes with every position's map (`manifolds._rotary`): the operations there must read the data through the
heads tensor alone, with constant (buffer- and shape-derived) other inputs, and act linearly on each row.

What pins (no factor, with the reason recorded): anything else between a projection and the product
(per-head norms, which trade their scales instead, a learned per-position map, one piece of a fused projection read
twice, a repeated query head), a
projection or normalized output read by anything else (a residual addition), a Linear or module called more than once
for a diagonal trade, shared parameters, GELU / SiLU / tanh / softmax after a Linear (not positively
homogeneous). Pinning only shrinks the group, so it is always safe.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor, fx, nn
from torch.utils._pytree import tree_leaves

from manifolds._einsum import EINSUM_META, as_matrix_products, is_einsum, not_rewritten
from manifolds._graph import (
    TracedNetwork,
    floating_cast,
    input_like,
    is_metadata,
    linear_arguments,
    reads_metadata_only,
    target_name,
    trace_network,
)
from manifolds._group_discovery import Pin, _plain_affine, attribute
from manifolds._matrix_group import COVERED, Block, Factor, MatrixSymmetry
from manifolds._modules import DROPOUTS, hooked, kept_buffers
from manifolds._rotary import Region, RegionError, check_region, commutant, find_region, position_maps
from manifolds._same_forward import read_as
from manifolds._structure import UnsupportedModelError, analyze

_RESHAPES = {"view", "reshape", "transpose", "permute", "contiguous", "flatten", "unflatten", "swapaxes", "swapdims",
             "unsqueeze"}
_SCALINGS = {"mul", "truediv", "div"}
_SELECTIONS = {"getitem", "select", "narrow", "mean"}  # rows picked or averaged (BERT's x[:, 0]): features stay put
_SPLITS = {"unbind", "chunk", "split", "tensor_split"}  # a tensor cut into disjoint pieces, read by getitem
_MATMULS = {"matmul", "bmm"}
_SDPA = "scaled_dot_product_attention"
_READ_LINEARLY = " (read by linear layers alone)"  # the label's end of a GL factor on features read linearly
_POSITIVE = {"relu", "relu_", "leaky_relu", "leaky_relu_", "dropout", "identity"}
_POSITIVE_MODULES = (nn.ReLU, nn.LeakyReLU, nn.Dropout, nn.Identity)
_STEPS_TO_PROJECTION = 8  # reshapes, selections and dropouts walked from a tensor to the layer reading it
_NORMS: tuple[type[nn.Module], ...] = (nn.LayerNorm, *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()))
# said of a query/key factor that leaves the bias of the side the softmax runs along (the keys) alone (`query_key`)
_UNMOVED = " (the bias {} unmoved, since the softmax along its rows ignores the shift of the scores it adds)"
_NON_HOMOGENEOUS = {"gelu", "silu", "tanh", "sigmoid", "softmax", "elu", "mish", "softplus", "hardswish"}


@dataclass(frozen=True)
class _Projection:
    """A node computing ``x W^T + b`` along the last axis of its data input ``x``: an ``nn.Linear`` call, or a
    function of parameters read directly (``F.linear(x, W, b)``; ``x @ W``, ``x @ W + b`` and HuggingFace's
    ``Conv1D``, ``torch.addmm(b, x, W)``, whose ``W`` is stored ``(in, out)``, ``transposed``). A function's bias
    may be concatenated in the forward from parameters and buffers (`_bias_pieces`).

    Attributes:
        node: the node whose output is the layer's output.
        data: the node ``x``.
        module: the Linear's name (a module call), else ``None``.
        weight, bias: the ``get_attr`` nodes of a function's parameters (``bias`` ``None`` where there is none, or
            the ``cat`` node of a bias concatenated from pieces).
        transposed: ``W`` is stored ``(in, out)``.
        inner: the product ``x @ W`` of ``x @ W + b`` (``node`` is the addition), else ``None``.
        through: the transpose the layer reads ``W`` by (``x @ W.T``, ``F.linear(x, W.t())``), else ``None``.
    """

    node: fx.Node
    data: fx.Node
    module: str | None = None
    weight: fx.Node | None = None
    bias: fx.Node | None = None
    transposed: bool = False
    inner: fx.Node | None = None
    through: fx.Node | None = None

    @property
    def reader(self) -> fx.Node:
        """The node reading ``x`` and ``W``."""
        return self.inner if self.inner is not None else self.node

    @property
    def key(self) -> str:
        """What names the layer among the claimed projections: the module, or the graph node."""
        return self.module if self.module is not None else self.node.name


class _Fail(Exception):
    """A pattern does not hold; the message says why (it becomes a pin's reason)."""


@dataclass
class _Found:
    factors: list[Factor] = field(default_factory=list)
    pins: list[Pin] = field(default_factory=list)
    # (units factor, the GL factor it becomes where nothing else moves the readers' rows): `_Finder.linear_pair`;
    # an embedding table's GL factor has no units (`_Finder.token_table`)
    pairs: list[tuple[Factor | None, Factor]] = field(default_factory=list)

    def fallbacks(self) -> list[tuple[Factor, Factor | None]]:
        """``(GL factor, its units or None)`` of the candidates `upgrade_pairs` kept among ``factors``."""
        return [(pair, units) for units, pair in self.pairs if any(f is pair for f in self.factors)]


@dataclass
class _Record:
    """One forward pass of the example input: the non-tensor value of every node (sizes, head counts, to replay
    reshapes), the value of every tensor that does not depend on the data's values (buffers and what is computed from
    them and from shapes: the operands of a rotary map), and which nodes depend on the data's values or on parameters.
    """

    values: dict[fx.Node, object] = field(default_factory=dict)
    constants: dict[fx.Node, object] = field(default_factory=dict)
    data_fed: set[fx.Node] = field(default_factory=set)
    param_fed: set[fx.Node] = field(default_factory=set)


def _values(model: nn.Module, graph: fx.Graph, x: Tensor) -> _Record:
    """Run ``x`` through ``graph`` once (eval mode, no gradients) and record what `_Record` holds."""
    record = _Record()
    parameters = {id(p) for p in model.parameters()}

    class _Run(fx.Interpreter):
        def run_node(self, n: fx.Node):
            value = super().run_node(n)
            inputs = n.all_input_nodes
            if n.op == "placeholder" or (not is_metadata(n) and any(a in record.data_fed for a in inputs)):
                record.data_fed.add(n)
            if (n.op == "get_attr" and id(attribute(model, n)) in parameters) or (
                    n.op == "call_module" and any(True for _ in model.get_submodule(str(n.target)).parameters())) \
                    or (not is_metadata(n) and any(a in record.param_fed for a in inputs)):  # fmt: skip
                record.param_fed.add(n)
            if not any(isinstance(v, Tensor) for v in tree_leaves(value)):
                record.values[n] = value
            elif n not in record.data_fed:
                record.constants[n] = value
            return value

        def call_module(self, target, args, kwargs):
            return model.get_submodule(str(target))(*args, **kwargs)

    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            _Run(model, graph=graph).run(x)
    finally:
        for m, training in modes:
            m.training = training
    return record


def _new_axes_only(index: object) -> bool:
    """Whether an index only adds axes (``None``) and takes whole ones (``:``, ``...``), with at least one ``None``."""
    parts = index if isinstance(index, tuple) else (index,)
    whole = all(p is None or p is Ellipsis or p == slice(None) for p in parts)
    return whole and any(p is None for p in parts)


class _Finder:
    def __init__(self, model: nn.Module, graph: fx.Graph, record: _Record, other: Callable[[], _Record]):
        self.model, self.graph, self.record, self.values = model, graph, record, record.values
        self._other, self._other_record = other, None  # the pass on another number of samples, run where needed
        self.calls = Counter(str(n.target) for n in graph.nodes if n.op == "call_module")
        named = list(model.named_parameters(remove_duplicate=False))
        count = self.name_count = Counter(id(p) for _, p in named)
        self.getattr_reads = Counter(id(attribute(model, n)) for n in graph.nodes if n.op == "get_attr")
        self.param_name: dict[int, str] = {}  # the first name, as `named_parameters()` (and every objective) lists it
        for n, p in named:
            self.param_name.setdefault(id(p), n)
        # a parameter under several names, or also read directly by the forward (a get_attr node), moves with
        # whatever else reads it: no factor may claim it alone
        direct = {id(attribute(model, n)) for n in graph.nodes if n.op == "get_attr"}
        self.shared = {n for n, p in named if count[id(p)] > 1 or id(p) in direct}
        self.found = _Found()
        self.claimed_rows: set[str] = set()  # Linear modules whose output features some factor moves
        self.layer_scaled: set[fx.Node] = set()  # products `h * w` whose w is traded against h's layer
        self.score_norms: set[fx.Node] = set()  # query/key normalizations whose scales are traded against each other
        self.claimed: list[tuple[tuple[str, int], set[int], set[int] | None]] = []  # (parameter, axis), what a factor
        # moves along that axis, and the indices of the other axis it is restricted to (None: all)
        self._input_fed: dict[fx.Node, bool] = {}
        self.attention_seen: set[str] = set()  # nn.MultiheadAttention modules whose factors are found
        self.commutants: dict[tuple, object] = {}  # position maps (shape, bytes) -> the algebra commuting with them

    # -- graph helpers ---------------------------------------------------------------------------------------
    def users(self, node: fx.Node) -> list[fx.Node]:
        return [u for u in node.users if not reads_metadata_only(u, node)]

    def module(self, node: fx.Node) -> nn.Module | None:
        return self.model.get_submodule(str(node.target)) if node.op == "call_module" else None

    def label(self, node: fx.Node) -> str:
        if node.op == "call_module":
            return f"module '{node.target}' ({type(self.module(node)).__name__})"
        if EINSUM_META in node.meta:  # a rewritten einsum (`manifolds._einsum`): named as the user wrote it
            equation, name = node.meta[EINSUM_META]
            part = "" if target_name(node) == "matmul" else "the axis order of "  # a permute the rewrite put in
            return f"{part}'einsum' '{equation}' (graph node '{name}')"
        proj = self.projection(node) if node.op == "call_function" else None
        weight = f" of '{proj.weight.target}'" if proj is not None and proj.module is None else ""
        return f"'{target_name(node)}'{weight} (graph node '{node.name}')"

    def input_fed(self, node: fx.Node) -> bool:
        """Whether ``node`` depends on the network's input (a placeholder among its ancestors)."""
        todo = [node]
        while todo:
            n = todo[-1]
            if n in self._input_fed:
                todo.pop()
                continue
            if n.op == "placeholder":
                self._input_fed[n] = True
                todo.pop()
                continue
            unknown = [a for a in n.all_input_nodes if a not in self._input_fed]
            if unknown:
                todo.extend(unknown)
                continue
            self._input_fed[n] = any(self._input_fed[a] for a in n.all_input_nodes)
            todo.pop()
        return self._input_fed[node]

    def plain_linear(self, node: fx.Node) -> bool:
        m = self.module(node)
        return m is not None and _plain_affine(m) is nn.Linear and not hooked(m)

    def projection(self, node: fx.Node) -> _Projection | None:
        """``node`` as a linear layer of its last axis (`_Projection`), else ``None``. A function's weight and bias
        must be ``get_attr`` nodes; whether they are parameters only it reads is checked where they are claimed
        (`owned`). ``x @ W`` whose only reader adds a bias vector is left to that addition."""
        if self.plain_linear(node):
            return _Projection(node, node.args[0], module=str(node.target)) if len(node.args) == 1 else None
        name, args, inner = target_name(node), node.args, None
        if node.op != "call_function" or (node.kwargs and name != "linear"):
            return None
        if name == "addmm" and len(args) == 3:
            bias, data, weight, transposed = args[0], args[1], args[2], True
        elif name == "linear":
            given = linear_arguments(node)
            if given is None:
                return None
            (data, weight, bias), transposed = given, False
        elif name in ("add", "matmul") and len(args) == 2:
            if name == "add":  # x @ W + b
                inner = next((a for a in args if isinstance(a, fx.Node) and a.op != "get_attr"), None)
                bias = next((a for a in args if isinstance(a, fx.Node) and a.op == "get_attr"), None)
                if inner is None or bias is None or target_name(inner) != "matmul" or self.users(inner) != [node]:
                    return None
                shape = bias.meta.get("shape")
                if shape is None or len(shape) != 1:
                    return None
                data, weight = inner.args if len(inner.args) == 2 and not inner.kwargs else (None, None)
            else:
                data, weight = args
                bias = None
                readers = self.users(node)
                if len(readers) == 1 and (p := self.projection(readers[0])) is not None and p.inner is node:
                    return None  # the bias addition is the layer
            transposed = True
        else:
            return None
        through = None
        if isinstance(weight, fx.Node) and weight.op != "get_attr" and (source := _transposed_of(weight)) is not None:
            through, weight, transposed = weight, source, not transposed  # W.T: the stored W is the other way round
            if data is through:  # F.linear(W.T, W.T): the weight is its own input (fx records one reader)
                return None
        if not (isinstance(data, fx.Node) and isinstance(weight, fx.Node) and weight.op == "get_attr"):
            return None
        if bias is not None and not (isinstance(bias, fx.Node)
                                     and (bias.op == "get_attr" or _bias_pieces(bias) is not None)):  # fmt: skip
            return None
        shape = weight.meta.get("shape")
        if shape is None or len(shape) != 2 or data.op == "get_attr":
            return None
        n_in, n_out = shape if transposed else shape[::-1]
        source, out = data.meta.get("shape"), node.meta.get("shape")
        if source is None or out is None or not source or source[-1] != n_in or tuple(out) != (*source[:-1], n_out):
            return None  # x @ W + b broadcasting b (or x) beyond one output feature each, say
        if bias is not None and tuple(bias.meta.get("shape") or ()) != (n_out,):
            return None  # a bias of another shape is no vector of the output features: (T, out), (1,), (1, out)
        return _Projection(node, data, None, weight, bias, transposed, inner, through)

    def once(self, proj: _Projection) -> bool:
        """Whether the layer acts once (a function's parameters are checked by `owned`)."""
        return proj.module is None or self.calls[proj.module] == 1

    def owned(self, node: fx.Node, reader: fx.Node) -> str:
        """The name of the parameter the ``get_attr`` ``node`` reads, where ``reader`` is all that reads it (no other
        graph node, name or module call); else `_Fail`."""
        tensor = attribute(self.model, node)
        name = self.param_name.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
        if name is None:
            raise _Fail(f"'{node.target}' is not a parameter")
        owner = name.rpartition(".")[0]
        called = [m for m in self.calls if owner == m or owner.startswith(f"{m}.")]
        once = self.name_count[id(tensor)] == 1 and self.getattr_reads[id(tensor)] == 1
        if not once or self.users(node) != [reader] or called:
            raise _Fail(f"the parameter '{name}' is also read elsewhere")
        return name

    def reading_projection(self, user: fx.Node) -> _Projection | None:
        """The linear layer whose input ``user`` reads: ``user`` itself, or the bias addition it alone feeds (the
        product of ``x @ W + b``)."""
        proj = self.projection(user)
        if proj is None and len(readers := self.users(user)) == 1:
            proj = self.projection(readers[0])
            proj = proj if proj is not None and proj.inner is user else None
        return proj

    def input_projection(self, user: fx.Node, node: fx.Node) -> _Projection | None:
        """The linear layer that ``user`` makes read ``node`` as its input (`reading_projection`), directly or through
        steps that each keep feature ``j`` feature ``j`` and that the next alone reads: reshapes keeping the features
        on the last axis (HuggingFace's ``Conv1D`` flattens the tokens first), row selections (``x[:, 0]``) and
        dropout layers (timm's ``head_drop``; the identity in eval mode, where every measure evaluates)."""
        found = self.input_projections(user, node)
        return found[0] if found is not None and len(found) == 1 else None

    def input_projections(self, user: fx.Node, node: fx.Node) -> list[_Projection] | None:
        """The linear layers that ``user`` makes read ``node``, as `input_projection` finds one, where a step's output
        may be read by several users, each leading to a linear layer the same way (a mean over the tokens read by a
        head and by a LoRA adapter): every layer sees the features the same step keeps. ``None`` where one path ends
        anywhere else."""
        for _ in range(_STEPS_TO_PROJECTION):
            proj = self.reading_projection(user)
            if proj is not None:
                return [proj] if proj.data is node else None
            if not (self.keeps_features(user, node) or self.is_dropout(user, node)):
                return None
            users = self.users(user)
            if len(users) != 1:  # each branch must end in linear layers (the graph is acyclic: the recursion ends)
                branches = [self.input_projections(u, user) for u in users]
                if not branches or any(b is None for b in branches):
                    return None
                return [proj for b in branches for proj in b]
            node, user = user, users[0]
        return None

    def is_dropout(self, user: fx.Node, node: fx.Node) -> bool:
        """Whether ``user`` is a dropout layer (no hooks) applied to ``node`` alone."""
        m = self.module(user)
        return (type(m) in DROPOUTS and not hooked(m) and user.args == (node,)
                and not user.kwargs)  # fmt: skip

    def reads_as_input(self, user: fx.Node, node: fx.Node) -> bool:
        """Whether ``user`` takes ``node`` as the input of layers whose columns can be divided: linear layers
        (`input_projections`) or an ``nn.MultiheadAttention``."""
        return self.is_mha(user) or self.input_projections(user, node) is not None

    def keeps_features(self, user: fx.Node, node: fx.Node) -> bool:
        """Whether ``user`` is a reshape of ``node`` alone that keeps its features, in order, on the last axis (the
        leading axes merged or split), or picks or averages its rows by constant arguments (``x[:, 0]``,
        ``x.mean(1)``), or moves or pads rows along other axes (`moves_rows`): feature ``j`` of every row stays
        feature ``j``."""
        name = target_name(user)
        if name in ("roll", "pad") and user.op == "call_function":
            return self.moves_rows(user, node)
        if user.op not in ("call_method", "call_function") or name not in _RESHAPES | _SELECTIONS:
            return False
        selection = name not in _RESHAPES
        if selection:
            nodes: list[fx.Node] = []
            fx.node.map_arg((user.args, user.kwargs), nodes.append)
            if nodes != [node] or user.args[0] is not node:  # the arguments but the tensor are the same for any input
                return False
        elif self.data_arg(user) is not node:
            return False
        shape, out = node.meta.get("shape"), user.meta.get("shape")
        if shape is None or out is None or not shape or not out or shape[-1] != out[-1]:
            return False
        try:
            probe = self.feature_probe(node)
            if selection:
                fn = getattr(probe, str(user.target)) if user.op == "call_method" else partial(user.target, probe)
                moved = fn(*user.args[1:], **user.kwargs)
            else:
                moved = self.replay([user], probe)
        except (RuntimeError, IndexError, ValueError, TypeError, _Fail):
            return False
        return tuple(moved.shape) == tuple(out) and bool((moved == torch.arange(out[-1], dtype=moved.dtype)).all())

    def moves_rows(self, user: fx.Node, node: fx.Node) -> bool:
        """Whether ``user`` is ``torch.roll`` of ``node`` along axes other than the last, or ``F.pad`` of it by zeros
        along other axes (Swin's cyclic shift and its padding to whole windows), by amounts the data do not set: every
        row keeps its features in order, or is a new row of zeros, which any diagonal scale keeps zero."""
        shape, out = node.meta.get("shape"), user.meta.get("shape")
        if not shape or not out or shape[-1] != out[-1] or not user.args or user.args[0] is not node:
            return False
        others: list[fx.Node] = []
        fx.node.map_arg((user.args[1:], user.kwargs), others.append)
        if any(n in self.record.data_fed for n in others):
            return False
        whole = lambda n: isinstance(n, int) and not isinstance(n, bool)  # noqa: E731
        if target_name(user) == "roll":
            dims = (dict(zip(("input", "shifts", "dims"), user.args)) | dict(user.kwargs)).get("dims")
            dims = (dims,) if whole(dims) else dims
            return isinstance(dims, (tuple, list)) and len(dims) > 0 and all(
                whole(d) and d % len(shape) != len(shape) - 1 for d in dims)  # fmt: skip
        given = dict(zip(("input", "pad", "mode", "value"), user.args)) | dict(user.kwargs)
        pads = given.get("pad")
        return isinstance(pads, (tuple, list)) and len(pads) >= 2 and all(whole(n) and n == 0 for n in pads[:2]) \
            and given.get("mode", "constant") == "constant" and given.get("value") in (None, 0, 0.0) \
            and set(given) <= {"input", "pad", "mode", "value"}  # fmt: skip

    def is_mha(self, node: fx.Node) -> bool:
        return type(self.module(node)) is nn.MultiheadAttention

    def param(self, module_name: str, attr: str) -> str | None:
        owner, _, attr = f"{module_name}.{attr}".rpartition(".")
        tensor = getattr(self.model.get_submodule(owner), attr, None)
        if tensor is None:
            return None
        name = self.param_name.get(id(tensor))
        if name is None:
            raise _Fail(f"'{module_name}.{attr}' is not a plain parameter")
        if name in self.shared:
            raise _Fail(f"the parameter '{name}' is also read outside its module")
        return name

    def data_arg(self, node: fx.Node) -> fx.Node | None:
        """The one tensor argument of a reshape or constant factor (others must be known non-tensors)."""
        if node.op not in ("call_method", "call_function") or _reinterprets(node):
            return None  # a module named like a reshape (`self.view = nn.Tanh()`), or `t.view(torch.int64)`
        nodes: list[fx.Node] = []
        fx.node.map_arg((node.args, node.kwargs), nodes.append)
        tensors = [n for n in nodes if n not in self.values]
        if len(tensors) != 1 or not node.args or node.args[0] is not tensors[0]:
            return None
        name = target_name(node)
        if name in _RESHAPES or name in _SPLITS or (name == "getitem" and self.piece_index(node) is not None):
            return tensors[0]
        if name == "getitem" and _new_axes_only(node.args[1]):  # x[:, :, None]: a view with an axis of size 1 added
            return tensors[0]
        shape, source = node.meta.get("shape"), tensors[0].meta.get("shape")
        if name == "expand" and shape is not None and source is not None and len(shape) == len(source) \
                and all(a == b or b == 1 for a, b in zip(shape, source)) and shape[:1] == source[:1]:  # fmt: skip
            # a view repeating size-1 axes (HuggingFace's repeat_kv: each key/value head read by a group of query
            # heads); what it repeats is read off the replayed feature indices, not assumed
            return tensors[0]
        if name in ("repeat_interleave", "repeat") and shape is not None and source is not None \
                and len(shape) == len(source) and shape[:1] == source[:1]:  # fmt: skip
            # copies of whole entries along axes other than the samples' (grouped-query attention written with
            # repeat_interleave, or tiled by repeat): read off the replayed feature indices like expand
            return tensors[0]
        if name in _SCALINGS and len(node.args) == 2 and not node.kwargs:
            factor = node.args[1]
            factor = self.values.get(factor) if isinstance(factor, fx.Node) else factor
            if isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor != 0:
                return tensors[0]
        return None

    def piece_index(self, node: fx.Node) -> int | tuple | None:
        """The index of a ``getitem`` taking one piece by a constant integer ``>= 0`` (``qkv[0]``, the first output
        of ``unbind``), or by a constant slice of the last axis alone (``qkv[..., :q_rows]``, Phi-3's cut of its fused
        projection; a tuple), else ``None``."""
        if node.op != "call_function" or target_name(node) != "getitem" or node.kwargs or len(node.args) != 2:
            return None
        index = node.args[1]
        if isinstance(index, int) and not isinstance(index, bool) and index >= 0:
            return index
        return index if _last_axis_slice(index, node.args[0]) else None

    def cut_into_pieces(self, node: fx.Node) -> bool:
        """Whether every reader of ``node`` takes a piece of it: ``getitem`` nodes of distinct integer indices (the
        pieces of a split, or entries along the first axis) or of distinct slices of the last axis; that the pieces
        hold disjoint features of the Linear they come from is checked once the Linear is known
        (`disjoint_pieces`)."""
        users = self.users(node)
        indices = [self.piece_index(u) for u in users]
        # distinct by their repr: slices are hashable only from Python 3.12
        return all(i is not None for i in indices) and len(set(map(repr, indices))) == len(indices)

    def disjoint_pieces(self, linear: fx.Node, chain: Sequence[fx.Node], cut: fx.Node) -> None:
        """Fails unless the pieces the readers of ``cut`` take hold disjoint sets of ``linear``'s features (a cut
        along the tokens or the batch, or overlapping pieces, would carry a role's rows to another reader):
        ``linear``'s feature indices replayed through ``chain`` (from ``linear`` to ``cut``) and each reader."""
        whole = self.replay(chain, self.feature_probe(linear))
        seen: set[int] = set()
        for reader in self.users(cut):
            piece = whole[self.piece_index(reader)]
            features = set(torch.as_tensor(piece).unique().long().tolist())
            if features & seen:
                raise _Fail(f"the pieces cut from {self.label(linear)} at {self.label(cut)} share its features")
            seen |= features

    def claim(self, factors: Sequence[Factor]) -> None:
        """Record the rows and columns ``factors`` move; fails where one is already moved by another factor (the query,
        key and value cut from one fused projection must be disjoint rows of it; two units may not divide the same
        columns of their reader). A block restricted to some indices of its other axis (a packed attention projection's
        query rows) meets another only where those overlap too."""
        taken: list[tuple[tuple[str, int], set[int], set[int] | None]] = []
        for factor in factors:
            for block in factor.blocks:
                key, index = (block.name, block.stored_axis), set(block.index)
                other = None if block.other is None else set(block.other)
                for seen_key, seen_index, seen_other in [*self.claimed, *taken]:
                    if seen_key == key and index & seen_index and (other is None or seen_other is None
                                                                   or other & seen_other):  # fmt: skip
                        raise _Fail(f"rows or columns of '{block.name}' would be moved by two factors")
                taken.append((key, index, other))
        self.claimed.extend(taken)

    def back(self, node: fx.Node, role: str, regions: list | None = None) -> tuple[fx.Node, list[fx.Node]]:
        """The Linear call whose output reaches ``node`` through reshapes only, and those reshapes in order.

        Given ``regions`` (a list), one position-wise linear map (`manifolds._rotary`) may sit between them: it is
        appended as ``(region, i)``, ``i`` the number of reshapes before it, and left out of the chain.
        """
        end, chain, cuts = self.walk_back(node, role, regions)
        proj = self.projection(end)
        if not self.once(proj):
            raise _Fail(f"the {role} projection {self.label(end)} is called more than once")
        for cut in cuts:
            self.disjoint_pieces(end, chain[: chain.index(cut) + 1] if cut is not end else [], cut)
        return proj, chain

    def walk_back(self, node: fx.Node, role: str, regions: list | None,
                  to_norm: bool = False) -> tuple[fx.Node, list[fx.Node], list[fx.Node]]:  # fmt: skip
        """From ``node`` back through single-input steps (reshapes, constant factors) each read once, to the first
        projection's output (`back`), or with ``to_norm`` the first normalization's (`score_norm`): that tensor, the
        steps in order from it, and the tensors on the way read elsewhere as pieces of a cut (only on the way to a
        projection: ``qkv.unbind``). Given ``regions`` (a list), one position-wise linear map (`manifolds._rotary`) may
        sit on the way: it is appended as ``(region, i)``, ``i`` the number of steps before it, and left out of the
        steps. Else `_Fail` with the reason."""
        found = self.is_norm if to_norm else (lambda n: self.projection(n) is not None)
        what = "a normalization's output reshaped" if to_norm else "a Linear's output reshaped into heads"
        chain: list[fx.Node] = []
        cuts: list[fx.Node] = []
        current = node
        region = None
        after = 0  # steps between the region and `node`
        while True:
            if len(self.users(current)) != 1 and not (region is not None and current is region.start):
                if to_norm or not (chain and self.cut_into_pieces(current)):
                    raise _Fail(f"the {role} {self.label(current)} is also read elsewhere")
                cuts.append(current)
            if found(current):
                chain.reverse()
                if region is not None:
                    regions.append((region, len(chain) - after))
                return current, chain, cuts
            source = self.data_arg(current)
            if source is None and regions is not None and region is None:
                region = self.position_region(current, role, norms=to_norm)
                after = len(chain)
                current = region.start
                continue
            if source is None:
                raise _Fail(f"the {role} is not {what} ({self.label(current)} is between)")
            chain.append(current)
            current = source

    def position_region(self, end: fx.Node, role: str, norms: bool = False) -> Region:
        """The position-wise map ending at ``end`` (`manifolds._rotary.find_region`), checked (`checked_region`);
        ``norms``: it may start at a normalization's output (`score_norm`'s walk), not only at a projection's."""
        shape = end.meta.get("shape")

        def may_start(n: fx.Node) -> bool:  # where `back` goes on, with the map keeping the shape
            on = self.projection(n) is not None or self.data_arg(n) is not None or (norms and self.is_norm(n))
            return on and shape is not None and tuple(n.meta.get("shape", ())) == tuple(shape)

        try:
            region = find_region(end, self.record.data_fed.__contains__, self.users, may_start)
        except RegionError as failure:
            raise _Fail(f"the {role} is not a Linear's output reshaped into heads and mapped per position "
                        f"({self.label(end)} is between: {failure})") from None  # fmt: skip
        return self.checked_region(region, role)

    def checked_region(self, region: Region, role: str) -> Region:
        """``region`` where it keeps the shape and holds linear operations on constants only
        (`manifolds._rotary.check_region`), else `_Fail` with the reason."""
        try:
            start, end_shape = region.start.meta.get("shape"), region.end.meta.get("shape")
            if start is None or end_shape is None or tuple(start) != tuple(end_shape):
                raise RegionError(f"it turns a {start} tensor into a {end_shape} one")
            check_region(region, self.model, self.record.data_fed.__contains__, self.record.param_fed.__contains__,
                         start[0])  # fmt: skip
        except RegionError as failure:
            raise _Fail(f"the {role} is not a Linear's output reshaped into heads and mapped per position "
                        f"({self.label(region.end)} is between: {failure})") from None  # fmt: skip
        return region

    def forward(self, node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
        """The Linear call reading ``node`` through reshapes only (nothing else reading them), and the reshapes."""
        chain: list[fx.Node] = []
        current = node
        while True:
            users = self.users(current)
            if len(users) != 1:
                raise _Fail(f"the heads' output {self.label(current)} is read by {len(users)} operations, not one")
            (user,) = users
            proj = self.reading_projection(user)
            if proj is not None and proj.data is current:
                if not self.once(proj):
                    raise _Fail(f"the output projection {self.label(user)} is called more than once")
                return proj, chain
            if self.data_arg(user) is not current:
                raise _Fail(f"the heads' output reaches {self.label(user)}, not an output Linear through reshapes")
            chain.append(user)
            current = user

    def replay(self, chain: Sequence[fx.Node], probe: Tensor) -> Tensor:
        """Run the reshapes of ``chain`` on ``probe`` (constant factors skipped: they move no index)."""
        current = probe
        for node in chain:
            if target_name(node) in _SCALINGS:
                continue
            source, data = self.data_arg(node), current
            args = fx.node.map_arg(node.args, lambda n, s=source, d=data: d if n is s else self.values[n])
            kwargs = fx.node.map_arg(node.kwargs, lambda n: self.values[n])
            if node.op == "call_method":
                current = getattr(args[0], str(node.target))(*args[1:], **kwargs)
            else:
                current = node.target(*args, **kwargs)
        return current

    def feature_probe(self, linear: fx.Node) -> Tensor:
        """A tensor shaped like the Linear's output holding each feature's index."""
        shape = linear.meta.get("shape")
        if shape is None:
            raise _Fail(f"the shape of {self.label(linear)} is unknown")
        return torch.arange(shape[-1], dtype=torch.float64).expand(shape).clone()

    # -- heads ---------------------------------------------------------------------------------------------
    def groups(self, probe: Tensor, features_last: bool, role: str) -> Tensor:
        """``(slots, hd)`` feature indices per head slot of a ``(..., tokens, hd)`` (or transposed) probe."""
        if probe.dim() < 2:
            raise _Fail(f"the {role} has fewer than two axes")
        if not features_last:
            probe = probe.transpose(-2, -1)
        if not bool((probe == probe[..., :1, :]).all()):
            raise _Fail(f"the {role}'s heads do not use the same features for every token")
        return probe[..., 0, :].reshape(-1, probe.shape[-1]).long()

    def heads(self, groups: Sequence[Tensor], role: str,
              shared: int | None = None) -> list[tuple[tuple[int, ...], ...]]:  # fmt: skip
        """The distinct heads: tuples of one feature group per operand; each operand's groups must be disjoint
        and each group belong to one head. The operand ``shared`` may give one group to several heads (a key head
        repeated for a group of query heads: grouped-query attention); its distinct groups must still be disjoint."""
        rows = torch.cat(list(groups), dim=1)
        hd = groups[0].shape[1]
        unique = [tuple(int(v) for v in r) for r in torch.unique(rows, dim=0)]
        heads = [tuple(u[i * hd : (i + 1) * hd] for i in range(len(groups))) for u in unique]
        for i in range(len(groups)):
            seen: set[int] = set()
            for g in (dict.fromkeys(h[i] for h in heads) if i == shared else (h[i] for h in heads)):
                if len(set(g)) != hd or seen & set(g):
                    raise _Fail(f"the {role}'s heads do not partition its features")
                seen |= set(g)
        return heads

    @staticmethod
    def key_groups(heads: Sequence[tuple]) -> list[list[tuple]]:
        """The (query, key) heads gathered by key head, in order of their first query: one factor each, moving the
        queries of every head in the group and the key they share."""
        groups: dict[tuple, list[tuple]] = {}
        for head in heads:
            groups.setdefault(head[1], []).append(head)
        return list(groups.values())

    def linear_blocks(self, proj: _Projection, index: tuple[int, ...], how: str, rows: bool,
                      bias_moves: bool = True) -> list[Block]:  # fmt: skip
        """The blocks of ``proj``'s output features ``index`` (``rows``: its weight's rows and, unless not
        ``bias_moves``, its bias) or of its input features (its weight's columns)."""
        rows_of_bias = rows and bias_moves
        if rows and not bias_moves:  # left unmoved as the output does not read it: read elsewhere, a shift would show
            self.bias_name(proj)
        if proj.module is not None:
            weight = self.param(proj.module, "weight")
            bias = self.param(proj.module, "bias") if rows_of_bias else None
        else:
            weight = self.owned(proj.weight, proj.through or proj.reader)
            if proj.through is not None and self.users(proj.through) != [proj.reader]:
                raise _Fail(f"the transpose of the parameter '{weight}' is also read elsewhere")
            if not rows_of_bias or proj.bias is None:  # the columns leave the bias as it is
                bias = None
            elif proj.bias.op != "get_attr":
                return [Block(weight, 0, index, None, how, proj.transposed), *self.bias_piece(proj, index, how)]
            else:
                bias = self.bias_name(proj)
        blocks = [Block(weight, 0 if rows else 1, index, None, how, proj.transposed)]
        if bias is not None:
            blocks.append(Block(bias, 0, index, None, how))
        return blocks

    def bias_name(self, proj: _Projection) -> str | None:
        """The name of ``proj``'s bias parameter (``None`` where there is none, or it is concatenated from pieces);
        `_Fail` where the bias is also read elsewhere."""
        if proj.module is not None:
            return self.param(proj.module, "bias")
        if proj.bias is None:
            return None
        if proj.bias.op == "get_attr":
            return self.owned(proj.bias, proj.node)
        if self.users(proj.bias) != [proj.node]:
            raise _Fail(f"the bias {self.label(proj.bias)} of {self.label(proj.node)} is also read elsewhere")
        return None

    def own_bias(self, proj: _Projection) -> str | None:
        """The name of ``proj``'s bias where it is a parameter that only ``proj`` reads, else ``None``."""
        try:
            return self.bias_name(proj)
        except _Fail:
            return None

    def sdpa_rows_sum_to_one(self, bound: dict) -> bool:
        """Whether every row of ``F.scaled_dot_product_attention``'s weights sums to one: no dropout, and a mask that
        leaves every query a key (a boolean mask with a row all ``False`` gives that row zeros, not weights summing to
        one), read off its value where it does not depend on the data (else unknown: ``False``)."""
        if bound.get("dropout_p", 0.0) not in (0, 0.0):
            return False
        mask = bound.get("attn_mask")
        if mask is None:
            return True
        value = self.record.constants.get(mask) if isinstance(mask, fx.Node) and mask not in self.record.data_fed \
            else None  # fmt: skip
        if not isinstance(value, Tensor) or value.dim() == 0:
            return False
        kept = value if value.dtype == torch.bool else torch.isfinite(value) if value.is_floating_point() else None
        return kept is not None and bool(kept.any(dim=-1).all())

    def softmax_axis(self, node: fx.Node, of: fx.Node) -> tuple[str, int] | None:
        """``("softmax" | "log_softmax", axis)`` where ``node`` is a softmax of ``of`` (the function or method, with
        an optional floating ``dtype``, or an ``nn.Softmax`` / ``nn.LogSoftmax`` module without hooks: timm's Swin,
        older hand-written attention), ``axis`` in ``[0, ndim)``; else ``None``."""
        shape = node.meta.get("shape")
        if shape is None or len(shape) == 0:
            return None
        m = self.module(node)
        if m is not None:
            if type(m) not in (nn.Softmax, nn.LogSoftmax) or hooked(m) or node.args != (of,) or node.kwargs:
                return None
            name, dim = ("softmax" if type(m) is nn.Softmax else "log_softmax"), m.dim
        else:
            name = target_name(node)
            if name not in ("softmax", "log_softmax") or not node.args or node.args[0] is not of:
                return None
            given = dict(zip(("input", "dim", "_stacklevel", "dtype"), node.args)) | dict(node.kwargs)
            dim, dtype = given.get("dim"), given.get("dtype")
            if not (dtype is None or isinstance(dtype, torch.dtype) and dtype.is_floating_point) \
                    or set(given) - {"input", "dim", "_stacklevel", "dtype"}:  # fmt: skip
                return None
        if not isinstance(dim, int) or isinstance(dim, bool):  # nn.Softmax(dim=None): an implicit axis, not read
            return None
        return name, dim % len(shape)

    def rows_sum_to_one(self, weights: fx.Node) -> bool:
        """Whether ``weights`` (the first operand of ``weights @ v``) is a softmax over its last axis, directly or
        through dropout layers (the identity in eval mode, where every measure evaluates) and casts to floating dtypes
        (HuggingFace's eager attention: ``softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)``): every row sums to
        one, to the rounding of the dtype it is held in."""
        for _ in range(_STEPS_TO_PROJECTION):
            if weights.args and isinstance(weights.args[0], fx.Node):
                found = self.softmax_axis(weights, weights.args[0])
                if found is not None:
                    return found == ("softmax", len(weights.meta["shape"]) - 1)
            source = weights.args[0] if weights.args else None
            if not isinstance(source, fx.Node) or \
                    not (self.is_dropout(weights, source) or floating_cast(weights) is source):  # fmt: skip
                return False
            weights = source
        return False

    def bias_label(self, proj: _Projection) -> str:
        """``proj``'s bias by name (its parameter, or the node concatenating it)."""
        if proj.module is not None:
            return f"'{proj.module}.bias'"
        return f"'{proj.bias.target}'" if proj.bias.op == "get_attr" else self.label(proj.bias)

    def has_bias(self, proj: _Projection) -> bool:
        """Whether ``proj`` adds a bias (a buffer piece of a concatenated one counts: it is not known to be zero)."""
        if proj.module is not None:
            return self.model.get_submodule(proj.module).bias is not None
        return proj.bias is not None

    def bias_piece(self, proj: _Projection, index: tuple[int, ...], how: str) -> list[Block]:
        """The block of the output features ``index`` in a bias concatenated from pieces (`_bias_pieces`): the rows
        of the one piece holding them all where it is a parameter, none where it is a buffer that is zero there (BEiT's
        and EVA's key bias: moved rows of zeros stay zeros); else `_Fail`."""
        cat = proj.bias
        self.bias_name(proj)  # read by the layer alone
        start = 0
        for piece in _bias_pieces(cat):
            size = piece.meta["shape"][0]
            inside = tuple(i - start for i in index if start <= i < start + size)
            start += size
            if not inside:
                continue
            if len(inside) != len(index):
                raise _Fail(f"the rows one factor moves span two pieces of the bias {self.label(cat)}")
            tensor = attribute(self.model, piece)
            if id(tensor) in self.param_name:
                return [Block(self.owned(piece, cat), 0, inside, None, how)]
            if not bool((tensor[list(inside)] == 0).all()):  # a fixed bias of moved rows would have to move too
                raise _Fail(f"the bias {self.label(cat)} holds the buffer '{piece.target}', nonzero at rows a factor "
                            "would move")  # fmt: skip
            return []
        raise _Fail(f"the bias {self.label(cat)} does not hold the rows a factor moves")

    def replayed(self, linear: fx.Node, chain: Sequence[fx.Node], where: tuple | None, features_last: bool,
                 role: str):  # fmt: skip
        """``linear``'s feature indices replayed to where the product reads them, their groups per head slot there
        (`groups`), and where there is a position-wise map ``where = (region, i)`` (`back`), the features of each row
        of its first sample's input ``(rows, hd)`` and the row's map ``(rows, hd, hd)`` (else ``None, None``).

        A map whose rows hold less than a head (Meta's LLaMA multiplies pairs ``(..., hd/2, 2)`` as complex numbers
        between two reshapes) takes in the reshapes on both sides, one pair at a time, until its rows hold whole heads.
        A map whose rows hold several whole heads (rotary embeddings on ``(N, T, D)`` before the heads are split) is
        cut into each head's block, where no head's features reach another's (`head_blocks`).
        """
        if not where:
            at_product = self.replay(chain, self.feature_probe(linear))
            return at_product, self.groups(at_product, features_last, role), None, None
        region, i = where
        before, after = list(chain[:i]), list(chain[i:])
        while True:
            probe = self.replay(before, self.feature_probe(linear))
            at_product = self.replay(after, probe)  # the map keeps the shape and each row's features
            groups = self.groups(at_product, features_last, role)
            # the features of every row of the first sample, as the maps are read: (tokens, heads) in any axis order
            at_start = probe[:1].reshape(-1, probe.shape[-1]).long()
            if set(map(tuple, at_start.tolist())) == set(map(tuple, groups.tolist())):
                break
            if self.holds_heads(at_start, groups):
                break
            if not before or not after or before[-1] is not region.start:
                raise _Fail(f"the {role}'s heads do not hold the same features in the same order on both sides of its "
                            "position map")  # fmt: skip
            start = before[-2] if len(before) > 1 else linear
            region = self.checked_region(Region(start, after[0], (before[-1], *region.nodes, after[0])), role)
            before, after = before[:-1], after[1:]
        try:
            maps = position_maps(region, tuple(probe.shape), self.record.constants | self.values, self.model)
            # read again on another number of samples: a map computed from it (x.numel() // ..., x.shape[-4]) differs
            if self._other_record is None:
                self._other_record = self._other()
            other = self._other_record
            again = position_maps(region, (2 if probe.shape[0] == 1 else 1, *probe.shape[1:]),
                                  other.constants | other.values, self.model)  # fmt: skip
        except RegionError as failure:
            raise _Fail(f"the {role}'s position map ({self.label(region.end)}): {failure}") from None
        except (RuntimeError, IndexError, ValueError, TypeError) as failure:
            raise _Fail(f"the {role}'s position map ({self.label(region.end)}) cannot be read on another number of "
                        f"samples ({type(failure).__name__})") from None  # fmt: skip
        if again.shape != maps.shape or not torch.allclose(again, maps, rtol=0, atol=1e-12 * float(maps.abs().max())):
            raise _Fail(f"the {role}'s position map ({self.label(region.end)}) changes with the number of samples")
        maps = maps.reshape(-1, *maps.shape[-2:])
        if at_start.shape[1] != groups.shape[1]:  # rows of several heads: each head's block of each row
            at_start, maps = self.head_blocks(at_start, maps, groups, role, region)
        return at_product, groups, at_start, maps

    @staticmethod
    def holds_heads(rows: Tensor, groups: Tensor) -> bool:
        """Whether every row of features ``rows`` ``(r, k)``, ``k > hd``, is made of whole head groups ``(slots, hd)``
        (the groups are disjoint: `heads` checks that)."""
        if rows.shape[1] <= groups.shape[1]:
            return False
        heads = {frozenset(g) for g in map(tuple, groups.tolist())}
        for row in map(set, rows.tolist()):
            if sum(len(h) for h in heads if h <= row) != len(row):
                return False
        return True

    def head_blocks(self, rows: Tensor, maps: Tensor, groups: Tensor, role: str, region: Region):
        """Each head's block ``(hd, hd)`` of each row's map ``(k, k)``, the rows' features ``rows`` ``(r, k)`` made
        of whole head groups: ``(r * heads per row, hd)`` features and ``(r * heads per row, hd, hd)`` maps. Fails
        where the map carries a head's features into another's (rotate_half over the whole width pairs features of
        two heads), which no per-head matrix can commute with: any nonzero entry between two heads' blocks (the maps
        are read on unit probes, so blocks the operations never join are exactly zero)."""
        heads = {frozenset(g): g for g in map(tuple, groups.tolist())}
        features, blocks = [], []
        for row, m in zip(rows.tolist(), maps):
            where = {f: i for i, f in enumerate(row)}
            for members, head in heads.items():
                if not members <= where.keys():
                    continue
                inside = torch.tensor([where[f] for f in head])
                outside = torch.tensor([i for i, f in enumerate(row) if f not in members], dtype=torch.long)
                leak = torch.cat((m[inside][:, outside].flatten(), m[outside][:, inside].flatten()))
                if leak.numel() and bool(leak.ne(0).any()):  # exactly: no scale to compare with (a head's
                    # features scaled up and its weights down would hide a leak below any relative threshold)
                    raise _Fail(f"the {role}'s position map ({self.label(region.end)}) mixes the features of "
                                "different heads")  # fmt: skip
                features.append(head)
                blocks.append(m[inside][:, inside])
        return torch.tensor(features, dtype=torch.long), torch.stack(blocks)

    @staticmethod
    def head_rows(head: tuple, side: int, groups: Tensor, maps: Tensor) -> Tensor:
        """The maps of the rows holding ``head``'s features on ``side`` (0 query, 1 key), ``(rows, hd, hd)``."""
        return maps[[i for i, g in enumerate(groups.tolist()) if tuple(g) == head[side]]]

    def head_algebra(self, heads: Sequence[tuple], sides: Sequence[tuple]):
        """The algebra of the subgroup of ``GL(hd)`` commuting with the query maps and key maps' transposes of
        ``heads``, the (query, key) feature groups one factor moves together (one pair, or the query heads sharing a
        key head) (`manifolds._rotary.commutant`; ``None``: no maps, the whole ``GL(hd)``). ``sides``: ``(side,
        groups at the map's input, maps)`` per side with a map (`replayed`)."""
        if not sides:
            return None
        picked = [self.head_rows(head, side, groups, m).transpose(-1, -2) if side == 1
                  else self.head_rows(head, side, groups, m)
                  for head in heads for side, groups, m in sides]  # fmt: skip
        stacked = torch.cat(picked)
        key = (tuple(stacked.shape), stacked.numpy().tobytes())
        if key not in self.commutants:
            try:
                self.commutants[key] = commutant(stacked)
            except RegionError as failure:
                raise _Fail(f"the query/key position maps: {failure}") from None
        return self.commutants[key]

    def query_key(self, where: str, q: fx.Node, k: fx.Node, k_features_last: bool, repeat: int = 1,
                  unread: int | None = None) -> None:  # fmt: skip
        """The query/key factors of scores ``q k^T``; ``repeat``: SDPA's ``enable_gqa`` reads each key head for that
        many consecutive query heads (``repeat_interleave`` along the heads' axis), replayed on the key's features.

        ``unread``: the side (0 ``q``, 1 ``k``) whose rows a softmax of the scores runs along, through steps that keep
        a shift along them a shift (`softmax_side`): the keys. Where no position map acts on them, the key bias is not
        read by the output at all: ``b_k -> b_k + u`` adds ``q . u`` to every score of query ``q``. The factors leave
        it unmoved (``q' . k' = q . k + q . A b_k`` is still such a shift), so neither the metric nor the measure
        depends on it, and a shift of it, which keeps the network's function, keeps the measure."""
        regions_q: list = []
        regions_k: list = []
        lq, chain_q = self.back(q, "query", regions_q)
        lk, chain_k = self.back(k, "key", regions_k)
        pq, gq_all, start_q, maps_q = self.replayed(lq.node, chain_q, regions_q[0] if regions_q else None, True,
                                                    "query")  # fmt: skip
        pk, gk_all, start_k, maps_k = self.replayed(lk.node, chain_k, regions_k[0] if regions_k else None,
                                                    k_features_last, "key")  # fmt: skip
        if repeat > 1:
            pk = _interleaved(pk, repeat)
            gk_all = self.groups(pk, k_features_last, "key")
        if pq.shape[:-2] != pk.shape[:-2]:  # size-1 axes the product broadcasts: read as the expand they are
            batch = _broadcast(pq.shape[:-2], pk.shape[:-2])
            if batch is None or maps_q is not None or maps_k is not None:
                raise _Fail("the query and key heads are broadcast against each other")
            pq, pk = pq.expand(*batch, *pq.shape[-2:]), pk.expand(*batch, *pk.shape[-2:])
            gq_all, gk_all = self.groups(pq, True, "query"), self.groups(pk, k_features_last, "key")
        groups = self.key_groups(self.heads([gq_all, gk_all], "query/key", shared=1))
        sides = [(side, at_start, maps) for side, (at_start, maps) in enumerate(((start_q, maps_q), (start_k, maps_k)))
                 if maps is not None]  # fmt: skip
        algebras = [self.head_algebra(pairs, sides) for pairs in groups]
        # the maps were read on the example's tokens only (one row per token): say so where the claim rests on them
        read = "" if not sides else f" (position maps read on {len(self.head_rows(groups[0][0], *sides[0]))} tokens)"
        factors = []
        keys, key_regions = (lq, regions_q) if unread == 0 else (lk, regions_k)
        unread = unread if unread is not None and not key_regions and self.has_bias(keys) else None
        unmoved = "" if unread is None else _UNMOVED.format(self.bias_label(keys))
        bias = None if unread is None else self.own_bias(keys)  # its name, where it is a parameter read there alone
        for h, (pairs, algebra) in enumerate(zip(groups, algebras)):
            queries = [b for gq, _ in pairs for b in self.linear_blocks(lq, gq, "T", True, bias_moves=unread != 0)]
            shared = "" if len(pairs) == 1 else f" (key head shared by {len(pairs)} query heads)"
            blocks = tuple(queries + self.linear_blocks(lk, pairs[0][1], "inv", True, bias_moves=unread != 1))
            label = f"attention at {where}, head {h}: query/key" + shared + read + unmoved
            entries = pairs[0][1] if unread == 1 else tuple(i for gq, _ in pairs for i in gq)
            factors.append(Factor("GL", len(pairs[0][0]), blocks, label, "A", algebra,
                                  unread=None if bias is None else (bias, tuple(entries))))  # fmt: skip
        self.claim(factors)
        self.found.factors.extend(factors)  # only once every head's blocks are known
        self.claimed_rows |= {lq.key, lk.key}

    def value_output(self, where: str, v: fx.Node, out: fx.Node, repeat: int = 1, features_last: bool = True,
                     rows_sum_to_one: bool = False) -> None:  # fmt: skip
        """The value/output factors of ``out = P v`` merged into an output projection; ``repeat`` as in
        `query_key`. ``features_last=False``: ``out = v^T P^T`` instead, ``v`` the value's transpose ``(..., hd,
        tokens)`` and the output ``(..., hd, tokens)``.

        ``rows_sum_to_one``: every row of ``P`` sums to one (a softmax over the keys). Then adding ``u`` to a value
        head's bias adds ``u`` to every row of the head's output, which the output projection turns into ``Wo_h u``
        for each query head reading it: subtracting that from the output bias keeps the function. Each factor then
        records the value bias and the output bias (`Factor.absorption`), where both are parameters."""
        lv, chain_v = self.back(v, "value")
        lo, chain_o = self.forward(out)
        pv = self.replay(chain_v, self.feature_probe(lv.node))
        if not features_last:
            pv = pv.transpose(-2, -1)
        if repeat > 1:
            pv = _interleaved(pv, repeat)
        shape = out.meta.get("shape")
        if shape is not None and len(shape) >= 3 and tuple(shape[:-2]) != tuple(pv.shape[:-2]) \
                and _broadcast(tuple(shape[:-2]), pv.shape[:-2]) == tuple(shape[:-2]):  # fmt: skip
            pv = pv.expand(*shape[:-2], *pv.shape[-2:])  # size-1 axes the product broadcasts (one value head shared)
        groups = self.groups(pv, True, "value")
        heads = [g for (g,) in self.heads([groups], "value")]
        hd = groups.shape[1]
        if shape is None or len(shape) < 3 or tuple(shape[:-2]) != tuple(pv.shape[:-2]) \
                or shape[-1 if features_last else -2] != hd:  # fmt: skip
            raise _Fail("the attention output's heads do not match the value's")
        # Code every entry of the heads' output by (slot, j), a slot being one (..., tokens, hd) block of it, and replay
        # the merge of the heads; the slots are read off the replay, not assumed: the samples may sit on any axis
        # (heads folded into the batch), and a value head may fill several slots (one per query head reading it).
        head_of = {g: h for h, g in enumerate(heads)}
        slot_head = torch.tensor([head_of[tuple(g)] for g in groups.tolist()])
        code = torch.arange(len(groups), dtype=torch.float64).reshape(*shape[:-2], 1, 1) * hd \
            + torch.arange(hd, dtype=torch.float64).reshape(hd if features_last else (hd, 1))  # fmt: skip
        merged = self.replay(chain_o, code.expand(shape).clone())
        rows = merged.reshape(-1, merged.shape[-1]).long()
        slots, j = rows // hd, rows % hd
        if not bool((j == j[:1]).all()) or not bool((slot_head[slots] == slot_head[slots[:1]]).all()):
            raise _Fail("the merged heads do not put every head at the same features for every token")
        # the output projection's columns in blocks that hold one slot in every row: a query head's columns
        blocks: dict[int, list[int]] = {}
        for column, slot in enumerate(slots[0].tolist()):
            blocks.setdefault(slot, []).append(column)
        readers: list[list[tuple[int, ...]]] = [[] for _ in heads]
        for members in blocks.values():
            cols = tuple(sorted(members, key=lambda c: int(j[0, c])))
            same_slot = bool((slots[:, list(cols)] == slots[:, cols[:1]]).all())
            if len(cols) != hd or [int(j[0, c]) for c in cols] != list(range(hd)) or not same_slot:
                raise _Fail("the merged heads do not cover the output projection's inputs once each")
            readers[int(slot_head[slots[0, cols[0]]])].append(cols)
        ordered = rows.sort(dim=1).values
        if bool((ordered[:, 1:] == ordered[:, :-1]).any()) or not all(readers):
            raise _Fail("the merged heads do not cover the output projection's inputs once each")
        # a constant factor on the way (`v * 2`, `(P v) / 4`) would scale the value bias's share of the output too
        scaled = any(target_name(n) in _SCALINGS for n in (*chain_v, *chain_o))
        output_bias = self.own_bias(lo) if rows_sum_to_one and not scaled else None
        factors = []
        for h, gv in enumerate(heads):
            blocks_h = self.linear_blocks(lv, gv, "T", True)
            value_bias = blocks_h[1] if len(blocks_h) > 1 else None  # after the weight's rows: the bias's
            for cols in readers[h]:
                blocks_h += self.linear_blocks(lo, cols, "invT", False)
            shared = "" if len(readers[h]) == 1 else f" (value head shared by {len(readers[h])} query heads)"
            absorption = None if value_bias is None or output_bias is None else (value_bias, output_bias)
            factors.append(Factor("GL", hd, tuple(blocks_h), f"attention at {where}, head {h}: value/output" + shared,
                                  "B", absorption=absorption))  # fmt: skip
        self.claim(factors)
        self.found.factors.extend(factors)
        self.claimed_rows.add(lv.key)

    def pin(self, where: str, channels: int, reason: str) -> None:
        self.found.pins.append(Pin(where, channels, reason))

    def is_norm(self, node: fx.Node) -> bool:
        """Whether ``node`` calls a normalization module (`_NORMS`)."""
        return node.op == "call_module" and read_as(self.module(node)) in _NORMS

    def score_norm(self, node: fx.Node, role: str, regions: list | None = None) -> tuple[fx.Node, list[fx.Node]]:
        """The normalization (`_NORMS`, called as a module) whose output reaches ``node`` through reshapes and constant
        factors only, each read once, and those steps in order from it; else `_Fail`. Given ``regions`` (a list), one
        position-wise linear map (rotary embeddings: `manifolds._rotary`) may sit between them, appended as in
        `back`."""
        norm, chain, _ = self.walk_back(node, role, regions, to_norm=True)
        return norm, chain

    def norm_pair(self, where: str, q: fx.Node, k: fx.Node, k_features_last: bool, repeat: int = 1) -> None:
        """Scores ``q k^T`` of a normalized query and key (timm's ``qk_norm``, ViT-22B, Qwen3, OLMo 2): ``LN_q``'s scale
        and shift ``* c`` and ``LN_k``'s ``/ c`` keep every score, where each query feature meets one key feature in
        every score (read off the replayed feature indices: feature ``j`` meets feature ``j`` where both norms cover
        the same features); a diagonal factor over the normalized features.

        With rotary embeddings between the normalizations and the product (Qwen3: ``R_t`` per position ``t``, rows
        ``q_t R_t``), ``(q_t C R_t)(k_s C^-1 R_s)^T = q_t R_t R_s^T k_s^T`` holds for every pair of positions exactly
        when the diagonal ``C`` commutes with every map: ``c_i = c_j`` wherever a map mixes features ``i`` and ``j``
        (a rotated pair). The features are tied so (read off the maps of both sides), one scale per tied set.

        With grouped-query attention and norms over all features before the heads are split (OLMo 2's layout with
        fewer key/value heads), the two norms have different sizes: key feature ``j`` meets the features of the query
        heads sharing its head, which then take its scale (``c`` over the key's features, each also moving the query
        features it meets)."""
        regions_q: list = []
        regions_k: list = []
        qn, chain_q = self.score_norm(q, "query", regions_q)
        kn, chain_k = self.score_norm(k, "key", regions_k)
        mq, mk = self.module(qn), self.module(kn)
        size, size_k = tuple(mq.normalized_shape), tuple(mk.normalized_shape)
        if qn is kn or len(size) != 1 or len(size_k) != 1 or mq.weight is None or mk.weight is None:
            raise _Fail("the query and key normalizations are not two with affine scales over a last axis each")
        for n in (qn, kn):
            self.called_once(n, self.label(n))
        pq, _, start_q, maps_q = self.replayed(qn, chain_q, regions_q[0] if regions_q else None, True, "query")
        pk, _, start_k, maps_k = self.replayed(kn, chain_k, regions_k[0] if regions_k else None, k_features_last,
                                               "key")  # fmt: skip
        if pq.dim() < 2 or pk.dim() < 2:
            raise _Fail("the normalized query or key has fewer than two axes")
        if not k_features_last:
            pk = pk.transpose(-2, -1)
        if repeat > 1:
            pk = _interleaved(pk, repeat)
        batch = _broadcast(pq.shape[:-2], pk.shape[:-2])
        if batch is None or pq.shape[-1] != pk.shape[-1] or pq.dim() < 2:
            raise _Fail("the normalized query and key do not meet feature by feature")
        pq, pk = pq.expand(*batch, *pq.shape[-2:]), pk.expand(*batch, *pk.shape[-2:])
        gq, gk = self.groups(pq, True, "query"), self.groups(pk, True, "key")
        found = _met_features(gq, gk, size[0], size_k[0])  # the query features each key feature meets
        if found is None:
            raise _Fail("the normalized query and key do not meet feature by feature")
        met, partner = found
        for n, m in ((qn, mq), (kn, mk)):  # the metric weighs feature j by |(gamma_j, beta_j)|^2: undefined at 0
            bias = getattr(m, "bias", None)  # nn.RMSNorm has none
            pair = torch.stack([m.weight.detach(), *([] if bias is None else [bias.detach()])])
            zeros = int((pair == 0).all(0).sum())
            if zeros:
                raise _Fail(f"{self.label(n)} has {zeros} feature(s) of zero scale and shift, where the metric of the "
                            "trade is undefined")  # fmt: skip
        # ties over the key's features, the query's maps read on the key features their features meet
        tied = _tied_features(size_k[0], [(None if start_q is None else partner[start_q], maps_q), (start_k, maps_k)])
        factors = []
        shared = len(met[0])  # query features meeting each key feature
        for sets in tied:  # one factor per size of the tied sets: member r of every set is block r of each tensor
            ranks = range(len(sets[0]))
            blocks = [Block(self.param(str(qn.target), p), 0, tuple(met[t[r]][o] for t in sets), None, "T")
                      for p in ("weight", "bias") if getattr(mq, p, None) is not None for r in ranks
                      for o in range(shared)]  # fmt: skip
            blocks += [Block(self.param(str(kn.target), p), 0, tuple(t[r] for t in sets), None, "inv")
                       for p in ("weight", "bias") if getattr(mk, p, None) is not None for r in ranks]  # fmt: skip
            label = f"attention at {where}: query/key normalization scales"
            if maps_q is not None or maps_k is not None:  # the claim rests on the maps of the example's positions
                tokens = (q.meta.get("shape") or (None, None))[-2]
                label += f" (position maps read on {tokens} tokens"
                label += ")" if len(sets[0]) == 1 else f"; tied in sets of {len(sets[0])} by them)"
            factors.append(Factor("diagonal", len(sets), tuple(blocks), label, "c"))
        self.claim(factors)
        self.score_norms |= {qn, kn}
        self.found.factors.extend(factors)

    def scores(self, where: str, q: fx.Node, k: fx.Node, k_features_last: bool, repeat: int = 1,
               unread: int | None = None) -> None:  # fmt: skip
        """The query/key factors of scores ``q k^T`` (`query_key`), or, where the query and key are normalized before
        the product, the trade between the normalizations' scales (`norm_pair`), which then also pins the
        projections' factors (with `query_key`'s reason); `_Fail` with both reasons where neither holds."""
        try:
            self.query_key(where, q, k, k_features_last, repeat, unread)
            return
        except _Fail as failure:
            first = failure
        try:
            self.norm_pair(where, q, k, k_features_last, repeat)
        except _Fail as failure:
            raise _Fail(f"{first}; as normalized query and key: {failure}") from None
        self.pin(f"query/key of {where}", 0, f"no query/key factor: {first}")

    def minus_infinity(self, value: object) -> bool:
        """Whether ``value`` (a number, or a node whose value does not depend on the data) is ``-inf`` throughout:
        entries filled so weigh nothing in a softmax, whatever the others are shifted by."""
        if isinstance(value, fx.Node):
            value = self.record.constants.get(value) if value not in self.record.data_fed else None
            return isinstance(value, Tensor) and value.numel() > 0 and bool((value == float("-inf")).all())
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == float("-inf")

    def softmax_side(self, node: fx.Node) -> int | None:
        """Which operand of the scores ``node = a @ b^T`` ``(..., rows of a, rows of b)`` a softmax runs along the rows
        of (1: ``b``'s, the last axis, as attention's keys; 0: ``a``'s, an einsum whose product puts the keys first),
        reached through steps each read alone that keep a shift of every score along that axis a shift: multiplying or
        dividing by a number, adding or subtracting what does not depend on the data (a mask, a position bias),
        ``masked_fill`` by a mask of that kind with ``-inf``, ``torch.where(mask, scores, -inf)``, transposes (which
        move the axes) and views regrouping the axes before the two (Swin's windows); the softmax a function, method
        or module (`softmax_axis`); else ``None``. That operand's bias then adds such a shift only, which the softmax
        ignores."""
        shape = node.meta.get("shape")
        if shape is None or len(shape) < 2:
            return None
        ndim = len(shape)
        axes = [ndim - 2, ndim - 1]  # where the rows of a and of b are
        current = node
        for _ in range(_STEPS_TO_PROJECTION):
            users = self.users(current)
            if len(users) != 1 or len(current.meta.get("shape") or ()) != ndim:
                return None
            (user,) = users
            name, args, kwargs = target_name(user), user.args, user.kwargs
            constant = lambda a: not isinstance(a, fx.Node) or a not in self.record.data_fed  # noqa: E731
            found = self.softmax_axis(user, current)
            if found is not None:
                return axes.index(found[1]) if found[1] in axes else None
            if user.op not in ("call_method", "call_function") or _reinterprets(user):
                return None  # a module named like an operation below (`self.view = nn.Tanh()`), a view as another dtype
            before, after = tuple(current.meta["shape"]), user.meta.get("shape")
            if name in ("view", "reshape") and args and args[0] is current and sorted(axes) == [ndim - 2, ndim - 1] \
                    and after is not None and len(after) >= 2 and tuple(after[-2:]) == before[-2:]:  # fmt: skip
                # the axes before the two regrouped (Swin's scores split by window for its mask): a shift along the
                # rows stays one
                axes = [a - ndim + len(after) for a in axes]
                ndim = len(after)
            elif name in ("transpose", "swapaxes", "permute") and args and args[0] is current and not kwargs \
                    and all(isinstance(a, int) and not isinstance(a, bool) for a in args[1:]):  # fmt: skip
                order = list(range(ndim))
                if name == "permute":
                    order = [a % ndim for a in args[1:]]
                elif len(args) == 3:
                    i, j = args[1] % ndim, args[2] % ndim
                    order[i], order[j] = j, i
                if sorted(order) != list(range(ndim)):
                    return None
                axes = [order.index(a) for a in axes]
            elif name in _SCALINGS and self.data_arg(user) is current:
                pass
            elif name in ("add", "sub") and len(args) == 2 and not kwargs and current in args \
                    and all(constant(a) for a in args if a is not current):  # fmt: skip
                pass  # (`m - scores` turns a shift around: still a shift)
            elif name == "masked_fill" and len(args) == 3 and not kwargs and args[0] is current \
                    and constant(args[1]) and self.minus_infinity(args[2]):  # fmt: skip
                pass  # (a finite fill stays put while the rest shifts: the softmax would see it)
            elif name == "where" and len(args) == 3 and not kwargs and args[1] is current \
                    and constant(args[0]) and self.minus_infinity(args[2]):  # fmt: skip
                pass
            else:
                return None
            current = user
        return None

    # -- patterns --------------------------------------------------------------------------------------------
    def matmul(self, node: fx.Node) -> None:
        if len(node.args) != 2 or node.kwargs or not all(isinstance(a, fx.Node) for a in node.args):
            return
        a, b = node.args
        if not (self.input_fed(a) and self.input_fed(b)):  # a weight product (e.g. `x @ (u * v)`), not attention
            return
        where = self.label(node)
        if a is b:  # `a @ a`: a transformation of one factor moves the other too
            self.pin(f"product {where}", 0, "no attention factor: one tensor is both factors of the product")
            return
        try:
            self.scores(where, a, b, k_features_last=False, unread=self.softmax_side(node))
            return
        except _Fail as qk_failure:
            first = str(qk_failure)
        try:
            self.value_output(where, b, node, rows_sum_to_one=self.rows_sum_to_one(a))
            return
        except _Fail as vo_failure:
            second = str(vo_failure)
        try:  # the transpose of weights times values, `v^T P^T` (an einsum whose output puts the features first)
            self.value_output(where, a, node, features_last=False)
        except _Fail as t_failure:  # a product of no attention we can prove: say why, it pins nothing else
            why = (f"no attention factor: as scores, {first}; as weights times values, {second}; as values times "
                   f"weights, transposed, {t_failure}")  # fmt: skip
            self.pin(f"product {where}", 0, why)

    def sdpa(self, node: fx.Node) -> None:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        bound = dict(zip(names, node.args)) | dict(node.kwargs)
        where = self.label(node)
        q, k, v = (bound.get(n) for n in names[:3])
        if len({q, k, v}) != 3:
            self.pin(f"attention {where}", 0, "one tensor is passed as more than one of query, key and value")
            return
        repeat = 1
        if bound.get("enable_gqa"):  # each key/value head read by `repeat` consecutive query heads
            shapes = [tuple(t.meta.get("shape", ())) if isinstance(t, fx.Node) else () for t in (q, k, v)]
            if bound["enable_gqa"] is not True or min(map(len, shapes)) < 3 or shapes[1][-3] != shapes[2][-3] \
                    or shapes[0][-3] % shapes[1][-3]:  # fmt: skip
                self.pin(f"attention {where}", 0, "enable_gqa with heads that do not group evenly")
                return
            repeat = shapes[0][-3] // shapes[1][-3]
        try:
            self.scores(where, q, k, k_features_last=True, repeat=repeat, unread=1)
        except _Fail as failure:
            self.pin(f"query/key of {where}", 0, f"no query/key factor: {failure}")
        try:
            self.value_output(where, v, node, repeat=repeat, rows_sum_to_one=self.sdpa_rows_sum_to_one(bound))
        except _Fail as failure:
            self.pin(f"value/output of {where}", 0, f"no value/output factor: {failure}")

    def mha(self, node: fx.Node) -> None:
        m = self.module(node)
        name, where = str(node.target), self.label(node)
        if hooked(m):
            self.pin(where, 0, "it has forward hooks")
            return
        if name in self.attention_seen:  # called again: the same factors act on every call (the same weights)
            return
        self.attention_seen.add(name)
        if self.calls[f"{name}.out_proj"]:  # a direct call reads the columns the value/output factor moves
            self.pin(where, 0, "its output projection is also called on its own")
            return
        e, heads = m.embed_dim, m.num_heads
        hd = e // heads
        try:
            if m._qkv_same_embed_dim:
                packed = self.param(name, "in_proj_weight")
                weights = [(packed, 0), (packed, e), (packed, 2 * e)]
            else:
                weights = [(self.param(name, f"{p}_proj_weight"), 0) for p in "qkv"]
            bias = self.param(name, "in_proj_bias")
            out = self.param(name, "out_proj.weight")
            out_bias = self.param(name, "out_proj.bias")
        except _Fail as failure:
            self.pin(where, 0, str(failure))
            return

        # the key bias shifts all of a query's scores alike, which the softmax ignores (see `query_key`), unless
        # add_zero_attn appends a key of zeros that it does not shift
        unread = bias is not None and not m.add_zero_attn

        def rows(i: int, h: int, how: str) -> list[Block]:
            weight, offset = weights[i]
            index = tuple(range(offset + h * hd, offset + (h + 1) * hd))
            blocks = [Block(weight, 0, index, None, how)]
            if bias is not None and not (i == 1 and unread):
                blocks.append(Block(bias, 0, tuple(range(i * e + h * hd, i * e + (h + 1) * hd)), None, how))
            return blocks

        for h in range(heads):
            label = f"attention {where}, head {h}"
            if m.bias_k is None:
                blocks = rows(0, h, "T") + rows(1, h, "inv")
                name_qk = f"{label}: query/key" + (_UNMOVED.format(f"'{bias}' (its key rows)") if unread else "")
                rows_k = tuple(range(e + h * hd, e + (h + 1) * hd))
                self.found.factors.append(Factor("GL", hd, tuple(blocks), name_qk, "A",
                                                 unread=(bias, rows_k) if unread else None))  # fmt: skip
            if m.bias_v is None:
                cols = Block(out, 1, tuple(range(h * hd, (h + 1) * hd)), None, "invT")
                value = rows(2, h, "T")
                # add_zero_attn appends a value of zeros that a value bias does not reach: no absorption then
                absorption = (value[1], out_bias) if len(value) == 2 and out_bias is not None and unread else None
                self.found.factors.append(Factor("GL", hd, (*value, cols), f"{label}: value/output", "B",
                                                 absorption=absorption))  # fmt: skip
        if m.bias_k is not None:
            self.pin(where, 2 * e, "add_bias_kv appends key and value rows that no projection moves")

    # -- diagonal trades -------------------------------------------------------------------------------------
    def consumer_blocks(self, node: fx.Node, index: tuple[int, ...]) -> list[Block]:
        """Column blocks (``/ c``) of every layer reading ``node``; fails unless all are input projections."""
        blocks: list[Block] = []
        users = self.users(node)
        if not users:
            raise _Fail("nothing reads it")
        for user in users:
            m = self.module(user)
            if m is not None and self.calls[str(user.target)] != 1:
                raise _Fail(f"it is read by {self.label(user)}, which is called more than once")
            if type(m) is nn.MultiheadAttention and not hooked(m):
                blocks.extend(self.mha_columns(user, m, node, index))
                continue
            projections = self.input_projections(user, node)
            if projections is None:
                raise _Fail(f"it is read by {self.label(user)}, which is not a Linear or attention input")
            for proj in projections:
                if not self.once(proj):  # reached through a reshape or selection: its calls are not counted above
                    raise _Fail(f"it is read by module '{proj.module}', which is called more than once")
                blocks.extend(self.linear_blocks(proj, index, "inv", False))
        return blocks

    def mha_columns(self, user: fx.Node, m: nn.MultiheadAttention, node: fx.Node, index) -> list[Block]:
        roles = ("query", "key", "value")
        bound = dict(zip(roles, user.args)) | {k: v for k, v in user.kwargs.items() if k in roles}
        elsewhere: list[fx.Node] = []
        fx.node.map_arg((user.args[3:], {k: v for k, v in user.kwargs.items() if k not in roles}), elsewhere.append)
        if node in elsewhere:
            raise _Fail(f"it is also a mask of {self.label(user)}")
        blocks = []
        name, e = str(user.target), m.embed_dim
        for i, role in enumerate(roles):
            if bound.get(role) is not node:
                continue
            if m._qkv_same_embed_dim:
                rows = tuple(range(i * e, (i + 1) * e))
                blocks.append(Block(self.param(name, "in_proj_weight"), 1, index, rows, "inv"))
            else:
                blocks.append(Block(self.param(name, f"{role[0]}_proj_weight"), 1, index, None, "inv"))
        return blocks

    def called_once(self, node: fx.Node, subject: str) -> None:
        """`_Fail` (``subject`` says what) unless the module call ``node`` has no forward hooks and is its only call:
        a trade of its parameters must act on one call, as the forward computes it."""
        m = self.module(node)
        if hooked(m):
            raise _Fail(f"{subject} has forward hooks")
        if self.calls[str(node.target)] != 1:
            raise _Fail(f"{subject} is called more than once")

    def norm(self, node: fx.Node) -> None:
        m = self.module(node)
        where = self.label(node)
        if m.weight is None or len(m.normalized_shape) != 1:
            why = "it has no affine scale" if m.weight is None else "it normalizes over more than the last axis"
            self.pin(f"output of {where}", 0, why)
            return
        size = m.normalized_shape[0]
        index = tuple(range(size))
        try:
            self.called_once(node, "it")
            own = [
                Block(self.param(str(node.target), p), 0, index, None, "T")
                for p in ("weight", "bias")
                if getattr(m, p, None) is not None
            ]
            blocks = own + self.consumer_blocks(node, index)
        except _Fail as failure:
            self.pin(f"output of {where}", size, f"its affine scale cannot be traded: {failure}")
            return
        self.found.factors.append(Factor("diagonal", size, tuple(blocks), f"affine scale of {where}", "c"))

    def scaled(self, node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
        """``(h, w)`` where ``node`` is ``h * w`` (or ``w * h``), ``w`` a ``get_attr`` vector along the last axis and
        ``h`` a tensor of the product's shape computed from the input, else ``None``."""
        args = node.args
        if node.kwargs or len(args) != 2 or not all(isinstance(a, fx.Node) for a in args):
            return None
        params = [a for a in args if a.op == "get_attr"]
        if len(params) != 1:
            return None
        (weight,) = params
        h = args[1] if args[0] is weight else args[0]
        shape, own, size = node.meta.get("shape"), h.meta.get("shape"), weight.meta.get("shape")
        if shape is None or own is None or size is None or len(size) != 1 or tuple(shape) != tuple(own):
            return None
        if not shape or shape[-1] != size[0] or not self.input_fed(h):
            return None
        return h, weight

    def layer_scale(self, node: fx.Node) -> None:
        """``y = h * w`` where the layers reading ``y`` cannot divide their columns (timm's ``LayerScale``: ``y`` is
        added to the residual stream) and ``h`` is a linear layer's output that only this product reads (through
        dropout layers, the identity in eval mode): ``w_j <- c_j w_j`` and the layer's row ``j`` and bias ``j`` ``<- /
        c_j``. Found before the layers' own units (`mlp`), so that those rows are not pinned first; where the readers
        can divide their columns, `scale` trades ``w`` forward instead."""
        found = self.scaled(node)
        if found is None:
            return
        h, weight = found
        size = weight.meta["shape"][0]
        index = tuple(range(size))
        try:
            self.consumer_blocks(node, index)
            return  # the readers take the trade (`scale`)
        except _Fail:
            pass
        reader, source = node, h
        rows = None  # the layer's row blocks (moved by 1 / c)
        for _ in range(_STEPS_TO_PROJECTION):  # back through dropout layers and reshapes, each read by the next alone
            if self.users(source) != [reader]:
                return
            proj = self.projection(source)
            if proj is not None:
                break
            rows = self.mha_rows(source, size)
            if rows is not None:
                break
            data = source.args[0] if source.args and isinstance(source.args[0], fx.Node) else None
            if data is None or not (self.is_dropout(source, data) or self.keeps_features(source, data)):
                return  # (GPT-2's Conv1D views its addmm back: a reshape keeping the features)
            reader, source = source, data
        else:
            return
        if rows is None and not self.once(proj):
            return
        where = self.label(node)
        try:
            name = self.owned(weight, node)
            zeros = int((attribute(self.model, weight) == 0).sum())
            if zeros:  # the trade holds, but its orbit degenerates there: no invariant metric is defined
                raise _Fail(f"'{name}' has {zeros} zero entr{'y' if zeros == 1 else 'ies'} (a zero-initialised "
                            "scale), where the metric of the trade is undefined")  # fmt: skip
            if rows is None:
                rows = self.linear_blocks(proj, index, "inv", True)
            blocks = (Block(name, 0, index, None, "T"), *rows)
            factor = Factor("diagonal", size, blocks, f"layer scale '{name}' at {where}", "c")
            self.claim([factor])
        except _Fail as failure:
            self.pin(f"output of {where}", size, f"its layer scale cannot be traded: {failure}")
            self.layer_scaled.add(node)  # (`scale` would only pin it again)
            return
        if proj is not None:
            self.claimed_rows.add(proj.key)
        self.layer_scaled.add(node)
        self.found.factors.append(factor)

    def mha_rows(self, node: fx.Node, size: int) -> list[Block] | None:
        """Where ``node`` is the output ``[0]`` of an ``nn.MultiheadAttention`` called once (no hooks) with ``size``
        features: the row blocks of its ``out_proj`` (weight and bias, moved by ``1 / c``), which only that output
        reads (the returned weights do not); else ``None``."""
        if node.op != "call_function" or target_name(node) != "getitem" or node.args[1:] != (0,) or node.kwargs:
            return None
        call = node.args[0]
        if not isinstance(call, fx.Node) or call.op != "call_module" or not self.is_mha(call):
            return None
        m = self.module(call)
        if hooked(m) or self.calls[str(call.target)] != 1 or m.embed_dim != size \
                or self.calls[f"{call.target}.out_proj"]:  # out_proj also called on its own: its rows are read there
            return None
        # the output read once: another `[0]` of the same call would read out_proj's rows unscaled
        if any(u is not node and self.piece_index(u) in (0, None) for u in self.users(call)):
            return None
        index = tuple(range(size))
        out = f"{call.target}.out_proj"
        try:  # out_proj's parameters read elsewhere too (shared, tied): no trade
            names = [self.param(out, "weight"), self.param(out, "bias")]
        except _Fail:
            return None
        return [Block(n, 0, index, None, "inv") for n in names if n is not None]

    def scale(self, node: fx.Node) -> None:
        """``h * w`` (or ``w * h``) with ``w`` a parameter vector along the last axis that nothing else reads, ``h`` of
        the product's shape: the affine scale of a normalization written by hand (LLaMA's ``RMSNorm``, ``weight *
        hidden_states``), traded like an ``nn.RMSNorm``'s against the columns of the layers reading the product."""
        found = self.scaled(node)
        if found is None or node in self.layer_scaled:
            return
        h, weight = found
        size = weight.meta["shape"]
        if self.users(h) != [node]:  # fx records `h *= w` out of place: another reader of h would see h w
            self.pin(f"output of {self.label(node)}", size[0], "its elementwise scale cannot be traded: the scaled "
                     "tensor is read elsewhere too")  # fmt: skip
            return
        where = self.label(node)
        index = tuple(range(size[0]))
        try:
            name = self.owned(weight, node)
            factor = Factor("diagonal", size[0], (Block(name, 0, index, None, "T"), *self.consumer_blocks(node, index)),
                            f"elementwise scale '{name}' at {where}", "c")  # fmt: skip
            self.claim([factor])  # the units of a gated product (mlp, earlier on the graph) may divide the same columns
        except _Fail as failure:
            self.pin(f"output of {where}", size[0], f"its elementwise scale cannot be traded: {failure}")
            return
        self.found.factors.append(factor)

    def mlp(self, node: fx.Node) -> None:
        """A Linear whose output reaches only Linears through ReLU / LeakyReLU / dropout and elementwise products with
        tensors computed without it (a gated unit): unit scalings. An output cut along its features into pieces
        (``chunk``, ``split``; Phi-3's ``gate, up = gate_up_proj(x).chunk(2, dim=-1)``) has its pieces' units found
        one piece at a time (`mlp_pieces`)."""
        if self.mlp_pieces(node):
            return
        self.units(node, node, tuple(range(node.meta.get("shape", (0,))[-1])))

    def mlp_pieces(self, node: fx.Node) -> bool:
        """Where ``node`` (a Linear's output) is read by one ``chunk``/``split`` along its last axis alone, whose
        readers each take one piece (distinct ``getitem`` indices), the units of each piece (`units`: rows of the
        Linear, gated by a product with another piece if need be), and ``True``; else ``False``."""
        users = self.users(node)
        if len(users) != 1 or target_name(users[0]) not in ("chunk", "split") or self.data_arg(users[0]) is not node:
            return False
        cut = users[0]
        dim = cut.kwargs.get("dim", cut.args[2] if len(cut.args) > 2 else 0)
        shape = node.meta.get("shape")
        if not isinstance(dim, int) or isinstance(dim, bool) or shape is None or dim % len(shape) != len(shape) - 1 \
                or not self.cut_into_pieces(cut):  # fmt: skip
            return False
        probe = self.feature_probe(node)
        for piece in self.users(cut):
            rows = self.replay([cut, piece], probe)[(0,) * (len(shape) - 1)].long().tolist()
            if rows:  # an empty piece has no units
                self.units(node, piece, tuple(rows), cut)
        return True

    def units(self, node: fx.Node, start: fx.Node, rows: tuple[int, ...], cut: fx.Node | None = None) -> None:
        """The unit scalings of ``rows`` of the Linear computing ``node``, whose features reach Linears from ``start``
        (``node`` itself, or a piece of it cut by ``cut``) only through positively homogeneous maps, gated products
        and selections that keep the features, else a pin with the reason."""
        proj, where = self.projection(node), self.label(node)
        if start is not node:  # a chunk or split along the last axis: contiguous rows
            where += f" (rows {rows[0]}:{rows[-1] + 1})"
        size = len(rows)
        current = start
        linear, padded = True, False  # every step so far commutes with any invertible map of the features; a zero pad
        try:
            if not self.once(proj):
                raise _Fail("it is called more than once")
            while True:
                users = self.users(current)
                user = users[0] if len(users) == 1 else None
                scaled = user is not None and (self.positive(user, current) or self.gated(user, current, node, cut))
                keeps = user is not None and not scaled and self.keeps_features(user, current)
                if scaled or keeps:
                    linear = linear and (keeps or self.passes_through(user, current))
                    padded = padded or target_name(users[0]) == "pad"
                    current = users[0]
                    continue
                if all(self.reads_as_input(u, current) for u in users):
                    break
                bad = next(u for u in users if not self.reads_as_input(u, current))
                kind = target_name(bad) if bad.op != "call_module" else type(self.module(bad)).__name__
                if kind.lower() in _NON_HOMOGENEOUS:
                    raise _Fail(f"it feeds {self.label(bad)}, which is not positively homogeneous")
                raise _Fail(f"it feeds {self.label(bad)}")
            pair = self.linear_pair(proj, rows, current, where, padded) if linear else None
            blocks = self.linear_blocks(proj, rows, "T", True) + self.consumer_blocks(current, tuple(range(size)))
            weight_rows = blocks[0]  # a GL factor moving the weight's columns (attention's output projection) would
            # leave the metric a tensor moved on both sides by factors it weighs one way each
            if any(f.kind == "GL" and b.name == weight_rows.name and b.stored_axis != weight_rows.stored_axis
                   for f in self.found.factors for b in f.blocks):  # fmt: skip
                raise _Fail("its inputs are moved by a GL factor (attention's value/output, or the features of a "
                            "linear layer read linearly), which the metric weighs on its own")  # fmt: skip
            factor = Factor("diagonal", size, tuple(blocks), f"units of {where}", "c")
            # both sides of a product of two homogeneous units (ReGLU's relu(w1 x) * w3 x) would divide the same
            # columns of the reader; the metric weighs a column by one factor, so the first found keeps them
            self.claim([factor])
        except _Fail as failure:
            self.pin(f"output of {where}", size, f"its units cannot be rescaled: {failure}")
            return
        self.found.factors.append(factor)
        if pair is not None:
            self.found.pairs.append((factor, pair))

    def passes_through(self, user: fx.Node, source: fx.Node) -> bool:
        """Whether ``user`` is the identity on ``source`` where the measures evaluate (eval mode): an ``nn.Identity``
        or dropout layer, ``F.dropout`` or ``identity``; a map commuting with every linear map of the features."""
        m = self.module(user)
        if m is not None:
            return (type(m) is nn.Identity or type(m) in DROPOUTS) and user.args == (source,) and not hooked(m)
        if target_name(user) == "identity":
            return user.args == (source,) and not user.kwargs
        # F.dropout(x, p, training) and torch.dropout(x, p, train): the identity only where not training (a mask
        # multiplies each entry: it commutes with scales of the features, not with maps mixing them)
        given = dict(zip(("input", "p", "training"), user.args)) | dict(user.kwargs)
        training = given.get("training", given.get("train", True))
        return target_name(user) == "dropout" and user.args[:1] == (source,) and training is False

    def linear_pair(self, proj: _Projection, rows: tuple[int, ...], end: fx.Node, where: str,
                    padded: bool) -> Factor | None:  # fmt: skip
        """Where the features ``rows`` of ``proj`` reach only linear layers (``end`` the last tensor before them), with
        nothing between but maps that commute with every linear map of the features (reshapes, selections, rolls and
        zero pads along other axes, dropout): ``GL(k)`` on them, ``k = len(rows)``. The rows (and bias) ``<- M^T
        (.)`` and the readers' columns ``<- (.) M^-T``: ``(y M) (V M^-T)^T = y V^T``. A low-rank factorization
        ``B A`` (LoRA's adapters), a bottleneck without activation, OPT-350m's ``project_out`` before an untied
        head. Where one reader alone reads them, directly, and both layers have biases of their own, a shift ``u`` of
        the first bias with ``-V u`` on the reader's keeps the function too (`Factor.absorption`).

        A candidate only: the features' units are recorded first, and the GL factor replaces them at the end of the
        search where no other factor moves a reader's rows (`upgrade_pairs`). ``None`` where a reader is an
        ``nn.MultiheadAttention`` or a layer whose rows a GL factor moves, or ``proj``'s columns are moved by a GL
        factor: the invariant metric weighs a tensor moved on both sides by GL factors in no way."""
        # k no more than W1's inputs: else the product has rank below k, the orbit degenerates (a stabilizer) and the
        # metric's Gram matrices are singular
        k = len(rows)
        if _features(proj.data) is None or _features(proj.data) < k:
            return None
        found = self.linear_readers(end, k, "invT")
        if found is None:
            return None
        readers, columns = found
        weight = self.linear_blocks(proj, rows, "T", True)
        if (weight[0].name, 1) in self.gl_sides():
            return None
        absorption = None
        if len(weight) > 1 and len(readers) == 1 and readers[0].data is end and not padded:
            output_bias = self.own_bias(readers[0])
            absorption = None if output_bias is None else (weight[1], output_bias)
        blocks = (*weight, *columns)
        return Factor("GL", len(rows), blocks, f"features of {where}{_READ_LINEARLY}", "M", absorption=absorption)

    def gl_sides(self) -> set[tuple[str, int]]:
        """``(tensor, axis)`` pairs the GL factors found so far move (axis 0: outputs, 1: inputs)."""
        return {(b.name, b.axis) for f in self.found.factors if f.kind == "GL" for b in f.blocks}

    def linear_readers(self, end: fx.Node, k: int, how: str) -> tuple[list[_Projection], list[Block]] | None:
        """The Linears reading ``end``'s ``k`` features (`input_projections`), each called once, and their column blocks
        moved ``how``; ``None`` where a reader is something else (an ``nn.MultiheadAttention``), has fewer than ``k``
        outputs (its columns' Gram matrix would be singular: a 4-feature layer before 3 classes), or has rows a GL
        factor moves (the metric weighs a tensor moved on both sides by GL factors in no way)."""
        gl_sides, readers, columns = self.gl_sides(), [], []
        for user in self.users(end):
            m = self.module(user)
            found = self.input_projections(user, end)
            if found is None or m is not None and self.calls[str(user.target)] != 1:
                return None
            for reader in found:
                if _features(reader.node) is None or _features(reader.node) < k or not self.once(reader):
                    return None
                blocks = self.linear_blocks(reader, tuple(range(k)), how, False)
                if (blocks[0].name, 0) in gl_sides:
                    return None
                readers.append(reader)
                columns.extend(blocks)
        return (readers, columns) if readers else None

    def token_table(self, node: fx.Node) -> None:
        """An ``nn.Embedding`` (called once, no hooks, no ``max_norm``) whose looked-up features reach only Linears
        through maps commuting with every linear map of the features: ``GL(P)`` on them, ``P`` its width. The table's
        columns ``<- (.) M^T`` and the readers' columns ``<- (.) M^-1``, so every looked-up row becomes ``x M^T`` and
        every reader sees the same product. Where the table is also the weight of one ``nn.Linear`` (an output layer
        tied to it) reading a Linear's outputs alone, that Linear's rows and bias ``<- M^-T (.)``: the logits ``y E^T``
        become ``(y M^-1)(E M^T)^T``. OPT-350m's ``project_in``, ``project_out`` and tied head (``P = 512``).

        Recorded as a candidate (no units to fall back on: the table's columns have no reference scale), kept where no
        other factor moves a reader's rows (`upgrade_pairs`)."""
        m = self.module(node)
        table, size = self.param_name.get(id(m.weight)), m.embedding_dim
        if table is None:
            return
        holders = [n for n, p in self.model.named_modules() if getattr(p, "weight", None) is m.weight and p is not m]
        where = f"embedding table '{table}'"
        try:
            if hooked(m) or self.calls[str(node.target)] != 1 or m.max_norm is not None:
                raise _Fail("it has hooks, a max_norm, or more than one call")
            # rows that can take any value: the table's columns need rank P for the metric (a padding row stays zero)
            if m.num_embeddings - (m.padding_idx is not None) < size:
                padding = " (a padding row among them stays zero)" if m.padding_idx is not None else ""
                raise _Fail(f"its {m.num_embeddings} rows{padding} span less than its {size} features")
            if self.getattr_reads[id(m.weight)] or self.name_count[id(m.weight)] != 1 + len(holders) \
                    or len(holders) > 1:  # fmt: skip
                raise _Fail("the table is also read otherwise than by one output layer tied to it")
            end = node
            while len(self.users(end)) == 1 and (self.passes_through(self.users(end)[0], end)
                                                 or self.keeps_features(self.users(end)[0], end)):  # fmt: skip
                end = self.users(end)[0]
            found = self.linear_readers(end, size, "inv")
            if found is None:
                raise _Fail("its features are not read by Linears alone")
            tied = self.tied_rows(holders[0], size) if holders else []
            blocks = (Block(table, 1, tuple(range(size)), None, "T"), *found[1], *tied)
            label = f"features of the {where}" + (f" and its tied output layer '{holders[0]}'" if tied else "")
            factor = Factor("GL", size, blocks, label + _READ_LINEARLY, "M")
            self.claim([factor])
        except _Fail as failure:
            self.pin(f"features of the {where}", size, f"no basis change of them keeps the function: {failure}")
            return
        self.found.pairs.append((None, factor))

    def tied_rows(self, head: str, size: int) -> list[Block]:
        """The row blocks (``<- M^-T (.)``) of the Linear whose ``size`` outputs the output layer ``head`` (a plain
        ``nn.Linear`` sharing the token table, called once) alone reads, through maps commuting with linear maps of
        the features; `_Fail` otherwise."""
        calls = [n for n in self.graph.nodes if n.op == "call_module" and str(n.target) == head]
        if len(calls) != 1 or not self.plain_linear(calls[0]) or len(calls[0].args) != 1:
            raise _Fail(f"the output layer '{head}' sharing it is not a plain Linear called once")
        reader, source = calls[0], calls[0].args[0]
        for _ in range(_STEPS_TO_PROJECTION):
            if not isinstance(source, fx.Node) or self.users(source) != [reader]:
                break
            proj = self.projection(source)
            if proj is not None:
                if not self.once(proj) or _features(proj.data) is None or _features(proj.data) < size:
                    break
                blocks = self.linear_blocks(proj, tuple(range(size)), "invT", True)
                if (blocks[0].name, 1) in self.gl_sides():
                    break
                return blocks
            data = source.args[0] if source.args and isinstance(source.args[0], fx.Node) else None
            if data is None or not (self.passes_through(source, data) or self.keeps_features(source, data)):
                break
            reader, source = source, data
        raise _Fail(f"the output layer '{head}' sharing it does not read a Linear's outputs alone")

    def upgrade_pairs(self) -> None:
        """Each units factor with a GL candidate (`linear_pair`) replaced by it where no other factor moves a reader's
        rows: the metric weighs a unit's row by its own norm, which a GL factor on the row's columns would change (a
        ReLU after the reader keeps its units, and the features their positive scales)."""
        for units, pair in self.found.pairs:
            readers = {b.name for b in pair.blocks if b.axis == 1}
            taken = any(b.name in readers and b.axis == 0 for f in self.found.factors if f is not units
                        for b in f.blocks)  # fmt: skip
            if units is None:  # an embedding table's (`token_table`): kept or pinned
                if taken:
                    self.pin(pair.label.removesuffix(_READ_LINEARLY), pair.size, "no basis change of them keeps the "
                             "metric defined: a reader's rows are moved by another factor")  # fmt: skip
                else:
                    self.found.factors.append(pair)
            elif not taken:
                self.found.factors[self.found.factors.index(units)] = pair

    def piece_of(self, node: fx.Node, cut: fx.Node) -> fx.Node | None:
        """The reader of ``cut`` (a piece) that ``node`` is computed from, following single tensor arguments back."""
        current = node
        while isinstance(current, fx.Node):
            if current.args[:1] == (cut,):
                return current
            sources = [a for a in current.all_input_nodes if a not in self.values]
            if len(sources) != 1:
                return None
            current = sources[0]
        return None

    def positive(self, user: fx.Node, source: fx.Node) -> bool:
        """Whether ``user`` commutes with a positive scaling of its only tensor input ``source``, feature-wise."""
        if user.args[:1] != (source,):
            return False
        m = self.module(user)
        if m is not None:
            return isinstance(m, _POSITIVE_MODULES) and len(user.args) == 1 and not hooked(m)
        extra = [a for a in list(user.args[1:]) + list(user.kwargs.values()) if isinstance(a, fx.Node)]
        return target_name(user) in _POSITIVE and not extra

    def gated(self, user: fx.Node, source: fx.Node, linear: fx.Node, cut: fx.Node | None = None) -> bool:
        """Whether ``user`` multiplies ``source`` elementwise by a tensor computed without ``linear`` (SwiGLU's
        ``silu(w1 x) * w3 x``, read from ``w3``'s side): ``(c h) g = c (h g)`` feature by feature, where ``h`` is not
        broadcast (its shape is the product's). With ``cut`` (``source`` a piece of ``linear``'s output cut there), the
        gate may read the other pieces of that cut, which hold other rows of the Linear (Phi-3's fused gate and up
        projections)."""
        if target_name(user) != "mul" or user.kwargs or len(user.args) != 2 or user.args.count(source) != 1:
            return False
        other = user.args[1] if user.args[0] is source else user.args[0]
        shape, own = user.meta.get("shape"), source.meta.get("shape")
        if not isinstance(other, fx.Node) or shape is None or own is None or tuple(shape) != tuple(own):
            return False
        if self.users(other) != [user]:  # fx records `g *= h` out of place: another reader of g would see g h
            return False
        own_piece = None if cut is None else self.piece_of(source, cut)
        todo, seen = [other], {other}
        while todo:  # `other` must not read `linear`'s output (h * h is no gate), but for other pieces of it
            n = todo.pop()
            if n is linear:
                return False
            if cut is not None and n.args[:1] == (cut,) and target_name(n) == "getitem" and n is not own_piece:
                continue
            for a in n.all_input_nodes:
                if a not in seen:
                    seen.add(a)
                    todo.append(a)
        return True

    def run(self) -> _Found:
        nodes = list(self.graph.nodes)
        for node in nodes:
            name = target_name(node) if node.op in ("call_function", "call_method") else ""
            if node.op == "call_module" and type(self.module(node)) is nn.MultiheadAttention:
                self.mha(node)
            elif name in _MATMULS or (node.op == "call_function" and node.target is operator.matmul):
                self.matmul(node)
            elif name == _SDPA:
                self.sdpa(node)
            elif is_einsum(node) and sum(self.input_fed(a) for a in node.all_input_nodes) > 1:
                equation = f" '{node.args[0]}'" if isinstance(node.args[0], str) else ""
                self.pin(f"product 'einsum'{equation} (graph node '{node.name}')", 0,
                         f"no attention factor: the einsum is not read as a matrix product: {not_rewritten(node)}")
        for node in nodes:
            if node.op in ("call_function", "call_method") and target_name(node) == "mul":
                self.layer_scale(node)
        for node in nodes:
            if node.op == "call_module" and type(self.module(node)) is nn.Embedding:
                self.token_table(node)
                continue
            if node.op == "call_module" and read_as(self.module(node)) in _NORMS:
                if node not in self.score_norms:
                    self.norm(node)
                continue
            if node.op in ("call_function", "call_method") and target_name(node) == "mul":
                self.scale(node)
                continue
            proj = self.projection(node)
            if proj is not None and proj.key not in self.claimed_rows:  # a layer no attention claimed: units
                self.mlp(node)
        self.upgrade_pairs()
        return self.found


def _features(node: fx.Node) -> int | None:
    """The size of the last axis of ``node``'s output, where its shape was recorded."""
    shape = node.meta.get("shape")
    return int(shape[-1]) if shape else None


def _bias_pieces(node: fx.Node) -> list[fx.Node] | None:
    """The ``get_attr`` nodes of 1-D tensors a bias vector is concatenated from in the forward (BEiT's and EVA's
    ``torch.cat((q_bias, k_bias, v_bias))``, the key's a buffer of zeros), else ``None``."""
    if node.op != "call_function" or target_name(node) != "cat" or len(node.args) > 2 \
            or set(node.kwargs) - {"tensors", "dim"}:  # fmt: skip
        return None
    given = dict(zip(("tensors", "dim"), node.args)) | dict(node.kwargs)
    parts, dim = given.get("tensors"), given.get("dim", 0)
    if not isinstance(parts, (list, tuple)) or isinstance(dim, bool) or dim not in (0, -1):
        return None
    if not all(isinstance(p, fx.Node) and p.op == "get_attr" and len(p.meta.get("shape") or ()) == 1 for p in parts):
        return None
    return list(parts)


def _reinterprets(node: fx.Node) -> bool:
    """Whether ``node`` is ``t.view(dtype)``: the bits read as another dtype, no reshape (nor any linear map)."""
    return target_name(node) == "view" and any(isinstance(a, torch.dtype) for a in (*node.args[1:],
                                                                                  *node.kwargs.values()))  # fmt: skip


def _interleaved(probe: Tensor, repeat: int) -> Tensor:
    """``probe`` ``(..., heads, tokens, hd)`` with each head repeated for ``repeat`` consecutive slots, as SDPA's
    ``enable_gqa`` reads keys and values."""
    if probe.dim() < 3:
        raise _Fail("enable_gqa on tensors without a heads axis")
    return probe.repeat_interleave(repeat, dim=-3)


def _last_axis_slice(index: object, source: object) -> bool:
    """Whether ``index`` takes a constant slice of the last axis of ``source`` (a node of known shape) and every entry
    of the others: ``(..., slice(a, b))`` or full slices before one such slice, with integer bounds and no step."""
    shape = source.meta.get("shape") if isinstance(source, fx.Node) else None
    if shape is None or not isinstance(index, tuple) or not index:
        return False
    *before, last = index
    if before != [Ellipsis] and (len(before) != len(shape) - 1 or any(b != slice(None) for b in before)):
        return False
    return isinstance(last, slice) and last.step is None and all(
        b is None or (isinstance(b, int) and not isinstance(b, bool)) for b in (last.start, last.stop))


def _met_features(gq: Tensor, gk: Tensor, size_q: int, size_k: int) -> tuple[list[tuple[int, ...]], Tensor] | None:
    """Per key feature ``j`` (of ``size_k``), the query features (of ``size_q``) it meets in the scores, sorted, and per
    query feature the key feature it meets (``(size_q,)``): head slot ``s`` pairs query feature ``gq[s, i]`` with key
    feature ``gk[s, i]``. ``None`` unless each query feature meets one key feature, and every key feature as many
    query features as the others (the query heads sharing its head)."""
    if gq.shape != gk.shape:
        return None
    partner: dict[int, int] = {}
    for a, b in zip(gq.flatten().tolist(), gk.flatten().tolist()):
        if partner.setdefault(a, b) != b:
            return None
    if set(partner) != set(range(size_q)) or set(partner.values()) != set(range(size_k)):
        return None
    met: list[list[int]] = [[] for _ in range(size_k)]
    for a, b in sorted(partner.items()):
        met[b].append(a)
    if len({len(m) for m in met}) != 1:
        return None
    return [tuple(m) for m in met], torch.tensor([partner[a] for a in range(size_q)], dtype=torch.long)


def _tied_features(size: int, sides: Sequence[tuple[Tensor | None, Tensor | None]]) -> list[list[tuple[int, ...]]]:
    """The ``size`` normalized features in sets that a diagonal scaling must scale alike to commute with every position
    map: features ``i`` and ``j`` are tied where a map of a side (``(rows, hd)`` features and ``(rows, hd, hd)`` maps,
    `replayed`; ``None``: no maps) mixes them. The sets (each sorted), gathered by size, smallest sets first: one
    list per size, in order of their first feature. `_Fail` where a side's maps mix no features at all (an example of
    one token: its rotation is the identity, which tells nothing of the others)."""
    from scipy.sparse import coo_array  # noqa: PLC0415 (scipy's import is slow, and only this reads rotary maps)
    from scipy.sparse.csgraph import connected_components  # noqa: PLC0415

    pairs: list[tuple[int, int]] = []
    for features, maps in sides:
        if maps is None:
            continue
        # relative to each row's own map: a row scaled far beyond the others must not hide their rotations
        entries = maps.abs() > 1e-12 * maps.abs().amax(dim=(-2, -1), keepdim=True)
        mixed = (entries | entries.transpose(-2, -1)) & ~torch.eye(maps.shape[-1], dtype=torch.bool)
        if not bool(mixed.any()):
            raise _Fail("its position maps on the example's tokens mix no features (every diagonal scaling commutes "
                        "with them, but maps of tokens beyond the example need not): pass an example with more tokens")
        pairs += [(int(features[row, i]), int(features[row, j])) for row, i, j in mixed.nonzero().tolist()]
    rows, cols = zip(*pairs) if pairs else ((), ())
    _, labels = connected_components(coo_array(([1] * len(pairs), (rows, cols)), shape=(size, size)), directed=False)
    sets: dict[int, list[int]] = {}
    for i in range(size):  # in order of their first feature
        sets.setdefault(int(labels[i]), []).append(i)
    by_size: dict[int, list[tuple[int, ...]]] = {}
    for members in sets.values():
        by_size.setdefault(len(members), []).append(tuple(members))
    return [by_size[k] for k in sorted(by_size)]


def _broadcast(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...] | None:
    """The shape ``a`` and ``b`` broadcast to (size-1 axes repeated, as ``matmul`` does its leading axes), else
    ``None``."""
    try:
        return tuple(torch.broadcast_shapes(tuple(a), tuple(b)))
    except RuntimeError:
        return None


def _transposed_of(node: fx.Node) -> fx.Node | None:
    """The ``get_attr`` node a matrix transpose reads (``W.T``, ``W.mT``, ``W.t()``, ``torch.t(W)``,
    ``W.transpose(0, 1)`` and its negative-axis spellings), else ``None``."""
    if node.op not in ("call_method", "call_function") or not node.args or node.kwargs:
        return None
    source, rest = node.args[0], node.args[1:]
    if not isinstance(source, fx.Node) or source.op != "get_attr" or len(source.meta.get("shape") or ()) != 2:
        return None
    name = target_name(node)
    if node.target is getattr:
        return source if rest in (("T",), ("mT",)) else None
    if name == "t" and not rest:
        return source
    if name in ("transpose", "swapaxes", "swapdims") and len(rest) == 2 and all(type(a) is int for a in rest):
        return source if {a % 2 for a in rest} == {0, 1} else None
    return None


def _diagonal_sides(group) -> set[tuple[str, int]]:
    """``(tensor, axis)`` pairs the diagonal group moves with a free scale (axis 0: outputs, 1: inputs)."""
    sides: set[tuple[str, int]] = set()
    for a in group.parameter_actions:
        for axis, index in ((0, a.plus), (1, a.minus)):
            if index is not None and bool((index < group.dim).any()):
                sides.add((a.name, axis))
    return sides


_Fallbacks = list[tuple[Factor, Factor | None]]  # (GL factor on features read linearly, its units or None)


def find_factors(model: nn.Module, traced: TracedNetwork,
                 example_input: Tensor) -> tuple[list[Factor], list[Pin], _Fallbacks]:  # fmt: skip
    """The matrix factors of ``model`` on its traced graph, and the reasons for what is pinned.

    Args:
        model: the network.
        traced: its [`manifolds.trace_network`][manifolds.trace_network] result (with shapes).
        example_input: one input batch (its first two samples are run once to read sizes).

    The passes that read the tensors' values run the model's modules: their buffers are put back after them.

    Returns:
        The factors, the pins, and ``(GL factor, its units)`` for each factor on features read linearly (`_Finder.
            linear_pair`; ``None`` for an embedding table's, which has no units to fall back on).
    """
    with kept_buffers(model):
        return _find_factors(model, traced, example_input)


def _find_factors(model: nn.Module, traced: TracedNetwork,
                  example_input: Tensor) -> tuple[list[Factor], list[Pin], _Fallbacks]:  # fmt: skip
    x = input_like(model, example_input)
    if x.shape[0] == 1:  # traced again on two samples, so that a reshape mixing the samples with the heads shows
        doubled = trace_network(model, torch.cat((x, x)))
        if doubled.graph is not None and doubled.has_shapes:
            traced, x = doubled, torch.cat((x, x))
    graph = as_matrix_products(traced.graph)  # einsum products read as the matmuls they are
    record = _values(model, graph, x)
    other = x[:1]  # another number of samples, for what must not depend on it
    found = _Finder(model, graph, record, lambda: _values(model, graph, other)).run()
    return found.factors, found.pins, found.fallbacks()


def transformer_symmetry(model: nn.Module, example_input: Tensor) -> MatrixSymmetry:
    """The function-preserving group of ``model``: the diagonal rescaling group times attention and
    normalization factors (see `manifolds._attention`).

    Args:
        model: the network (not modified).
        example_input: one input batch (for the shapes and sizes on the graph).

    Returns:
        The `MatrixSymmetry`; ``print(sym.describe())`` lists every factor and pin. A factor that would
            move a side of a tensor the diagonal group already moves is dropped (and listed as pinned).

    Raises:
        UnsupportedModelError: fx cannot trace ``model`` or the forward fails on ``example_input``.
    """
    return required_symmetry(analyze(model, example_input))


def required_symmetry(structure) -> MatrixSymmetry:
    """The whole group of an `manifolds.analyze` result (its ``symmetry``, built once per structure and shared by
    everything holding it, e.g. an objective and its copies at transformed parameters: the graph is theirs alike).

    Raises:
        UnsupportedModelError: the structure's diagonal group is unknown (the sentence names why).
    """
    if structure.group is None:
        raise UnsupportedModelError(f"Cannot find the symmetry group: {structure.group_failure}.")
    return structure.symmetry


def symmetry_of(structure) -> MatrixSymmetry:
    """The whole group of an `manifolds.analyze` result whose diagonal group is known (its ``symmetry``)."""
    traced, model = structure.traced, structure.traced.model
    example = structure.example_input
    if example is None:  # the input analyze guessed: the shape its graph was traced with
        placeholder = next(n for n in traced.graph.nodes if n.op == "placeholder")
        example = torch.zeros(placeholder.meta["shape"])
    full = structure.group
    factors, pins, fallbacks = find_factors(model, traced, example)
    names = [n for n, _ in model.named_parameters()]
    if full is not None:
        # A GL factor on features read linearly pins the diagonal classes scaling its tensors (below), and with them,
        # tensor by tensor, others: where that takes a side from the diagonal group that its units would leave it and
        # no factor moves instead (a convolution's channels before the pair), the measures' claim of the diagonal
        # group would fail. The features keep their units there (an embedding table's are dropped, and said so).
        for pair, units in fallbacks:
            instead = [units if f is pair else f for f in factors if f is not pair or units is not None]
            kept, diagonal = _assembled(full, factors, names)
            moved = {(b.name, b.axis) for f in kept for b in f.blocks}
            if _diagonal_sides(_assembled(full, instead, names)[1]) - _diagonal_sides(diagonal) - moved:
                factors = instead
                if units is None:
                    pins.append(Pin(pair.label.removesuffix(_READ_LINEARLY), pair.size, COVERED))
    kept, diagonal = _assembled(full, factors, names)
    pins.extend(Pin(f.label, f.size, COVERED) for f in factors if f not in kept)
    return MatrixSymmetry(tuple(kept), diagonal, tuple(pins))


def _assembled(full, factors: list[Factor], names: list[str]) -> tuple[list[Factor], object]:
    """The factors kept beside the diagonal group ``full`` and what is left of it (``None`` where ``full`` is)."""
    # A tensor moved by a factor and by the diagonal group on its other side cannot be weighed by the metric (it
    # weighs a tensor one way): such a tensor is left to the factors and the diagonal classes scaling it pinned,
    # starting with the rows GL factors move and the normalization trades (their unit-block metric is defined
    # where a shift is zero, as at initialization; the node metric is not), until no factor and the diagonal
    # group share a tensor.
    moved = {b.name for f in factors if f.kind == "GL" or f.label.startswith("affine scale") for b in f.blocks}
    while True:
        diagonal = None if full is None else _without(full, names, moved)
        taken = _diagonal_sides(diagonal) if diagonal is not None else set()
        kept = [f for f in factors if not any((b.name, b.axis) in taken for b in f.blocks)]  # sides: out 0, in 1
        shared = {b.name for f in kept for b in f.blocks} & {name for name, _ in taken}
        if not shared:
            return kept, diagonal
        moved |= shared


def _without(group, names: Sequence[str], moved: set[str]):
    """``group`` with every class that scales a tensor in ``moved`` pinned (``group`` itself when none does)."""
    if not {a.name for a in group.parameter_actions} & moved:
        return group
    return group.restricted([n for n in names if n not in moved])


def random_transform(
    model: nn.Module, example_input: Tensor, scale: float = 1.0, generator: torch.Generator | None = None
) -> nn.Module:
    """A deep copy of ``model`` moved by a random element of its whole symmetry group (the same function).

    Args:
        model: the network.
        example_input: one input batch (for the graph's shapes).
        scale: spread of the element (see [`MatrixSymmetry.random_element`][manifolds.MatrixSymmetry.random_element]).
        generator: random generator, or ``None`` for the global one.
    """
    sym = transformer_symmetry(model, example_input)
    return sym.transformed(model, sym.random_element(scale, generator))
