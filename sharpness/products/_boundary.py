"""The library's boundary: what [`Objective`][sharpness.Objective] checks of its arguments before any work.

Every check here is cheap (no pass over the data: at most one forward pass on two samples of the first batch) and
ends in one sentence naming the problem and the fix, with one documented exception type per kind of problem:

- ``TypeError``: an argument of the wrong kind (not a module, not a tensor, not a dtype).
- ``ValueError``: an argument with a wrong value (unknown or misshapen parameters, a non-floating or half-precision
  ``dtype``, the meta device, non-finite weights, a loss that is not a scalar, a vector of another shape or one
  that would be rounded).
- `manifolds.UnsupportedModelError` (a ``ValueError``): a model the objective cannot evaluate functionally
  (TorchScript) or whose forward does not return one tensor of outputs.
- [`DataError`][sharpness.DataError] (a ``ValueError``): data the model or loss cannot use.

It also holds what the objective's own evaluations share: `functional_call` (attention through PyTorch's
math kernel, the only one with second derivatives) and `float32_hessian_error` (whether float32 holds the
Hessian at this point).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from manifolds import UnsupportedModelError
from manifolds import functional_call as tie_aware_call
from manifolds._modules import input_check
from sharpness.products._data import LEAD_SAMPLES, ChunkedData, DataError, cast_batch
from sharpness.products._second_order import gradient_products, gradient_with_graph

# Samples of the first batch the float32 precision check differentiates twice, in float32 and in float64.
PRECISION_SAMPLES = 64
# A float32 Hessian-vector product further than this from float64's (relative, on those samples) has lost the
# Hessian: float32 rounding alone gives 1e-7..1e-5 at ordinary points.
PRECISION_TOLERANCE = 1e-2
_HALF = (torch.float16, torch.bfloat16)


def _names(names: list[str], limit: int = 3) -> str:
    """``'a', 'b', 'c'`` or ``5 names: 'a', 'b', 'c', ...`` (a summary of a possibly long list)."""
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown if len(names) <= limit else f"{len(names)} names: {shown}, ..."


def unwrap_model(model: object) -> tuple[nn.Module, str]:
    """The module to evaluate and the prefix its wrappers add to parameter names: ``DataParallel`` and
    ``DistributedDataParallel`` give their ``.module``, ``torch.compile`` its original module (``._orig_mod``).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        UnsupportedModelError: a TorchScript module, whose parameters ``torch.func.functional_call`` cannot swap.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    prefix = ""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model, prefix = model.module, prefix + "module."
        elif type(model).__name__ == "OptimizedModule" and type(model).__module__.startswith("torch._dynamo"):
            model, prefix = model._orig_mod, prefix + "_orig_mod."
        else:
            break
    if isinstance(model, torch.jit.ScriptModule):
        raise UnsupportedModelError(
            f"{type(model).__name__} is a TorchScript module, whose parameters cannot be swapped for the "
            "evaluation points the measures need; pass the original nn.Module (before torch.jit.script or trace)"
        )
    _refuse_inexact_second_derivatives(model)
    return model, prefix


def _refuse_inexact_second_derivatives(model: nn.Module) -> None:
    """Refuse what the Hessian cannot be taken through exactly: weight normalization, whose fused kernel
    (``torch._weight_norm``) has an inexact double backward and no forward-mode derivative (a product 23% off was
    measured), and complex parameters, which the objective's real arithmetic would silently truncate.

    Raises:
        UnsupportedModelError: a module under ``weight_norm`` (the parametrization or the older hook).
        TypeError: a complex or integer parameter.
    """
    for name, module in model.named_modules():
        parametrizations = getattr(module, "parametrizations", None)
        hooks = getattr(module, "_forward_pre_hooks", {}).values()
        normed = [k for k, p in (parametrizations or {}).items() if any(type(q).__name__ == "_WeightNorm" for q in p)]
        if normed or any(type(h).__name__ == "WeightNorm" for h in hooks):
            where = f"module {name!r}" if name else type(model).__name__
            raise UnsupportedModelError(
                f"{where} is under weight_norm, whose fused kernel has no exact second derivative; remove it before "
                "measuring (torch.nn.utils.parametrize.remove_parametrizations(module, 'weight'), or "
                "torch.nn.utils.remove_weight_norm for the older hook): the function is the same"
            )
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            raise TypeError(
                f"parameter {name!r} is {p.dtype}; the objective differentiates real floating-point parameters only"
            )


def select_params(model: nn.Module, params: Mapping[str, Tensor] | None, prefix: str = "") -> dict[str, Tensor]:
    """The tensors the objective differentiates in: ``params`` (checked against the model's parameters), or the
    model's trainable parameters. Names may carry the ``prefix`` of a wrapper the model was taken out of. A tensor the
    model holds under several names (a module reached under two names, a weight tied between modules) may be given
    under any of them, and is kept under the first, the one ``model.named_parameters()`` lists: the name every
    analysis of the model (its traced graph, its symmetry group) uses.

    Raises:
        TypeError: ``params`` is not a mapping of names to floating-point tensors.
        ValueError: no trainable parameters, names the model does not have, or shapes that differ from the
            model's.
    """
    named = dict(model.named_parameters(remove_duplicate=False))  # tied parameters under every name
    if params is None:
        source = {k: p for k, p in model.named_parameters() if p.requires_grad}
        if not source:
            raise ValueError(f"{type(model).__name__} has no trainable parameters (every requires_grad is False)")
        return source
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a mapping of parameter names to tensors, got {type(params).__name__}")
    # names as the wrapper gave them (model.module.named_parameters() of DataParallel) are read as the model's
    given = {k.removeprefix(prefix) if prefix and k not in named else k: v for k, v in params.items()}
    unknown = [k for k in given if k not in named]
    if unknown:
        missing = [k for k, p in model.named_parameters() if p.requires_grad and k not in given]
        hint = f"; the model's parameters not given are {_names(missing)}" if missing else ""
        raise ValueError(
            f"params holds {_names(unknown)}, which {type(model).__name__} has no parameter of{hint}; "
            "use the names of model.named_parameters()"
        )
    if not given:
        raise ValueError("params is empty; give at least one of the model's parameters, or None for all of them")
    for k, v in given.items():
        if not isinstance(v, Tensor) or not v.is_floating_point():
            kind = v.dtype if isinstance(v, Tensor) else type(v).__name__
            raise TypeError(f"params[{k!r}] must be a floating-point tensor, got {kind}")
        if v.shape != named[k].shape:
            raise ValueError(
                f"params[{k!r}] has shape {tuple(v.shape)} but the model's parameter has {tuple(named[k].shape)}"
            )
    first = {id(p): k for k, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
    canonical: dict[str, Tensor] = {}
    source: dict[str, str] = {}
    for k, v in given.items():
        name = first[id(named[k])]
        if name in canonical and canonical[name] is not v:
            raise ValueError(f"params gives one tensor of the model twice, under {source[name]!r} and {k!r}; give it "
                             "once")  # fmt: skip
        canonical[name], source[name] = v, k
    return canonical


def evaluation_dtype(dtype: torch.dtype | None, reference: torch.dtype) -> torch.dtype:
    """The dtype the objective computes in: ``dtype``, or the parameters' own (``reference``), where half
    precision (float16, bfloat16) is raised to float32: its 8 or 11 significant bits lose most of a Hessian.

    Raises:
        TypeError: ``dtype`` is not a ``torch.dtype``.
        ValueError: ``dtype`` is not a real floating dtype, or is half precision.
    """
    if dtype is None:
        return torch.float32 if reference in _HALF else reference
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.float64, got {type(dtype).__name__}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype (torch.float32 or torch.float64), got {dtype}")
    if dtype.itemsize < 4:
        raise ValueError(
            f"dtype={dtype} cannot hold Hessian products (a bfloat16 model's Euclidean sharpness is off by half); "
            "use dtype=torch.float32 or torch.float64 (the model's weights are cast, not changed)"
        )
    return dtype


def check_device(device: object) -> torch.device:
    """``device`` (a ``torch.device`` or its name), refused where it names none or one that holds no values.

    Raises:
        ValueError: a name torch does not know, or the meta device.
    """
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a device torch knows; give 'cpu', 'cuda' or 'cuda:N'") from exc
    if device.type == "meta":
        raise ValueError("the meta device holds no values to evaluate; give device='cpu' or a GPU")
    return device


def _differentiated(model: nn.Module, params: Mapping[str, Tensor]) -> Callable[[str], bool]:
    """Whether a tensor of ``model`` (by any of its names) is among ``params``: compared by the tensor object,
    since a module reached under two names and a weight tied between modules both hold one tensor under several
    names, and ``params`` may use any of them."""
    named = dict(model.named_parameters(remove_duplicate=False))
    given = {id(named[k]) for k in params if k in named}
    return lambda name: name in params or (name in named and id(named[name]) in given)


def check_embedding_gradients(model: nn.Module, params: Mapping[str, Tensor]) -> None:
    """Refuse a differentiated ``nn.Embedding`` table whose autograd gradient is not the loss's: ``scale_grad_by_freq``
    divides it by the ids' counts in the batch (no function has that gradient, so its "Hessian" is not symmetric),
    and ``sparse`` gradients, which the whole-data-set sums cannot add.

    Raises:
        UnsupportedModelError: naming the module and the option to turn off (the function is the same without it).
    """
    differentiated = _differentiated(model, params)
    for name, m in model.named_modules():
        if not isinstance(m, nn.Embedding) or not differentiated(f"{name}.weight" if name else "weight"):
            continue
        option = "scale_grad_by_freq" if m.scale_grad_by_freq else "sparse" if m.sparse else None
        if option is not None:
            why = "its gradient is scaled by the ids' counts, which is no loss's gradient" if option != "sparse" \
                else "its gradients are sparse tensors, which the sums over the data set do not take"  # fmt: skip
            raise UnsupportedModelError(
                f"module {name!r} is an nn.Embedding with {option}=True: {why}; set module.{option} = False before "
                "measuring (the function is the same)"
            )


def _embedding_calls(graph: fx.Graph | None, differentiated: Callable[[str], bool]):
    """``(node, padding, scale_grad_by_freq, sparse)`` of every ``F.embedding`` or ``torch.embedding`` call on the
    traced ``graph`` whose table may be differentiated (anything but a tensor of the model held fixed)."""
    for node in graph.nodes if graph is not None else ():
        if node.op != "call_function" or node.target not in (F.embedding, torch.embedding):
            continue
        if node.target is F.embedding:
            names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
        else:  # the op under it: its padding_idx -1 is none
            names = ("weight", "indices", "padding_idx", "scale_grad_by_freq", "sparse")
        bound = dict(zip(names, node.args)) | dict(node.kwargs)
        table = bound.get("weight")
        if isinstance(table, fx.Node) and table.op == "get_attr" and not differentiated(str(table.target)):
            continue
        padding = bound.get("padding_idx")
        padded = padding is not None and not (node.target is torch.embedding and padding == -1)
        yield node, padded, bool(bound.get("scale_grad_by_freq")), bool(bound.get("sparse"))


def check_functional_embeddings(model: nn.Module, params: Mapping[str, Tensor], graph: fx.Graph | None) -> None:
    """`check_embedding_gradients` for tables read by ``F.embedding`` or ``torch.embedding`` on the traced ``graph``.

    Raises:
        UnsupportedModelError: naming the call and the option to turn off.
    """
    for node, _, by_freq, sparse in _embedding_calls(graph, _differentiated(model, params)):
        if by_freq or sparse:
            option = "scale_grad_by_freq" if by_freq else "sparse"
            raise UnsupportedModelError(
                f"the embedding at graph node {node.name!r} passes {option}=True, so its table's gradient is not the "
                f"loss's; call it without {option} before measuring (the function is the same)"
            )


def padded_embedding(model: nn.Module, params: Mapping[str, Tensor], graph: fx.Graph | None) -> str | None:
    """Where a differentiated table is read with a padding row (an ``nn.Embedding`` with ``padding_idx``, or
    ``F.embedding``/``torch.embedding`` with one on the traced ``graph``), named for a message, else ``None``.
    Autograd's backward holds that row fixed and forward mode does not, so ``jvp(grad)`` is no symmetric operator
    there."""
    differentiated = _differentiated(model, params)
    for name, m in model.named_modules():
        if isinstance(m, nn.Embedding) and m.padding_idx is not None and differentiated(f"{name}.weight" if name
                                                                                        else "weight"):  # fmt: skip
            return f"module {name!r}"
    padded = [node for node, pad, _, _ in _embedding_calls(graph, differentiated) if pad]
    return f"the embedding at graph node {padded[0].name!r}" if padded else None


def fixed_tensors(model: nn.Module, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Every tensor ``functional_call`` reads from the module itself: its buffers and the parameters not in
    ``params`` (frozen ones among them), which must be cast with the rest. A tied parameter given under any of its
    names (``lm_head.weight`` for a table the output layer shares) is in ``params``."""
    differentiated = _differentiated(model, params)
    held = dict(model.named_buffers())
    held.update((k, p) for k, p in model.named_parameters() if not differentiated(k))
    return held


def check_meta(tensors: Mapping[str, Tensor], what: str) -> None:
    """Refuse tensors on the meta device (they have shapes but no values).

    Raises:
        ValueError: one of ``tensors`` is on the meta device.
    """
    meta = [k for k, t in tensors.items() if t.is_meta]
    if meta:
        raise ValueError(
            f"{what} {_names(meta)} {'is' if len(meta) == 1 else 'are'} on the meta device and hold no values; "
            "materialize the model (model.to_empty(device='cpu')) and load its weights first"
        )


def check_finite(params: Mapping[str, Tensor], others: Mapping[str, Tensor], dtype: torch.dtype) -> None:
    """Refuse weights with NaN or infinite entries in the evaluation dtype (the loss and its derivatives are
    undefined there; an overflowing cast to float32 included).

    Raises:
        ValueError: a parameter or floating buffer is not finite.
    """
    bad = [k for k, t in {**params, **others}.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise ValueError(
            f"the model's {_names(bad)} {'holds' if len(bad) == 1 else 'hold'} NaN or infinite values in {dtype}, "
            "where the loss and its derivatives are undefined; load finite weights"
            + (" or use dtype=torch.float64" if dtype != torch.float64 else "")
        )


def squeeze_label_column(data: object, loss_fn: Callable, output_dims: Callable[[Tensor], int]) -> object:
    """An ``(X, y)`` pair of tensors whose ``y`` is a column ``(n, 1)`` of integer class labels, as pandas and
    scikit-learn give them, under ``CrossEntropyLoss``/``NLLLoss``, for a model whose outputs are ``(n, C)``
    (``output_dims(x)``: the dimensions of the outputs on inputs ``x``; a language model's ``(n, V, 1)`` on one-token
    sequences takes ``(n, 1)`` as it is): the pair with ``y`` as ``(n,)`` (a view); anything else as given (other
    sources are checked on their first batch, `check_first_batch`)."""
    if not isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)) or not isinstance(data, (tuple, list)):
        return data
    if len(data) != 2 or not all(isinstance(t, Tensor) for t in data):
        return data
    x, y = data
    if y.dim() == 2 and y.shape[1] == 1 and not y.is_floating_point() and not y.is_complex() and y.dtype != torch.bool \
            and output_dims(x[:2]) == 2:  # fmt: skip
        return (x, y[:, 0])
    return data


@contextlib.contextmanager
def _math_attention() -> Iterator[None]:
    """Attention through PyTorch's math kernel, the one with second derivatives (the fused CPU and GPU kernels
    have none), no fused ``MultiheadAttention`` fast path (no derivatives at all), and the hard sigmoid as
    `_TwiceDifferentiable` computes it."""
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH), _TwiceDifferentiable():
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)


_HARD_SIGMOIDS = (F.hardsigmoid, torch._C._nn.hardsigmoid, torch._C._nn.hardsigmoid_)


class _TwiceDifferentiable(TorchFunctionMode):
    """``F.hardsigmoid`` (``nn.Hardsigmoid``: MobileNetV3's gates) computed as ``hardtanh(x + 3, 0, 6) / 6``, the
    arithmetic of torch's own kernel (equal to the bit in float32 and float64, the dtypes the objectives compute in),
    through operations with second derivatives: torch has none for the hard sigmoid's backward, neither by double
    backward nor in forward mode, so every Hessian-vector product by autograd failed. ``hardtanh``'s slope is zero at
    the kinks -3 and 3, as the hard sigmoid's (``clamp``'s is not), and its second derivative zero everywhere. (torch's
    own backward multiplies by 1/6 rounded to float32 even in float64; this slope is 1/6 in the input's dtype, as the
    R-operator's.) Every other call runs as it is (a pass-through costs no measurable time: bench workloads F1, C1 and
    T1's gradients within their noise)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _HARD_SIGMOIDS:
            return func(*args, **kwargs)
        x = args[0] if args else kwargs["input"]
        inplace = func is torch._C._nn.hardsigmoid_ or (
            func is F.hardsigmoid and bool(args[1] if len(args) > 1 else kwargs.get("inplace", False)))
        if inplace:  # the caller's tensor updated, as the kernel does
            return F.hardtanh_(x.add_(3), 0.0, 6.0).div_(6)
        return F.hardtanh(x + 3, 0.0, 6.0) / 6


def functional_call(model: nn.Module, tensors: Mapping[str, Tensor] | tuple[Mapping[str, Tensor], ...], args: tuple,
                    aliases: Mapping[str, tuple[str, ...]] | None = None) -> object:  # fmt: skip
    """`manifolds.functional_call` (shared modules keep their own tensors; ``aliases`` its `manifolds.tensor_aliases`
    where known) with attention through the math kernel (see `_math_attention`)."""
    with _math_attention():
        return tie_aware_call(model, tensors, args, aliases=aliases)


def check_loss_signature(loss_fn: Callable) -> None:
    """The loss must take ``(outputs, targets)``. A plain Python function, or a torch module called through its own
    ``forward`` (no ``__call__`` of its own, no pre-hook that could repack the arguments), whose signature cannot bind
    two positional arguments is refused before any work, naming what it needs; for anything else (a partial, a
    callable object) the first call decides.

    Raises:
        TypeError: not callable, or a signature read as above that needs more (or fewer) than two arguments.
    """
    if not callable(loss_fn):
        raise TypeError(f"the loss function must be callable as loss_fn(outputs, targets), got a "
                        f"{type(loss_fn).__name__}")  # fmt: skip
    if isinstance(loss_fn, nn.Module):
        plain = type(loss_fn).__call__ is nn.Module.__call__ and not loss_fn._forward_pre_hooks
        target = loss_fn.forward if plain else None
    else:
        target = loss_fn if inspect.isfunction(loss_fn) else None
    if target is None:
        return
    signatures = []
    for follow in (False, True):  # a decorator's own signature, and the function it wraps: either may be the real one
        try:
            signatures.append(inspect.signature(target, follow_wrapped=follow))
        except (TypeError, ValueError):  # no signature to read: the first call says
            return
    for signature in signatures:
        try:
            signature.bind(None, None)
            return
        except TypeError:
            continue
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    raise TypeError(
        f"the loss function must take (outputs, targets); {name}{signatures[0]} does not: wrap it, e.g. "
        f"lambda out, y: {name}(out, y, ...)"
    )


def model_input_check(model: nn.Module) -> Callable[[Tensor], None] | None:
    """The check of a model that says which inputs it takes (`manifolds._modules.input_check`: the toolkit's language
    models and encoders, whose embeddings would otherwise fail with a bare ``IndexError``, and its vision
    transformers), raising `DataError` with the model's sentence; ``None`` for any other model."""
    check = input_check(model)
    if check is None:
        return None

    def checked(x: Tensor) -> None:
        try:
            check(x)
        except ValueError as failure:
            raise DataError(f"the data do not fit {type(model).__name__}: {failure}") from None

    return checked


def check_model_inputs(model: nn.Module, data: ChunkedData) -> None:
    """Every batch's inputs checked by the model (`model_input_check`) before any forward: those held in memory now,
    a stream's in its first complete pass and every later one (`ChunkedData.check_inputs`).

    Raises:
        DataError: the model's sentence.
    """
    check = model_input_check(model)
    if check is not None:
        data.check_inputs(check)


def check_first_batch(
    model: nn.Module, loss_fn: Callable, params: Mapping[str, Tensor], others: Mapping[str, Tensor],
    batch: tuple[Tensor, Tensor], dtype: torch.dtype, device: torch.device,
) -> None:  # fmt: skip
    """One forward pass on two samples of the first batch (the caller sets eval mode): the model returns one
    floating tensor, the targets fit it and the loss is a scalar.

    Raises:
        DataError: targets a torch loss would broadcast against the outputs (regression
            targets of another shape), class labels of another shape than the loss takes or outside the classes.
        UnsupportedModelError: the forward returns a tuple, list, dict or non-floating tensor.
        TypeError, ValueError: the loss returns something other than a scalar tensor.
    """
    x, y = batch
    x, y = cast_batch(x[:2], y, dtype, device)  # every label of the batch for the range check
    with torch.no_grad():
        out = functional_call(model, (params, others), (x,))
    _check_output(model, out)
    name = type(loss_fn).__name__
    if isinstance(loss_fn, nn.modules.loss._Loss):
        _check_targets(loss_fn, out, y)
    y = y[: x.shape[0]]
    try:
        with torch.no_grad():
            loss = loss_fn(out, y)
    except (RuntimeError, ValueError, IndexError) as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(
            f"{name} cannot take the model's outputs of shape {tuple(out.shape)} with targets of shape "
            f"{tuple(y.shape)} ({detail}); give targets the loss takes"
        ) from None
    if not isinstance(loss, Tensor):
        raise TypeError(f"the loss function returned a {type(loss).__name__}; it must return a 0-dim tensor")
    if loss.dim() != 0:
        raise ValueError(
            f"the loss function returned a tensor of shape {tuple(loss.shape)} on {x.shape[0]} samples, not a "
            "scalar; reduce it over the samples (reduction='mean' or 'sum', or .mean())"
        )
    _check_second_derivative(loss_fn, out, y, name)


def check_reduction(model: nn.Module, loss_fn: Callable, params: Mapping[str, Tensor], others: Mapping[str, Tensor],
                    batch: tuple[Tensor, Tensor], dtype: torch.dtype, device: torch.device, per_sample: bool) -> None:
    """The loss combines samples as the objective combines chunks (the caller sets eval mode): on two samples of the
    first batch, the loss of both together is the mean (``per_sample``) or the sum of each one's alone. A loss that
    declares another reduction than it computes, or weighs samples by the batch (a contrastive loss over the batch, a
    class-weighted mean, which normalizes by the batch's weights), would give a value that depends on how the data are
    chunked. The pair is a sample and the first after it whose target differs (a class-weighted mean of two samples of
    one class is their plain mean), tried from each of the first `_REDUCTION_ANCHORS` samples in turn until both
    losses alone are finite; a pair whose loss together is finite while one alone is not (a sample whose tokens are all
    ignored, under a mean over the kept tokens) is refused. Skipped where it cannot tell: fewer than two samples,
    outputs or targets whose first axis is not the samples', no pair with finite losses."""
    x, y = batch
    if x.shape[0] < 2 or y.dim() == 0 or y.shape[0] < 2 or y.shape[0] != x.shape[0]:
        return
    pairs = []
    for i in range(min(_REDUCTION_ANCHORS, y.shape[0] - 1)):
        differs = (y[i + 1 :] != y[i : i + 1]).reshape(y.shape[0] - i - 1, -1).any(dim=1)
        if bool(differs.any()):
            pairs.append((i, i + 1 + int(differs.nonzero()[0])))
    for pair in pairs or [(0, 1)]:
        index = torch.tensor(pair)
        xs, ys = cast_batch(x[index.to(x.device)], y[index.to(y.device)], dtype, device)  # indexing, not index_select:
        with torch.no_grad():  # unsigned integer targets have none
            out = functional_call(model, (params, others), (xs,))
            if not isinstance(out, Tensor) or out.dim() == 0 or out.shape[0] != 2:
                return
            both, one, two = (float(loss_fn(out[s], ys[s])) for s in (slice(0, 2), slice(0, 1), slice(1, 2)))
        if all(math.isfinite(v) for v in (both, one, two)):
            break
        if math.isfinite(both):  # a mean or sum of the two would not be finite either
            raise ValueError(
                f"the loss of two samples of the first batch together is {both:.6g}, but one of them alone gives "
                f"{one if not math.isfinite(one) else two}: it does not reduce over the samples as a "
                f"{'mean' if per_sample else 'sum'} (a mean over the targets a loss keeps, such as the tokens left by "
                "ignore_index, weighs samples by their count), so chunks of the data cannot be combined exactly; "
                "give a loss that treats every sample apart, or reduction='sum' over the kept targets"
            )
    else:
        return
    combined = (one + two) / 2 if per_sample else one + two
    tolerance = 1e-4 if dtype == torch.float32 else 1e-10
    if abs(both - combined) > tolerance * max(abs(both), abs(combined), 1e-30):
        kind = "the mean" if per_sample else "the sum"
        raise ValueError(
            f"the loss of two samples of the first batch together is {both:.6g}, but {kind} of each one's alone is "
            f"{combined:.6g}: it does not reduce over the samples as a {'mean' if per_sample else 'sum'}, so chunks of "
            "the data cannot be combined exactly; declare the reduction it computes (reduction='mean' or 'sum') or "
            "give a loss that treats every sample apart"
        )


# Samples of the first batch the reduction check pairs with a later one, in turn, until both losses alone are finite.
_REDUCTION_ANCHORS = 4


def _check_second_derivative(loss_fn: Callable, out: Tensor, y: Tensor, name: str) -> None:
    """The loss has a second derivative in the outputs: torch writes none for some (``MultiMarginLoss``), and every
    Hessian-vector product would fail on it."""
    with torch.enable_grad():
        o = out.detach().requires_grad_(True)
        try:
            (g,) = torch.autograd.grad(loss_fn(o, y), o, create_graph=True)
            if g.requires_grad:
                torch.autograd.grad(g, o, grad_outputs=torch.ones_like(g))
        except (RuntimeError, NotImplementedError) as exc:
            if "not implemented" not in str(exc) and not isinstance(exc, NotImplementedError):
                raise
            raise ValueError(
                f"{name} has no second derivative in torch ({str(exc).splitlines()[0]}), so no Hessian of it can "
                "be computed; use a loss that has one (CrossEntropyLoss, MSELoss, ...)"
            ) from None


# Relative distance between sample 0's outputs beside two different samples above which the model mixes samples.
# Both batches have the same shape, so the same kernels compute them and a model that treats every sample apart gives
# the same numbers; far below what any mixing of samples does.
_APART_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}
# The same samples in batches of two sizes: other kernels, whose rounding a deep network amplifies (80 tanh layers of
# gain 3 in float32: 3.4e-4), and no mixing of samples moves outputs by as little as this
_SIZE_TOLERANCE = {torch.float32: 1e-2, torch.float64: 1e-6}
# Distinct samples `check_samples_apart` compares, each beside the others and beside copies of itself, found among
# the data's first APART_SCAN (all a pass keeps of them)
APART_SAMPLES, APART_SCAN = 3, LEAD_SAMPLES


def _relative_gap(a: Tensor, b: Tensor, scale: float) -> float:
    """The largest entry of ``|a - b|`` over ``scale``, in float64 (NaN where either is not finite: never <= a
    tolerance)."""
    return float((a.to(torch.float64) - b.to(torch.float64)).abs().max()) / scale


def check_samples_apart(model: nn.Module, params: Mapping[str, Tensor], others: Mapping[str, Tensor], x: Tensor,
                        dtype: torch.dtype, device: torch.device) -> None:  # fmt: skip
    """The model treats every sample apart (the caller sets eval mode and has checked the outputs), so the
    whole-data-set loss is the sum of the chunks' whatever the chunks, and any cut of a chunk into pieces gives the same
    products. The first `APART_SAMPLES` distinct samples of ``x`` (the data's first `APART_SCAN`, whatever the chunk
    size) are compared, each beside the others and beside copies of itself in the same place of a batch of the same
    shape (so the same kernels: no rounding apart), in a batch of them and again in one a sample longer (the first
    repeated), and the same samples' outputs in the two batches (to a looser tolerance: other kernels): two samples
    would miss a view that mixes samples only in batches of three or more
    (``h.reshape(D, n)``), the first sample alone one reading the sample before it, and one batch size a mixing whose
    period divides it (``torch.roll(h, 3, 0)`` of three samples); a number read off the batch's size changes the
    outputs between the two. Mixing whose period divides both sizes (a roll by 12), or that starts in larger batches,
    is not seen. Outputs finite for the samples but not beside copies of one (a
    standardization over the batch) are mixing too. Skipped where it cannot tell: fewer than two distinct samples,
    outputs whose first axis does not follow the batch's size (``(T, N, C)``), or outputs of the samples themselves
    that are not finite.

    Raises:
        UnsupportedModelError: the outputs differ (a mean over the batch axis, attention across the samples from a
            ``batch_first`` mix-up), or two calls on the same batch differ (a forward that is random in eval mode).
    """
    x = cast_batch(x[:APART_SCAN], x[:APART_SCAN], dtype, device)[0]
    chosen: list[int] = []
    for i in range(x.shape[0]):
        if len(chosen) < APART_SAMPLES and not any(torch.equal(x[i], x[j]) for j in chosen):
            chosen.append(i)
    if len(chosen) < 2:
        return
    x = x[chosen]
    n = x.shape[0]
    name, tol = type(model).__name__, _APART_TOLERANCE.get(dtype, 1e-4)
    gap, firsts = 0.0, []
    for batch in (x, torch.cat([x, x[:1]])):  # the samples, and the same first in a batch one longer
        size = batch.shape[0]
        copies = [x[i : i + 1].expand_as(batch).contiguous() for i in range(n)]  # sample i beside copies of itself
        with torch.no_grad():
            # the samples twice in the first batch (a forward random in eval mode), once in the longer
            again = (batch,) if not firsts else ()
            outputs = [functional_call(model, (params, others), (b,)) for b in (batch, *again, *copies)]
        first = 1 + len(again)  # where the batches of copies start
        if any(out.dim() == 0 or out.shape[0] != size for out in outputs) or not bool(torch.isfinite(outputs[0]).all()):
            return
        scale = max(float(outputs[0].abs().max()), torch.finfo(outputs[0].dtype).tiny)
        firsts.append(outputs[0][:n])
        if again and not _relative_gap(outputs[0], outputs[1], scale) <= tol:
            raise UnsupportedModelError(
                f"{name} gives other outputs on each call with the same inputs even in eval mode, so every pass would "
                "evaluate another function; make its forward deterministic in eval mode (no dropout with "
                "training=True)"
            )
        for i in range(n):
            d = _relative_gap(outputs[0][i], outputs[first + i][i], scale)
            gap = d if not d <= gap else gap  # a NaN (an output not finite beside copies) is kept
    if not gap <= tol:
        how = (f"are up to {gap:.2g} apart, relative; rounding leaves under {tol:g}" if gap == gap
               else "are finite beside others and not beside copies of itself")  # fmt: skip
        raise UnsupportedModelError(
            f"{name}'s output for a sample depends on the other samples of its batch (a sample's outputs beside "
            f"others and beside copies of itself {how}), so the whole-data-set loss would change with how the data "
            "are cut into chunks; keep the samples apart in the forward (no mean or attention over the batch axis: "
            "nn.MultiheadAttention takes (batch, tokens, features) inputs only with batch_first=True)"
        )
    # across batch sizes the kernels differ, and a deep network may amplify their rounding: a looser tolerance
    size_tol = _SIZE_TOLERANCE.get(dtype, 1e-2)
    change = _relative_gap(firsts[0], firsts[1], scale)
    if not change <= size_tol:
        raise UnsupportedModelError(
            f"{name}'s outputs for the same samples change with the size of their batch ({change:.2g} apart, "
            f"relative, in batches of {n} and {n + 1}; another kernel's rounding leaves under {size_tol:g}), so the "
            "whole-data-set loss would change with how the data are cut into chunks; compute each sample's outputs "
            "from that sample alone (no number read off the batch's size)"
        )


def _check_output(model: nn.Module, out: object) -> None:
    name = type(model).__name__
    if isinstance(out, Mapping):
        keys = [str(k) for k in out]
        raise UnsupportedModelError(
            f"{name}'s forward returns a {type(out).__name__} (keys {_names(keys)}), not one tensor of outputs; wrap "
            f"the model so that forward returns the tensor the loss takes, e.g. model(x)[{keys[0]!r}]"
            if keys else f"{name}'s forward returns an empty {type(out).__name__}; it must return one tensor"
        )
    if isinstance(out, (tuple, list)):
        raise UnsupportedModelError(
            f"{name}'s forward returns a {type(out).__name__} of {len(out)} items, not one tensor of outputs; wrap "
            "the model so that forward returns the tensor the loss takes, e.g. model(x)[0]"
        )
    if not isinstance(out, Tensor) or not out.is_floating_point():
        kind = out.dtype if isinstance(out, Tensor) else type(out).__name__
        raise UnsupportedModelError(f"{name}'s forward returns {kind}, not a floating-point tensor of outputs")


# torch losses of one target per output entry, whatever the targets' dtype (integer targets broadcast as floats do)
_ELEMENTWISE_LOSSES = (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.BCELoss, nn.BCEWithLogitsLoss,
                       nn.SoftMarginLoss, nn.KLDivLoss, nn.PoissonNLLLoss)  # fmt: skip


def _check_targets(loss_fn: nn.Module, out: Tensor, y: Tensor) -> None:
    """Targets a torch loss would broadcast (regression targets of another shape) or misread (class labels of
    another shape, or outside the classes)."""
    name = type(loss_fn).__name__
    if y.is_floating_point() or isinstance(loss_fn, _ELEMENTWISE_LOSSES):
        if out.shape[1:] != y.shape[1:]:
            raise DataError(
                f"targets of shape {tuple(y.shape[1:])} per sample do not match the model's outputs of shape "
                f"{tuple(out.shape[1:])} per sample, which {name} would broadcast into a different loss; "
                f"reshape the targets to (n, {', '.join(map(str, out.shape[1:]))})"
            )
    elif isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)) and out.dim() >= 2 and y.numel():
        if y.shape[1:] != out.shape[2:]:
            shape = ", ".join(["n", *map(str, out.shape[2:])])
            column = " (an (X, y) pair of tensors with a (n, 1) column is read as (n,) for you)" if y.dim() == 2 else ""
            raise DataError(
                f"class labels of shape {tuple(y.shape[1:])} per sample do not fit outputs of shape "
                f"{tuple(out.shape[1:])} per sample; {name} needs labels of shape ({shape}): reshape them, e.g. "
                f"y.reshape({', '.join(['-1', *map(str, out.shape[2:])])}){column}"
            )
        classes, ignore = out.shape[1], loss_fn.ignore_index
        kept = y[y != ignore]
        if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= classes):
            raise DataError(
                f"class labels range over [{int(kept.min())}, {int(kept.max())}] but the model has {classes} "
                f"outputs; {name} needs labels in [0, {classes - 1}]"
            )


def as_vector(v: object, size: int, dtype: torch.dtype, device: torch.device, batched: bool = False) -> Tensor:
    """``v`` as a flat ``(size,)`` vector (``(k, size)`` where ``batched``) in the objective's dtype and on its
    device: moved between devices, and converted where that is exact (float32 to float64, half precision to
    either); a conversion that would round is refused.

    Raises:
        TypeError: ``v`` is not a floating-point tensor.
        ValueError: another shape, or a dtype that converts to ``dtype`` only by rounding.
    """
    if not isinstance(v, Tensor) or not v.is_floating_point():
        kind = v.dtype if isinstance(v, Tensor) else type(v).__name__
        raise TypeError(f"the vector must be a floating-point tensor, got {kind}")
    fits = v.dim() == 2 and v.shape[1] == size if batched else v.shape == (size,)
    if not fits:
        want = f"(k, {size})" if batched else f"({size},)"
        raise ValueError(f"the vector has shape {tuple(v.shape)} but the objective's parameters need {want}")
    if v.dtype != dtype:
        have, want = torch.finfo(v.dtype), torch.finfo(dtype)
        if want.eps > have.eps or want.max < have.max or want.smallest_normal > have.smallest_normal:
            raise ValueError(
                f"the vector is {v.dtype} but the objective computes in {dtype}, and the conversion would round it; "
                f"pass v.to({dtype}) or build the objective with dtype={v.dtype}"
            )
        v = v.to(dtype)
    if v.device != device:
        v = v.to(device)
    return v


def float32_hessian_error(
    model: nn.Module, loss_fn: Callable, params: Mapping[str, Tensor], others: Mapping[str, Tensor],
    batch: tuple[Tensor, Tensor], device: torch.device, rop: Callable | None = None,
) -> float:  # fmt: skip
    """Relative distance between one Hessian-vector product in float32 and the same in float64, on the first
    `PRECISION_SAMPLES` samples of ``batch`` at the same weights (a fixed random direction): how much of the
    Hessian float32 keeps here. At a well-fitted point the loss's curvature lies below float32's resolution (a
    softmax's ``p (1 - p)`` with ``1 - p`` near 1e-7) and the distance is of order one. The caller sets eval mode.

    ``rop(params, buffers)``: where given, the model's R-operator reader (`sharpness.products._rop`,
    `sharpness.products._rop_graph`) for parameters and buffers in a dtype; both products are then the R-operator's,
    the products a float32 solve of this objective uses (and no autograd graph is built), else autograd's.
    """
    x, y = batch[0][:PRECISION_SAMPLES], batch[1][:PRECISION_SAMPLES]
    generator = torch.Generator().manual_seed(0)
    # drawn in float32 and widened exactly (both products see one direction): a quarter of float64's drawing time,
    # which on a model of 100M parameters is seconds of a check run once per objective
    direction = [torch.randn(t.shape, generator=generator, dtype=torch.float32) for t in params.values()]
    products = []
    for dtype in (torch.float32, torch.float64):
        p = {k: t.detach().to(device, dtype) for k, t in params.items()}
        b = {k: t.to(device, dtype) if t.is_floating_point() else t for k, t in others.items()}
        xs, ys = cast_batch(x, y, dtype, device)
        tangent = [d.to(device, dtype) for d in direction]
        reader = rop(p, b) if rop is not None else None
        if reader is not None:
            hv = [torch.zeros_like(t) for t in p.values()]
            with torch.no_grad():
                state = reader.forward_state(p, xs, ys, loss_fn, 1.0)
                reader.add_products(p, state, dict(zip(p, tangent)), dict(zip(p, hv)))
        else:
            with torch.enable_grad():
                leaves = [t.requires_grad_(True) for t in p.values()]
                loss = loss_fn(functional_call(model, (p, b), (xs,)), ys)
                hv = gradient_products(gradient_with_graph(loss, leaves), leaves, tangent)
        products.append(hv)
    distance, scale = _squared_distance(*products)
    return math.sqrt(distance / scale) if scale > 0 else 0.0


# Entries per piece of `_squared_distance`: 32 MiB of float64 temporaries at a time, whatever the model's size
_DISTANCE_PIECE = 1 << 22


def _squared_distance(a: list[Tensor], b: list[Tensor]) -> tuple[float, float]:
    """``|a - b|^2`` and ``|b|^2`` in float64 for two lists of tensors of the same shapes, piece by piece: no flat
    float64 copy of either (two of them cost seconds and gigabytes on a model of 100M parameters)."""
    distance = scale = torch.zeros((), dtype=torch.float64, device=b[0].device if b else None)
    for s, t in zip(a, b):
        for u, v in zip(s.reshape(-1).split(_DISTANCE_PIECE), t.reshape(-1).split(_DISTANCE_PIECE)):
            v = v.double()
            distance = distance + torch.linalg.vector_norm(v - u).square()  # v - u promotes u to float64
            scale = scale + torch.linalg.vector_norm(v).square()
    return float(distance), float(scale)


def precision_warning(error: float) -> str | None:
    """The sentence a result carries where float32 lost the Hessian (`float32_hessian_error` above
    `PRECISION_TOLERANCE`), else ``None``."""
    if not error > PRECISION_TOLERANCE:
        return None
    return (
        f"float32 does not hold the Hessian at this point: on the first samples a float32 Hessian-vector product "
        f"differs from float64's by {error:.0%}, so values measured in float32 can be far off (traces and densities "
        "first, top eigenvalues as the loss falls further); measure with dtype=torch.float64 (--dtype float64)"
    )
