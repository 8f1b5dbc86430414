"""The loss of a model over a whole data set, as a function of its parameters.

``Objective`` binds an ``nn.Module``, a loss and data. Its value is the exact loss over all samples
(the mean over samples for ``reduction="mean"``, the sum for ``"sum"``), accumulated chunk by chunk
with each chunk weighted by its number of samples, so unequal batches are weighted correctly.
Parameters are passed functionally (``torch.func.functional_call``); the user's module keeps its
parameters untouched. With ``distributed=True`` the processes of a ``torch.distributed`` group share the
samples, and every value, gradient and product is summed over them (`sharpness.products._distributed`).
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import cached_property

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.func import grad, jvp, vmap

from manifolds import NetworkStructure, ParamLayout, TracedNetwork, UnsupportedModelError, trace_network
from manifolds import eval_mode as eval_mode  # every submodule's mode restored; re-exported here
from manifolds._structure import analyze_traced
from sharpness.products._boundary import (
    APART_SCAN,
    as_vector,
    check_device,
    check_embedding_gradients,
    check_finite,
    check_first_batch,
    check_functional_embeddings,
    check_loss_signature,
    check_meta,
    check_model_inputs,
    check_reduction,
    check_samples_apart,
    evaluation_dtype,
    fixed_tensors,
    float32_hessian_error,
    functional_call,
    model_input_check,
    padded_embedding,
    precision_warning,
    select_params,
    squeeze_label_column,
    unwrap_model,
)
from sharpness.products._data import ChunkedData, DataError, cast_batch
from sharpness.products._data_conv import DataConvolution, split_data_convolution
from sharpness.products._distributed import Communicator, communicator, shared
from sharpness.products._heap import retain_freed_memory
from sharpness.products._layout import channels_last
from sharpness.products._rop import ChunkState, RopChain, rop_chain
from sharpness.products._rop_graph import RopGraph, rop_graph
from sharpness.products._second_order import gradient_products, gradient_with_graph

HVP_STRATEGIES = ("auto", "rop", "graph", "double_backward", "jvp")
# Largest tensor of the R-operator products' state, in bytes: each chunk's state is built and used in pieces of
# at most this many bytes per tensor. A piece's temporaries must fit in the freed memory the heap keeps
# (sharpness.products._heap, 128 MiB), or every piece maps them afresh from the system, page by page: with
# 16 MiB pieces a ResNet-20 product on 1000 samples took 150-450 thousand page faults, a fifth of its time.
_ROP_PIECE_BYTES = 4 * 2**20
# On a GPU there is no such heap to fit, and every piece launches the same few hundred kernels: a ResNet-20 product on
# 1000 samples (H200, float32) took 4.9x a gradient in 4 MiB pieces, 1.5x in 16 MiB and 1.09x from 64 MiB up
# (bench/rop_pieces.py). The memory budget still bounds the state as a whole.
_ROP_PIECE_BYTES_GPU = 256 * 2**20
# Forward activations of one gradient piece on the CPU (larger chunks cut to it; smaller ones joined up to it where
# the memory budget allows). Activations that fit in the heap's retained memory are reused instead of mapped afresh:
# a ResNet-20 gradient over 1000 samples took 5.5 s in one piece and 2.0 s in pieces of 70 samples (2 threads).
_GRADIENT_PIECE_BYTES = 128 * 2**20


CPU_MEMORY_BUDGET = 2 * 2**30


def default_memory_budget(device: torch.device) -> int:
    """Bytes an objective may hold by default: 2 GiB on the CPU; on a CUDA device half of its memory free now
    (what the allocator already caches for this process counts as free)."""
    if device.type != "cuda":
        return CPU_MEMORY_BUDGET
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return (free + cached) // 2


def _activation_bytes_per_sample(model: nn.Module, params, buffers, x: Tensor) -> float:
    """Bytes of all leaf-module outputs of one forward pass, per sample (a memory estimate)."""
    total = [x.numel() * x.element_size()]

    def hook(_module, _inputs, output):
        if isinstance(output, Tensor):
            total[0] += output.numel() * output.element_size()

    handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            functional_call(model, (params, buffers), (x,))
    finally:
        for h in handles:
            h.remove()
    return total[0] / max(x.shape[0], 1)


def hvp_by_jvp(loss: Callable[[object, Tensor, Tensor], Tensor], point: object, tangent: object, x: Tensor,
               y: Tensor) -> object:  # fmt: skip
    """``torch.func.jvp`` of ``torch.func.grad(loss)`` at ``point`` along ``tangent`` (forward over reverse): the
    Hessian-vector product of ``loss(point, x, y)`` in its first argument, shaped like ``point``.

    Floating targets go along as a primal with a zero tangent of their own: torch's forward-mode formula of
    ``mse_loss``'s backward under ``reduction="mean"`` divides the targets' tangent in place, which raises
    "ZeroTensors are immutable" when the targets have none (torch 2.x)."""
    if not y.is_floating_point():
        return jvp(lambda p: grad(loss)(p, x, y), (point,), (tangent,))[1]
    return jvp(lambda p, t: grad(loss)(p, x, t), (point, y), (tangent, torch.zeros_like(y)))[1]


# torch losses whose ``weight`` rescales each output entry: their mean is still over every entry, a per-sample mean
_ELEMENT_WEIGHTED = (nn.BCELoss, nn.BCEWithLogitsLoss, nn.MultiLabelSoftMarginLoss)


def _loss_reduction(loss_fn: Callable, reduction: str | None) -> str:
    reduction = reduction or getattr(loss_fn, "reduction", "mean")
    if reduction == "batchmean" and isinstance(loss_fn, nn.KLDivLoss) and loss_fn.reduction == "batchmean":
        return "mean"  # the sum over a batch over its samples: a per-sample mean
    if reduction not in ("mean", "sum"):
        raise ValueError(f"the loss reduction must be 'mean' or 'sum', got {reduction!r}")
    weighted = getattr(loss_fn, "weight", None) is not None and not isinstance(loss_fn, _ELEMENT_WEIGHTED)
    if reduction == "mean" and weighted:
        raise ValueError(
            "a class-weighted mean loss is not a per-sample mean, so chunks cannot be combined exactly; "
            "use reduction='sum' (and divide the results by the total weight) or an unweighted loss"
        )
    return reduction


def _reduced_as(loss_fn: Callable, reduction: str) -> Callable:
    """The loss the objective evaluates: a torch loss module whose own ``reduction`` differs from ``reduction``
    (the ``reduction=`` override) is evaluated as a copy reduced as the override says, so the value is the true
    mean or sum over the data set however it is chunked (the chunks' means summed, or their sums averaged, would
    depend on the chunking). Any other callable is taken to compute what ``reduction`` declares."""
    if isinstance(loss_fn, nn.modules.loss._Loss) and loss_fn.reduction != reduction:
        reduced = copy.copy(loss_fn)  # shares the module's tensors (class weights); only the reduction differs
        reduced.reduction = reduction
        return reduced
    return loss_fn


def _chunked_mean(loss_fn: Callable, data: ChunkedData, n_samples: int) -> tuple[Callable, float, bool]:
    """``(chunk loss, weight, per sample)`` of a mean-reduced loss: a chunk of ``m`` samples weighs ``weight * m``
    (``per sample``), or, for a loss that leaves out the targets equal to its ``ignore_index`` where some do, or
    whose targets are several labels per sample (one per token or pixel), the loss summed over the chunk weighs
    ``1 / (targets counted over the whole data set)``: a mean over a chunk's counted targets would weigh its samples
    differently from chunk to chunk (and so would a mean over a chunk's tokens where batches have other lengths)."""
    if not isinstance(loss_fn, nn.modules.loss._Loss):
        labels = data.labels_other_than(-100)
        if labels is not None and labels[1]:
            raise DataError(
                "some class labels are -100, which F.cross_entropy and F.nll_loss leave out of their mean by default "
                "(ignore_index=-100), so the means of chunks with other counts of them cannot be combined exactly; "
                "pass nn.CrossEntropyLoss() or nn.NLLLoss(), whose ignored targets are counted over the whole data set"
            )
    ignored = getattr(loss_fn, "ignore_index", None)
    if isinstance(loss_fn, nn.modules.loss._Loss) and isinstance(ignored, int):
        labels = data.labels_other_than(ignored)
        if labels is not None and labels[0] == 0:
            raise DataError(f"every target equals the loss's ignore_index ({ignored}): the mean loss is undefined")
        if labels is not None and (labels[1] or labels[0] != data.total_samples):
            summed = copy.copy(loss_fn)
            summed.reduction = "sum"
            return summed, 1.0 / labels[0], False
    return loss_fn, 1.0 / n_samples, True


class Objective:
    """Whole-data-set loss ``f(w)`` of ``model`` under ``loss_fn``, with gradients and HVPs.

    Everything is checked when the objective is built, before any work (`sharpness.products._boundary`), with
    one sentence and one documented exception per problem (see Raises).

    Args:
        model: an ``nn.Module`` whose forward returns one floating tensor of outputs (a tuple or dict is refused:
            wrap the model so that forward returns the tensor the loss takes). ``DataParallel``,
            ``DistributedDataParallel`` and ``torch.compile`` wrappers are taken off (the module inside is
            evaluated); TorchScript modules are refused. Attention runs through PyTorch's math kernel (the fused
            kernels have no second derivatives). It is evaluated in eval mode (dropout off, batch-norm
            running statistics) and given back in its own mode after each evaluation; a warning says
            so when the module was in training mode.
        loss_fn: ``loss_fn(outputs, targets) -> scalar`` (a 0-dim tensor, checked on the first batch); a module's
            ``reduction`` attribute (``"mean"``/``"sum"``) is honoured, a plain function is taken as a per-sample
            mean (unless ``reduction`` says otherwise).
        data: ``(X, y)`` tensors, a DataLoader, or an iterable of ``(inputs, targets)`` batches
            ([`ChunkedData`][sharpness.ChunkedData]). Every pass must yield the same samples in the same order:
            a shuffling DataLoader is refused here, and each pass over another loader or iterable is compared
            with the first complete one (sample count and a digest of content and order), so a one-shot iterable,
            one that yields fewer batches later, a random sampler or random augmentation raise
            `DataError` (here or at the first pass that differs) instead of giving each product other data.
            Inputs are constants (detached). Under ``CrossEntropyLoss``/``NLLLoss`` an ``(X, y)`` pair whose ``y`` is a
            column ``(n, 1)`` of integer labels (pandas, scikit-learn) is read as ``(n,)``; batches of such
            columns are refused, naming the reshape.
        chunk_size: most samples per forward pass (``None``: chosen from ``memory_budget``).
        dtype: evaluate in this floating dtype, float32 or float64 (parameters, buffers, parameters held
            fixed and floating data are cast; the model is not changed); ``None`` keeps the parameters' dtype,
            except half precision (float16, bfloat16), which is measured in float32: bfloat16 arithmetic loses
            half of a Hessian. Results record it (``dtype`` in `facts`), and say where float32 is not
            enough ([`precision_warning`][sharpness.Objective.precision_warning]).
        device: device to evaluate on (``None``: the parameters' device).
        reduction: override the loss's reduction (``"mean"`` or ``"sum"``). A torch loss module whose own
            ``reduction`` differs is evaluated as a copy with this one (the value is the true mean or sum over
            the data set); for any other callable it declares what the callable computes.
        memory_budget: bytes of activations allowed in flight; sets the default chunk size and
            whether the Hessian-vector products may keep a whole-data-set graph alive (``None``:
            `default_memory_budget` of the device).
        params: evaluate at these parameter values instead of the module's, and differentiate in these only
            (names of ``model.named_parameters()``, or the wrapper's; a name the model does not have or a shape
            that differs is refused).
        structure: `manifolds.analyze` of ``model``, when already known (see `structure`).
        distributed: ``True``: share the samples among the processes of the default ``torch.distributed``
            group (a ``ProcessGroup``: of that group). Every process must build its objective with the same
            model, parameters and whole data set (a DataLoader without shuffling), and then make the same
            calls; each evaluates its contiguous share of the samples (shares differ by at most one sample,
            nothing is repeated) and the sums are reduced once per value, gradient or product, so every
            process gets the whole-data-set result. ``memory_budget`` is per process. Validation errors are
            raised on every process. ``False`` (default): this process alone, on all the data.

    Attributes:
        model: the module evaluated (``model`` with its wrappers taken off).
        params: ``{name: tensor}`` of the trainable parameters (detached copies in ``dtype``).
        buffers: ``{name: tensor}`` of everything else the forward reads from the module: its buffers and the
            parameters held fixed (frozen ones included), copies in ``dtype`` where floating.
        layout: `manifolds.ParamLayout` of ``params`` (flat vectors have length ``layout.size``).
        n_samples: number of samples in the data set (every process's share together).
        comm: the [`Communicator`][sharpness.Communicator] the sums go through.
        chunk_loss_fn: the loss each chunk's weighted share is taken of: the objective is
            ``sum(weight * chunk_loss_fn(outputs, targets))`` over `chunks` (or `pieces`). It is
            ``loss_fn``, except for a mean-reduced loss that leaves out the targets equal to its ``ignore_index``
            (``CrossEntropyLoss``, ``NLLLoss``) where some do, or whose targets are several class labels per sample
            (per token, per pixel): then its summed copy, each chunk weighted by one over the targets counted in
            the whole data set, so the objective is the mean over those targets however the data are chunked
            (found by one pass over the targets when the objective is built).

    Raises:
        TypeError: an argument of the wrong kind (a model that is not an ``nn.Module``, ``params`` values that
            are not floating tensors, a ``dtype`` that is not a ``torch.dtype``, a loss returning a non-tensor).
        ValueError: an argument with a wrong value: no trainable parameters, unknown or misshapen ``params``,
            a non-floating or half-precision ``dtype``, the meta device or tensors on it, NaN or infinite weights
            (in ``dtype``), a loss that is not a scalar, a reduction other than mean or sum.
        manifolds.UnsupportedModelError: a TorchScript model, or a forward that does not return one floating
            tensor.
        DataError: unusable data (every target ignored by a mean-reduced loss included), a DataLoader that
            shuffles, data that change between passes (also raised later, by the first evaluation whose pass
            differs); with several processes also fewer samples than processes, or data that differ between
            processes (another count, other inputs or targets, or another order: compared by digest).
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        data: object,
        *,
        chunk_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        reduction: str | None = None,
        memory_budget: int | None = None,
        params: Mapping[str, Tensor] | None = None,
        structure: NetworkStructure | None = None,
        distributed: bool | dist.ProcessGroup | Communicator = False,
    ):
        # The boundary (sharpness.products._boundary): every argument checked before any work, one sentence each.
        model, prefix = unwrap_model(model)
        if model.training:
            warnings.warn(
                f"{type(model).__name__} is in training mode; the objective evaluates it in eval mode "
                "(dropout off, batch-norm running statistics) and leaves its mode as it was",
                UserWarning,
                stacklevel=2,
            )
        self.model = model
        check_loss_signature(loss_fn)
        self.loss_fn = loss_fn
        self.reduction = _loss_reduction(loss_fn, reduction)
        # KLDivLoss's "batchmean" is its per-sample mean: evaluated as it is, unless another reduction is asked for
        batchmean = reduction in (None, "batchmean") and getattr(loss_fn, "reduction", None) == "batchmean"
        self._reduced_loss = loss_fn if batchmean else _reduced_as(loss_fn, self.reduction)
        source = select_params(model, params, prefix)
        check_embedding_gradients(model, source)
        others = fixed_tensors(model, source)
        check_meta(source, "parameter" if params is None else "params entry")
        check_meta(others, "tensor")
        ref = next(iter(source.values()))
        self.device = check_device(device if device is not None else ref.device)
        self.dtype = evaluation_dtype(dtype, ref.dtype)
        self.comm = communicator(distributed)
        if self.device.type == "cpu":  # pieces of data allocate and free the same tensors over and over
            retain_freed_memory()
        self.params = {k: p.detach().to(self.device, self.dtype) for k, p in source.items()}
        # Every tensor functional_call takes from the module: buffers and the parameters held fixed (frozen ones).
        # Copies, never views of the caller's tensors: a forward that writes into a buffer must not reach the model.
        self.buffers = {
            k: b.detach().to(self.device, self.dtype if b.is_floating_point() else None, copy=True)
            for k, b in others.items()
        }
        if self.comm.world_size > 1:  # process 0's parameters and buffers everywhere, as DistributedDataParallel does
            self.params = {k: self.comm.broadcast_(t.clone()) for k, t in self.params.items()}
            self.buffers = {k: self.comm.broadcast_(t.clone()) for k, t in self.buffers.items()}
        check_finite(self.params, self.buffers, self.dtype)  # after the broadcast: the same verdict everywhere
        data = squeeze_label_column(data, loss_fn, self._output_dims)
        self.layout = ParamLayout.from_tensors(self.params)
        self._rop_bytes_per_sample: int | None = None  # its state's size, once measured (None: not yet)
        self._rop_piece: int | None = None  # samples per piece of a chunk's state (None: whole chunks)
        self._rop_states: list | None = None  # the chunks' cached forward state (strategy "rop")
        if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float))
                                          or not memory_budget >= 0):  # fmt: skip
            raise ValueError(f"memory_budget must be a number of bytes >= 0 or None, got {memory_budget!r}")
        self.memory_budget = default_memory_budget(self.device) if memory_budget is None else int(memory_budget)
        self._bytes_per_sample: float | None = None
        self.data = self._share_data(data, chunk_size)
        self.n_samples = self.data.total_samples
        # What one process holds at most (the memory decisions, the same on every process).
        self._share_size = -(-self.n_samples // self.comm.world_size)
        # The loss each chunk's weighted share is taken of, and the weights (see chunk_loss_fn).
        reduced = self._reduced_loss
        self.chunk_loss_fn, self._weight, self._per_sample = reduced, 1.0, False
        if self.reduction == "mean":
            self.chunk_loss_fn, self._weight, self._per_sample = _chunked_mean(reduced, self.data, self.n_samples)
        error = None
        try:  # on this process's first samples: raised on every process together
            with eval_mode(self.model):
                check_reduction(self.model, self.chunk_loss_fn, self.params, self.buffers, self.data.first_batch(),
                                self.dtype, self.device, self._per_sample)  # fmt: skip
        except ValueError as exc:
            error = exc
        self.comm.check_together(error)
        self._graph: tuple[list[Tensor], list[Tensor]] | None = None
        self._value: Tensor | None = None  # the loss at ``params``, once computed
        self._strategy: str | None = None
        self._autograd_strategy: str | None = None
        self._embeddings_checked = False  # the traced graph's embedding calls (hvp_strategy checks them once)
        self.gradient_seconds: float | None = None
        # filled once, shared by the with_params copies
        self._structure: list[NetworkStructure] = [] if structure is None else [structure]
        self._traced: list[TracedNetwork] = []  # the traced graph alone, where no structure was needed yet
        # Read off the traced graph (self.structure) on first use:
        # where the model starts with a convolution of the data, second derivatives skip its input gradient;
        # where the model is made of affine layers, eval-mode BatchNorm and piecewise-linear operations (a chain,
        # or a graph with residual sums and concatenations), HVPs by hand.
        self._cuts: tuple[DataConvolution | None, RopChain | RopGraph | None] | None = None

    # ----------------------------------------------------------------------------------------------
    # plumbing
    def _output_dims(self, x: Tensor) -> int:
        """The dimensions of the model's outputs on inputs ``x`` (a few samples; checked by the model first where it
        says which inputs it takes)."""
        check = model_input_check(self.model)
        if check is not None:
            check(x)
        xs = x.to(self.device, self.dtype if x.is_floating_point() else None)
        with torch.no_grad(), eval_mode(self.model):
            return functional_call(self.model, (self.params, self.buffers), (xs,)).dim()

    def _share_data(self, data: object, chunk_size: int | None) -> ChunkedData:
        """The data chunked, and cut to this process's share where several processes share them. Checked on
        every process together: one that fails fails them all, with its message."""
        comm, shard = self.comm, (self.comm.rank, self.comm.world_size)
        error, chunked, fingerprint = None, None, None
        try:
            chunked = ChunkedData(data, chunk_size)
            checked = isinstance(data, ChunkedData) and data.shard == shard  # a with_params copy: compared before
            if comm.world_size > 1 and not checked:
                fingerprint = chunked.fingerprint()
        except Exception as exc:  # noqa: BLE001 - every process must learn of it, whatever it is
            error = exc
        comm.check_together(error)
        _check_same_data(comm, fingerprint)
        try:
            chunked = ChunkedData(chunked, chunk_size, shard=shard)
            check_model_inputs(self.model, chunked)  # before any forward (the chunk size is measured by one)
            if chunk_size is None:
                self.data = chunked
                chunked = ChunkedData(chunked, self._auto_chunk_size())
            self.data = chunked
            self._check_targets()
            chunked.n_samples  # noqa: B018 - counts this process's share, and refuses an empty data set
        except Exception as exc:  # noqa: BLE001
            error = exc
        comm.check_together(error)
        return chunked

    def _check_targets(self) -> None:
        """One forward pass on two samples of the first batch: outputs, targets and loss as the objective needs
        them (`sharpness.products._boundary.check_first_batch`)."""
        before = {k: b.clone() for k, b in self.buffers.items()}
        with eval_mode(self.model):
            check_first_batch(self.model, self._reduced_loss, self.params, self.buffers, self.data.first_batch(),
                              self.dtype, self.device)  # fmt: skip
        changed = [k for k, b in self.buffers.items() if not torch.equal(b, before[k])]
        if changed:
            raise UnsupportedModelError(
                f"the forward changes buffer(s) {', '.join(map(repr, changed[:3]))} in place even in eval mode, so "
                "every pass would evaluate another function; keep the forward free of state updates while measuring"
            )
        with eval_mode(self.model):
            check_samples_apart(self.model, self.params, self.buffers, self.data.leading_inputs(APART_SCAN),
                                self.dtype, self.device)  # fmt: skip

    def facts(self) -> dict:
        """What every result records about its objective: ``loss`` (at ``params``), ``n_params`` (the
        trainable parameters the Hessian is taken over), ``n_samples``, ``dtype`` (the one computed in, e.g.
        ``"float32"``), where several processes share the data ``processes``, and where float32 loses the Hessian
        at this point ``warnings`` (a list of sentences; see `precision_warning`)."""
        facts = {"loss": float(self.value()), "n_params": self.layout.size, "n_samples": self.n_samples,
                 "dtype": str(self.dtype).removeprefix("torch.")}  # fmt: skip
        if self.precision_warning is not None:
            facts["warnings"] = [self.precision_warning]
        return facts if self.comm.world_size == 1 else {**facts, "processes": self.comm.world_size}

    @property
    def precision_warning(self) -> str | None:
        """Where the objective computes in float32: a sentence naming ``dtype=torch.float64`` when float32 loses
        the Hessian at ``params`` (a float32 Hessian-vector product on the first samples more than 1% from
        float64's, `sharpness.products._boundary.float32_hessian_error`; checked once), else ``None``."""
        if self.dtype != torch.float32:
            return None
        if not hasattr(self, "_precision_warning"):
            with eval_mode(self.model):
                error = float32_hessian_error(self.model, self.chunk_loss_fn, self.params, self.buffers,
                                              self.data.first_batch(), self.device, self._rop_reader())  # fmt: skip
            self._precision_warning = precision_warning(error)
        return self._precision_warning

    @property
    def structure(self) -> NetworkStructure:
        """`manifolds.analyze` of the model: its layers and which rescalings it admits (computed once,
        shared with the [`with_params`][sharpness.Objective.with_params] copies)."""
        if not self._structure:
            self._structure.append(analyze_traced(self.model, self._traced_network(), self.data.first_batch()[0]))
        return self._structure[0]

    def _traced_network(self) -> TracedNetwork:
        """The model's traced graph with shapes (`manifolds.trace_network`, traced once and shared like `structure`):
        all the products read, without the symmetry analysis `structure` adds."""
        if self._structure and self._structure[0].traced is not None:
            return self._structure[0].traced
        if not self._traced:
            self._traced.append(trace_network(self.model, self.data.first_batch()[0]))
        return self._traced[0]

    def _graph_cuts(self) -> tuple[DataConvolution | None, RopChain | RopGraph | None]:
        if self._cuts is None:
            traced = self._traced_network()
            graph = traced.graph  # None where fx cannot trace the model: the generic autograd products apply
            cut = split_data_convolution(self.model, self.params, graph)
            rop = rop_chain(self.model, self.params, graph)
            if rop is None and traced is not None and traced.has_shapes:
                rop = rop_graph(self.model, self.params, self.buffers, graph)
            self._cuts = (cut, rop)
        return self._cuts

    def _rop_reader(self) -> Callable | None:
        """Where the R-operator products apply, ``(params, buffers) -> `` this model's chain or graph reader for
        them (its BatchNorm statistics in their dtype), else ``None``."""
        if self._rop is None or (self._rop_bytes_per_sample is None and not self._rop_applies()):
            return None
        graph = self._traced_network().graph
        if isinstance(self._rop, RopChain):
            return lambda params, buffers: rop_chain(self.model, params, graph)
        return lambda params, buffers: rop_graph(self.model, params, buffers, graph)

    @property
    def _data_conv(self) -> DataConvolution | None:
        return self._graph_cuts()[0]

    @property
    def _rop(self) -> RopChain | RopGraph | None:
        return self._graph_cuts()[1]

    def with_params(self, params: Mapping[str, Tensor]) -> Objective:
        """The same model, loss and data evaluated at other parameter values (same names and shapes)."""
        with warnings.catch_warnings():  # this objective said so already when it was built
            warnings.filterwarnings("ignore", message=".* is in training mode", category=UserWarning)
            twin = Objective(
                self.model,
                self.loss_fn,
                self.data,
                chunk_size=self.data.chunk_size,
                dtype=self.dtype,
                device=self.device,
                reduction=self.reduction,
                memory_budget=self.memory_budget,
                params=params,
                distributed=self.comm,
            )
        twin._structure, twin._traced = self._structure, self._traced
        return twin

    def activation_bytes_per_sample(self) -> float:
        """Estimated bytes of one sample's forward activations (measured once on a few samples)."""
        if self._bytes_per_sample is None:
            x, y = self.data.first_batch()
            x, _ = cast_batch(x[:8], y[:8], self.dtype, self.device)
            with eval_mode(self.model):
                self._bytes_per_sample = _activation_bytes_per_sample(self.model, self.params, self.buffers, x)
        return self._bytes_per_sample

    def _auto_chunk_size(self) -> int:
        # A double-backward pass keeps roughly four copies of the forward activations alive.
        return max(1, int(self.memory_budget / (4 * self.activation_bytes_per_sample())))

    def chunks(self) -> Iterator[tuple[Tensor, Tensor, float]]:
        """Yield ``(inputs, targets, weight)``; the objective is ``sum(weight * chunk_loss)``."""
        for x, y in self.data:
            x, y = cast_batch(x, y, self.dtype, self.device)
            w = self._weight * x.shape[0] if self._per_sample else self._weight
            yield x, y, w

    def pieces(self, size: int, join: bool = False) -> Iterator[tuple[Tensor, Tensor, float]]:
        """`chunks` regrouped into pieces of at most ``size`` samples, each weighted by its share, so that
        ``sum(weight * piece_loss)`` is still the objective: a larger chunk is cut into near-equal pieces, and with
        ``join`` consecutive smaller chunks are concatenated up to ``size`` samples (a piece then holds several
        chunks' inputs at once)."""
        size = max(1, int(size))
        held: list[tuple[Tensor, Tensor, float]] = []
        for x, y, w in self.chunks():
            n = x.shape[0]
            if held and (not join or sum(h[0].shape[0] for h in held) + n > size
                         or x.shape[1:] != held[0][0].shape[1:] or y.shape[1:] != held[0][1].shape[1:]):  # fmt: skip
                yield self._joined(held)  # samples of another shape (sequences of another length) are not joined
                held = []
            if n > size:
                cuts = -(-n // size)
                for i in range(cuts):
                    lo, hi = n * i // cuts, n * (i + 1) // cuts
                    yield x[lo:hi], y[lo:hi], (w * (hi - lo) / n if self._per_sample else w)
            elif join:
                held.append((x, y, w))
            else:
                yield x, y, w
        if held:
            yield self._joined(held)

    def _joined(self, held: list[tuple[Tensor, Tensor, float]]) -> tuple[Tensor, Tensor, float]:
        """Consecutive chunks as one: the summed weight of a per-sample mean (each chunk's is its share of the
        samples), the common weight of a sum."""
        if len(held) == 1:
            return held[0]
        w = sum(h[2] for h in held) if self._per_sample else held[0][2]
        return torch.cat([h[0] for h in held]), torch.cat([h[1] for h in held]), w

    def _chunk_loss(self, params: Mapping[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        return self.chunk_loss_fn(functional_call(self.model, (params, self.buffers), (x,)), y)

    def _weighted_loss(self, params: Mapping[str, Tensor], x: Tensor, y: Tensor, w: float) -> Tensor:
        # The chunk's weight is folded into the loss, so its derivatives come out weighted for free.
        return w * self._chunk_loss(params, x, y)

    def _autograd_loss(self, params: Mapping[str, Tensor], x: Tensor, y: Tensor, w: float) -> Tensor:
        """`_weighted_loss` for the autograd HVP paths (graph, double backward): same value and
        derivatives, through `sharpness.products._data_conv` where the model allows it."""
        if self._data_conv is None or x.requires_grad:
            return self._weighted_loss(params, x, y, w)
        return w * self.chunk_loss_fn(self._data_conv(params, self.buffers, x), y)

    def _accumulator(self, like: Tensor, out: Tensor | None = None) -> tuple[Tensor, list[Tensor]]:
        """A flat ``(..., n)`` sum (zero, or ``out`` to add to) and its per-parameter views, to add chunk
        results in place."""
        total = torch.zeros_like(like) if out is None else out
        return total, list(self.layout.unflatten(total).values())

    def _params(self, params: Mapping[str, Tensor] | Tensor | None) -> dict[str, Tensor]:
        if params is None:
            return self.params
        if isinstance(params, Tensor):
            return self.layout.unflatten(params.to(self.device))
        return {k: t.to(self.device) for k, t in params.items()}

    # ----------------------------------------------------------------------------------------------
    # values
    @torch.no_grad()
    def value(self, params: Mapping[str, Tensor] | Tensor | None = None) -> Tensor:
        """The loss over the whole data set, a 0-dim tensor (at ``params``: computed once, then reused)."""
        if params is None and self._value is not None:
            return self._value.clone()
        p = self._params(params)
        total = torch.zeros((), dtype=self.dtype, device=self.device)
        with eval_mode(self.model):
            for x, y, w in self.chunks():
                total += w * self._chunk_loss(p, x, y)
        self.comm.sum_(total)
        if params is None:
            self._value = total.clone()
        return total

    @torch.no_grad()
    def evaluate(self, params: Mapping[str, Tensor] | Tensor | None = None) -> dict[str, float]:
        """Loss and, for class-index targets, accuracy (fraction of argmax hits) over the data set."""
        p = self._params(params)
        # the loss, the hits and whether any chunk's outputs are not class scores, summed on the device (read once)
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        with eval_mode(self.model):
            for x, y, w in self.chunks():
                out = functional_call(self.model, (p, self.buffers), (x,))
                sums[0] += w * self.chunk_loss_fn(out, y).double()
                if not y.is_floating_point() and out.dim() == 2:
                    sums[1] += (out.argmax(dim=1) == y).sum()
                else:
                    sums[2] = 1.0
        loss, hits, other = self.comm.sum_(sums).tolist()
        classify = other == 0.0
        return {"loss": loss, "accuracy": hits / self.n_samples} if classify else {"loss": loss}

    def _gradient_pieces(self) -> Iterator[tuple[Tensor, Tensor, float]]:
        """The data for gradients: on the CPU the chunks cut to about ``_GRADIENT_PIECE_BYTES`` of forward
        activations, and smaller chunks joined up to that where the memory budget would allow such a chunk;
        elsewhere the chunks as they are."""
        if self.device.type != "cpu":
            return self.chunks()
        per_sample = self.activation_bytes_per_sample()
        size = max(1, int(_GRADIENT_PIECE_BYTES // per_sample))
        return self.pieces(size, join=4 * per_sample * size <= self.memory_budget)  # as _auto_chunk_size counts

    def _check_embedding_calls(self) -> None:
        """`check_functional_embeddings` on the traced graph, once, before the first derivative (the modules are
        checked at construction; the calls need the graph, traced on first use)."""
        if not self._embeddings_checked:
            check_functional_embeddings(self.model, self.params, self._traced_network().graph)
            self._embeddings_checked = True

    def gradient(self, params: Mapping[str, Tensor] | Tensor | None = None) -> Tensor:
        """Euclidean gradient of the whole-data-set loss, flat ``(n,)``."""
        self._check_embedding_calls()
        p = self._params(params)
        start = time.perf_counter()
        total, views = self._accumulator(torch.empty(self.layout.size, dtype=self.dtype, device=self.device))
        g_fn = grad(self._weighted_loss)
        with eval_mode(self.model):
            for x, y, w in self._gradient_pieces():
                _add_into(views, g_fn(p, x, y, w).values())
        self.comm.sum_(total)
        if params is None:
            self.gradient_seconds = time.perf_counter() - start
        return total

    def value_and_gradient(self, params: Mapping[str, Tensor] | Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(f, grad f)`` in one pass over the data."""
        p = self._params(params)
        value = torch.zeros((), dtype=self.dtype, device=self.device)
        total, views = self._accumulator(torch.empty(self.layout.size, dtype=self.dtype, device=self.device))
        fn = torch.func.grad_and_value(self._weighted_loss)
        with eval_mode(self.model):
            for x, y, w in self._gradient_pieces():
                g, v = fn(p, x, y, w)
                _add_into(views, g.values())
                value += v.detach()
        if self.comm.world_size == 1:
            return value, total
        both = self.comm.sum_(torch.cat([value.reshape(1), total]))  # one reduction for both
        return both[0], both[1:]

    # ----------------------------------------------------------------------------------------------
    # Hessian-vector products
    def _graph_fits(self) -> bool:
        # The cached double-backward graph holds every chunk's activations at once.
        return 4 * self.activation_bytes_per_sample() * self._share_size <= self.memory_budget

    def _rop_applies(self) -> bool:
        """Whether the R-operator products apply: a chain or graph of supported operations that runs on these
        data (measuring its state's size on one sample on the way)."""
        if self._rop is None:
            return False
        x, _ = cast_batch(*self.data.first_batch(), self.dtype, self.device)
        try:
            with torch.no_grad(), eval_mode(self.model):
                self._rop_bytes_per_sample, largest = self._rop.state_sizes(self.params, x)
                piece_bytes = _ROP_PIECE_BYTES if self.device.type == "cpu" else _ROP_PIECE_BYTES_GPU
                self._rop_piece = max(1, piece_bytes // max(largest, 1))
        except (ValueError, RuntimeError):  # e.g. Linear layers on (n, seq, features) inputs
            return False
        return True

    def _rop_fits(self) -> bool:
        if self._rop_bytes_per_sample is None and not self._rop_applies():
            return False
        return self._rop_bytes_per_sample * self._share_size <= self.memory_budget

    @cached_property
    def _padded_embedding(self) -> str | None:
        """Where a differentiated table is read with a padding row (`padded_embedding`), or ``None``: autograd's
        backward holds that row fixed and forward mode does not, so ``jvp(grad)`` mixes the two."""
        return padded_embedding(self.model, self.params, self._traced_network().graph)

    def _choose_autograd_strategy(self) -> str:
        if self._graph_fits():
            return "graph"
        if self._padded_embedding is not None:
            return self.comm.choose("double_backward", ("double_backward", "jvp"))
        # Streaming: time one product of each kind on the first chunk and keep the faster.
        x, y = cast_batch(*self.data.first_batch(), self.dtype, self.device)
        v = {k: torch.ones_like(t) for k, t in self.params.items()}
        kinds = {"double_backward": self._hvp_double_backward, "jvp": self._hvp_jvp}
        try:
            self._hvp_jvp(v, x, y, 1.0)  # warm-up
        except (NotImplementedError, RuntimeError):  # no forward-mode derivative (Huber's backward, integer targets)
            return self.comm.choose("double_backward", tuple(kinds))
        self._hvp_double_backward(v, x, y, 1.0)
        # Best of three, interleaved, so a passing spell of load on the machine does not decide.
        timings = dict.fromkeys(kinds, float("inf"))
        for _ in range(3):
            for name, fn in kinds.items():
                start = _clock(self.device)
                fn(v, x, y, 1.0)
                timings[name] = min(timings[name], _clock(self.device) - start)
        # Timings differ between processes; one choice for all keeps their calls in step.
        return self.comm.choose(min(timings, key=timings.get), tuple(kinds))

    def hvp_strategy(self, strategy: str = "auto", autograd: bool = False) -> str:
        """Resolve ``strategy`` (``"auto"`` picks once, by model, memory and measurement, and remembers).

        ``"auto"`` is ``"rop"`` where it applies (see `hvp`), else ``"graph"`` when the whole-data-set
        graph fits in ``memory_budget``, else the faster streaming kind; with ``autograd=True`` (for
        products through a reparametrization, which the R-operator does not see) only the autograd ones.
        """
        if strategy not in HVP_STRATEGIES:
            raise ValueError(f"unknown HVP strategy {strategy!r}; choose one of {', '.join(HVP_STRATEGIES)}")
        if strategy == "rop" and (autograd or self._rop is None):
            raise ValueError(
                "the 'rop' HVP strategy needs a model built from Linear/ConvNd layers, eval-mode BatchNorm, ReLU, "
                "LeakyReLU, max/average pooling, flatten/view, Identity, dropout, residual sums, concatenation and "
                "stacking, LayerNorm, RMSNorm, smooth elementwise functions (GELU, tanh, sigmoid, SiLU, softplus, exp, "
                "log, powers), elementwise products, softmax and log_softmax, self-attention by nn.MultiheadAttention "
                "or written by hand (matmul, einsum, scaled_dot_product_attention, transpose/permute, "
                "unbind/chunk/split, indexing, floating dtype casts), token embeddings (nn.Embedding, F.embedding; "
                "tied output layers too) and parameters added outside modules (torch.fx-traceable, no hooks), "
                "differentiated in all its layers' parameters; use 'graph', "
                "'double_backward' or 'jvp'"
            )
        self._check_embedding_calls()
        if strategy == "jvp" and self._padded_embedding is not None:
            raise ValueError(
                f"the 'jvp' HVP strategy is not a symmetric operator here: {self._padded_embedding} holds its padding "
                "row fixed in autograd's backward but not in the forward-mode derivative jvp takes through it; use "
                "'auto', 'graph' or 'double_backward'"
            )
        if strategy != "auto":
            return strategy
        if self._strategy is None:
            self._strategy = "rop" if self._rop_applies() else self._resolve_autograd()
        if autograd and self._strategy == "rop":
            return self._resolve_autograd()
        return self._strategy

    def _resolve_autograd(self) -> str:
        if self._autograd_strategy is None:
            with eval_mode(self.model):
                self._autograd_strategy = self._choose_autograd_strategy()
        return self._autograd_strategy

    def _hvp_jvp(self, v: dict[str, Tensor], x: Tensor, y: Tensor, w: float) -> dict[str, Tensor]:
        return hvp_by_jvp(lambda p, x, y: self._weighted_loss(p, x, y, w), self.params, v, x, y)

    def _hvp_double_backward(self, v: dict[str, Tensor], x: Tensor, y: Tensor, w: float) -> dict[str, Tensor]:
        with torch.enable_grad():
            p = {k: t.detach().requires_grad_(True) for k, t in self.params.items()}
            leaves = list(p.values())
            g = gradient_with_graph(self._autograd_loss(p, x, y, w), leaves)
            hv = gradient_products(g, leaves, list(v.values()))
        return dict(zip(self.params, hv))

    def _build_graph(self) -> tuple[list[Tensor], list[Tensor]]:
        if self._graph is None:
            start = time.perf_counter()
            with torch.enable_grad(), eval_mode(self.model):
                leaves = [t.detach().requires_grad_(True) for t in self.params.values()]
                p = dict(zip(self.params, leaves))
                total, value = None, 0.0
                for x, y, w in self.chunks():
                    loss = self._autograd_loss(p, x, y, w)
                    g = gradient_with_graph(loss, leaves)
                    total = list(g) if total is None else [a + b for a, b in zip(total, g)]
                    value = value + loss.detach()
            self._graph = (leaves, total)
            if self._value is None:
                self._value = self.comm.sum_(torch.as_tensor(value, dtype=self.dtype, device=self.device))
            self.gradient_seconds = time.perf_counter() - start
        return self._graph

    def _hvp_graph(self, vs: list[Tensor], batched: bool) -> list[Tensor]:
        leaves, g = self._build_graph()
        with torch.enable_grad():
            hv = gradient_products(g, leaves, vs, batched=batched, retain_graph=True)
        return [h.detach() for h in hv]

    def release_graph(self) -> None:
        """Free the cached whole-data-set graph and R-operator state (the next product rebuilds them)."""
        self._graph = None
        self._rop_states = None

    def rop_states(self) -> tuple[RopChain | RopGraph, list[ChunkState]] | None:
        """The R-operator chain or graph and every chunk's forward state (`sharpness.products._rop`,
        `sharpness.products._rop_graph`), computed once and kept; ``None`` where those products do not apply
        or the states do not fit in ``memory_budget``. Where several processes share the data: the chunks of
        this process's share."""
        if self._rop_states is None:
            if self._rop is None or not self._rop_fits():
                return None
            with torch.no_grad(), eval_mode(self.model):
                self._rop_states = self._rop_pass()
        return self._rop, self._rop_states

    def _rop_pass(self, products: Callable[[ChunkState], None] | None = None) -> list[ChunkState]:
        """One pass over the data building each chunk's forward state, in pieces of at most ``_ROP_PIECE_BYTES``
        per tensor: kept and returned, or, with ``products``, applied to them and dropped piece by piece
        (streaming). Records the loss on the way."""
        states, value, seconds = [], 0.0, 0.0
        for x, y, w in self._rop_pieces():
            start = time.perf_counter()
            state = self._rop.forward_state(self.params, channels_last(x), y, self.chunk_loss_fn, w)
            seconds += time.perf_counter() - start
            if products is None:
                states.append(state)
            else:
                products(state)
            value = value + state.loss
        if products is None:
            self.gradient_seconds = seconds  # the forward and backward passes the kept products share
        if self._value is None:
            self._value = self.comm.sum_(torch.as_tensor(value, dtype=self.dtype, device=self.device))
        return states

    def _rop_pieces(self) -> Iterator[tuple[Tensor, Tensor, float]]:
        """`chunks` cut into pieces of at most ``_rop_piece`` samples, each weighted by its share."""
        return self.chunks() if self._rop_piece is None else self.pieces(self._rop_piece)

    def _hvp_rop(self, tangents: list[dict[str, Tensor]], totals: list[dict[str, Tensor]]) -> None:
        """Add ``H v`` for every tangent into the matching ``totals`` (``{name: view}``) by R-operator
        products. Each chunk's forward state is kept from the first call when it fits in
        ``memory_budget``, and recomputed per call, one chunk at a time, otherwise."""

        def products(state: ChunkState) -> None:
            for v, into in zip(tangents, totals):
                self._rop.add_products(self.params, state, v, into)

        kept = self.rop_states()
        with torch.no_grad():
            if kept is not None:  # no module is called: no eval mode to set
                for state in kept[1]:
                    products(state)
                return
            with eval_mode(self.model):
                self._rop_pass(products)

    def hvp(self, v: Tensor, strategy: str = "auto", out: Tensor | None = None) -> Tensor:
        """Hessian-vector product ``H v`` at ``params``, flat ``(n,)`` in and out.

        ``v`` is moved to the objective's device and converted to its dtype where that is exact (float32 to
        float64); a ``v`` of another shape, or one the conversion would round (float64 into a float32
        objective), is refused with ``ValueError``; a non-floating one with ``TypeError``.

        ``out``: an ``(n,)`` tensor (not sharing storage with ``v``) that ``H v`` is *added* to in place
        and returned; the chunk results go straight into it, with no product-sized temporary for the
        ``"rop"``, ``"double_backward"`` and ``"jvp"`` strategies (in one process: with several, the sum over
        the processes is formed apart and then added).

        ``strategy``: ``"rop"`` (models of Linear/ConvNd layers, eval-mode BatchNorm, ReLU, LeakyReLU,
        max/average pooling, flatten/view, Identity, dropout, residual sums and concatenation, as chains or
        graphs, and transformers: LayerNorm, exact GELU, tanh, batch-first self-attention by
        ``nn.MultiheadAttention`` or written by hand (products of activations, softmax,
        ``F.scaled_dot_product_attention`` without dropout, transposes, pieces of a fused projection), parameters added
        outside modules) is the R-operator written out by hand (`sharpness.products._rop`,
        `sharpness.products._rop_graph`, `sharpness.products._rop_smooth`, `sharpness.products._rop_attention`), with
        each chunk's forward state
        kept across products when it fits in ``memory_budget`` and recomputed per chunk otherwise;
        ``"graph"`` keeps the whole-data-set gradient graph and differentiates it again for each
        product (memory of one double-backward pass over all the data); ``"double_backward"``
        recomputes forward and backward per chunk; ``"jvp"`` is forward-over-reverse
        ``torch.func.jvp`` of ``torch.func.grad`` per chunk; ``"auto"`` uses ``"rop"`` where it
        applies, else ``"graph"`` when it fits in ``memory_budget``, else the faster streaming kind on
        this machine (measured once).
        """
        v = as_vector(v, self.layout.size, self.dtype, self.device)
        strategy = self.hvp_strategy(strategy)
        if out is not None:
            _check_out(out, v)
            if self.comm.world_size > 1:  # the sum over the processes must not take in out's contents
                return out.add_(self.hvp(v, strategy))
        if strategy == "graph":
            products = self._hvp_graph(list(self.layout.unflatten(v).values()), batched=False)
            flat = self.comm.sum_(self.layout.flatten(dict(zip(self.params, products))))
            return flat if out is None else out.add_(flat)
        total, views = self._accumulator(v, out)
        if strategy == "rop":
            self._hvp_rop([self.layout.unflatten(v)], [dict(zip(self.params, views))])
            return self.comm.sum_(total)
        fn = self._hvp_jvp if strategy == "jvp" else self._hvp_double_backward
        tangent = self.layout.unflatten(v)
        with eval_mode(self.model):
            for x, y, w in self.chunks():
                _add_into(views, fn(tangent, x, y, w).values())
        return self.comm.sum_(total)

    def hvp_batch(self, vs: Tensor, strategy: str = "auto") -> Tensor:
        """Several Hessian-vector products at once: ``(k, n)`` in, ``(k, n)`` out (vmap)."""
        vs = as_vector(vs, self.layout.size, self.dtype, self.device, batched=True)
        strategy = self.hvp_strategy(strategy)
        tangents = self.layout.unflatten(vs)
        if strategy == "graph":
            products = self._hvp_graph(list(tangents.values()), batched=True)
            return self.comm.sum_(self.layout.flatten(dict(zip(self.params, products))))
        total, views = self._accumulator(vs)
        if strategy == "rop":  # one pass over the data, every tangent per chunk
            rows = [{k: t[i] for k, t in tangents.items()} for i in range(vs.shape[0])]
            self._hvp_rop(rows, [{k: t[i] for k, t in zip(self.params, views)} for i in range(vs.shape[0])])
            return self.comm.sum_(total)
        with eval_mode(self.model):
            for x, y, w in self.chunks():
                if strategy == "jvp":
                    out = vmap(lambda t, x=x, y=y, w=w: self._hvp_jvp(t, x, y, w))(tangents)
                else:
                    out = self._hvp_double_backward_batched(tangents, x, y, w)
                _add_into(views, out.values())
        return self.comm.sum_(total)

    def _hvp_double_backward_batched(
        self, tangents: dict[str, Tensor], x: Tensor, y: Tensor, w: float
    ) -> dict[str, Tensor]:
        with torch.enable_grad():
            p = {k: t.detach().requires_grad_(True) for k, t in self.params.items()}
            leaves = list(p.values())
            g = gradient_with_graph(self._autograd_loss(p, x, y, w), leaves)
            hv = gradient_products(g, leaves, list(tangents.values()), batched=True)
        return dict(zip(self.params, hv))


def _check_same_data(comm: Communicator, fingerprint: tuple[int, int, int] | None) -> None:
    """Refuse, on every process alike, data whose `ChunkedData.fingerprint` (count and digests of the inputs
    and the targets, in order) differs from process 0's (``None`` everywhere: nothing to compare)."""
    text = "" if fingerprint is None else " ".join(map(str, fingerprint))
    prints = [tuple(int(t) for t in p.split()) for p in comm.gather_text(text)]
    differs = [rank for rank, p in enumerate(prints) if p != prints[0]]  # exact: integer digests
    if differs:
        rank, (n0, x0, _), (n1, x1, _) = differs[0], prints[0], prints[differs[0]]
        what = (f"{n1} samples against {n0}" if n1 != n0 else
                f"the same {n0} samples but other {'inputs' if x1 != x0 else 'targets'} or another order")  # fmt: skip
        raise shared(DataError(
            f"process {rank} was given other data than process 0 ({what}); give every process the whole data set in "
            "the same order: each evaluates its own share"
        ))  # fmt: skip


def _clock(device: torch.device) -> float:
    """``time.perf_counter()`` once the device's queued work is done (kernels on a GPU run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _byte_range(t: Tensor) -> tuple[int, int]:
    """First and one-past-last byte a tensor's elements occupy."""
    span = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def _check_out(out: Tensor, v: Tensor) -> None:
    """``out`` must match ``v`` and must not overlap it: the product is added to ``out`` while ``v`` is read."""
    if out.shape != v.shape or out.dtype != v.dtype or out.device != v.device:
        raise ValueError(
            f"out must have v's shape, dtype and device ({tuple(v.shape)}, {v.dtype}, {v.device}), "
            f"got {tuple(out.shape)}, {out.dtype}, {out.device}"
        )
    (a0, a1), (b0, b1) = _byte_range(out), _byte_range(v)
    if a0 < b1 and b0 < a1:
        raise ValueError("out must not share memory with v")


def _add_into(views: list[Tensor], parts: Iterable[Tensor]) -> None:
    """``views[i] += parts[i]`` in place (a chunk's per-parameter result into the flat sum)."""
    for view, part in zip(views, parts):
        view.add_(part)


__all__ = ["DataError", "HVP_STRATEGIES", "Objective", "eval_mode"]


def build_objective(
    model: nn.Module | None,
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None,
    data: object,
    objective: Objective | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> Objective:
    """``objective`` when given (then ``dtype`` must be ``None`` or its own), else ``Objective(model, loss_fn,
    data, dtype=dtype)``: the one place the public functions get their objective from.

    Raises:
        ValueError: neither an objective nor a model, loss and data are given, or ``dtype`` contradicts the
            given objective's.
    """
    if objective is not None:
        if dtype is not None and dtype != objective.dtype:
            raise ValueError(f"dtype={dtype} contradicts the given objective's {objective.dtype}; pass one of them")
        return objective
    if model is None or loss_fn is None or data is None:
        raise ValueError("give a model, a loss and data, or an objective")
    return Objective(model, loss_fn, data, dtype=dtype)
