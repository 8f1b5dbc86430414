"""Linear algebra of a rescaling group in log coordinates ``u = log|w|``.

The group element ``exp(t c)`` adds ``t (c[plus] - c[minus])`` to ``u`` entry-wise (see
`manifolds.RescalingGroup`), so the orbit through any point is an affine subspace ``u + range(J)``
with a constant ``(n, dim)`` matrix ``J`` whose rows hold at most one ``+1`` and one ``-1``.
[`NodeSymmetry`][manifolds.NodeSymmetry] applies ``J``, its transpose, its Gram matrix and the projection onto
``range(J)^perp`` without forming ``J``: each tensor's class indices broadcast against it.

Entries left out of the tangent space (exactly-zero weights under the node metric) get zero rows of ``J``, so the
projection is the orthogonal one on the space actually used. The Gram matrix ``J^T J = D - C - C^T`` (``D`` the
number of entries per class, ``C[p, m]`` the number of entries with plus class ``p`` and minus class ``m``) is
graph-like, and between two fully connected layers ``C`` holds a dense block: every weight couples every output unit
with every input unit. Such a block is ``mult a b^T`` (``a``, ``b`` the class counts along the output and input
axes, ``mult`` the kernel size), rank one, so large ones are kept as rank-one terms and the Gram matrix is solved
as ``S + U W U^T`` (``S`` sparse, nearly diagonal) by the Woodbury identity with one small dense system, instead
of a sparse LU that fills in the dense blocks. Left-out entries inside a rank-one block enter ``S`` as a sparse
correction.

``J`` is the incidence matrix of a graph on the classes (and one extra "no class" node, the ground), so its kernel
is spanned by the indicators of the connected components that do not reach the ground (a class whose entries are
all left out is one). Dropping one class of each such component leaves ``range(J)`` unchanged and makes the Gram
matrix positive definite: those classes get coefficient 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from manifolds._group import RescalingGroup
from manifolds._layout import ParamLayout

# Above this many classes the Gram matrix is solved by its structure (sparse + rank-one terms) on the CPU.
_DENSE_LIMIT = 4096
# A dense count block with more (plus class, minus class) pairs than this is kept as one rank-one term.
_LOW_RANK_MIN = 4096
# Tensors of at least this many entries are projected as matrices (matrix-vector sums, a rank-two update: fewer passes
# over memory); smaller ones by broadcasting (fewer operations).
_MATRIX_MIN = 1 << 16


@dataclass(frozen=True)
class _Block:
    where: slice  # position of the tensor in the flat vector
    shape: tuple[int, ...]
    plus: Tensor | None  # class indices broadcastable to shape; dim = "no term"
    minus: Tensor | None
    dropped: Tensor | None  # flat indices (within the tensor) of the left-out entries; None when there are none


def _reduce_to(x: Tensor, index: Tensor, batch: int) -> Tensor:
    """Sum ``x`` ``(k, *shape)`` over the axes along which ``index`` broadcasts: ``(k, index.numel())``."""
    dims = tuple(batch + i for i, size in enumerate(index.shape) if size == 1 and x.shape[batch + i] != 1)
    if dims:
        x = x.sum(dim=dims, keepdim=True)
    return x.reshape(x.shape[0], index.numel())


@dataclass
class _GramParts:
    """``J^T J = diag(diagonal) - C - C^T - sum_t mult_t (a_t b_t^T + b_t a_t^T)`` over the first ``dim`` classes.

    ``pairs`` (``(dim + 1, dim + 1)`` scipy COO, signed counts) holds ``C`` outside the rank-one terms, including the
    corrections for left-out entries inside them; ``active`` (bool ``(dim,)``) the classes that keep a coefficient.
    """

    diagonal: np.ndarray
    pairs: object
    low_rank: list[tuple[float, np.ndarray, np.ndarray]]
    active: np.ndarray


class NodeSymmetry:
    """The infinitesimal action ``J`` (``(n, dim)``) of a rescaling group in log coordinates.

    Args:
        group: the group ([`manifolds.NetworkStructure.group`][manifolds.NetworkStructure] or ``.layer_group``).
        layout: flat layout of the parameters. Parameters the group does not act on get zero rows of ``J``;
            scales acting on a tensor outside the layout (a frozen parameter) are left out, as it must not move.
        kept: bool ``(n,)``, the entries of the tangent space (default: all); the others get zero rows of ``J``
            (e.g. exactly-zero weights, which the node metric leaves out), so that
            [`project_out`][manifolds.NodeSymmetry.project_out] is the orthogonal projection on the kept entries.
        signs: ``(n,)`` entries ``+-1`` (default: all ``+1``) multiplying the rows of ``J``: the same group in
            coordinates flipped entry-wise (the node metric's whitened coordinates are ``sign(w) log|w|``). Kept
            by reference, on its own device and dtype; entries outside ``kept`` are ignored.

    Attributes:
        dim: number of columns of ``J`` (the group's dimension).
        size: ``n``, the length of the flat parameter vector.
    """

    def __init__(self, group: RescalingGroup, layout: ParamLayout, kept: Tensor | None = None,
                 signs: Tensor | None = None):  # fmt: skip
        group = group.restricted(layout.names)  # parameters outside the layout (frozen ones) must stay fixed
        actions = group.parameter_actions
        self.dim = group.dim
        self.size = layout.size
        if kept is not None:
            if kept.shape != (layout.size,):
                raise ValueError(f"kept must have shape ({layout.size},), got {tuple(kept.shape)}")
            kept = kept.detach().to("cpu", torch.bool)
        dropped_all = None if kept is None else (~kept).nonzero().reshape(-1)  # sorted; usually few
        blocks = []
        for a in actions:
            where = layout.slice(a.name)
            dropped = None
            if dropped_all is not None:
                lo, hi = torch.searchsorted(dropped_all, torch.tensor([where.start, where.stop])).tolist()
                dropped = dropped_all[lo:hi] - where.start if hi > lo else None
            blocks.append(_Block(where, a.shape, a.plus, a.minus, dropped))
        self._blocks = tuple(blocks)
        self._parts: _GramParts | None = None
        self._factor: dict[torch.device, object] = {}
        self._on_device: dict[torch.device, list[tuple[Tensor | None, ...]]] = {}
        # the tensors no block covers (projecting copies them); every block is a whole tensor
        acted = {a.name for a in actions}
        self._gaps = tuple(layout.slice(name) for name in layout.names if name not in acted)
        self._dropped = None if dropped_all is None or not dropped_all.numel() else dropped_all
        self._dropped_on: dict[torch.device, Tensor] = {}
        if signs is not None and signs.shape != (layout.size,):
            raise ValueError(f"signs must have shape ({layout.size},), got {tuple(signs.shape)}")
        self._signs = None if signs is None else signs.detach()
        self._signs_on: dict[tuple[torch.device, torch.dtype], Tensor] = {}

    def _signs_for(self, like: Tensor) -> Tensor | None:
        """``signs`` on ``like``'s device and dtype (copied once), or ``None``."""
        if self._signs is None:
            return None
        key = (like.device, like.dtype)
        if key not in self._signs_on:
            self._signs_on[key] = self._signs.to(like.device, like.dtype)
        return self._signs_on[key]

    def _indices(self, device: torch.device) -> list[tuple[Tensor | None, ...]]:
        """Every block's ``(plus, minus, dropped, dropped_plus, dropped_minus)`` on ``device``, copied once (a copy per
        product would wait for the device each time): ``dropped`` are flat indices into the whole vector, and the
        classes of those entries (``dim`` for none)."""
        if device not in self._on_device:
            table = []
            for b in self._blocks:
                plus, minus = (None if t is None else _full_index(t, len(b.shape), self.dim).to(device)
                               for t in (b.plus, b.minus))  # fmt: skip
                if b.dropped is None:
                    table.append((plus, minus, None, None, None))
                    continue
                ndim = len(b.shape)
                p, m = (_classes_at(_full_index(t, ndim, self.dim), b.shape, b.dropped) for t in (b.plus, b.minus))
                table.append((plus, minus, (b.dropped + b.where.start).to(device), p.to(device), m.to(device)))
            self._on_device[device] = table
        return self._on_device[device]

    def apply(self, c: Tensor) -> Tensor:
        """``J c``: the derivative of ``log|w|`` along the rescaling ``exp(t c)`` at ``t = 0`` (0 off ``kept``).

        Args:
            c: ``(dim,)`` or ``(k, dim)``.

        Returns:
            ``(n,)`` or ``(k, n)``.
        """
        if c.shape[-1] != self.dim:
            raise ValueError(f"expected a last dimension of {self.dim}, got shape {tuple(c.shape)}")
        batch = c.shape[:-1]
        ext = torch.cat([c, c.new_zeros(*batch, 1)], dim=-1)
        out = c.new_zeros(*batch, self.size)
        for b, (plus, minus, dropped, _, _) in zip(self._blocks, self._indices(c.device)):
            value = ext.new_zeros(*batch, *[1] * len(b.shape))
            if plus is not None:
                value = value + ext[..., plus]
            if minus is not None:
                value = value - ext[..., minus]
            out[..., b.where] = value.expand(*batch, *b.shape).reshape(*batch, b.where.stop - b.where.start)
            if dropped is not None:
                out[..., dropped] = 0
        signs = self._signs_for(out)
        return out if signs is None else out * signs

    def apply_transpose(self, v: Tensor) -> Tensor:
        """``J^T v``, the exact adjoint of [`apply`][manifolds.NodeSymmetry.apply].

        Args:
            v: ``(n,)`` or ``(k, n)``.

        Returns:
            ``(dim,)`` or ``(k, dim)``.
        """
        if v.shape[-1] != self.size:
            raise ValueError(f"expected a last dimension of {self.size}, got shape {tuple(v.shape)}")
        batch = v.shape[:-1]
        signs = self._signs_for(v)
        flat = (v if signs is None else v * signs).reshape(-1, self.size)
        k = flat.shape[0]
        out = flat.new_zeros(k, self.dim + 1)
        for b, (plus, minus, dropped, dropped_plus, dropped_minus) in zip(self._blocks, self._indices(v.device)):
            block = flat[:, b.where].view(k, *b.shape)
            matrix = _matrix_form(b.shape, plus, minus)
            for which, (index, sign) in enumerate(((plus, 1.0), (minus, -1.0))):
                if index is None:
                    continue
                if matrix is None:
                    reduced = _reduce_to(block, index, 1)
                else:  # row or column sums by matrix-vector products, a vector at a time (the same sums for each)
                    reduced = torch.stack([_matrix_sums(row.view(matrix), which, index.numel()) for row in block])
                out.index_add_(1, index.reshape(-1), reduced if sign > 0 else -reduced)
            if dropped is not None:  # take the left-out entries back out of the sums (they are few)
                values = flat[:, dropped]
                out.index_add_(1, dropped_plus, -values)
                out.index_add_(1, dropped_minus, values)
        return out[:, : self.dim].reshape(*batch, self.dim)

    # -- the Gram matrix -----------------------------------------------------------------------------------
    def _gram_parts(self) -> _GramParts:
        """The Gram matrix by its structure (built once): see `_GramParts`."""
        if self._parts is None:
            self._parts = _build_parts(self._blocks, self.dim)
        return self._parts

    def gram(self) -> Tensor:
        """``J^T J``, ``(dim, dim)`` float64 (dense), with the rows of left-out entries zero.

        Row ``e_p - e_m`` of an entry contributes ``+1`` to both diagonals and ``-1`` off the diagonal.
        """
        return torch.from_numpy(_dense(self._gram_parts(), np.ones(self.dim, dtype=bool)))

    def _solve(self, rhs: Tensor) -> Tensor:
        """``(J^T J)^+ rhs`` for ``rhs`` ``(k, dim)`` float64 in ``range(J^T)``, factored once per device.

        Classes dropped by the grounding get 0, which is a solution whenever ``rhs = J^T v``.
        """
        if rhs.device not in self._factor:  # the factor and the active classes' index, once per device
            parts = self._gram_parts()
            active = parts.active
            factor = index = None
            if active.any():
                if int(active.sum()) <= _DENSE_LIMIT:
                    gram = torch.from_numpy(_dense(parts, active))
                    factor = torch.linalg.cholesky(gram).to(rhs.device)  # positive definite once grounded
                else:
                    factor = _Structured(parts, rhs.device)
                index = torch.from_numpy(np.flatnonzero(active)).to(rhs.device)
            self._factor[rhs.device] = (factor, index)
        factor, index = self._factor[rhs.device]
        out = torch.zeros_like(rhs)
        if factor is None:
            return out
        sub = rhs.index_select(1, index)
        solved = torch.cholesky_solve(sub.T, factor).T if isinstance(factor, Tensor) else factor.solve(sub)
        return out.index_copy_(1, index, solved)

    def project_out(self, v: Tensor, out: Tensor | None = None) -> Tensor:
        """``v - J (J^T J)^+ J^T v``: Euclidean projection onto the orthogonal complement of ``range(J)`` within the
        kept entries (the others are set to 0).

        Args:
            v: ``(n,)`` or ``(k, n)``.
            out: a contiguous tensor of ``v``'s shape, dtype and device to write the result to; ``v`` itself
                projects it in place (no vector-sized temporary). Default: a new tensor.

        Returns:
            ``out``: same shape and dtype as ``v``; solved in float64 with a factor computed once.
        """
        if out is None:
            out = torch.empty_like(v, memory_format=torch.contiguous_format)
        elif out.shape != v.shape or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous tensor of shape {tuple(v.shape)}, got {tuple(out.shape)}")
        in_place = out.data_ptr() == v.data_ptr()
        if self.dim == 0:
            return self._without_dropped(out if in_place else out.copy_(v))
        rhs = self.apply_transpose(v).to(torch.float64)
        coef = self._solve(rhs.reshape(-1, self.dim)).reshape(rhs.shape).to(v.dtype)
        # v - J coef block by block, without forming J coef (two passes over each tensor, in place when asked)
        batch = v.shape[:-1]
        ext = torch.cat([coef, coef.new_zeros(*batch, 1)], dim=-1)
        if not in_place:
            for gap in self._gaps:
                out[..., gap] = v[..., gap]
        signs = self._signs_for(v)
        for b, (plus, minus, *_) in zip(self._blocks, self._indices(v.device)):
            target = out[..., b.where].view(*batch, *b.shape)
            source = v[..., b.where].view(*batch, *b.shape)
            sign = None if signs is None else signs[b.where].view(b.shape)
            matrix = None if sign is not None else _matrix_form(b.shape, plus, minus)
            if matrix is not None:  # one rank-two update of the matrix per vector: one pass
                for src, dst, c in zip(source.reshape(-1, *b.shape), target.reshape(-1, *b.shape),
                                       ext.reshape(-1, self.dim + 1)):  # fmt: skip
                    left, right = _rank_two(matrix, c, plus, minus)
                    if in_place:
                        dst.view(matrix).addmm_(left, right)
                    else:
                        torch.addmm(src.view(matrix), left, right, out=dst.view(matrix))
                continue
            if plus is None:
                if not in_place:
                    target.copy_(source)
            elif sign is None:
                torch.sub(source, ext[..., plus], out=target)
            else:
                torch.addcmul(source, sign, ext[..., plus], value=-1, out=target)
            if minus is not None:
                if sign is None:
                    target.add_(ext[..., minus])
                else:
                    target.addcmul_(sign, ext[..., minus])
        return self._without_dropped(out)

    def _without_dropped(self, out: Tensor) -> Tensor:
        """``out`` with the dropped entries set to 0 in place (they are not in the tangent space)."""
        if self._dropped is not None:
            if out.device not in self._dropped_on:
                self._dropped_on[out.device] = self._dropped.to(out.device)
            out[..., self._dropped_on[out.device]] = 0
        return out


def _matrix_form(shape: tuple[int, ...], plus: Tensor | None, minus: Tensor | None) -> tuple[int, int] | None:
    """``(rows, columns)`` when the tensor, as a matrix of its first axis by the others, has plus classes varying
    along its rows only and minus classes along its second axis only (a layer's output units by its inputs, kernel
    entries alike): then ``J^T`` is row and column sums, and ``J c`` a rank-two matrix. ``None`` otherwise."""
    if len(shape) < 2 or (plus is None and minus is None) or int(np.prod(shape)) < _MATRIX_MIN:
        return None
    if plus is not None and any(size != 1 for size in plus.shape[1:]):
        return None
    if minus is not None and (minus.shape[0] != 1 or any(size != 1 for size in minus.shape[2:])):
        return None
    return shape[0], int(np.prod(shape[1:]))


def _matrix_sums(matrix: Tensor, which: int, classes: int) -> Tensor:
    """Row sums (``which == 0``, plus classes) or column sums over the second axis (minus classes) of ``matrix``
    (`_matrix_form`), reduced to the ``classes`` entries of the index, by matrix-vector products (one pass, where a
    reduction over the leading axis takes two)."""
    rows, columns = matrix.shape
    if which == 0:
        sums = torch.mv(matrix, matrix.new_ones(columns))
    else:
        sums = torch.mv(matrix.t(), matrix.new_ones(rows))
        sums = sums.view(classes, -1).sum(1) if classes > 1 else sums.sum().reshape(1)
        return sums
    return sums if classes > 1 else sums.sum().reshape(1)


def _rank_two(matrix: tuple[int, int], ext: Tensor, plus: Tensor | None, minus: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(left, right)`` with ``left @ right`` the matrix of ``-(J c)`` on a tensor of `_matrix_form`: ``-c[plus]``
    along the rows, ``+c[minus]`` along the second axis (``ext``: the coefficients with a trailing 0)."""
    rows, columns = matrix
    left, right = [], []
    if plus is not None:
        left.append(-ext[plus.reshape(-1)].expand(rows))
        right.append(ext.new_ones(columns))
    if minus is not None:
        values = ext[minus.reshape(-1)]
        left.append(ext.new_ones(rows))
        right.append(values.repeat_interleave(columns // values.numel()) if values.numel() > 1
                     else values.expand(columns))  # fmt: skip
    return torch.stack(left, 1), torch.stack(right, 0)


def _classes_at(index: Tensor, shape: tuple[int, ...], flat: Tensor) -> Tensor:
    """The classes ``index`` (broadcastable to ``shape``) gives the entries at the flat positions ``flat``."""
    coords = np.unravel_index(flat.numpy(), shape)
    picked = tuple(torch.from_numpy(np.asarray(c)) if size > 1 else torch.zeros(len(flat), dtype=torch.long)
                   for c, size in zip(coords, index.shape))  # fmt: skip
    return index[picked]


def _full_index(index: Tensor | None, ndim: int, none: int) -> Tensor:
    """The class indices with ``ndim`` axes on the CPU; ``None`` (no term) as the index ``none``."""
    if index is None:
        return torch.full((1,) * ndim, none, dtype=torch.long)
    index = index.cpu()
    return index.reshape((1,) * (ndim - index.dim()) + tuple(index.shape))


def _unique_pairs(plus: Tensor, minus: Tensor, none: int) -> tuple[Tensor, Tensor]:
    """``(keys, counts)`` of the pairs ``plus * (none + 1) + minus`` (1-D tensors of equal length)."""
    return torch.unique(plus * (none + 1) + minus, return_counts=True)


def _build_parts(blocks: tuple[_Block, ...], dim: int) -> _GramParts:
    from scipy import sparse
    from scipy.sparse.csgraph import connected_components

    none = dim
    keys: list[Tensor] = []  # exact counts of kept pairs outside the rank-one terms (also the graph's edges)
    weights: list[Tensor] = []
    corrections: list[tuple[Tensor, Tensor]] = []  # left-out entries inside rank-one terms (negative counts)
    edges: list[tuple[np.ndarray, np.ndarray]] = []  # graph edges of the rank-one terms
    low_rank: list[tuple[float, np.ndarray, np.ndarray]] = []
    diagonal = np.zeros(dim + 1)
    for b in blocks:
        ndim = len(b.shape)
        plus, minus = _full_index(b.plus, ndim, none), _full_index(b.minus, ndim, none)
        shared = [i for i in range(ndim) if plus.shape[i] > 1 and minus.shape[i] > 1]
        # every entry's pair first; the left-out entries' pairs are taken back out below, whatever the block
        big = False
        if shared:  # classes of both sides vary along one axis: no rank-one block, count the pairs
            joint = torch.broadcast_shapes(plus.shape, minus.shape)
            key, count = _unique_pairs(plus.expand(joint).reshape(-1), minus.expand(joint).reshape(-1), none)
            keys.append(key)
            weights.append(count * (int(np.prod(b.shape)) // int(np.prod(joint))))
        else:  # separable: the count matrix of the block is mult * a b^T
            mult = int(np.prod(b.shape)) // (plus.numel() * minus.numel())
            a = np.bincount(plus.reshape(-1).numpy(), minlength=none + 1).astype(np.float64)
            c = np.bincount(minus.reshape(-1).numpy(), minlength=none + 1).astype(np.float64)
            sa, sc = np.flatnonzero(a), np.flatnonzero(c)
            big = np.count_nonzero(a[:none]) * np.count_nonzero(c[:none]) > _LOW_RANK_MIN
            if big:
                low_rank.append((float(mult), a[:none], c[:none]))
                diagonal += mult * (a * c.sum() + c * a.sum())
                if b.dropped is None:  # a star spans the complete bipartite graph of the block
                    edges.append((np.full(len(sc), sa[0]), sc))
                    edges.append((sa, np.full(len(sa), sc[0])))
            else:
                pp, mm = np.meshgrid(sa, sc, indexing="ij")
                keys.append(torch.from_numpy((pp * (none + 1) + mm).reshape(-1)))
                weights.append(torch.from_numpy((mult * np.outer(a[sa], c[sc])).reshape(-1)).round().long())
        if b.dropped is None:
            continue
        dropped_plus, dropped_minus = _classes_at(plus, b.shape, b.dropped), _classes_at(minus, b.shape, b.dropped)
        key, count = _unique_pairs(dropped_plus, dropped_minus, none)
        if big:  # the rank-one term counts them: a correction, and the graph of the pairs actually kept
            corrections.append((key, count))
            edges.append(_kept_edges(plus, minus, b.shape, b.dropped, mult))
        else:  # exact counts: a pair whose entries are all left out sums to 0 and is no edge
            keys.append(key)
            weights.append(-count)

    n = none + 1
    if keys:
        key, weight = torch.cat(keys), torch.cat(weights).to(torch.float64)
        exact = sparse.coo_matrix((weight.numpy(), ((key // n).numpy(), (key % n).numpy())), shape=(n, n)).tocsr()
        exact.eliminate_zeros()
    else:
        exact = sparse.csr_matrix((n, n))
    pairs = exact
    if corrections:
        key = torch.cat([k for k, _ in corrections])
        weight = -torch.cat([c for _, c in corrections]).to(torch.float64)
        pairs = pairs + sparse.coo_matrix((weight.numpy(), ((key // n).numpy(), (key % n).numpy())), shape=(n, n))
    pairs = sparse.csr_matrix(pairs)
    diagonal = diagonal + np.asarray(pairs.sum(axis=1)).ravel() + np.asarray(pairs.sum(axis=0)).ravel()

    # grounding: one class dropped per connected component that does not reach the "no class" node
    rows = [exact.tocoo().row] + [e[0] for e in edges]
    cols = [exact.tocoo().col] + [e[1] for e in edges]
    graph = sparse.coo_matrix((np.ones(sum(len(r) for r in rows)), (np.concatenate(rows), np.concatenate(cols))),
                              shape=(n, n))  # fmt: skip
    _, label = connected_components(graph, directed=False)
    active = np.ones(dim, dtype=bool)
    ground = label[none]
    _, first = np.unique(label[:none], return_index=True)
    for cls in first:
        if label[cls] != ground:
            active[cls] = False
    return _GramParts(diagonal[:none], pairs[:none, :none].tocsr(), low_rank, active)


def _kept_edges(plus: Tensor, minus: Tensor, shape: tuple[int, ...], dropped: Tensor, mult: int):
    """Edges ``(classes, classes)`` with the connected components of the pairs a separable block keeps.

    Position ``r`` along the plus axes and ``q`` along the minus axes are joined unless all ``mult`` entries between
    them are left out. Where some position is joined to every position on the other side, a star through it and one
    edge per other position span the same components; otherwise (a block mostly left out) the kept pairs are listed.
    """
    coords = np.unravel_index(dropped.numpy(), shape)
    rows = np.ravel_multi_index(tuple(c if s > 1 else 0 * c for c, s in zip(coords, plus.shape)), tuple(plus.shape))
    cols = np.ravel_multi_index(tuple(c if s > 1 else 0 * c for c, s in zip(coords, minus.shape)), tuple(minus.shape))
    n_rows, n_cols = plus.numel(), minus.numel()
    pair, count = np.unique(rows * n_cols + cols, return_counts=True)
    cut = pair[count == mult]  # position pairs with nothing left
    cut_rows, cut_cols = cut // n_cols, cut % n_cols
    plus_of, minus_of = plus.reshape(-1).numpy(), minus.reshape(-1).numpy()
    for side, (n_side, n_other, cut_side, cut_other) in enumerate(
        ((n_rows, n_cols, cut_rows, cut_cols), (n_cols, n_rows, cut_cols, cut_rows))
    ):
        full = np.setdiff1d(np.arange(n_side), cut_side)
        if not len(full):
            continue
        hub = full[0]  # joined to every position on the other side
        partner = np.full(n_side, -1)
        partner[full] = 0  # any position on the other side: the hub reaches it
        for position in np.unique(cut_side):
            free = np.setdiff1d(np.arange(n_other), cut_other[cut_side == position])
            if len(free):
                partner[position] = free[0]
        joined = np.flatnonzero(partner >= 0)
        side_of, other_of = (plus_of, minus_of) if side == 0 else (minus_of, plus_of)
        star = (np.full(n_other, side_of[hub]), other_of)
        each = (side_of[joined], other_of[partner[joined]])
        return np.concatenate([star[0], each[0]]), np.concatenate([star[1], each[1]])
    kept = np.ones(int(np.prod(shape)), dtype=bool)
    kept[dropped.numpy()] = False
    kept = torch.from_numpy(kept.reshape(shape))
    keys = torch.unique(plus.expand(shape)[kept] * (2**31) + minus.expand(shape)[kept])
    return (keys // (2**31)).numpy(), (keys % (2**31)).numpy()


def _sparse_part(parts: _GramParts, active: np.ndarray):
    """``S = diag(diagonal) - C - C^T`` on the ``active`` classes (scipy CSC)."""
    from scipy import sparse

    s = sparse.diags(parts.diagonal) - parts.pairs - parts.pairs.T
    return sparse.csc_matrix(s)[active][:, active]


def _dense(parts: _GramParts, active: np.ndarray) -> np.ndarray:
    """The Gram matrix on the ``active`` classes as a dense ``float64`` array."""
    gram = _sparse_part(parts, active).toarray()
    for mult, a, c in parts.low_rank:
        outer = np.outer(a[active], c[active])
        gram -= mult * (outer + outer.T)
    return gram


class _Structured:
    """``(S + U W U^T)^{-1}`` by the Woodbury identity, with one step of iterative refinement.

    ``U = [A, B]`` holds the rank-one terms' count vectors and ``W = [[0, -M], [-M, 0]]`` (``M`` their
    multiplicities); the capacitance ``K = W^{-1} + U^T S^{-1} U`` is ``2r x 2r`` and invertible exactly when the
    Gram matrix is. ``S`` diagonal (no sparse pairs between classes) is solved on ``device``; otherwise it is
    factored by a sparse LU on the CPU (it has no dense blocks left, so that is cheap).
    """

    def __init__(self, parts: _GramParts, device: torch.device):
        from scipy.sparse.linalg import splu

        active = parts.active
        s = _sparse_part(parts, active)
        diagonal_only = s.count_nonzero() == np.count_nonzero(s.diagonal())
        self._lu = None if diagonal_only else splu(s)
        self._s = s
        cols = [a[active] for _, a, _ in parts.low_rank] + [c[active] for _, _, c in parts.low_rank]
        mult = np.array([m for m, _, _ in parts.low_rank])
        r = len(mult)
        u = np.stack(cols, axis=1) if cols else np.zeros((int(active.sum()), 0))
        w = np.zeros((2 * r, 2 * r))
        w[:r, r:] = w[r:, :r] = -np.diag(mult)
        w_inv = np.zeros((2 * r, 2 * r))
        if r:
            w_inv[:r, r:] = w_inv[r:, :r] = -np.diag(1.0 / mult)
        where = device if self._lu is None else torch.device("cpu")
        self._diag = torch.from_numpy(s.diagonal().copy()).to(where)
        self._u = torch.from_numpy(u).to(where)
        self._w = torch.from_numpy(w).to(where)
        z = self._s_solve(self._u.T).T  # S^-1 U
        capacitance = torch.from_numpy(w_inv).to(where) + self._u.T @ z
        self._z = z
        self._k = torch.linalg.lu_factor(capacitance) if r else None

    def _s_solve(self, rhs: Tensor) -> Tensor:
        """``S^{-1}`` applied to the rows of ``rhs`` ``(k, d)``."""
        if self._lu is None:
            return rhs / self._diag
        return torch.from_numpy(self._lu.solve(rhs.T.numpy())).T

    def _matvec(self, x: Tensor) -> Tensor:
        """The Gram matrix applied to the rows of ``x`` ``(k, d)``."""
        if self._lu is None:
            out = x * self._diag
        else:
            out = torch.from_numpy(np.asarray(self._s @ x.T.numpy())).T
        return out + ((x @ self._u) @ self._w) @ self._u.T

    def _woodbury(self, rhs: Tensor) -> Tensor:
        y = self._s_solve(rhs)
        if self._k is None:
            return y
        return y - torch.linalg.lu_solve(*self._k, (y @ self._u).T).T @ self._z.T

    def solve(self, rhs: Tensor) -> Tensor:
        """The Gram matrix's inverse applied to the rows of ``rhs`` ``(k, d)`` float64 (on ``rhs``'s device)."""
        device = rhs.device
        if self._lu is not None:  # the sparse LU is on the CPU
            rhs = rhs.cpu()
        x = self._woodbury(rhs)
        x = x + self._woodbury(rhs - self._matvec(x))  # refinement: the Woodbury sum cancels a few digits
        return x.to(device)

