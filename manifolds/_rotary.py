"""Position-wise linear maps between a query or key projection and attention (rotary position embeddings), and the
subgroup of a head's query/key ``GL(hd)`` that commutes with them.

Rotary embeddings (RoFormer, GPT-NeoX, LLaMA) turn each query row ``q_t`` of a head (token ``t``) into ``q_t R_t`` and
each key row into ``k_s S_s``, with ``R_t``, ``S_s`` rotations by position-dependent angles in fixed planes of feature
pairs. Moving the query rows by ``A`` (``q -> q A``) and the key rows by ``A^-T`` keeps every score when the maps carry
``A`` through them, ``q A R_t = q R_t A`` and ``k A^-T S_s = k S_s A^-T``: then
``(q A R_t) (k A^-T S_s)^T = q R_t A A^-1 S_s^T k^T = q R_t S_s^T k^T``. That holds exactly when ``A`` commutes with
every ``R_t`` and every ``S_s^T``. The matrices commuting with a set of matrices form an algebra; its invertible
elements are a group whose Lie algebra is that commutant. For rotations in distinct planes at distinct frequencies it
is one complex number per plane, ``a I + b J`` on each pair (a scaling times a rotation within the plane), dimension
``hd`` against ``hd^2`` for the whole ``GL(hd)``; features no map touches (partial rotary) keep ``GL`` among themselves.

How the maps are read: the operations between the heads tensor (``start``) and what the product reads (``end``)
form a region whose only input that depends on the data's values is ``start``; its other inputs are constants
(buffers, tensors computed from buffers and shapes, never a parameter: a map the training moves would change the
group with it), and nothing outside the region reads its intermediate results. The region is run on unit probes in
float64 to give the map of every row of the example input, checked to be linear and row-wise on a random probe, and
the commutant is the null space of ``Omega -> M Omega - Omega M`` over the distinct maps, solved by SVD block by
block on the feature sets the maps never couple (never through an orthonormal basis of the maps' span: its
directions of small singular value carry rounding of ``eps / sigma`` and would add constraints that are not there).

What it cannot see: maps of positions the example input does not reach (the rotary tables of longer sequences are
rotations in the same planes, so their commutant is the same, but a map that changes kind with the position would
not be), and examples too large to read row by row (`MAX_MAP_ENTRIES`), which pin the factor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import product

import numpy as np
import torch
from scipy.linalg import qr
from scipy.sparse.csgraph import connected_components
from torch import Tensor, fx, nn

from manifolds._graph import reads_metadata_only, target_name
from manifolds._modules import hooked

MAX_REGION_NODES = 64  # operations searched between the heads tensor and the product
MAX_MAP_ENTRIES = 1 << 24  # numbers of the per-row maps of the example input (128 MiB in float64)
_CHUNK_ENTRIES = 1 << 23  # numbers of the stacked constraints solved at once
_NULL_TOL = 1e-9  # a direction commutes where the commutator's singular value is below this (maps of unit scale)


class RegionError(ValueError):
    """The operations between a projection and attention are not a constant position-wise linear map (why)."""


@dataclass(frozen=True)
class Region:
    """Operations read as a position-wise linear map from ``start`` to ``end``.

    Attributes:
        start: the heads tensor they read.
        end: their result (what the product, or the reshapes before it, read).
        nodes: every operation of the region in graph order, ``end`` last.
    """

    start: fx.Node
    end: fx.Node
    nodes: tuple[fx.Node, ...]


def find_region(end: fx.Node, data_fed: Callable[[fx.Node], bool], users: Callable[[fx.Node], list],
                may_start: Callable[[fx.Node], bool]) -> Region:  # fmt: skip
    """The region ending at ``end``: the nearest ``start`` with ``may_start(start)`` (searching back over
    data-dependent inputs) such that every data-dependent input of the operations between them is ``start`` or one of
    them, and nothing else reads ``start`` or an intermediate result.

    Raises:
        RegionError: no such ``start`` within `MAX_REGION_NODES` operations.
    """
    order, seen = [end], {end}
    for node in order:
        if len(order) >= MAX_REGION_NODES:
            break
        for a in node.all_input_nodes:
            if a not in seen and data_fed(a) and not reads_metadata_only(node, a):
                seen.add(a)
                order.append(a)
    position = {n: i for i, n in enumerate(end.graph.nodes)}
    above = sorted(order, key=position.__getitem__)  # graph order: inputs before their readers
    for start in (n for n in order[1:] if may_start(n)):
        between: set[fx.Node] = set()
        for node in above[above.index(start) + 1:]:
            if any(a is start or a in between for a in node.all_input_nodes):
                between.add(node)
        if end not in between:
            continue
        inputs_ok = all(a is start or a in between or not data_fed(a) or reads_metadata_only(n, a)
                        for n in between for a in n.all_input_nodes)  # fmt: skip
        readers_ok = all(u in between for n in (start, *between) if n is not end for u in users(n))
        if inputs_ok and readers_ok:
            return Region(start, end, tuple(n for n in above if n in between))
    raise RegionError(f"no operations from one heads tensor to '{end.name}' are read by nothing else")


# Operations linear in their data input (the heads tensor and what the region computed from it); everything else,
# a clamp or a normalization included, is refused before any probe (a probe can miss a kink it never reaches).
_LINEAR = {"add", "sub", "neg", "cat", "concat", "concatenate", "stack", "getitem", "view", "reshape", "transpose",
           "permute", "contiguous", "flatten", "unflatten", "swapaxes", "swapdims", "unsqueeze", "squeeze", "chunk",
           "split", "unbind", "narrow", "flip", "roll", "clone", "expand", "expand_as", "movedim", "view_as_complex",
           "view_as_real"}  # fmt: skip (complex views: Meta's LLaMA multiplies pairs as complex numbers)
_PRODUCTS = {"mul", "truediv", "div", "matmul"}  # linear where one operand is data (the numerator for a division)
_CASTS = {"to", "type_as", "float", "double", "half", "bfloat16", "type"}  # read as the identity (probes in float64)
_MODULES = (nn.Identity, nn.Dropout)  # dropout: the group is read in eval mode


def check_region(region: Region, model: nn.Module, data_fed: Callable[[fx.Node], bool],
                 param_fed: Callable[[fx.Node], bool], batch: int) -> None:  # fmt: skip
    """Refuses a region that could not be a fixed linear map of each row: an operation that is not linear in its data
    input (`_LINEAR`, `_PRODUCTS` with one data operand, `_CASTS`, `nn.Identity` / `nn.Dropout`), one that works in
    place, an input computed from parameters, or a constant with its own entry per sample (``batch`` of them along
    the first axis: the map would depend on the sample).

    Raises:
        RegionError: with the reason.
    """
    inside = set(region.nodes) | {region.start}
    for node in region.nodes:
        name = target_name(node)  # a function from outside torch keeps its module: never a known name
        if node.op == "call_module":
            m = model.get_submodule(str(node.target))
            if not isinstance(m, _MODULES) or hooked(m):
                raise RegionError(f"the module '{node.target}' is not known to be linear")
        elif node.op not in ("call_function", "call_method"):
            raise RegionError(f"'{node.name}' is not an operation")
        elif name in _PRODUCTS:
            data = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node) and a in inside]
            if len(data) != 1 or (name != "mul" and name != "matmul" and node.args[:1] != (data[0],)):
                raise RegionError(f"'{node.name}' is not linear in the heads tensor")
        elif name not in _LINEAR and name not in _CASTS:
            raise RegionError(f"'{node.name}' ({name}) is not known to be linear")
        for a in node.all_input_nodes:
            if a in inside or reads_metadata_only(node, a):  # (the dtype `type_as` copies: not a value)
                continue
            if param_fed(a):
                raise RegionError(f"'{node.name}' reads '{a.name}', which is computed from parameters")
            shape = a.meta.get("shape")
            start = region.start.meta.get("shape")
            if data_fed(a) or (shape is not None and start is not None and len(shape) == len(start) and batch > 1
                               and shape[0] == batch):  # fmt: skip
                raise RegionError(f"'{node.name}' reads '{a.name}', which differs from sample to sample")


def _run(region: Region, probe: Tensor, constants: Mapping[fx.Node, object], model: nn.Module) -> Tensor:
    """The region's result on ``probe`` in place of ``start`` (everything else as recorded on the example input), with
    dtype casts read as the identity so that float64 probes stay float64."""
    env: dict[fx.Node, object] = {region.start: probe}

    def value(n: fx.Node) -> object:
        return env[n] if n in env else constants[n]

    for node in region.nodes:
        if node.op == "call_method" and node.target == "type_as" and node.args[1] not in env \
                and node.args[1] not in constants:  # fmt: skip
            env[node] = value(node.args[0])  # the cast to a data tensor's (floating) dtype: the identity on probes
            continue
        args = fx.node.map_arg(node.args, value)
        kwargs = fx.node.map_arg(node.kwargs, value)
        if node.op != "call_module" and target_name(node) in _CASTS:
            cast = getattr(args[0], str(node.target))(*args[1:], **kwargs) if node.op == "call_method" else \
                node.target(*args, **kwargs)  # fmt: skip
            if not (cast.is_floating_point() or cast.is_complex()):
                raise RegionError(f"'{node.name}' casts to {cast.dtype}")
            # between floating dtypes (or complex ones) the float64 probe is kept: such a cast only rounds; from
            # complex to real it drops the imaginary part, a linear map run as it is
            env[node] = args[0] if cast.is_complex() == args[0].is_complex() else cast
        elif node.op == "call_function":
            env[node] = node.target(*args, **kwargs)
        elif node.op == "call_method":
            env[node] = getattr(args[0], str(node.target))(*args[1:], **kwargs)
        else:
            env[node] = model.get_submodule(str(node.target))(*args, **kwargs)
    out = env[region.end]
    if not isinstance(out, Tensor):
        raise RegionError(f"'{region.end.name}' is not a tensor")
    return out


def position_maps(region: Region, shape: tuple[int, ...], constants: Mapping[fx.Node, object],
                  model: nn.Module) -> Tensor:  # fmt: skip
    """The map of every row of the first sample: ``(*shape[1:-1], k, k)`` with
    ``out[0, ..., t, :] = probe[0, ..., t, :] @ maps[..., t, :, :]`` (``k = shape[-1]``; `check_region` has refused
    constants that differ from sample to sample), read on unit probes in float64 and checked on random probes of
    very different sizes (a threshold a unit probe misses shows there).

    Raises:
        RegionError: the region changes the shape, is not linear (an offset, a nonlinearity), mixes rows, or its maps
            would take more than `MAX_MAP_ENTRIES` numbers.
    """
    k = shape[-1]
    rows = int(np.prod(shape[1:-1]))
    if rows * k * k > MAX_MAP_ENTRIES:
        raise RegionError(f"its maps would take {rows * k * k} numbers for this example input (at most "
                          f"{MAX_MAP_ENTRIES}); pass a shorter example")  # fmt: skip
    maps = torch.empty(*shape[1:-1], k, k, dtype=torch.float64)
    probe = torch.zeros(shape, dtype=torch.float64)
    with torch.no_grad():
        for j in range(k):
            probe.zero_()
            probe[..., j] = 1.0
            out = _run(region, probe, constants, model)
            if tuple(out.shape) != tuple(shape):
                raise RegionError(f"it turns a {tuple(shape)} tensor into a {tuple(out.shape)} one")
            maps[..., j, :] = out[0].double()
        generator = torch.Generator().manual_seed(0)
        for size in (0.0, 1e-6, 1.0, 1e6):
            z = size * torch.randn(shape, generator=generator, dtype=torch.float64)
            out = _run(region, z, constants, model).double()
            predicted = torch.einsum("...i,...ij->...j", z, maps.expand(shape[0], *maps.shape))
            if not float((out - predicted).abs().max()) <= 1e-10 * max(float(predicted.abs().max()), 0.0):
                raise RegionError("it is not a linear map of each row of features alone (an offset, a nonlinearity, "
                                  "or a mix of tokens)")  # fmt: skip
    return maps


def commutant(maps: Tensor) -> tuple[tuple[tuple[int, int, float], ...], ...]:
    """A basis of the matrices ``Omega`` (``k x k``) with ``M Omega = Omega M`` for every ``M`` of ``maps``
    ``(n, k, k)``, each element as its nonzero entries ``(row, column, value)``.

    Raises:
        RegionError: only ``Omega = 0`` commutes with them, or every matrix does (maps that are multiples of the
            identity on the example's tokens say nothing about the tokens beyond it).
    """
    k = maps.shape[-1]
    maps = maps.double()
    distinct = torch.unique(maps.reshape(-1, k * k), dim=0)
    scale = float(distinct.abs().max()) if distinct.numel() else 0.0
    if scale == 0.0:
        raise RegionError("its maps are zero")
    distinct = (distinct / scale).reshape(-1, k, k)
    pattern = (distinct != 0).any(0)
    pattern = (pattern | pattern.T).numpy()
    _, labels = connected_components(pattern, directed=False)
    labels_t = torch.as_tensor(labels)
    blocks: dict[int, list[Tensor]] = {}
    for c in range(int(labels.max()) + 1):
        members = torch.nonzero(labels_t == c).reshape(-1)
        blocks.setdefault(len(members), []).append(members)
    basis: list[tuple[tuple[int, int, float], ...]] = []
    for lefts, rights in product(blocks.values(), blocks.values()):  # blocks of one size stacked: one batched solve
        left, right = torch.stack(lefts), torch.stack(rights)
        per_left = max(1, _CHUNK_ENTRIES // (len(distinct) * len(right) * (left.shape[1] * right.shape[1]) ** 2))
        for lo in range(0, len(left), per_left):
            basis.extend(_block_commutant(distinct, left[lo: lo + per_left], right))
    if not basis:
        raise RegionError("only the identity commutes with its maps")
    if len(basis) == k * k:
        raise RegionError("its maps on the example's tokens are multiples of the identity (every matrix commutes with "
                          "them, but maps of tokens beyond the example need not): pass an example with more tokens")
    dense = torch.zeros(len(basis), k, k, dtype=torch.float64)
    for i, element in enumerate(basis):
        for a, b, v in element:
            dense[i, a, b] = v
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):  # random combinations of maps and basis: a pair that fails to commute shows (with probability 1)
        m = torch.einsum("n,nab->ab", torch.randn(len(distinct), generator=generator, dtype=torch.float64), distinct)
        omega = torch.einsum("d,dab->ab", torch.randn(len(basis), generator=generator, dtype=torch.float64), dense)
        if float((m @ omega - omega @ m).norm()) > 1e-8 * float(m.norm()) * float(omega.norm()):
            raise RegionError("its maps commute with no subgroup that could be read to working precision")
    return tuple(basis)


def _block_commutant(maps: Tensor, left: Tensor, right: Tensor) -> list[tuple[tuple[int, int, float], ...]]:
    """The ``X`` (``mi x mj``) with ``A X = X B`` for every map (``A``, ``B`` its diagonal blocks on features
    ``left[p]`` and ``right[q]``), for every pair ``(p, q)``: each solution as the entries of a ``k x k`` matrix. In
    row-major coordinates of ``X`` the map is ``kron(A, I) - kron(I, B^T)``; its null space, stacked over the maps, by
    SVD."""
    mi, mj = left.shape[1], right.shape[1]
    a = maps[:, left[:, :, None], left[:, None, :]]  # (n, P, mi, mi)
    b = maps[:, right[:, :, None], right[:, None, :]]  # (n, Q, mj, mj)
    eye_i = torch.eye(mi, dtype=maps.dtype)
    eye_j = torch.eye(mj, dtype=maps.dtype)
    ka = torch.einsum("npac,bd->npabcd", a, eye_j).reshape(*a.shape[:2], mi * mj, mi * mj)
    kb = torch.einsum("ac,nqdb->nqabcd", eye_i, b).reshape(*b.shape[:2], mi * mj, mi * mj)
    k = ka[:, :, None] - kb[:, None, :]  # (n, P, Q, q, q)
    stacked = k.permute(1, 2, 0, 3, 4).reshape(k.shape[1], k.shape[2], -1, mi * mj)
    # singular values, not the eigenvalues of K^T K: those carry rounding of eps * |K|^2, hiding a commutator of 1e-8
    _, values, vh = torch.linalg.svd(stacked, full_matrices=False)
    null = values <= _NULL_TOL * max(1.0, maps.shape[0] ** 0.5)  # maps of entries at most 1
    out = []
    for p, q in {(p, q) for p, q, _ in torch.nonzero(null).tolist()}:
        for x in _reduced(vh[p, q][null[p, q]]):
            x = x.reshape(mi, mj)
            out.append(tuple((int(left[p, r]), int(right[q, c]), float(x[r, c]))
                             for r in range(mi) for c in range(mj) if abs(float(x[r, c])) > 1e-12))  # fmt: skip
    return out


def _reduced(rows: Tensor) -> Tensor:
    """The reduced row echelon form of independent ``rows`` (the same span): one pivot entry 1 per row, zeros in the
    other rows' pivots, so that a rotary pair's algebra reads ``I`` and ``J`` rather than a rotation of them."""
    _, _, pivots = qr(rows.numpy(), pivoting=True, mode="economic")
    pivots = torch.as_tensor(pivots[: rows.shape[0]].copy())
    return torch.linalg.solve(rows[:, pivots], rows)
