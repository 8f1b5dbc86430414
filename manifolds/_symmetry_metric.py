"""A Riemannian metric invariant under a whole [`MatrixSymmetry`][manifolds.MatrixSymmetry] (GL and diagonal factors and
the diagonal rescaling group), block-diagonal so that nothing is dense in the number of parameters.

Write a parameter block moved from the left as ``X -> L X`` (``L`` invertible ``k x k``) and from the right as
``X -> X S`` (``S`` a positive diagonal). The metric of the block is the balanced metric with a column weight

    ``g_X(xi, eta) = tr((X P X^T)^-1 xi P eta^T)``,   ``P = diag(p) > 0``,

invariant as soon as ``p -> p / s^2`` when the columns move by ``s``: then ``X P X^T -> L (X P X^T) L^T`` and
``xi P eta^T -> L xi P eta^T L^T``. Which parameters form ``X``, and what ``p`` is:

* **Rows moved by a factor** (PyTorch stores ``y = x W^T + b``, so a factor moving a layer's outputs moves rows):
  for a GL factor, the ``k`` rows it moves with one ``how`` (e.g. ``Wq_h`` and ``bq_h`` under ``A^T``) form one
  ``X``, each bias entry appended as a column of weight 1 (biases move with the rows, never with the columns); for
  a diagonal factor (a normalization's affine scale, ReLU units) each index ``j`` is its own ``1 x m`` block
  (``[gamma_j, beta_j]``, ``[W_j,:, b_j]``), so the metric is ``|xi_j|_P^2 / |x_j|_P^2``: the node metric of a
  whole unit, defined where a LayerNorm's ``beta`` or a bias is zero.
* **Column weights** ``p``: a column divided (or multiplied) by the scale ``c_j`` of a diagonal factor gets
  ``p_j = r_j`` (or ``1 / r_j``), where ``r_j = |x_j|_P^2`` is the factor's reference: the squared weighted norm of
  its own ``j``-th row block (``gamma_j^2 + beta_j^2`` for a LayerNorm, ``gamma_j^2`` for an RMSNorm, the unit's
  incoming weights and bias for ReLU units), which scales as ``c_j^2``. For a query block fed by a LayerNorm this
  is DESIGN's ``tr((W Gam^2 W^T)^-1 xi Gam^2 xi^T)`` with ``Gam^2`` made ``diag(gamma^2 + beta^2)``. References
  are computed upstream first (a factor's reference uses the column weights of its own rows); a cycle is refused.
* **Columns moved by a GL factor** (an output projection's head columns under ``B^-T``) on a tensor whose rows
  nothing moves: ``tr((X^T X)^-1 xi^T eta)`` per head block, the balanced metric read column-wise.
* **Everything else**: ``xi^2 p`` entry by entry (``p = 1`` where nothing acts: the Euclidean metric, invariant
  because the group leaves those entries and their weights alone).
* **Tensors of the diagonal rescaling group** (`manifolds.analyze`'s, where no factor acts): the node metric
  ``xi^2 / w^2``, invariant under every entry-wise positive scaling.

Refused with `UnsupportedModelError` (one sentence each): a tensor moved both by a factor and by
the diagonal rescaling group, rows moved by two factors, GL-moved columns on a tensor whose rows also move, a
block whose rows carry different column weights, and references that depend on each other in a cycle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from manifolds._attention import _diagonal_sides
from manifolds._connection import Metric
from manifolds._layout import ParamLayout
from manifolds._matrix_group import Block, MatrixSymmetry, _grid
from manifolds._structure import UnsupportedModelError


@dataclass(frozen=True)
class _Rows:
    """Row blocks ``X`` (``(B, k, m)`` flat indices) sharing one column weight per block (``(B, m)`` indices into
    the weight table); ``factor`` is the diagonal factor whose reference this group is, or ``None``."""

    index: Tensor
    weight: Tensor
    factor: int | None


def _refuse(why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"The symmetry-invariant metric cannot be built: {why}.")


def _select(flat: Tensor, block: Block, shape: torch.Size) -> Tensor:
    """The block's flat indices as ``(k, m)`` (rows; ``m = 1`` for a vector) or ``(m, k)`` (columns) of the
    ``(out, in)`` matrix (`manifolds._matrix_group._grid`: a transposed tensor's rows are its stored columns)."""
    picked = flat[_grid(block, tuple(shape), flat.device)]
    return picked[:, None] if len(shape) == 1 else picked


class _Plan:
    """Which flat entries form which block, and which reference weighs which column (built once per model)."""

    def __init__(self, symmetry: MatrixSymmetry, params: Mapping[str, Tensor]):
        self.layout = layout = ParamLayout.from_tensors(params)
        n = layout.size
        flat = {name: torch.arange(layout.slice(name).start, layout.slice(name).stop).reshape(shape)
                for name, shape in zip(layout.names, layout.shapes)}
        missing = [name for name in symmetry.names if name not in flat]
        if missing:
            raise _refuse(f"the group moves {', '.join(missing)}, which the parameters do not hold (a frozen "
                          "tensor?); make them trainable or pass the subgroup that leaves them alone "
                          "(`symmetry.restricted(params)`)")
        factors = symmetry.factors
        shapes = dict(zip(layout.names, layout.shapes))
        factor_names = {b.name for f in factors for b in f.blocks}
        diagonal_names: set[str] = set()
        if symmetry.diagonal is not None and symmetry.diagonal_dim:
            diagonal_names = {name for name, _ in _diagonal_sides(symmetry.diagonal)}
        both = sorted(factor_names & diagonal_names)
        if both:
            raise _refuse(f"{', '.join(both)} is moved both by a matrix factor and by the diagonal rescaling group")

        # -- rows moved by factors: one group per (factor, how) --------------------------------------------
        # a diagonal factor's rows on a tensor whose columns a GL factor moves (an output projection's rows under a
        # layer scale) form no row block of their own: they are weighed entry by entry, by the factor's reference,
        # and the GL factor's column blocks carry those weights per row
        gl_moved = {b.name for f in factors if f.kind == "GL" for b in f.blocks if b.axis == 1}
        row_owner = torch.full((n,), -1, dtype=torch.long)
        groups: list[tuple[int, str, Tensor]] = []  # (factor, how, (k, m) flat indices)
        weighed: list[tuple[int, str, Tensor]] = []  # diagonal rows weighed entry by entry: (factor, how, (k, m))
        for fi, f in enumerate(factors):
            for how in dict.fromkeys(b.how for b in f.blocks if b.axis == 0):
                blocks = [b for b in f.blocks if b.axis == 0 and b.how == how]
                index = torch.cat([_select(flat[b.name], b, shapes[b.name]) for b in blocks], dim=1)
                if bool((row_owner[index] >= 0).any()):
                    raise _refuse(f"rows of {f.label} are also moved by another factor")
                if f.kind == "diagonal" and any(b.name in gl_moved for b in blocks):
                    weighed.append((fi, how, index))
                    continue
                row_owner[index] = len(groups)
                groups.append((fi, how, index))

        # -- column weights: entry -> (diagonal factor, j, power) ------------------------------------------
        ref_how: dict[int, str] = {}
        for fi, how, _ in groups:
            if factors[fi].kind == "diagonal":
                ref_how.setdefault(fi, how)
        col_factor = torch.full((n,), -1, dtype=torch.long)
        col_j = torch.zeros(n, dtype=torch.long)
        col_power = torch.zeros(n, dtype=torch.long)

        def weigh(fi: int, how: str, index: Tensor, j: Tensor, what: str) -> None:
            """Entries ``index`` moved by diagonal factor ``fi`` (``how``), as its ``j``-th scale: weighed by its
            reference (the reference scales as c^2 ("T") or c^-2, an entry as c or 1/c: the weight must scale as
            1/s^2)."""
            if fi not in ref_how:
                raise _refuse(f"{factors[fi].label} moves {what} only, so no row block gives it a reference scale")
            if bool((col_factor[index] >= 0).any()):
                raise _refuse(f"{what} are moved by two diagonal factors")
            col_factor[index] = fi
            col_j[index] = j
            col_power[index] = -1 if (how == "T") == (ref_how[fi] == "T") else 1

        gl_columns: list[Tensor] = []
        column_entries: list[Tensor] = []  # entries of diagonal factors' column blocks
        for fi, f in enumerate(factors):
            for b in (b for b in f.blocks if b.axis == 1):
                index = _select(flat[b.name], b, shapes[b.name])  # (rows, k)
                if f.kind == "GL":
                    if bool((row_owner[flat[b.name]] >= 0).any()):
                        raise _refuse(f"{b.name} has columns moved by {f.label} and rows moved by another factor")
                    gl_columns.append(index)
                    continue
                weigh(fi, b.how, index, torch.arange(f.size)[None, :], f"columns of {b.name}")
                column_entries.append(index.reshape(-1))
        for fi, how, index in weighed:
            weigh(fi, how, index, torch.arange(factors[fi].size)[:, None], f"rows of {factors[fi].label}")
        gl_entries = torch.cat([c.reshape(-1) for c in gl_columns]) if gl_columns else torch.zeros(0, dtype=torch.long)
        scaled = torch.zeros(n, dtype=torch.bool)
        for entries in column_entries:
            scaled[entries] = True
        if bool(scaled[gl_entries].any()):
            raise _refuse("columns moved by a GL factor are also scaled by a diagonal factor")

        # weight table: [1, r_0, ..., r_F, 1/r_0, ..., 1/r_F] with r_f the reference of diagonal factor f
        self.ref_offsets = {}
        total = 0
        for fi in ref_how:
            self.ref_offsets[fi] = total
            total += factors[fi].size
        self.n_refs = total

        offsets = torch.zeros(len(factors) + 1, dtype=torch.long)  # by factor; the last for "no factor" (-1)
        for fi, offset in self.ref_offsets.items():
            offsets[fi] = offset

        def weight_index(entries: Tensor) -> Tensor:
            fi, j, power = col_factor[entries], col_j[entries], col_power[entries]
            slot = 1 + offsets[fi] + j + torch.where(power < 0, total, 0)
            return torch.where(fi >= 0, slot, 0)

        # -- row blocks, their references, and the order references are computed in -------------------------
        rows: list[_Rows] = []
        deps: dict[int, set[int]] = {}
        for columns in gl_columns:  # X (m, k) weighed column-wise is the row block X^T (k, m), rows weighing it
            weights = weight_index(columns.T)
            if bool((weights != weights[:1]).any()):
                raise _refuse("the columns of a GL factor carry different row weights")
            rows.append(_Rows(columns.T[None], weights[:1], None))
        for fi, how, index in groups:
            f = factors[fi]
            weights = weight_index(index)  # (k, m)
            if f.kind == "GL":
                if bool((weights != weights[:1]).any()):
                    raise _refuse(f"the rows of {f.label} carry different column weights")
                rows.append(_Rows(index[None], weights[:1], None))
            else:
                reference = fi if ref_how.get(fi) == how else None
                rows.append(_Rows(index[:, None, :], weights, reference))
                if reference is not None:
                    deps[fi] = {int(g) for g in col_factor[index].unique() if int(g) >= 0}
        order: list[int] = []
        state: dict[int, int] = {}

        def visit(fi: int) -> None:
            if state.get(fi) == 2:
                return
            if state.get(fi) == 1:
                raise _refuse(f"the column weights of {factors[fi].label} depend on themselves through other factors")
            state[fi] = 1
            for g in deps.get(fi, ()):
                visit(g)
            state[fi] = 2
            order.append(fi)

        for fi in deps:
            visit(fi)
        by_factor = {r.factor: r for r in rows if r.factor is not None}
        self.references = [(fi, by_factor[fi]) for fi in order]
        # blocks of one shape are stacked into one batch (the heads of a model alike): a few batched products per
        # shape instead of a few small ones per block, for the metric and for its derivatives
        self.rows = _stacked([r for r in rows if r.factor is None]) + [r for _, r in self.references]

        # -- everything else, entry-wise ------------------------------------------------------------------
        taken = torch.zeros(n, dtype=torch.bool)
        for r in self.rows:
            taken[r.index.reshape(-1)] = True
        self.entries = torch.nonzero(~taken).reshape(-1)
        self.entry_weight = weight_index(self.entries)
        node = torch.zeros(n, dtype=torch.bool)
        for name in diagonal_names:
            node[flat[name].reshape(-1)] = True
        self.entry_node = node[self.entries]
        perm = torch.cat([r.index.reshape(-1) for r in self.rows] + [self.entries])
        if not torch.equal(torch.sort(perm).values, torch.arange(n)):
            raise _refuse("the factors' blocks overlap")  # each entry in exactly one block; a defect if reached
        self.perm = perm
        self.inverse = torch.argsort(perm)
        self.block_of = torch.empty(n, dtype=torch.long)  # metric block id of every entry (for sparsity)
        next_id = 0
        for part in (r.index for r in self.rows):
            for blk in part:
                self.block_of[blk.reshape(-1)] = next_id
                next_id += 1
        self.block_of[self.entries] = next_id + torch.arange(self.entries.numel())


def _stacked(rows: list[_Rows]) -> list[_Rows]:
    """Row groups of one block shape (and no reference role) concatenated into one batch of blocks."""
    by_shape: dict[tuple[int, ...], list[_Rows]] = {}
    for r in rows:
        by_shape.setdefault(tuple(r.index.shape[1:]), []).append(r)
    return [_Rows(torch.cat([r.index for r in same]), torch.cat([r.weight for r in same]), None)
            for same in by_shape.values()]  # fmt: skip


class _Point:
    """The metric's factors at one point ``w`` ``(n,)``, or at a batch of points ``(..., n)`` (each its own
    metric, e.g. along a batch of geodesics): Gram matrices of every block and the column weights."""

    def __init__(self, plan: _Plan, w: Tensor):
        self.plan, self.batch = plan, w.shape[:-1]
        table = w.new_ones(*w.shape[:-1], 1 + 2 * plan.n_refs)
        for fi, r in plan.references:  # upstream first: a reference reads the weights of earlier ones
            x = w[..., r.index]  # (..., k, 1, m)
            p = table[..., r.weight][..., None, :]
            ref = (x * x * p).sum((-2, -1))
            start = 1 + plan.ref_offsets[fi]
            size = ref.shape[-1]
            table = torch.cat([table[..., :start], ref, table[..., start + size:]], dim=-1)
            start += plan.n_refs
            table = torch.cat([table[..., :start], 1.0 / ref, table[..., start + size:]], dim=-1)
        self.table = table  # [1, references, their inverses]: what the column weights are read from
        self.row_p = [table[..., r.weight][..., None, :] for r in plan.rows]  # (..., B, 1, m)
        self.row_s = [(w[..., r.index] * p) @ w[..., r.index].transpose(-1, -2) for r, p in zip(plan.rows, self.row_p)]
        node = plan.entry_node.to(w.device)  # the plan is built once on the CPU; the point may be on a GPU
        we = torch.where(node, w[..., plan.entries], 1.0)  # no 1/0 in the branch not taken: its derivative would be nan
        self.entry_p = torch.where(node, 1.0 / (we * we), table[..., plan.entry_weight])

    def fields(self) -> tuple[Tensor, ...]:
        """Every factor as one flat tuple: ``row_s``, ``row_p`` (one per block batch), ``entry_p``."""
        return (*self.row_s, *self.row_p, self.entry_p)

    def map(self, v: Tensor, row, entry) -> Tensor:
        """Apply per-block maps to ``v`` (``(..., n)``) and put the pieces back in the flat order."""
        return self.blockwise(v, row, entry, zip(self.row_s, self.row_p), self.entry_p)

    def blockwise(self, v: Tensor, row, entry, row_args, entry_args) -> Tensor:
        """`map` with other per-block arguments: ``row(x, *row_args[i])``, ``entry(x, entry_args)``."""
        plan = self.plan
        batch = torch.broadcast_shapes(v.shape[:-1], self.batch)
        pieces = [row(v[..., r.index], *a).reshape(*batch, -1) for r, a in zip(plan.rows, row_args)]
        pieces.append(entry(v[..., plan.entries], entry_args))
        return torch.cat(pieces, dim=-1)[..., plan.inverse]


def singular_blocks(plan: _Plan, w: Tensor) -> Tensor:
    """``(n,)`` flags of the entries of ``w`` (``(n,)``) in row blocks whose Gram matrix ``X P X^T`` is singular at
    ``w`` (rows of zero weighted norm, or linearly dependent ones), where the metric is undefined."""
    flags = torch.zeros(w.shape, dtype=torch.bool, device=w.device)
    for r, s in zip(plan.rows, _Point(plan, w).row_s):
        singular = torch.linalg.matrix_rank(s) < s.shape[-1]  # (B,)
        flags[r.index.to(w.device)[singular].reshape(-1)] = True
    return flags


def _solve(s: Tensor, x: Tensor) -> Tensor:
    """``s^-1 x`` for a batch of small SPD ``s`` and matrices ``x`` (broadcast over the batch); ``1 x 1`` blocks (units)
    by division, not LAPACK."""
    if s.shape[-1] == 1:
        return x / s
    # x is a matrix: expanded to s's batch, never read as a batch of vectors (torch.linalg.solve reads a (k, k) x
    # against B = k blocks of s as B right-hand sides)
    return torch.linalg.solve(s, x.expand(*s.shape[:-2], *x.shape[-2:]) if x.dim() < s.dim() else x)


def _mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for batches of small matrices; an inner dimension of 1 (units' ``1 x 1`` blocks) by broadcasting."""
    return a * b if a.shape[-1] == 1 else a @ b


def _sym_power(s: Tensor, power: float) -> Tensor:
    if s.shape[-1] == 1:
        return s.pow(power)
    lam, vec = torch.linalg.eigh(s)
    return (vec * lam.pow(power)[..., None, :]) @ vec.transpose(-1, -2)


def symmetry_metric(symmetry: MatrixSymmetry, params: Mapping[str, Tensor]) -> Metric:
    """The metric of `manifolds._symmetry_metric` for ``symmetry``, on flat vectors in the order of ``params``.

    ``apply`` is differentiable in the point by ``torch.func`` (for the Levi-Civita connection of
    `manifolds.MetricQuotient`); ``solve``, ``whiten`` and ``unwhiten`` (``W = G^{1/2}``, symmetric) work
    block by block on ``k x k`` Gram matrices, so nothing is dense in the number of parameters. Every map
    accepts ``(..., n)`` vectors, and a batch of points ``(..., n)`` of the same batch shape (each vector
    under the metric at its own point: geodesics integrated in batches).

    Args:
        symmetry: the group ([`manifolds.transformer_symmetry`][manifolds.transformer_symmetry]).
        params: ``{name: tensor}`` giving the flat layout (`manifolds.ParamLayout`); every tensor the
            group moves must be present.

    Returns:
        The [`manifolds.Metric`][manifolds.Metric] (name ``"symmetry"``).

    Raises:
        UnsupportedModelError: a structure the metric cannot weigh invariantly (see the module docstring).
    """
    return _metric(_Plan(symmetry, params))


def _metric(plan: _Plan) -> Metric:
    def apply(w: Tensor, xi: Tensor) -> Tensor:
        return _Point(plan, w).map(xi, lambda x, s, p: _solve(s, x * p), lambda x, p: x * p)

    def solve(w: Tensor, v: Tensor) -> Tensor:
        return _solver(_Point(plan, w))(v)

    def whiten(w: Tensor, xi: Tensor) -> Tensor:
        return _whitener(_Point(plan, w), -0.5)(xi)

    def unwhiten(w: Tensor, zeta: Tensor) -> Tensor:
        return _whitener(_Point(plan, w), 0.5)(zeta)

    return Metric(apply, solve, whiten, unwhiten, name="symmetry", batched=True,
                  derivative=lambda w, a: _derivative(plan, w, a),
                  jacobian=lambda w, u: _jacobian(plan, w, u))  # fmt: skip


def _solver(point: _Point):
    """``v -> G^-1 v`` at ``point``."""
    return lambda v: point.map(v, lambda x, s, p: s @ (x / p), lambda x, p: x / p)


def _whitener(point: _Point, power: float):
    """``xi -> W xi`` (``power = -0.5``, ``W = G^{1/2}``) or ``zeta -> W^-1 zeta`` (``power = 0.5``) at ``point``, with
    the blocks' matrix roots taken once (a fixed point's maps are applied many times)."""
    rows, entry = _roots(point, power)
    return lambda v: point.blockwise(v, lambda x, r, q: r @ (x * q), lambda x, q: x * q, rows, entry)


def _roots(point: _Point, power: float) -> tuple[list[tuple[Tensor, Tensor]], Tensor]:
    """The blocks' factors of ``G^-power``: ``(s^power, p^-power)`` per row batch and ``p^-power`` on the entries
    (``power = -0.5``: ``W``, ``0.5``: ``W^-1``)."""
    rows = [(_sym_power(s, power), p.pow(-power)) for s, p in zip(point.row_s, point.row_p)]
    return rows, point.entry_p.pow(-power)


def _whitening_entries(point: _Point) -> tuple[Tensor, Tensor, Tensor]:
    """``W = G^{1/2}`` at one point ``(n,)`` as ``(row, column, value)`` triplets of a sparse ``n x n`` matrix (each
    ``1-D``): ``k^2 m`` numbers per ``k x m`` row block, one per entry."""
    plan = point.plan
    rows, entry = _roots(point, -0.5)
    out = []
    for r, (root, q) in zip(plan.rows, rows):  # (W x)[b, a, j] = sum_c root[b, a, c] q[b, j] x[b, c, j]
        idx = r.index.to(root.device)
        big, k, m = idx.shape
        shape = (big, k, k, m)  # (block, a, c, j)
        out.append((idx[:, :, None, :].expand(shape), idx[:, None, :, :].expand(shape),
                    root[..., None] * q[:, None, :, :]))  # fmt: skip
    entries = plan.entries.to(entry.device)
    out.append((entries, entries, entry))
    return tuple(torch.cat([part[i].reshape(-1) for part in out]) for i in range(3))


def _derivative(plan: _Plan, w: Tensor, a: Tensor):
    """``xi -> DG(w)[a] xi`` for one point ``w`` and direction ``a`` (both ``(n,)``), with what does not depend on
    ``xi`` computed once: the factors' derivatives along ``a`` (one JVP), the blocks' inverses.

    ``G`` is ``s^-1 (x p)`` on a row block and ``x p`` on an entry, so along ``a`` (``ds``, ``dp`` the factors'
    derivatives) its derivative is ``-s^-1 ds s^-1 (x p) + s^-1 (x dp)`` and ``x dp``.
    """
    point = _Point(plan, w)
    _, tangent = torch.func.jvp(lambda p: _Point(plan, p).fields(), (w,), (a,))
    rows = len(plan.rows)
    d_row_s, d_row_p = tangent[:rows], tangent[rows: 2 * rows]
    row_inv = [torch.linalg.inv(s) for s in point.row_s]
    row_args = [(inv, inv @ ds @ inv, p, dp) for inv, ds, p, dp in zip(row_inv, d_row_s, point.row_p, d_row_p)]

    def apply(xi: Tensor) -> Tensor:
        return point.blockwise(xi, lambda x, inv, t, p, dp: inv @ (x * dp) - t @ (x * p), lambda x, dp: x * dp,
                               row_args, tangent[-1])  # fmt: skip

    return apply


def _jacobian(plan: _Plan, w: Tensor, u: Tensor):
    """``(xi -> A xi, eta -> A^T eta)`` for ``A`` the Jacobian of ``w -> G(w) u`` at one point (``w``, ``u``,
    ``xi``, ``eta`` all ``(n,)``), in closed form, with what does not depend on the vector computed once.

    On a row block ``G u = Y = Z (U p)`` with ``Z = s^-1``, ``s = X diag(p) X^T``; along ``xi`` (block ``Xi``) and the
    column weights' change ``dp``, ``ds = Xi P X^T + X P Xi^T + X dP X^T`` and ``d(G u) = Z (U dp) - Z ds Y``. On an
    entry ``u p``:
    ``u dp``, with ``dp = -2 xi / w^3`` under the node metric. The weights ``p`` are read from the table of
    references ``r = sum x^2 p`` (and ``1 / r``), whose change ``dr = sum (2 x xi p + x^2 dp)`` is carried
    upstream first; ``A^T`` is the same chain read backwards (references downstream first), with the cotangent of
    ``ds`` ``-Z H Y^T``.
    """
    point = _Point(plan, w)
    table, refs = point.table, plan.n_refs
    dev = w.device  # the plan's index tables live on the host; every index is used where the point is
    by_shape: dict[tuple[int, ...], list[tuple[Tensor, ...]]] = {}  # references too: fewer, larger batches
    for r, s, p in zip(plan.rows, point.row_s, point.row_p):
        by_shape.setdefault(tuple(r.index.shape[1:]), []).append((r.index.to(dev), r.weight.to(dev), s, p))
    rows = []
    for same in by_shape.values():
        index, weight, s, p = (torch.cat(parts) for parts in zip(*same))
        z = _solve(s, torch.eye(s.shape[-1], dtype=s.dtype, device=s.device))
        rows.append((index, weight, w[index], u[index], z, _mm(z, u[index] * p), p))
    perm = torch.cat([index.reshape(-1).cpu() for index, *_ in rows] + [plan.entries])
    inverse = torch.argsort(perm.to(dev))  # the flat order of the pieces, in the batches above
    node = plan.entry_node.to(w.device)
    entries = plan.entries.to(dev)
    ue = u[entries]
    we = torch.where(node, w[entries], 1.0)
    node_scale = torch.where(node, -2.0 * ue / (we * we * we), 0.0)  # d(u / w^2) = -2 u xi / w^3
    entry_u = torch.where(node, 0.0, ue)
    entry_weight = plan.entry_weight.to(w.device)
    references = []  # (reference block, x, p, slot of r, r)
    for fi, r in plan.references:
        r = _Rows(r.index.to(dev), r.weight.to(dev), fi)
        x = w[r.index]
        start = 1 + plan.ref_offsets[fi]
        ref = table[start: start + x.shape[0]]
        references.append((r, x, table[r.weight][:, None, :], start, ref))

    def forward(xi: Tensor) -> Tensor:
        dt = xi.new_zeros(table.shape)
        for r, x, p, start, ref in references:  # upstream first
            dref = (x * (2.0 * xi[r.index] * p + x * dt[r.weight][:, None, :])).sum((-2, -1))
            dt[start: start + ref.shape[0]] = dref
            dt[start + refs: start + refs + ref.shape[0]] = -dref / (ref * ref)
        pieces = []
        for index, weight, x, ur, z, y, p in rows:
            dx, dp = xi[index], dt[weight][:, None, :]
            ds = (dx * p) @ x.transpose(-1, -2)
            ds = ds + ds.transpose(-1, -2) + (x * dp) @ x.transpose(-1, -2)
            pieces.append(_mm(z, ur * dp - _mm(ds, y)).reshape(-1))
        pieces.append(node_scale * xi[entries] + entry_u * dt[entry_weight])
        return torch.cat(pieces)[inverse]

    def backward(eta: Tensor) -> Tensor:
        gt = eta.new_zeros(table.shape)  # the cotangent of the table
        pieces = []
        for index, weight, x, ur, z, y, p in rows:
            zh = _mm(z, eta[index])
            sym = zh @ y.transpose(-1, -2)  # Z H Y^T: minus the cotangent of ds
            pieces.append((-_mm(sym + sym.transpose(-1, -2), x) * p).reshape(-1))
            gt.index_add_(0, weight.reshape(-1), ((zh * ur) - x * _mm(sym, x)).sum(-2).reshape(-1))
        he = eta[entries]
        pieces.append(node_scale * he)
        gt.index_add_(0, entry_weight, entry_u * he)
        out = torch.cat(pieces)[inverse]
        for r, x, p, start, ref in reversed(references):  # downstream first: their weights read upstream references
            g = gt[start: start + ref.shape[0]] - gt[start + refs: start + refs + ref.shape[0]] / (ref * ref)
            g = g[:, None, None]
            out.index_add_(0, r.index.reshape(-1), (2.0 * x * p * g).reshape(-1))
            gt.index_add_(0, r.weight.reshape(-1), (x * x * g).reshape(-1))
        return out

    return forward, backward
