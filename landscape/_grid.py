"""Exact whole-data-set loss (and accuracy) at every point of a grid ``theta + sum_i c_i d_i``
([`evaluate_grid`][landscape.evaluate_grid]), or at the points ``p(c)`` of any map from grid coordinates to parameters
([`evaluate_points`][landscape.evaluate_points]: curved charts such as G-space planes or geodesic planes).

Three strategies, all giving the same values (to rounding):

* ``"first-layer"`` (the fast path): for an ``nn.Sequential`` whose first parameterized module is
  linear in its parameters (``Linear``, ``Conv1d/2d/3d``, transposed convolutions), the first
  layer's output along the grid is ``f(x; theta) + sum_i c_i f(x; d_i)``: ``k + 1`` products per
  data chunk instead of one per grid point. The remaining layers run for a batch of grid points at
  once: batched matrix products for a chain of ``Linear`` and ``ReLU``, ``torch.func.vmap`` over
  ``functional_call`` otherwise. On CPU the first layer is where the time goes: for an MLP
  784-300-100-10 it holds ~88% of the multiply-adds.
* ``"vmap"``: the whole model vmapped over a batch of grid points (any model, any point map).
* ``"loop"``: one ``functional_call`` per grid point (any model, any point map).

``"auto"`` takes the fast path when the model allows it, otherwise ``"loop"`` on CPU (where a
vmapped forward pass is slower than a loop) and ``"vmap"`` elsewhere. The fast path needs the first
layer's parameters to be linear in the grid coordinates: always for [`evaluate_grid`][landscape.evaluate_grid], and for
`evaluate_points` when the caller says so (``first_layer``; G-space planes, whose first layer is
``v_1 / d``, qualify).

Both functions share one driver: the data are traversed once (outer loop over pieces of data, inner
loop over batches of grid points); the batch size comes from a memory budget (and, on CPU, a
cache-friendly cap). The pieces are the objective's chunks, joined or, on CPU, cut to about
``CPU_PIECE_BYTES`` of activations. The model's own parameters are never modified: points are passed
functionally.

Grids are evaluated in eval mode, where a BatchNorm with running statistics is a per-channel affine
map: every engine runs the model's traced graph with each such BatchNorm folded into the ``Linear``
or convolution before it (`sharpness.products.fold_batch_norms`), so no pass over the activations is spent
on it, and its views made reshapes. On CPU, images go through the convolutions in channels-last order; a batch
of one grid point is a plain call rather than a vmapped one, with the ReLUs and additions done in place where
nothing else reads the tensor (`landscape._inplace`). On ResNet-20 with 3x32x32 inputs these took a point
from 0.96 s to about 0.52 s (2 threads). With ``compile=True`` each point's forward pass, the first layer's
combination included, runs through ``torch.compile`` (`landscape._compiled`), which fuses the element-wise
work between the convolutions and drops the cost of calling the model with new parameters (12% less a point).
"""

from __future__ import annotations

import copy
import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, fx, nn
from torch.func import vmap

from landscape._compiled import compiled_forward, require_compiler
from landscape._inplace import inplace_activations
from manifolds import FirstLayerSplit, UnsupportedModelError, eval_mode, functional_call, split_first_layer
from sharpness import Objective
from sharpness.io import progress_bar
from sharpness.products import fold_batch_norms
from sharpness.products._boundary import _math_attention as math_attention
from sharpness.products._layout import channels_last, cpu_images, reshape_views

STRATEGIES = ("auto", "first-layer", "vmap", "loop")

# Maps a batch of grid coordinates ``(B, k)`` to flat parameter vectors ``(B, n)`` or ``{name: (B, *shape)}``.
PointFn = Callable[[Tensor], "Tensor | Mapping[str, Tensor]"]

# A point map is called on at most this many bytes of parameters at once where the engine consumes the
# points piecewise (the loop, the fast path's later layers): fresh temporaries of tens of MB cost page
# faults on every call (measured: a 32 x 266k float32 copy 0.9 ms per point, 8 x 266k 0.4 ms).
POINT_MAP_BYTES = 8 * 2**20

# On CPU, batches of more grid points run slower per point once their activations fall out of cache
# (measured on the MLP 784-300-100-10 with 500 samples: 32 points per batch beat 8, 16 and 64).
CPU_BATCH_CAP = 32

# On CPU the data run through the model in pieces of about this many bytes of forward activations (one sample's,
# summed over the layers, times the samples), consecutive chunks joined or large ones cut to it: fewer calls per
# point than small chunks, activations that stay in cache and clear of page faults unlike large ones (measured on
# ResNet-20 with 1000 3x32x32 samples, about 1.8 MiB a sample: 35-sample chunks 0.59 s a point, 64 to 128 samples
# 0.525 s, all 1000 at once 0.9 s). Elsewhere pieces are joined up to half the memory budget.
CPU_PIECE_BYTES = 128 * 2**20

# Modules whose output is linear in their parameters (weight and bias) for a fixed input.
_LINEAR_MODULES = (
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
)  # fmt: skip


def grid_axis(lo: float, hi: float, steps: int, anchors: Sequence[float] = (0.0,)) -> np.ndarray:
    """``steps`` evenly spaced coordinates over ``[lo, hi]`` that contain every anchor in the range exactly.

    An anchor within a hundredth of a spacing of a grid point replaces that point (so odd counts on a
    symmetric range hit 0 exactly); any other anchor is inserted, giving ``steps + 1`` points.

    Returns:
        ``(m,)`` float64, increasing.
    """
    if steps < 1:
        raise ValueError(f"the number of grid steps must be positive, got {steps}")
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi < lo or (hi == lo and steps > 1):
        raise ValueError(f"the grid range [{lo}, {hi}] is empty or not finite; give lo < hi")
    x = np.linspace(lo, hi, steps)
    spacing = (hi - lo) / max(steps - 1, 1)
    for a in anchors:
        if not lo <= a <= hi:
            continue
        j = int(np.argmin(np.abs(x - a)))
        if abs(x[j] - a) <= 1e-2 * spacing:
            x[j] = a
        else:
            x = np.sort(np.append(x, a))
    return x


@dataclass(frozen=True)
class GridValues:
    """Loss (and accuracy) at each grid point, and how they were computed.

    Attributes:
        loss: ``(P,)`` float64 whole-data-set loss per grid point.
        accuracy: ``(P,)`` float64 accuracy per point (class-index targets), else ``None``.
        strategy: ``"first-layer"``, ``"vmap"`` or ``"loop"``.
        batch: grid points evaluated together.
        seconds: wall time.
        bytes_per_point: estimated bytes one grid point of a batch keeps alive (activations of a data
            chunk and the parameter copies); ``batch * bytes_per_point`` stays within the budget.
        compiled: whether the forward passes ran compiled (``compile=True`` on a path that calls the model).
    """

    loss: np.ndarray
    accuracy: np.ndarray | None
    strategy: str
    batch: int
    seconds: float
    bytes_per_point: float = 0.0
    compiled: bool = False

    @property
    def points_per_second(self) -> float:
        return len(self.loss) / max(self.seconds, 1e-12)


def split_first_linear(objective: Objective) -> FirstLayerSplit | None:
    """The model cut after its first layer for the fast path, or ``None`` when it does not have that shape.

    The fast path needs a first parameterized module that is linear in its parameters (Linear, a
    convolution), reached from the input by parameter- and buffer-free operations only, with no connection
    skipping it, and all its parameters among those the grid moves. The cut is read off the model's traced
    graph (`Objective.structure`), so any traceable model qualifies, not only an ``nn.Sequential``.
    """
    traced = objective.structure.traced
    if traced is None or traced.graph is None:
        return None
    split = split_first_layer(traced.graph, objective.model, _LINEAR_MODULES, fold_relu=True)
    return split if split is not None and split.layer_among(objective.params) else None


def choose_strategy(objective: Objective, strategy: str = "auto") -> str:
    """Resolve ``strategy`` for this objective (``"first-layer"`` only where the model allows it)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown grid strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    fast = split_first_linear(objective) is not None
    if strategy == "first-layer" and not fast:
        raise ValueError(
            f"the first-layer fast path needs a first parameterized module that is a Linear or Conv layer of the "
            f"input, reached through parameter-free operations only; {type(objective.model).__name__} has none, so "
            "use strategy 'vmap' or 'loop'"
        )
    if strategy != "auto":
        return strategy
    if fast:
        return "first-layer"
    return "loop" if objective.device.type == "cpu" else "vmap"


def _bytes_per_point(objective: Objective, chunk: int, n_moved: int) -> float:
    """Estimated bytes one grid point of a batch keeps alive: activations of a data chunk, parameter copies."""
    per_sample = objective.activation_bytes_per_sample()
    elem = torch.empty((), dtype=objective.dtype).element_size()
    # batched kernels keep about two activation-sized temporaries per point alive at once
    return 2 * per_sample * chunk + 2 * n_moved * elem


def _piece_size(objective: Objective, budget: int) -> int:
    """Samples per piece of data the engines see: chunks are joined up to half the budget's worth of activations
    and, on CPU, joined or cut to ``CPU_PIECE_BYTES`` (a chunk is never cut for the budget: it is the data's own
    unit, which the budget already sized)."""
    per_sample = objective.activation_bytes_per_sample()
    size = max(int(budget / 2 // per_sample), objective.data.chunk_size or objective.n_samples)
    if objective.device.type == "cpu":
        size = min(size, int(CPU_PIECE_BYTES // per_sample))
    return max(1, min(objective.n_samples, size))


def _sizes(objective: Objective, memory_budget: int | None, n_moved: int) -> tuple[int, int, float]:
    """The grid's budget in bytes, its samples per piece and the bytes a grid point keeps alive."""
    budget = _budget(objective, memory_budget)
    piece = _piece_size(objective, budget)
    return budget, piece, _bytes_per_point(objective, piece, n_moved)


def _batch_size(objective: Objective, budget: int, per_point: float) -> int:
    """Grid points per batch within ``budget`` bytes (and, on CPU, at most ``CPU_BATCH_CAP``)."""
    batch = max(1, int(budget // per_point))
    return min(batch, CPU_BATCH_CAP) if objective.device.type == "cpu" else batch


def _classifies(out: Tensor, y: Tensor) -> bool:
    """Accuracy is defined for class-index targets and ``(n, classes)`` outputs (as in ``Objective.evaluate``)."""
    return not y.is_floating_point() and out.dim() == 2


def _loss_and_hits(loss_fn, out: Tensor, y: Tensor, classify: bool) -> tuple[Tensor, Tensor]:
    loss = loss_fn(out, y)
    hits = (out.argmax(dim=-1) == y).sum() if classify else torch.zeros((), dtype=torch.long, device=out.device)
    return loss, hits


class _Points:
    """The parameters of a batch of grid coordinates, from a point map.

    The map returns flat vectors ``(B, n)`` or a ``{name: (B, *shape)}`` dict; its first output is
    checked. Without ``rest`` the points come back as such a dict (for the loop and vmap engines);
    with ``rest`` (the names of the layers after the first, on the fast path) as one flat ``(B, m)``
    block of those tensors, and ``linear`` (the first layer's names, centre and directions) is compared
    with the map's first-layer output on the first batch, since the fast path takes that layer from
    it. When ``cache`` is set, every batch's points are kept for the later data chunks.
    """

    def __init__(
        self, fn: PointFn, objective: Objective, cache: bool, rest: Sequence[str] | None = None,
        linear: tuple[Sequence[str], Tensor, Tensor] | None = None,
    ):  # fmt: skip
        self.fn, self.layout = fn, objective.layout
        self.dtype, self.device = objective.dtype, objective.device
        self.cache: dict[int, Tensor | dict[str, Tensor]] | None = {} if cache else None
        self.rest, self.linear = rest, linear
        self.checked = False
        elem = torch.empty((), dtype=self.dtype).element_size()
        self.step = max(1, POINT_MAP_BYTES // (self.layout.size * elem))  # points per call of the map

    def _params(self, c: Tensor, points) -> dict[str, Tensor]:
        """``{name: (B, *shape)}`` from the map's output, checked once."""
        B, layout = c.shape[0], self.layout
        if isinstance(points, Tensor):
            if not self.checked and tuple(points.shape) != (B, layout.size):
                raise ValueError(
                    f"the point map must return flat parameter vectors of shape ({B}, {layout.size}) for {B} grid "
                    f"points, got {tuple(points.shape)}"
                )
            return layout.unflatten(points.to(self.device, self.dtype))
        if not isinstance(points, Mapping):
            raise ValueError(f"the point map must return a tensor or a dict of tensors, got {type(points).__name__}")
        if not self.checked:
            for name, shape in zip(layout.names, layout.shapes):
                got = points.get(name)
                if got is None or tuple(got.shape) != (B, *shape):
                    what = "nothing" if got is None else f"shape {tuple(got.shape)}"
                    raise ValueError(
                        f"the point map must return {name!r} with shape {(B, *shape)} for {B} grid points, got {what}"
                    )
        return {n: points[n].to(self.device, self.dtype) for n in layout.names}

    def _check_linear(self, c: Tensor, params: dict[str, Tensor]) -> None:
        names, theta, D = self.linear
        got = torch.cat([params[n].reshape(c.shape[0], -1) for n in names], dim=1)
        expected = theta + c @ D
        eps = torch.finfo(self.dtype).eps
        scale = float(expected.abs().max()) if expected.numel() else 0.0
        if not torch.allclose(got, expected, rtol=1e3 * eps, atol=1e3 * eps * scale):
            raise ValueError(
                "the point map's first-layer parameters are not center + coords @ directions as given in "
                "first_layer; pass the directions of the first layer's (linear) part, or leave out first_layer"
            )

    def _rest(self, c: Tensor) -> Tensor:
        params = self._params(c, self.fn(c))
        if not self.checked and self.linear is not None:
            self._check_linear(c, params)
        self.checked = True
        return torch.cat([params[n].reshape(c.shape[0], -1) for n in self.rest], 1)

    def __call__(self, lo: int, c: Tensor) -> Tensor | dict[str, Tensor]:
        if self.cache is not None and lo in self.cache:
            return self.cache[lo]
        if self.rest is None:
            out = self._params(c, self.fn(c))
            self.checked = True
        else:  # the whole points are dropped at once: map small sub-batches, whose temporaries stay cached
            out = torch.cat([self._rest(c[i : i + self.step]) for i in range(0, c.shape[0], self.step)])
        if self.cache is not None:
            self.cache[lo] = out
        return out


def _linear_points(theta: Tensor, D: Tensor) -> PointFn:
    """The point map of the linear grid ``theta + c @ D``."""
    return lambda c: theta + c @ D


def _eval_module(module: nn.Module, graph: fx.Graph | None, buffers: Mapping[str, Tensor], inplace: bool = False):
    """What a grid runs for ``module`` (traced as ``graph``, if at all): the graph with its BatchNorms folded
    where it allows (grids are evaluated in eval mode), its views made reshapes (it may then be given
    channels-last images) and, with ``inplace`` (plain calls, not vmap), its ReLUs and additions done in place
    where safe, or the module as it is where there is no graph; the names of its tensors (only those may be
    passed to it) and those of ``buffers`` among them."""
    if graph is not None:
        module = reshape_views(fold_batch_norms(module, graph) or fx.GraphModule(module, copy.deepcopy(graph)))
        if inplace:
            module = inplace_activations(module)
    names = {n for n, _ in (*module.named_parameters(), *module.named_buffers())}
    return module, names, {n: b for n, b in buffers.items() if n in names}


def _traced_graph(objective: Objective) -> fx.Graph | None:
    try:
        traced = objective.structure.traced
    except UnsupportedModelError:  # no graph: the model as it is
        return None
    return None if traced is None else traced.graph


class _Loop:
    """One ``functional_call`` of the whole model per grid point."""

    inplace = True  # plain calls: the graph's ReLUs and additions may write into fresh tensors

    def __init__(self, objective: Objective, points: _Points, compile: bool = False):
        self.objective, self.points, self.compile = objective, points, compile
        graph = _traced_graph(objective)
        self.traced = graph is not None
        inplace = self.inplace and not compile  # the compiler plans memory itself
        self.module, self.names, self.buffers = _eval_module(objective.model, graph, objective.buffers, inplace)
        self.forward = compiled_forward(self.module, self.buffers) if compile else self._forward

    def _forward(self, params: dict[str, Tensor], x: Tensor) -> Tensor:
        return functional_call(self.module, (params, self.buffers), (x,))

    def prepare(self, x: Tensor) -> Tensor:
        return channels_last(x) if self.traced else x  # an untraced model's views may need the standard order

    def __call__(self, lo: int, c: Tensor, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, bool]:
        obj, step = self.objective, self.points.step
        losses, hits, classify = [], [], True
        for start in range(0, c.shape[0], step):  # small sub-batches of points: their temporaries stay cached
            params = {n: t for n, t in self.points(lo + start, c[start : start + step]).items() if n in self.names}
            for i in range(next(iter(params.values())).shape[0]):
                out = self.forward({n: t[i] for n, t in params.items()}, x)
                classify = _classifies(out, y)
                loss, hit = _loss_and_hits(obj.chunk_loss_fn, out, y, classify)
                losses.append(loss)
                hits.append(hit)
        return torch.stack(losses), torch.stack(hits), classify


class _Vmap(_Loop):
    """The whole model vmapped over a batch of grid points."""

    inplace = False  # vmap cannot write one point's values into a tensor all points share

    def prepare(self, x: Tensor) -> Tensor:
        return x  # vmap's batching rules need the standard strides

    def __call__(self, lo: int, c: Tensor, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, bool]:
        obj, module, buffers = self.objective, self.module, self.buffers
        params = {n: t for n, t in self.points(lo, c).items() if n in self.names}
        out = vmap(lambda p: functional_call(module, (p, buffers), (x,)))(params)
        classify = _classifies(out[0], y)
        loss, hits = vmap(lambda o: _loss_and_hits(obj.chunk_loss_fn, o, y, classify))(out)
        return loss, hits, classify


def _sub(tensors: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """Entries under ``prefix.`` with the prefix removed (the names inside a submodule)."""
    return {k[len(prefix) + 1 :]: v for k, v in tensors.items() if k.startswith(prefix + ".")}


def _columns(layout, names: Sequence[str], device: torch.device) -> Tensor:
    """Indices of the flat entries of the tensors ``names``, in order."""
    idx = [torch.arange(layout.slice(n).start, layout.slice(n).stop, device=device) for n in names]
    return torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long, device=device)


def _mlp_layers(chain, names: Sequence[str]) -> list[tuple[str, nn.Module]] | None:
    """The steps of ``chain`` (a `FirstLayerSplit.chain`) when it is a plain chain of ``Linear`` and
    ``ReLU`` whose parameters all move with the grid (then batched matrix products replace vmap), else ``None``."""
    if chain is None:
        return None
    for name, module in chain:
        if type(module) is nn.ReLU:
            continue
        if type(module) is not nn.Linear or any(f"{name}.{p}" not in names for p, _ in module.named_parameters()):
            return None
    return list(chain)


def _combined(w: Tensor, z: Tensor, nhwc: bool, relu: bool) -> Tensor:
    """The first layer's output at one grid point as the later layers take it: ``sum_i w_i z_i`` over the stored
    outputs ``z`` of shape ``(k + 1, *output)`` with ``w = (1, c)``, in the standard axis order (``z`` holds images
    channels-last when ``nhwc``), rectified when a ReLU comes first. Traced into the compiled forward pass, it runs
    in one pass over ``z`` with what follows (a BatchNorm, a ReLU)."""
    h = (w.view(-1, *[1] * (z.dim() - 1)) * z).sum(0)
    if nhwc:
        h = h.permute(0, 3, 1, 2)
    return h.relu() if relu else h


class _FirstLayer:
    """The fast path: the first layer's output along the grid from ``k + 1`` products per data chunk,
    the other layers evaluated for a batch of grid points at once (their parameters from the linear
    grid, or from a point map whose first layer is linear in the coordinates)."""

    def __init__(self, objective: Objective, split: FirstLayerSplit, theta: Tensor, D: Tensor, compile: bool = False):
        layout = objective.layout
        self.split, self.loss_fn, self.buffers = split, objective.chunk_loss_fn, objective.buffers
        self.first_theta = _sub(layout.unflatten(theta), split.name)
        self.first_dirs = [_sub(layout.unflatten(d), split.name) for d in D]
        self.rest_names = [n for n in layout.names if not n.startswith(split.name + ".")]
        self.first_names = [n for n in layout.names if n.startswith(split.name + ".")]
        self.rest_shapes = [(n, layout.shapes[layout.names.index(n)]) for n in self.rest_names]
        rest_index = _columns(layout, self.rest_names, theta.device)
        # only the later layers' parameters are formed per grid point: a compact flat block
        self.rest_theta, self.rest_dirs = theta[rest_index], D[:, rest_index]
        self.rest_points: _Points | None = None
        self.mlp = _mlp_layers(split.chain, layout.names)
        self.compile = compile and self.mlp is None  # a chain of Linear and ReLU runs as batched products: none
        self.scratch: dict[str, Tensor] = {}

    @functools.cached_property
    def rest_batched(self) -> tuple[nn.Module, set[str], dict[str, Tensor]]:
        """The later layers for batches of points (vmapped), the names they take and the buffers among them."""
        return _eval_module(self.split.rest, self.split.rest.graph, self.buffers)

    @functools.cached_property
    def rest_single(self) -> tuple[nn.Module, set[str], dict[str, Tensor]]:
        """The same for one point (a plain call: ReLUs and additions in place where safe)."""
        return _eval_module(self.split.rest, self.split.rest.graph, self.buffers, inplace=True)

    @functools.cached_property
    def rest_compiled(self) -> tuple[Callable[..., Tensor], set[str]]:
        """One point's forward pass from the stored first-layer outputs, compiled (``compile=True``), and the
        names of the parameters it takes: ``(params, w, z, nhwc, relu_first) -> outputs``, see `_combined`."""
        module, keep, buffers = self.rest_batched  # without in-place operations: the compiler plans memory
        return compiled_forward(module, buffers, head=_combined), keep

    def _scratch(self, key: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """A reused buffer of ``shape`` for the activations of a batch: a fresh tensor of tens of MB costs
        page faults on every batch (measured: 19 MB filled in 1.8 ms fresh, 0.7 ms reused)."""
        numel = math.prod(shape)
        buf = self.scratch.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = self.scratch[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel].view(shape)

    def prepare(self, x: Tensor) -> tuple[tuple[int, ...], Tensor, bool]:
        """The first layer's output shape as stored, ``[z0; z_1; ...; z_k]``, ``(k + 1, n * ...)``: its output at
        theta and along each direction, and whether images are stored channels-last ``(n, H, W, C)``. For a chain
        of ``Linear`` and ``ReLU`` on ``(n, features)`` rows the outputs are stored transposed, ``(features, n)``,
        see `_mlp`."""
        xp = self.split.prefix(x)
        z0 = functional_call(self.split.layer, self.first_theta, (xp,))
        zd = [functional_call(self.split.layer, d, (xp,)) for d in self.first_dirs]
        if self.mlp is not None and z0.dim() == 2:
            z0, zd = z0.T, [z.T for z in zd]
        nhwc = cpu_images(z0)  # stored (n, H, W, C): the later convolutions then read channels-last
        if nhwc:
            z0, zd = z0.permute(0, 2, 3, 1), [z.permute(0, 2, 3, 1) for z in zd]
        return tuple(z0.shape), torch.stack([z0, *zd]).reshape(len(zd) + 1, -1), nhwc

    def rest_params(self, lo: int, c: Tensor) -> dict[str, Tensor]:
        """``{name: (P, *shape)}`` parameters of the layers after the first at the grid points ``c``."""
        if self.rest_points is None:
            out = self._scratch("rest parameters", (c.shape[0], self.rest_theta.shape[0]), c)
            flat = torch.addmm(self.rest_theta, c, self.rest_dirs, out=out)
        else:
            flat = self.rest_points(lo, c)
        out, offset = {}, 0
        for name, shape in self.rest_shapes:
            out[name] = flat[:, offset : offset + shape.numel()].reshape(c.shape[0], *shape)
            offset += shape.numel()
        return out

    def _mlp(self, h: Tensor, params: dict[str, Tensor]) -> Tensor:
        """The chain of ``Linear`` and ``ReLU`` on activations ``(P, features, n)``, as ``(P, outputs, n)``.

        Samples along the last axis make every layer ``W @ h`` a batched product with the weights as
        stored, and put the outputs in the layout in which a softmax over classes is fast (measured on
        the MLP 784-300-100-10: the loss 6x faster than on ``(P, n, classes)``).
        """
        for step, (name, module) in enumerate(self.mlp):
            if type(module) is nn.ReLU:
                h = h.relu_()
                continue
            weight, bias = params[f"{name}.weight"], params.get(f"{name}.bias")
            # one buffer per step, not per module: a module called twice must not write over its own input
            out = self._scratch(f"step {step}", (h.shape[0], weight.shape[1], h.shape[2]), h)
            h = torch.bmm(weight, h, out=out) if bias is None else torch.baddbmm(bias.unsqueeze(2), weight, h, out=out)
        return h

    def _mlp_loss(self, out: Tensor, y: Tensor) -> tuple[Tensor, Tensor, bool]:
        """Loss and hits per point from MLP outputs ``(P, outputs, n)``."""
        classify = not y.is_floating_point() and y.dim() == 1
        if classify and isinstance(self.loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)):
            # the class axis is dim 1 both ways: a (1, C, n) input with (1, n) targets is the same loss
            # (weights, ignore_index, label smoothing, reduction included) as (n, C) with (n,)
            loss = vmap(lambda o: self.loss_fn(o.unsqueeze(0), y.unsqueeze(0)))(out)
            return loss, (out.max(dim=1).indices == y).sum(dim=1), True  # max: first index among ties
        out = out.transpose(1, 2)
        classify = _classifies(out[0], y)
        loss, hits = vmap(lambda o: _loss_and_hits(self.loss_fn, o, y, classify))(out)
        return loss, hits, classify

    def __call__(
        self, lo: int, c: Tensor, prepared: tuple[tuple[int, ...], Tensor, bool], y: Tensor
    ) -> tuple[Tensor, Tensor, bool]:
        shape, z, nhwc = prepared
        # f(x; theta + sum c_i d_i) = z0 + sum c_i z_i, exact because the first layer is linear in its
        # parameters; the weights (1, c) of each row combine the stored outputs [z0; z_1; ...]
        w = torch.cat([torch.ones(c.shape[0], 1, dtype=c.dtype, device=c.device), c], dim=1)
        if self.compile:  # one point (see evaluate_grid): the combination runs in one pass with what follows
            forward, keep = self.rest_compiled
            params = {n: t[0] for n, t in self.rest_params(lo, c).items() if n in keep}
            out = forward(params, w[0], z.view(z.shape[0], *shape), nhwc, self.split.relu_first)
            return self._single_loss(out, y)
        # one product writes the combination without a separate copy of z0
        h = torch.mm(w, z, out=self._scratch("", (c.shape[0], z.shape[1]), z))
        h = h.view(c.shape[0], *shape)
        if nhwc:  # (P, n, C, H, W) with channels-last strides; vmap's batching rules need the standard ones
            h = h.permute(0, 1, 4, 2, 3) if c.shape[0] == 1 else h.permute(0, 1, 4, 2, 3).contiguous()
        if self.split.relu_first:
            h = h.relu_()  # in place: saves one pass over the largest activation
        params = self.rest_params(lo, c)
        if self.mlp is not None and h.dim() == 3:
            return self._mlp_loss(self._mlp(h, params), y)
        # each module is built on first use: a grid of one-point batches never needs the vmapped one
        if c.shape[0] == 1:  # one point: a plain call (vmap's batching rules cost a quarter of a ResNet's pass)
            rest, keep, buffers = self.rest_single
            out = functional_call(rest, ({n: t[0] for n, t in params.items() if n in keep}, buffers), (h[0],))
            return self._single_loss(out, y)
        rest, keep, buffers = self.rest_batched
        params = {n: t for n, t in params.items() if n in keep}
        out = vmap(lambda p, z: functional_call(rest, (p, buffers), (z,)))(params, h)
        classify = _classifies(out[0], y)
        loss, hits = vmap(lambda o: _loss_and_hits(self.loss_fn, o, y, classify))(out)
        return loss, hits, classify

    def _single_loss(self, out: Tensor, y: Tensor) -> tuple[Tensor, Tensor, bool]:
        """Loss and hits of one point's outputs, as a batch of one."""
        classify = _classifies(out, y)
        loss, hits = _loss_and_hits(self.loss_fn, out, y, classify)
        return loss[None], hits[None], classify


def _coords(coords: Tensor | np.ndarray, objective: Objective, k: int | None) -> Tensor:
    C = (coords if isinstance(coords, Tensor) else torch.as_tensor(np.asarray(coords))).to(
        objective.device, objective.dtype
    )
    if C.dim() != 2 or (k is not None and C.shape[1] != k):
        raise ValueError(f"coords must have shape (P, {'k' if k is None else k}), got {tuple(C.shape)}")
    return C


def _run(
    objective: Objective, engine, C: Tensor, strategy: str, batch: int, piece: int, per_point: float,
    progress: bool | None, start: float, points: _Points | None = None,
) -> GridValues:  # fmt: skip
    """The shared driver: data traversed once in pieces of ``piece`` samples, batches of grid points inside, exact
    piece weights. Where several processes share the data, each evaluates every point on its share and the sums
    are reduced once at the end."""
    n_points, device = C.shape[0], objective.device
    # The losses, the hits and (last entry) whether any chunk's outputs are not class scores.
    sums = torch.zeros(2 * n_points + 1, dtype=torch.float64, device=device)
    loss, hits = sums[:n_points], sums[n_points:-1]
    classify = True
    share = objective.data.n_samples  # this process's samples
    bar = progress_bar(n_points, "grid points", progress, unit="pt", estimate=True)
    # attention as the Objective runs it: the math kernel, no fused MultiheadAttention fast path (which vmap
    # cannot batch and which takes another kernel than the one the measures differentiate)
    with torch.no_grad(), eval_mode(objective.model), math_attention(), bar:
        for x, y, w in objective.pieces(piece, join=True):
            if points is not None and x.shape[0] >= share:
                points.cache = None  # one piece holds every sample: no later piece reuses the points
            prepared = engine.prepare(x)
            for lo in range(0, n_points, batch):
                c = C[lo : lo + batch]
                chunk_loss, chunk_hits, chunk_classify = engine(lo, c, prepared, y)
                classify = classify and chunk_classify
                loss[lo : lo + batch] += w * chunk_loss.to(torch.float64)
                hits[lo : lo + batch] += chunk_hits
                bar.update(len(c) * x.shape[0] / share)
    sums[-1] = 0.0 if classify else 1.0
    objective.comm.sum_(sums)
    classify = float(sums[-1]) == 0.0
    # divided on the host: a GPU divides by a scalar as a product with its reciprocal, which rounds differently
    accuracy = (hits.cpu() / objective.n_samples).numpy() if classify else None
    seconds = time.perf_counter() - start
    return GridValues(loss.cpu().numpy(), accuracy, strategy, batch, seconds, per_point, engine.compile)


def check_compile(compile: bool, strategy: str, device: torch.device | None = None) -> None:
    """Refuse ``compile=True`` where it cannot apply (see `evaluate_grid`), before anything is computed.

    Raises:
        ValueError: ``compile`` with strategy ``"vmap"``, or (given a ``device``) where ``torch.compile`` has no
            code generator for it (a C++ compiler on the CPU, Triton on a GPU).
    """
    if not compile:
        return
    if strategy == "vmap":
        raise ValueError(
            "compile=True compiles one grid point's forward pass at a time, and strategy 'vmap' evaluates batches of "
            "points: use 'auto', 'first-layer' or 'loop'"
        )
    if device is not None:
        require_compiler(device)


def _compiled_strategy(strategy: str, compile: bool) -> str:
    return "loop" if compile and strategy == "vmap" else strategy  # vmap itself was refused by check_compile


def _compiled_batch(compiled: bool, batch: int | None) -> int | None:
    """The first-layer path's batch when compiled: one point (a compiled forward pass takes one point)."""
    if not compiled:
        return batch
    if batch is not None and int(batch) != 1:
        raise ValueError(f"compile=True evaluates the first-layer path one grid point at a time; got batch={batch}")
    return 1


def _budget(objective: Objective, memory_budget: int | None) -> int:
    return objective.memory_budget if memory_budget is None else int(memory_budget)


def evaluate_grid(
    objective: Objective,
    directions: Tensor,
    coords: Tensor | np.ndarray,
    center: Tensor | None = None,
    *,
    strategy: str = "auto",
    memory_budget: int | None = None,
    batch: int | None = None,
    progress: bool | None = None,
    compile: bool = False,
) -> GridValues:
    """Whole-data-set loss and accuracy at ``center + coords @ directions`` for every row of ``coords``.

    Args:
        objective: model, loss and data (`sharpness.Objective`); its data are read chunk by chunk and
            run in pieces of about ``CPU_PIECE_BYTES`` of activations on CPU (chunks joined or cut).
        directions: ``(k, n)`` flat directions in ``objective.layout``.
        coords: ``(P, k)`` grid coordinates.
        center: ``(n,)`` flat point (default: ``objective.params``).
        strategy: ``"auto"``, ``"first-layer"``, ``"vmap"`` or ``"loop"`` (see the module docstring).
        memory_budget: bytes for activations and parameter copies of one batch of grid points
            (default: ``objective.memory_budget``); on CPU a batch holds at most ``CPU_BATCH_CAP`` points.
        batch: grid points per batch (overrides the budget and the cap).
        progress: progress bar (``None``: only on a terminal).
        compile: run each grid point's forward pass compiled with ``torch.compile``, one point at a time: the
            loop, and the first-layer path except for a chain of ``Linear`` and ``ReLU`` layers (batched matrix
            products, not compiled; `GridValues.compiled` says which ran). ``"auto"`` then takes the loop
            where it would take vmap; ``"vmap"`` and a first-layer ``batch`` above 1 are refused, and so is a
            machine without a C++ compiler (CPU) or Triton (GPU). The first point takes seconds to tens of
            seconds more (compiling), the others less (ResNet-20 on 2 CPU threads: 12%).

    Returns:
        [`GridValues`][landscape.GridValues] with ``(P,)`` float64 ``loss`` (and ``accuracy`` for class-index targets).
    """
    start = time.perf_counter()
    check_compile(compile, strategy, objective.device)
    strategy = _compiled_strategy(choose_strategy(objective, strategy), compile)
    dtype, device = objective.dtype, objective.device
    layout = objective.layout
    D = torch.as_tensor(directions).to(device, dtype)
    if D.dim() != 2 or D.shape[1] != layout.size:
        raise ValueError(f"directions must have shape (k, {layout.size}), got {tuple(D.shape)}")
    C = _coords(coords, objective, D.shape[0])
    theta = layout.flatten(objective.params) if center is None else torch.as_tensor(center).to(device, dtype)
    n_points = C.shape[0]
    split = split_first_linear(objective) if strategy == "first-layer" else None
    moved = layout.size if split is None else sum(p.numel() for p in split.rest.parameters())
    budget, piece, per_point = _sizes(objective, memory_budget, moved)
    if split is not None:
        engine = _FirstLayer(objective, split, theta, D, compile)
        batch = _compiled_batch(engine.compile, batch)
    else:
        points = _Points(_linear_points(theta, D), objective, cache=False)  # a linear point costs one product
        engine = (_Vmap if strategy == "vmap" else _Loop)(objective, points, compile)
    if batch is None:
        batch = 1 if strategy == "loop" else _batch_size(objective, budget, per_point)
    batch = max(1, min(int(batch), n_points))
    return _run(objective, engine, C, strategy, batch, piece, per_point, progress, start)


def evaluate_points(
    objective: Objective,
    point_fn: PointFn,
    coords: Tensor | np.ndarray,
    *,
    first_layer: tuple[Tensor, Tensor] | None = None,
    strategy: str = "auto",
    memory_budget: int | None = None,
    batch: int | None = None,
    progress: bool | None = None,
    compile: bool = False,
) -> GridValues:
    """Whole-data-set loss and accuracy at the parameter points ``point_fn(coords)``.

    The general form of [`evaluate_grid`][landscape.evaluate_grid] for charts that are not linear in the coordinates
    (a G-space plane ``w(v + a d1 + b d2)``, a geodesic plane ``Exp_theta(a xi1 + b xi2)``): the same
    driver (data traversed once, batches sized from the memory budget, progress bar). When only the
    later layers are curved and the first layer's parameters are ``center + c @ directions`` (as in
    G-space, whose first layer is ``v_1 / d``), ``first_layer`` enables the first-layer fast path.

    Args:
        objective: model, loss and data (`sharpness.Objective`); its data are read chunk by chunk and
            run in pieces of about ``CPU_PIECE_BYTES`` of activations on CPU (chunks joined or cut).
        point_fn: maps a batch of coordinates ``(B, k)`` (in ``objective.dtype`` on ``objective.device``)
            to flat parameter vectors ``(B, n)`` in ``objective.layout``, or to a dict
            ``{name: (B, *shape)}`` of every parameter (spares a copy); it runs without autograd.
            With several data chunks, each batch's points are computed once and kept for the later
            chunks while all points together take at most a quarter of the memory budget, otherwise
            once per batch and chunk.
        coords: ``(P, k)`` grid coordinates.
        first_layer: ``(center, directions)``, flat ``(n,)`` and ``(k, n)``: the first layer's parameters
            at every point are ``center + c @ directions`` on that layer's entries (other entries are not
            read). Checked against ``point_fn`` on the first batch. Only used by the first-layer path.
        strategy: ``"auto"`` (``"first-layer"`` when ``first_layer`` is given and the model allows it,
            else ``"loop"`` on CPU and ``"vmap"`` elsewhere), ``"first-layer"``, ``"vmap"`` or ``"loop"``.
        memory_budget: bytes for activations and parameter copies of one batch of grid points
            (default: ``objective.memory_budget``); on CPU a batch holds at most ``CPU_BATCH_CAP`` points.
        batch: grid points per batch (overrides the budget and the cap). ``point_fn`` sees at most a
            batch at once; the loop and the fast path call it on pieces of at most ``POINT_MAP_BYTES``
            of parameters.
        progress: progress bar (``None``: only on a terminal).
        compile: run each grid point's forward pass compiled, one point at a time (as in `evaluate_grid`).

    Returns:
        [`GridValues`][landscape.GridValues] with ``(P,)`` float64 ``loss`` (and ``accuracy`` for class-index targets).
    """
    start = time.perf_counter()
    check_compile(compile, strategy, objective.device)
    if strategy == "first-layer" and first_layer is None:
        raise ValueError(
            "the first-layer fast path needs a first layer that is linear in the coordinates: pass "
            "first_layer=(center, directions), or use strategy 'loop' or 'vmap'"
        )
    if strategy == "auto" and first_layer is None:
        strategy = "loop" if objective.device.type == "cpu" else "vmap"
    strategy = _compiled_strategy(choose_strategy(objective, strategy), compile)
    dtype, device, layout = objective.dtype, objective.device, objective.layout
    C = _coords(coords, objective, None)
    n_points, k = C.shape
    split = split_first_linear(objective) if strategy == "first-layer" else None
    if split is not None:
        theta, D = (torch.as_tensor(t).to(device, dtype) for t in first_layer)
        if tuple(theta.shape) != (layout.size,) or tuple(D.shape) != (k, layout.size):
            raise ValueError(
                f"first_layer must be a center of shape ({layout.size},) and directions of shape ({k}, {layout.size}), "
                f"got {tuple(theta.shape)} and {tuple(D.shape)}"
            )
    moved = layout.size if split is None else sum(p.numel() for p in split.rest.parameters())
    budget, piece, per_point = _sizes(objective, memory_budget, moved)
    elem = torch.empty((), dtype=dtype).element_size()
    cache = n_points * moved * elem <= budget / 4
    if split is not None:
        engine = _FirstLayer(objective, split, theta, D, compile)
        batch = _compiled_batch(engine.compile, batch)
        first_idx = _columns(layout, engine.first_names, device)
        linear = (engine.first_names, theta[first_idx], D[:, first_idx])
        points = engine.rest_points = _Points(point_fn, objective, cache, rest=engine.rest_names, linear=linear)
    else:
        points = _Points(point_fn, objective, cache)
        engine = (_Vmap if strategy == "vmap" else _Loop)(objective, points, compile)
    if batch is None:
        batch = _batch_size(objective, budget, per_point)
    batch = max(1, min(int(batch), max(n_points, 1)))
    return _run(objective, engine, C, strategy, batch, piece, per_point, progress, start, points)
