"""The quotient of the parameters by a `MatrixSymmetry`: exact Hessian, projection by Gram matrix.

The vertical space at ``w`` is ``range(V)``, ``V xi = symmetry.vertical(w, xi)`` (``xi`` in the group's Lie
algebra, ``d`` coordinates). The ``G``-orthogonal projection onto the horizontal space is
``P eta = eta - V M^-1 V^T G eta`` with ``M = V^T G V`` (``d x d``); in whitened coordinates ``zeta = W eta``
(``W = G^{1/2}`` symmetric) it is ``zeta - W V M^-1 V^T W zeta``. ``M`` is built without ever forming ``V``:
``M y = V^T G V y`` by [`vertical`][manifolds.MatrixSymmetry.vertical], the metric and
[`vertical_adjoint`][manifolds.MatrixSymmetry.vertical_adjoint], on probe vectors that each cover many factors at once.
The metric of `manifolds.symmetry_metric` is block-diagonal, so factors whose orbit tangents meet no common
metric block are ``G``-orthogonal (``M`` is zero between them); factors are coloured so that no two in a colour
share a metric block or a neighbour (a distance-2 colouring of the graph "touch a common block"), and one probe
per colour and coordinate reads the columns of all of its factors. ``M`` is then factored once (Cholesky). The
connection terms (Christoffel symbols by automatic differentiation) are `manifolds.MetricQuotient`'s.

With the default metric the projection exploits the group's block structure further. The diagonal rescaling group
moves tensors no factor moves, under the node metric (entry-wise ``1 / w^2``), so its whitened orbit tangents are
``sign(w) J`` on their own entries: that part is [`NodeSymmetry`][manifolds.NodeSymmetry]'s projection (its Gram
matrix ``J^T J`` solved by its structure, no probe at all), orthogonal to the factors' part. Each factor's whitened
tangents live on the metric blocks of its own rows and columns (a head's ``W_Q`` rows and ``W_K`` rows, say), and
a coordinate moves one row or column of a block by another (``+-E_ab``), so ``V`` is read block by block as a
sparse ``(n, d)`` matrix with no probe, ``W`` (block-diagonal) as a sparse matrix of its blocks' roots, and ``W V``
is one sparse product; ``M = (W V)^T W V`` follows from it exactly, and a projection is two sparse products and one
``d x d`` solve instead of two passes of the group's action through automatic differentiation. (A metric given by
the caller still gets ``M`` from the coloured probes above.)
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch
from torch import Tensor

from manifolds._connection import Metric, MetricQuotient, _orthonormal_rows
from manifolds._layout import ParamLayout
from manifolds._matrix_group import MatrixSymmetry, _grid
from manifolds._node_symmetry import NodeSymmetry
from manifolds._structure import UnsupportedModelError, name_list
from manifolds._symmetry_metric import _metric, _Plan, _Point, _solver, _whitener, _whitening_entries, singular_blocks

_PROBE_ENTRIES = 1 << 22  # probes per batch of the Gram build: about this many numbers (32 MiB in float64) at once


class SymmetryQuotient(MetricQuotient):
    """`manifolds.MetricQuotient` for the metric of `manifolds.symmetry_metric` and a whole group.

    Args:
        symmetry: the group ([`manifolds.transformer_symmetry`][manifolds.transformer_symmetry]).
        params: the point ``{name: tensor}`` (its order is the flat layout; every tensor the group moves present).
        metric: another metric invariant under ``symmetry`` (e.g. to show what a non-invariant one does), or
            ``None`` for `manifolds.symmetry_metric`. A metric given here must be block-diagonal over the
            blocks of `manifolds.symmetry_metric` for the sparse Gram build to be exact; ``dense_gram=True``
            builds ``M`` column by column instead.
        dense_gram: build ``M`` with one probe per coordinate (no colouring).

    Attributes:
        vertical_dim: rank of the vertical space (``symmetry.dim`` unless the orbit is degenerate at ``w``).
        gram_probes: the number of products ``V^T G V y`` that built ``M`` (0 with the default metric: ``M`` is read
            from ``W V``, built block by block).

    Raises:
        UnsupportedModelError: the metric cannot be built for this group (see `manifolds._symmetry_metric`),
            or it is not finite at the point (a zero weight under the node metric, a row block of zero norm); the
            message names the tensors.
    """

    def __init__(self, symmetry: MatrixSymmetry, params: Mapping[str, Tensor], metric: Metric | None = None,
                 dense_gram: bool = False):  # fmt: skip
        self.symmetry = symmetry
        self.params = {n: p.detach() for n, p in params.items()}
        self.layout = ParamLayout.from_tensors(self.params)
        plan = _Plan(symmetry, self.params)
        default_metric = metric is None
        self._plan = plan if default_metric else None  # the default metric's maps are frozen at the point (_factors)
        metric = metric or _metric(plan)
        w = self.layout.flatten(self.params)
        try:
            bad = ~torch.isfinite(metric.apply(w, torch.ones_like(w)))
        except torch.linalg.LinAlgError:  # a block's Gram matrix is singular (rows of zero weight): say which
            bad = singular_blocks(plan, w)
        if default_metric and not bool(bad.any()):
            # a Gram matrix singular up to rounding (rows that are exactly dependent: a table whose padding row stays
            # zero) solves without an error into numbers of order 1/eps; its rank, read in float64, says so
            bad = singular_blocks(plan, w.double()).to(bad.device)
        if bool(bad.any()):
            names = [name for name, flags in self.layout.blocks(bad) if bool(flags.any())]
            raise UnsupportedModelError(
                f"The {metric.name} metric is undefined at this point: {name_list(names)} has zero entries (moved by "
                "the rescaling group, whose node metric divides by them) or rows of zero norm (moved by a factor); "
                "move the point (e.g. perturb those weights) or use a measure defined there"
            )
        super().__init__(metric, w, vertical=None)
        self._node: NodeSymmetry | None = None
        self._columns: tuple[Tensor, Tensor] | None = None  # W V and its transpose (sparse), factor coordinates
        if default_metric and not dense_gram:
            diagonal = symmetry.diagonal if symmetry.diagonal_dim else None
            if diagonal is not None:  # the node metric on the tensors it moves: W V = sign(w) J there
                self._node = NodeSymmetry(diagonal, self.layout, signs=torch.sign(w))
            gram, self.gram_probes = self._sparse_columns()
            (kind, f), rank = _factor(gram)
            # its inverse, once: applying a d x d matrix beats two triangular solves per projection by far
            self._gram_factor = ("pinv", torch.cholesky_inverse(f) if kind == "cholesky" else f)
            self.vertical_dim = rank + (0 if self._node is None else int(self._node._gram_parts().active.sum()))
        else:
            gram, self.gram_probes = self._gram(None if dense_gram else plan.block_of)
            self._gram_factor, self.vertical_dim = _factor(gram)
        self._q = None  # built on request only (O(n d))

    def _factors(self, dense_limit: int):
        if self._plan is None:
            return super()._factors(dense_limit)
        point = _Point(self._plan, self.point)  # one set of block factors and matrix roots for every product
        return _solver(point), _whitener(point, -0.5), _whitener(point, 0.5)

    # -- V, V^T on flat vectors -----------------------------------------------------------------------------
    def vertical(self, y: Tensor) -> Tensor:
        """``V y``: the orbit tangent of Lie-algebra coordinates ``y`` ``(d,)``, flat ``(n,)``."""
        v = self.symmetry.vertical(self.params, y)
        return self.layout.flatten({n: v[n] if n in v else torch.zeros_like(t) for n, t in self.params.items()})

    def _verticals(self, ys: Tensor):
        """``V y`` for the rows of ``ys`` ``(p, d)``, a batch of about `_PROBE_ENTRIES` numbers at a time (``V`` is
        linear in ``y``: one pass per batch is exact); yields ``(first row, (rows, n) tangents)``. Rows with no
        diagonal-group coordinates take `_factor_tangents` (the factors' blocks in place), others a vmapped
        `vertical`."""
        chunk = max(1, _PROBE_ENTRIES // max(self.point.numel(), 1))
        factors_only = not bool(ys[:, : self.symmetry.diagonal_dim].any())
        for lo in range(0, ys.shape[0], chunk):
            part = ys[lo: lo + chunk]
            yield lo, self._factor_tangents(part) if factors_only else torch.func.vmap(self.vertical)(part)

    def _block_index(self, block) -> Tensor:
        """The flat positions of a factor block's entries in the point: ``(k, m)`` for a row block, ``(m, k)`` for a
        column block, ``(k,)`` for a vector."""
        where = self.layout.slice(block.name)
        shape = self.layout.shapes[self.layout.names.index(block.name)]
        flat = torch.arange(where.start, where.stop, device=self.point.device).reshape(shape)
        return flat[_grid(block, tuple(shape), self.point.device)]

    def _factor_tangents(self, ys: Tensor) -> Tensor:
        """``V y`` ``(p, n)`` for rows ``ys`` ``(p, d)`` that move the factors only: what `vertical` computes
        (`manifolds.MatrixSymmetry.vertical`), block by block for the whole batch, added into one flat buffer."""
        sym, w = self.symmetry, self.point
        out = ys.new_zeros(ys.shape[0], w.numel())
        parts = torch.split(ys, [sym.diagonal_dim, *[f.dim for f in sym.factors]], dim=1)
        for f, p in zip(sym.factors, parts[1:]):
            diagonal = f.kind == "diagonal"
            omega = p if diagonal else f.omega(p)
            for b in f.blocks:
                index = self._block_index(b)
                x = w[index]
                d = omega if b.how == "T" else -omega
                if diagonal:  # d (p, k): scales the block's rows (or entries) or its columns
                    value = d[:, :, None] * x if b.axis == 0 and x.dim() == 2 else (d * x if x.dim() == 1
                                                                                      else x * d[:, None, :])
                else:
                    d = d.transpose(-1, -2) if b.how in ("T", "invT") else d
                    value = d @ x if b.axis == 0 and x.dim() == 2 else ((d @ x[:, None])[..., 0] if x.dim() == 1
                                                                        else x @ d)
                out.index_add_(1, index.reshape(-1), value.reshape(ys.shape[0], -1))
        return out

    def _vertical_entries(self) -> tuple[Tensor, Tensor, Tensor]:
        """``V`` over the factors' coordinates as ``(row, column, value)`` triplets of a sparse ``(n, d)`` matrix
        (columns: the factors' coordinates in order, the diagonal group's left out), read block by block: the
        coordinate ``(a, b)`` of a GL factor is ``d = +-E_ab`` (transposed for ``"T"`` and ``"invT"``), which moves
        row ``a`` of a row block by ``+-`` its row ``b`` (``d x``), and column ``b`` of a column block by ``+-`` its
        column ``a`` (``x d``); the ``j``-th coordinate of a diagonal factor is ``a = b = j``, and a basis element of a
        subgroup's algebra is the sum of its entries ``v E_ab``. What
        `_factor_tangents` computes for unit coordinates, without a dense ``(d, n)`` buffer."""
        sym, w = self.symmetry, self.point
        rows, cols, values = [], [], []
        offset = 0
        for f in sym.factors:
            if f.kind == "diagonal":
                t = a = b = torch.arange(f.dim, device=w.device)
                weight = None
            else:  # every nonzero (a, b, v) of a basis element moves like E_ab, times v
                t, a, b, weight = (e.to(w.device) for e in f.nonzeros())
            for blk in f.blocks:
                index = self._block_index(blk)
                x = w[index]
                sign = 1.0 if blk.how == "T" else -1.0
                r, c = (b, a) if f.kind != "diagonal" and blk.how in ("T", "invT") else (a, b)
                if blk.axis == 0 or x.dim() == 1:  # row (or entry) r takes +- row c
                    entry, value = index[r], sign * x[c]
                else:  # column c takes +- column r
                    entry, value = index[:, c].T, sign * x[:, r].T
                entry = entry.reshape(len(t), -1)
                value = value.reshape(len(t), -1)
                if weight is not None:
                    value = value * weight.to(value.dtype)[:, None]
                rows.append(entry.reshape(-1))
                cols.append((offset + t)[:, None].expand(entry.shape).reshape(-1))
                values.append(value.reshape(-1))
            offset += f.dim
        if not rows:
            return w.new_zeros(0, dtype=torch.long), w.new_zeros(0, dtype=torch.long), w.new_zeros(0)
        return torch.cat(rows), torch.cat(cols), torch.cat(values)

    def vertical_adjoint(self, eta: Tensor) -> Tensor:
        """``V^T eta`` for a flat ``eta`` ``(n,)``: ``(d,)``."""
        return self.symmetry.vertical_adjoint(self.params, self.layout.unflatten(eta))

    def _gram(self, block_of: Tensor | None) -> tuple[Tensor, int]:
        sym, w = self.symmetry, self.point
        d = sym.dim
        gram = w.new_zeros(d, d)
        if d == 0:
            return gram, 0
        sizes = [sym.diagonal_dim, *(f.dim for f in sym.factors)]
        starts = torch.tensor([0, *sizes]).cumsum(0).tolist()
        groups = [i for i, s in enumerate(sizes) if s]
        colours = _colouring(self, groups, starts, block_of)
        probes = 0
        for t, members, y in _probes(colours, sizes, starts, w.new_zeros(d)):
            u = self.vertical_adjoint(self.metric.apply(w, self.vertical(y)))
            probes += 1
            for g, owner in colours.reach(members):  # rows of g belong to the one member g can see
                gram[starts[g]: starts[g + 1], starts[owner] + t] = u[starts[g]: starts[g + 1]]
        return (gram + gram.T) / 2, probes

    def _sparse_columns(self) -> tuple[Tensor, int]:
        """``W V`` over the factors' coordinates as sparse matrices (kept in ``_columns``), and ``M`` from it: ``V``
        read block by block (`_vertical_entries`), ``W`` as its blocks' roots (block-diagonal, so ``W V`` keeps to
        the blocks each factor's tangents touch), multiplied as sparse matrices; no probe. Returns ``(M, 0)``."""
        from scipy import sparse

        w = self.point
        n, d = w.numel(), self.symmetry.dim - self.symmetry.diagonal_dim
        to_host = lambda t: t.cpu().numpy()  # noqa: E731
        # assembled on the host by scipy (repeated positions summed: a tensor both a row and a column block of one
        # factor moves), both ways round
        v_rows, v_cols, v_values = self._vertical_entries()
        vertical = sparse.csr_matrix((to_host(v_values), (to_host(v_rows), to_host(v_cols))), shape=(n, d))
        w_rows, w_cols, w_values = _whitening_entries(_Point(self._plan, w))
        whiten = sparse.csr_matrix((to_host(w_values), (to_host(w_rows), to_host(w_cols))), shape=(n, n))
        host = (whiten @ vertical).tocsr()
        host.eliminate_zeros()  # entries of W V that cancel exactly (as the probes' reading dropped them)
        host_t = host.T.tocsr()
        with warnings.catch_warnings():  # CSR (MKL's products on the CPU, cuSPARSE's on a GPU) is "beta" in torch
            warnings.simplefilter("ignore", UserWarning)
            self._columns = (_torch_csr(host, w), _torch_csr(host_t, w))
        gram = torch.from_numpy((host_t @ host).toarray()).to(w.device, w.dtype)
        return (gram + gram.T) / 2, 0

    # -- the projection --------------------------------------------------------------------------------------
    def _solve_gram(self, a: Tensor) -> Tensor:
        """``M^-1 a`` (pseudo-inverse where ``M`` is singular) for ``a`` ``(d,)``, or ``(d, k)`` with the sparse
        columns (whose factor is always the pseudo-inverse matrix)."""
        kind, f = self._gram_factor
        if kind == "cholesky":
            return torch.cholesky_solve(a[:, None], f)[:, 0]  # the dense path: one vector at a time
        return f @ a

    def whitened_projection(self, zeta: Tensor) -> Tensor:
        """Orthogonal projection of whitened vectors ``(..., n)`` onto the whitened horizontal space."""
        if not self.vertical_dim:
            return zeta
        if self._columns is not None and self._node is None and zeta.dim() == 1 and self._columns[0].shape[1]:
            wv, wv_t = self._columns  # one vector: sparse matrix-vector products (twice as fast as on (n, 1) columns)
            return zeta - wv @ self._solve_gram(wv_t @ zeta)
        if self._columns is not None:
            flat = zeta.reshape(-1, zeta.shape[-1])
            out = flat if self._node is None else self._node.project_out(flat)  # leaves the factors' tensors alone
            wv, wv_t = self._columns
            if wv.shape[1]:
                out = out - (wv @ self._solve_gram(wv_t @ flat.T)).T
            return out.reshape(zeta.shape)
        if zeta.dim() > 1:
            return torch.stack([self.whitened_projection(z) for z in zeta.reshape(-1, zeta.shape[-1])]).reshape(
                zeta.shape)
        y = self._solve_gram(self.vertical_adjoint(self.whiten(zeta)))
        return zeta - self.whiten(self.vertical(y))

    def whitened_vertical_basis(self) -> Tensor:
        """``(d', n)``: an orthonormal basis (rows) of the whitened vertical space ``range(W V)`` (``O(n d)``)."""
        if self._q is None and self._columns is not None:
            node = self._node
            parts = [] if node is None else [node.apply(torch.eye(node.dim, dtype=self.point.dtype,
                                                                   device=self.point.device))]  # fmt: skip
            parts.append(self._columns[0].to_dense().T)
            self._q = _orthonormal_rows(torch.cat(parts))
        if self._q is None:
            eye = torch.eye(self.symmetry.dim, dtype=self.point.dtype, device=self.point.device)
            wv = torch.stack([self.whiten(self.vertical(e)) for e in eye]) if self.symmetry.dim else eye
            kind, f = self._gram_factor
            # W V L^-T has orthonormal columns when M = L L^T; the pseudo-inverse root otherwise
            self._q = (torch.linalg.solve_triangular(f, wv, upper=False) if kind == "cholesky"
                       else _psd_root(f) @ wv)
            self._q = self._q[torch.linalg.vector_norm(self._q, dim=1) > 0.5]
        return self._q

    def vertical_basis(self) -> Tensor:
        """``(d', n)``: a ``G``-orthonormal basis (rows) of the vertical space."""
        q = self.whitened_vertical_basis()
        return self.unwhiten(q) if q.shape[0] else q


def _torch_csr(matrix, like: Tensor) -> Tensor:
    """A scipy CSR matrix as a torch one on ``like``'s device and dtype (column indices sorted in each row)."""
    matrix.sort_indices()
    index = {"dtype": torch.int32 if max(matrix.shape) < 2**31 and matrix.nnz < 2**31 else torch.long,
             "device": like.device}  # 32-bit indices where they fit: less to read per product
    return torch.sparse_csr_tensor(torch.as_tensor(matrix.indptr, **index), torch.as_tensor(matrix.indices, **index),
                                   torch.as_tensor(matrix.data, dtype=like.dtype, device=like.device),
                                   matrix.shape)  # fmt: skip


def _factor(gram: Tensor) -> tuple[tuple[str, Tensor], int]:
    """Cholesky of ``M``; where ``M`` is singular (a degenerate orbit), its pseudo-inverse, and the rank."""
    if gram.shape[0] == 0:
        return ("pinv", gram), 0
    chol, info = torch.linalg.cholesky_ex(gram)
    if int(info) == 0:
        return ("cholesky", chol), gram.shape[0]
    lam, vec = torch.linalg.eigh(gram)
    keep = lam > lam.max() * gram.shape[0] * torch.finfo(gram.dtype).eps
    return ("pinv", (vec[:, keep] / lam[keep]) @ vec[:, keep].T), int(keep.sum())


def _psd_root(pinv: Tensor) -> Tensor:
    lam, vec = torch.linalg.eigh(pinv)
    return (vec * lam.clamp_min(0).sqrt()) @ vec.T


class _Colours(list):
    """Colour classes of coordinate groups, for each group the groups it touches, and (where the metric blocks are
    known) the metric blocks each group's orbit tangents touch."""

    def __init__(self, classes: list[list[int]], touches: dict[int, set[int]], support: dict[int, set[int]]):
        super().__init__(classes)
        self.touches = touches
        self.support = support

    def reach(self, members: list[int]) -> list[tuple[int, int]]:
        """``(group, member)`` for every group that touches (or is) a member of one colour: at most one each."""
        out = []
        for g, near in self.touches.items():
            seen = [m for m in members if m == g or m in near]
            if seen:
                out.append((g, seen[0]))
        return out


def _probes(colours, sizes: list[int], starts: list[int], zeros: Tensor):
    """The probe vectors of a colouring: for each colour and coordinate ``t``, the colour's ``members`` that have a
    ``t``-th coordinate and ``y``, a copy of ``zeros`` with a 1 at each of them; yields ``(t, members, y)``."""
    for colour in colours:
        for t in range(max(sizes[g] for g in colour)):
            members = [g for g in colour if t < sizes[g]]
            y = zeros.clone()
            for g in members:
                y[starts[g] + t] = 1.0
            yield t, members, y


def _colouring(quotient: SymmetryQuotient, groups: list[int], starts: list[int], block_of: Tensor | None) -> _Colours:
    """A distance-2 greedy colouring of the groups (0: the diagonal group, ``i``: factor ``i - 1``)."""
    support: dict[int, set[int]] = {}
    if block_of is None:  # no structure known: every group touches every other
        touches = {g: set(groups) - {g} for g in groups}
    else:
        generator = torch.Generator().manual_seed(0)  # generic coefficients: no entry of a tangent cancels by chance
        ys = quotient.point.new_zeros(len(groups), quotient.symmetry.dim)
        for i, g in enumerate(groups):
            coefficients = 0.5 + torch.rand(starts[g + 1] - starts[g], generator=generator, dtype=ys.dtype)
            ys[i, starts[g]: starts[g + 1]] = coefficients.to(ys.device)
        for lo, tangents in quotient._verticals(ys):
            for g, tangent in zip(groups[lo:], tangents):
                moved = torch.nonzero(tangent).reshape(-1).cpu()  # block_of is a host table
                support[g] = set(torch.unique(block_of[moved]).tolist())
        touches = {g: {h for h in groups if h != g and support[g] & support[h]} for g in groups}
    colour: dict[int, int] = {}
    for g in groups:
        near = set(touches[g]) | {k for h in touches[g] for k in touches[h]}
        taken = {colour[h] for h in near if h in colour}
        colour[g] = next(c for c in range(len(groups) + 1) if c not in taken)
    classes = [[g for g in groups if colour[g] == c] for c in range(max(colour.values(), default=-1) + 1)]
    return _Colours(classes, touches, support)
