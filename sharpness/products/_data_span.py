"""The Euclidean Hessian with the first layer's weight in coordinates of the span of the data.

A first ``Linear`` layer sees the data only through ``z = X W^T`` (``X``: the ``n`` inputs of that layer,
``(n, d)``). When ``n < d``, a weight direction ``V`` whose rows are orthogonal to the rows of ``X`` changes
nothing (``X V^T = 0``): the Hessian vanishes on those ``h (d - n)`` directions, and the first-layer block of
every product ``H v`` is ``E^T X``, ``E`` ``(n, h)`` being the tangent errors at the layer's output, so it
lies in the span of the data. With ``X X^T = L L^T`` (``L`` lower triangular ``(n, n)``, so ``X = L Q^T`` with
orthonormal columns ``Q`` ``(d, n)``), the coordinates ``U = V Q`` ``(h, n)`` of that span keep norms
(``||V|| = ||U||`` for ``V = U Q^T``), and the first layer's two products become

    zdot = X V^T = L U^T,        (H v)_U = E^T L,

products by an ``n x n`` triangular matrix instead of by the ``n x d`` data (the zero blocks above the
diagonal are skipped), while every solver vector is ``h (d - n)`` entries shorter. Every nonzero eigenvalue
of ``H`` is one of the operator here, with its eigenvector in the span; the rest of ``H``'s spectrum is 0.

An eigenvector ``u`` of eigenvalue ``lambda != 0`` is mapped back without inverting ``L`` (which the data's
conditioning would amplify): ``v = H v / lambda``, whose first-layer block ``E^T X / lambda`` is one more
product's tangent errors times the data.

The operator's spectrum depends on ``L`` only through ``L L^T``, so the Cholesky factor of the Gram matrix,
computed in the objective's dtype, gives the eigenvalues to the rounding of the Gram matrix (that of the
full products' matrix products); where the Gram matrix is not numerically positive definite (duplicate
samples) the factor comes from a QR factorization of ``X^T``, whose rank deficiency only adds zero
eigenvalues to the operator.
"""

from __future__ import annotations

import torch
from torch import Tensor

from manifolds import ParamLayout
from sharpness.products._hessian import HessianOperator
from sharpness.products._objective import Objective
from sharpness.products._operator import SymmetricOperator
from sharpness.products._rop import ChunkState, RopChain
from sharpness.products._rop_gradient import chain_gradient_but_first_weight, shared_gradient
from sharpness.products._rop_graph import RopGraph
from sharpness.solvers._vectors import _canonical_signs

# Rows of L per block of the triangular products: blocks much smaller than this run below the matrix
# product's best speed, so the zero half of L is skipped in at most 4 x 4 blocks.
_BLOCK_ROWS = 250
_MAX_BLOCKS = 4
# Data-span coordinates are used where their set-up costs at most the work this many products save, or
# where it is negligible (multiply-adds: a tenth of a millisecond).
_PAYBACK_PRODUCTS = 6
_NEGLIGIBLE_SETUP = 10**7


def _block_count(n: int) -> int:
    """Blocks per side of the triangular products with an ``n x n`` factor."""
    return max(1, min(_MAX_BLOCKS, round(n / _BLOCK_ROWS)))


class _LowerTriangular:
    """A lower-triangular ``(n, n)`` matrix ``L`` multiplied block by block, the zero blocks above the diagonal
    skipped (with ``b x b`` blocks, ``(b + 1) / (2 b)`` of the dense work).

    Attributes:
        count: blocks per side; bounds: their row offsets; blocks: ``{(i, j): block}`` for ``j <= i``.
    """

    def __init__(self, lower: Tensor):
        n = lower.shape[0]
        self.count = _block_count(n)
        self.bounds = [n * i // self.count for i in range(self.count + 1)]
        self.blocks = {
            (i, j): lower[self.rows(i), self.rows(j)].contiguous() for i in range(self.count) for j in range(i + 1)
        }

    def rows(self, i: int) -> slice:
        """The rows (and columns) of block ``i``."""
        return slice(self.bounds[i], self.bounds[i + 1])

    def left(self, b: Tensor, out: Tensor) -> Tensor:
        """``out = L @ b`` for ``b`` ``(n, c)``."""
        for i in range(self.count):
            rows = out[self.rows(i)]
            torch.mm(self.blocks[i, 0], b[self.rows(0)], out=rows)
            for j in range(1, i + 1):
                rows.addmm_(self.blocks[i, j], b[self.rows(j)])
        return out

    def right_add(self, a: Tensor, out: Tensor) -> Tensor:
        """``out += a @ L`` for ``a`` ``(c, n)``."""
        for j in range(self.count):
            columns = out[:, self.rows(j)]
            for i in range(j, self.count):
                columns.addmm_(a[:, self.rows(i)], self.blocks[i, j])
        return out


class DataSpanHessian(SymmetricOperator):
    """The Euclidean Hessian of ``objective`` with its first ``Linear`` weight ``(h, d)`` in data-span coordinates
    ``(h, n)`` (see the module docstring); the other parameters are as they are. Build it with
    `data_span_hessian`.

    Attributes:
        layout: the flat layout of its vectors (the first weight's shape is ``(h, n)``).
        objective: the objective and the name of the first layer's weight.
        weight: the objective and the name of the first layer's weight.
        samples: ``n`` and ``d``.
        features: ``n`` and ``d``.
        factor: the triangular factor ``L`` of the Gram matrix of the data.
    """

    def __init__(self, objective: Objective, chain: RopChain | RopGraph, states: list[ChunkState], lower: Tensor):
        self.objective, self.chain, self.states = objective, chain, states
        self.weight, self.inputs = chain.first_linear(states)
        self.samples, self.features = lower.shape[0], self.inputs[0].shape[1]
        hidden = objective.params[self.weight].shape[0]
        shapes = {
            name: (hidden, self.samples) if name == self.weight else p.shape for name, p in objective.params.items()
        }
        self.layout = ParamLayout.from_tensors({name: torch.empty(s, device="meta") for name, s in shapes.items()})
        super().__init__(self.layout.size, objective.dtype, objective.device)
        self.factor, self._lower = _LowerTriangular(lower), lower
        bounds = [0]
        for x in self.inputs:
            bounds.append(bounds[-1] + x.shape[0])
        self._chunks = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
        self._first_dot = lower.new_empty(self.samples, hidden)
        self._errors = lower.new_empty(self.samples, hidden)

    def info(self) -> dict:
        """What a result records of these coordinates: ``{"samples": n, "features": d}``."""
        return {"samples": self.samples, "features": self.features}

    def _tangent_errors(self, tangent: dict[str, Tensor], into: dict[str, Tensor]) -> Tensor:
        """Add the blocks of ``H v`` but the first weight's to ``into`` and return the tangent errors ``E``
        ``(n, h)`` at the first layer's output (a buffer, overwritten by the next product)."""
        with torch.no_grad():
            first_dot = self.factor.left(tangent[self.weight].T, self._first_dot)
            for rows, state in zip(self._chunks, self.states):
                first_layer = (first_dot[rows], self._errors[rows])
                self.chain.add_products(self.objective.params, state, tangent, into, first_layer)
        return self._errors

    def _matvec(self, v: Tensor) -> Tensor:
        return self._matvec_add(v, torch.zeros_like(v))

    def _matvec_add(self, v: Tensor, out: Tensor) -> Tensor:
        into = self.layout.unflatten(out)
        errors = self._tangent_errors(self.layout.unflatten(v), into)
        self.factor.right_add(errors.T, into[self.weight])
        return out

    def start_hint(self) -> Tensor | None:
        """The gradient in these coordinates, ``(size,)``: the first weight's block ``G_U = G_W Q = E^T X Q = E^T L``
        (``E`` ``(n, h)`` the errors at the first layer's output), the others as they are. Read off a chain's kept
        state (its first error carried back from the second layer's: no pass over the data); elsewhere from the
        whole gradient as ``(G_W X^T) L^-T`` (a triangular solve, ``n x n``), ``None`` where that solve is not finite
        (a rank-deficient ``L``)."""
        if isinstance(self.chain, RopChain):
            total = torch.zeros(self.size, dtype=self.dtype, device=self.device)
            into = self.layout.unflatten(total)
            errors = chain_gradient_but_first_weight(self.objective, self.chain, self.states, into)
            if errors is not None:
                self.factor.right_add(torch.cat(errors).T, into[self.weight])
                return total
        full = self.objective.layout.unflatten(shared_gradient(self.objective, "rop"))
        projected = torch.cat([full[self.weight] @ x.T for x in self.inputs], dim=1)  # G_W X^T, (h, n)
        block = torch.linalg.solve_triangular(self._lower, projected.T, upper=False).T
        if not bool(torch.isfinite(block).all()):
            return None
        return self.layout.flatten({**full, self.weight: block})

    def lift(self, vectors: Tensor) -> Tensor:
        """Parameter-space unit eigenvectors ``(k, N)`` from this operator's eigenvectors ``(k, size)`` of nonzero
        eigenvalues: ``H v`` normalized, one product each (counted in ``n_matvec``), largest-magnitude entry
        positive."""
        params = self.objective.layout
        out = vectors.new_zeros(vectors.shape[0], params.size)
        for u, row in zip(vectors, out):
            full = params.unflatten(row)
            errors = self._tangent_errors(self.layout.unflatten(u), full)
            for rows, x in zip(self._chunks, self.inputs):  # E^T X, chunk by chunk: the data are not copied
                full[self.weight].addmm_(errors[rows].T, x)
        self.n_matvec += vectors.shape[0]
        return _canonical_signs(out, normalize=True)


def data_span_hessian(op: HessianOperator) -> DataSpanHessian | None:
    """``op`` in data-span coordinates where they apply: R-operator products (``op.strategy == "rop"``) whose
    chunk states are kept in memory in a single process, a ``Linear`` layer of the data (the first layer of a
    chain; in a graph, a layer whose input depends on no parameter, alone or fused with the BatchNorm it feeds), and
    fewer samples than it has input features, by enough that the set-up pays for itself within a few products
    (`_pays_off`).
    ``None`` otherwise."""
    if op.strategy != "rop" or op.objective.comm.world_size > 1:  # the span of every process's data together
        return None
    kept = op.objective.rop_states()
    if kept is None:
        return None
    chain, states = kept
    first = chain.first_linear(states)
    if first is None:
        return None
    weight, inputs = first
    samples, features = sum(x.shape[0] for x in inputs), inputs[0].shape[1]
    hidden = op.objective.params[weight].shape[0]
    if samples >= features or not _pays_off(samples, features, hidden):
        return None
    return DataSpanHessian(op.objective, chain, states, _gram_factor(inputs))


def _pays_off(samples: int, features: int, hidden: int) -> bool:
    """Whether the factorization (the Gram matrix, ``n^2 d`` multiply-adds, and its Cholesky factor, counted
    as ``n^3`` for its lower speed) costs at most what the first layer's products save in
    ``_PAYBACK_PRODUCTS`` products (``2 n h (d - f n)`` each, ``f = (b + 1) / (2 b)`` the share of ``b x b``
    blocks the triangular products compute). With ``n`` close to ``d`` and a narrow first layer it would not:
    a top-eigenvalue solve takes 10-20 products, and mapping each eigenvector back about one more. A set-up of
    fewer than ``_NEGLIGIBLE_SETUP`` multiply-adds always pays."""
    blocks = _block_count(samples)
    setup = samples**2 * features + samples**3
    saved = 2 * samples * hidden * (features - (blocks + 1) / (2 * blocks) * samples)
    return setup <= max(_NEGLIGIBLE_SETUP, _PAYBACK_PRODUCTS * saved)


def _gram_factor(chunks: list[Tensor]) -> Tensor:
    """A lower-triangular ``L`` ``(n, n)`` with ``L L^T = X X^T``, ``X`` ``(n, d)`` the rows of ``chunks``: the
    Cholesky factor of the Gram matrix (built block by block), or, where rounding leaves that matrix not
    positive definite (duplicate or nearly dependent samples), the transposed R of a QR factorization of
    ``X^T``."""
    rows = [torch.cat([a @ b.T for b in chunks], dim=1) for a in chunks]
    gram = rows[0] if len(rows) == 1 else torch.cat(rows)
    lower, info = torch.linalg.cholesky_ex(gram)
    if int(info) == 0:
        return lower
    return torch.linalg.qr(torch.cat(chunks).T, mode="r")[1].T


__all__ = ["DataSpanHessian", "data_span_hessian"]
