"""Vector helpers the eigen-solvers share: checks, random start vectors, Gram-Schmidt against a
block of orthonormal rows, a Krylov basis stored in blocks, and true residuals of finished pairs."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from sharpness.products._operator import SymmetricOperator

# A vector left by Gram-Schmidt is taken to lie in the span of the block (invariant or exhausted
# subspace) when its norm is below this many rounding units (times sqrt of the block size) of the
# norm it had before: twice-repeated classical Gram-Schmidt leaves about eps * sqrt(m) of such a vector.
_BREAKDOWN_ULPS = 100.0

# Gram-Schmidt is repeated when one pass leaves less than this fraction of the vector's norm.
_DGKS_ETA = 1.0 / math.sqrt(2.0)
# An operator whose products are projected already (SymmetricOperator.products_in_subspace) has the solvers' vectors
# re-projected every this many products only: sums of projected vectors leave the subspace by rounding alone, and
# a three-term recurrence can amplify that drift by a bounded factor per step (tests/test_projection_skip.py
# measures it below 1e-12 relative in float64).
_REPROJECT_EVERY = 4

def _check_k(k: int, n: int) -> None:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if k > n:
        raise ValueError(f"k={k} eigenpairs were asked of an operator of size {n}; ask for at most {n}")


def _as_vector(v0: Tensor, op: SymmetricOperator) -> Tensor:
    """A user's start vector as an ``(n,)`` tensor in the operator's dtype and device."""
    if v0.numel() != op.size:
        raise ValueError(f"v0 has {v0.numel()} entries but the operator has size {op.size}")
    return v0.detach().reshape(-1).to(dtype=op.dtype, device=op.device)


def _random(shape: tuple[int, ...], op: SymmetricOperator, generator: torch.Generator | None) -> Tensor:
    """Standard normal ``shape`` in the operator's dtype and device, drawn on the generator's device (process 0's
    draw, where several processes apply the operator together)."""
    device = op.device if generator is None else generator.device
    return op.comm.broadcast_(torch.randn(shape, generator=generator, dtype=op.dtype, device=device).to(op.device))


def _breakdown_threshold(dtype: torch.dtype, block_size: int) -> float:
    """Relative norm below which a vector orthogonalized against ``block_size`` vectors is rounding."""
    return _BREAKDOWN_ULPS * math.sqrt(max(block_size, 1)) * torch.finfo(dtype).eps


def _gram_schmidt(
    v: Tensor, block: Tensor | KrylovBasis, overwrite: bool = False
) -> tuple[Tensor, Tensor, float, float]:
    """Classical Gram-Schmidt of ``v`` (n,) against orthonormal rows (``(m, n)`` or a basis), repeated once if needed.

    ``overwrite=True`` lets it work in ``v``'s own storage (the caller's vector is then consumed):
    no new vector of size ``n`` per call.

    Returns:
        The orthogonalized vector ``(n,)``, the summed coefficients ``(m,)`` it lost, its norm, and
            the norm ``v`` had. Only the final norm is a pass over the vector: the rows being orthonormal,
            the norm before a pass is ``hypot(||coefficients||, norm after)``.
    """
    blocks = block.blocks() if isinstance(block, KrylovBasis) else [block]
    if sum(b.shape[0] for b in blocks) == 0:
        norm = float(torch.linalg.vector_norm(v))
        return v, v.new_zeros(0), norm, norm
    if not overwrite:
        v = v.clone()
    coeffs = _coefficients(blocks, v)
    _subtract_combination(v, blocks, coeffs)
    after = float(torch.linalg.vector_norm(v))
    before = math.hypot(float(torch.linalg.vector_norm(coeffs)), after)
    # A second pass restores orthogonality lost to cancellation in the first ("twice is enough"); it
    # is only needed when the first one removed most of the vector (Daniel-Gragg-Kaufman-Stewart).
    if after > _DGKS_ETA * before:
        return v, coeffs, after, before
    correction = _coefficients(blocks, v)
    _subtract_combination(v, blocks, correction)
    return v, coeffs + correction, float(torch.linalg.vector_norm(v)), before


def _orthogonalize(v: Tensor, block: Tensor | KrylovBasis, overwrite: bool = False) -> tuple[Tensor, Tensor]:
    """`_gram_schmidt` without the norms: ``(orthogonalized v, summed coefficients)``."""
    v, coeffs, _, _ = _gram_schmidt(v, block, overwrite)
    return v, coeffs


def _coefficients(blocks: list[Tensor], v: Tensor) -> Tensor:
    """``rows @ v`` over the rows of ``blocks``: ``(m,)``."""
    return torch.cat([b @ v for b in blocks]) if len(blocks) > 1 else blocks[0] @ v


def _subtract_combination(v: Tensor, blocks: list[Tensor], coeffs: Tensor, scale: float = 1.0) -> None:
    """``v = scale * (v - sum_i coeffs[i] * row_i)`` in place, in one pass over the rows and ``v``."""
    start = 0
    for b in blocks:
        v.addmv_(b.T, coeffs[start : start + b.shape[0]], beta=scale if start == 0 else 1.0, alpha=-scale)
        start += b.shape[0]
    if start == 0 and scale != 1.0:
        v.mul_(scale)


def _combine(blocks: list[Tensor], coeffs: Tensor) -> Tensor:
    """``sum_i coeffs[i] * row_i`` over the rows of ``blocks``: ``(m,)`` -> ``(n,)``, ``(m, k)`` -> ``(k, n)``."""
    out, start = None, 0
    for b in blocks:
        c = coeffs[start : start + b.shape[0]]
        term = b.T @ c if c.dim() == 1 else c.T @ b
        out = term if out is None else out + term
        start += b.shape[0]
    return out


class KrylovBasis:
    """Orthonormal rows ``(m, n)`` stored in blocks of ``block_rows``, allocated as the basis grows.

    A single preallocated matrix would hold ``max_iter`` vectors of the parameter size; growing one
    by copying would briefly hold two. Blocks hold at most ``block_rows - 1`` unused rows.
    """

    def __init__(self, n: int, dtype: torch.dtype, device: torch.device, block_rows: int = 8):
        self.n, self.dtype, self.device, self.block_rows = n, dtype, device, block_rows
        self._blocks: list[Tensor] = []
        self._spare: Tensor | None = None
        self.size = 0

    def append(self, v: Tensor, scale: float = 1.0) -> None:
        """Store ``scale * v`` as the next row (scaled on the way in: no temporary vector; nothing to do when
        ``v`` is that row, from `next_row`, and ``scale`` is 1)."""
        if self.size == len(self._blocks) * self.block_rows:
            self._spare = None  # v may be it: it stays alive until copied into the new block
            self._blocks.append(torch.empty(self.block_rows, self.n, dtype=self.dtype, device=self.device))
        row = self._blocks[-1][self.size % self.block_rows]
        if scale != 1.0 or v.data_ptr() != row.data_ptr():
            torch.mul(v, scale, out=row)
        self.size += 1

    def next_row(self) -> Tensor:
        """Storage for the vector `append` stores next, to be built in place: the next row of the last
        block, or a single spare vector when every block is full (a new block is only allocated when
        that vector is appended, so a last, discarded vector never costs a whole block)."""
        if self.size < len(self._blocks) * self.block_rows:
            return self._blocks[-1][self.size % self.block_rows]
        if self._spare is None:
            self._spare = torch.empty(self.n, dtype=self.dtype, device=self.device)
        return self._spare

    def __getitem__(self, i: int) -> Tensor:
        return self._blocks[i // self.block_rows][i % self.block_rows]

    def blocks(self) -> list[Tensor]:
        """Views of the filled rows, block by block."""
        full, rest = divmod(self.size, self.block_rows)
        return self._blocks[:full] + ([self._blocks[full][:rest]] if rest else [])

    def coefficients_and_norm(self, v: Tensor) -> tuple[Tensor, float]:
        """``(rows @ v, ||v||^2)`` for the vector about to be stored (`next_row`), in one pass over the
        basis and ``v`` when ``v`` is that row of the last block."""
        full, rest = divmod(self.size, self.block_rows)
        if self.size < len(self._blocks) * self.block_rows and v.data_ptr() == self._blocks[-1][rest].data_ptr():
            last = self._blocks[full][: rest + 1] @ v
            coeffs = torch.cat([*(b @ v for b in self._blocks[:full]), last[:-1]]) if full else last[:-1]
            return coeffs, float(last[-1])
        return _coefficients(self.blocks(), v), float(torch.dot(v, v))

    def combine(self, coeffs: Tensor) -> Tensor:
        """``coeffs.T @ rows``: ``(m, k)`` coefficients -> ``(k, n)`` combinations of the rows."""
        return _combine(self.blocks(), coeffs)


def _unit_orthogonal(
    op: SymmetricOperator, block: Tensor | KrylovBasis, v: Tensor, owned: bool
) -> Tensor | None:
    """``v`` (n,) projected, made orthogonal to the rows of ``block`` and scaled to unit norm; ``None``
    when nothing of it is left beyond rounding (``block`` spans what ``v`` has in the subspace).
    ``owned=False`` leaves ``v`` itself untouched."""
    v, _, _, before = _gram_schmidt(op.project(v), block, overwrite=owned)
    # Project again: rounding of the projection must not let excluded directions in.
    v, _, norm, _ = _gram_schmidt(op.project(v), block, overwrite=True)
    rows = block.size if isinstance(block, KrylovBasis) else block.shape[0]
    if before == 0.0 or norm <= _breakdown_threshold(op.dtype, rows) * before:
        return None
    # Not owned and nothing to orthogonalize against: v may still be the caller's tensor.
    return v.div_(norm) if owned else v / norm


def _fresh_direction(
    op: SymmetricOperator, block: Tensor | KrylovBasis, generator: torch.Generator | None
) -> Tensor | None:
    """A random unit vector of the operator's subspace orthogonal to the rows of ``block`` (m, n).

    Returns:
        ``(n,)`` unit vector, or ``None`` when ``block`` already spans the subspace.
    """
    return _unit_orthogonal(op, block, _random((op.size,), op, generator), owned=True)


def _start_vector(
    op: SymmetricOperator,
    found: Tensor | KrylovBasis,
    v0: Tensor | None,
    generator: torch.Generator | None,
) -> Tensor:
    """Unit start vector ``(n,)`` in the operator's subspace, orthogonal to the rows of ``found``."""
    if v0 is None:
        v = _fresh_direction(op, found, generator)
    else:
        v = _unit_orthogonal(op, found, _as_vector(v0, op), owned=False)
    if v is None:
        if v0 is not None:
            raise ValueError("v0 has no component in the operator's subspace; pass another v0 or none")
        rows = found.size if isinstance(found, KrylovBasis) else found.shape[0]
        raise ValueError(
            f"more eigenpairs were asked than the dimension {rows} of the operator's subspace; "
            f"ask for at most {rows}"
        )
    return v


def _project_rows(op: SymmetricOperator, block: Tensor) -> Tensor:
    """``op.project`` applied to every row of ``block`` (b, n)."""
    return torch.stack([op.project(row) for row in block])


def _reprojected(op: SymmetricOperator, w: Tensor, step: int | None = None, always: bool = False) -> Tensor:
    """``op.project(w)`` for a vector built from a product, unless the operator's products are projected already
    (``products_in_subspace``): then ``w`` itself, except at every `_REPROJECT_EVERY`-th ``step`` (``None``: a
    one-off product of a projected vector, never re-projected) and where the caller says ``always``."""
    if op.products_in_subspace and not always and (step is None or (step + 1) % _REPROJECT_EVERY):
        return w
    return op.project(w)


# Where the wanted eigenvalue is not clearly above 0, a solver without a stored basis re-projects every product:
# the excluded directions are in the kernel of an operator whose products are projected only to rounding (the node
# measure's), so the rounding they gather behaves as an eigenvalue of 0, which would then be the top one.
_NEAR_ZERO = 1e-3


def _near_zero(theta: float | None, norm: float) -> bool:
    """Whether a Ritz value ``theta`` (``None``: none yet) is at most `_NEAR_ZERO` times ``norm`` (``||A||`` so
    far) above 0."""
    return theta is None or theta <= _NEAR_ZERO * norm


def _residual_scale(values: np.ndarray, anorm: float, dtype: torch.dtype) -> np.ndarray:
    """``max(|theta|, tiny)`` with ``tiny = eps * ||A||``: an eigenvalue below rounding counts as zero."""
    tiny = max(anorm * torch.finfo(dtype).eps, np.finfo(np.float64).tiny)
    return np.maximum(np.abs(values), tiny)


def _canonical_signs(vectors: Tensor, normalize: bool = False) -> Tensor:
    """Flip rows of ``vectors`` (k, n), in place, so each one's largest-magnitude entry is positive
    (reproducible; on an exact tie between a largest and a smallest entry, the largest is made
    positive); ``normalize=True`` also scales them to unit norm in the same pass."""
    # Row-wise amax/amin: the dim=1 forms of aminmax and argmax are ten times slower on long rows.
    low, high = vectors.amin(dim=1), vectors.amax(dim=1)
    scale = torch.where(high >= -low, 1.0, -1.0).to(vectors.dtype)
    if normalize:
        scale = scale / torch.linalg.vector_norm(vectors, dim=1)
    return vectors.mul_(scale[:, None])


def _true_residuals(
    op: SymmetricOperator, vectors: Tensor, values: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Rayleigh quotients and relative residuals of unit ``vectors`` (k, n), with one ``op.matmat``.

    Args:
        op: the operator (its ``project`` is applied to the products).
        vectors: ``(k, n)`` unit rows in the operator's subspace.
        values: ``(k,)`` float64 eigenvalue estimates; ``None`` uses the Rayleigh quotients.

    Returns:
        ``(values, residuals)``, both ``(k,)`` float64 CPU tensors, residuals
            ``||A v - theta v|| / max(|theta|, eps ||A||)``.
    """
    products = op.matmat(vectors)
    products = (products if op.products_in_subspace else _project_rows(op, products)).double()
    vecs = vectors.double()
    if values is None:
        values = (vecs * products).sum(dim=1).cpu()
    norms = torch.linalg.vector_norm(products - values.to(vecs.device)[:, None] * vecs, dim=1).cpu()
    anorm = float(values.abs().max())
    scale = torch.from_numpy(_residual_scale(values.numpy(), anorm, op.dtype))
    return values, norms / scale
