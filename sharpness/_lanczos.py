"""Lanczos with full reorthogonalization: the default solver for the top eigenpairs of a symmetric operator.

Also holds the small vector helpers the other solvers share (random start vectors, Gram-Schmidt
against a block, true residuals of finished eigenpairs).
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
from scipy.linalg import eigh_tridiagonal
from torch import Tensor

from sharpness._operator import SymmetricOperator
from sharpness._progress import progress_bar
from sharpness._results import EigenResult

# A vector left by Gram-Schmidt is taken to lie in the span of the block (invariant or exhausted
# subspace) when its norm is below this many rounding units (times sqrt of the block size) of the
# norm it had before: twice-repeated classical Gram-Schmidt leaves about eps * sqrt(m) of such a vector.
_BREAKDOWN_ULPS = 100.0

# The Krylov basis starts with room for this many vectors and doubles when full, so memory follows
# the iterations actually spent, not ``max_iter``.
_INITIAL_CAPACITY = 64


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
    """Standard normal ``shape`` in the operator's dtype and device, drawn on the generator's device."""
    device = op.device if generator is None else generator.device
    return torch.randn(shape, generator=generator, dtype=op.dtype, device=device).to(op.device)


def _breakdown_threshold(dtype: torch.dtype, block_size: int) -> float:
    """Relative norm below which a vector orthogonalized against ``block_size`` vectors is rounding."""
    return _BREAKDOWN_ULPS * math.sqrt(max(block_size, 1)) * torch.finfo(dtype).eps


def _orthogonalize(v: Tensor, block: Tensor) -> tuple[Tensor, Tensor]:
    """Classical Gram-Schmidt of ``v`` (n,) against the orthonormal rows of ``block`` (m, n), twice.

    Returns:
        The orthogonalized vector ``(n,)`` and the summed coefficients ``(m,)`` it lost.
    """
    if block.shape[0] == 0:
        return v, v.new_zeros(0)
    coeffs = block @ v
    v = v - block.T @ coeffs
    # A second pass restores orthogonality lost to cancellation in the first ("twice is enough").
    correction = block @ v
    return v - block.T @ correction, coeffs + correction


def _fresh_direction(
    op: SymmetricOperator, block: Tensor, generator: torch.Generator | None
) -> Tensor | None:
    """A random unit vector of the operator's subspace orthogonal to ``block`` (m, n).

    Returns:
        ``(n,)`` unit vector, or ``None`` when ``block`` already spans the subspace.
    """
    v = op.project(_random((op.size,), op, generator))
    start = float(torch.linalg.vector_norm(v))
    if start == 0.0:
        return None
    v, _ = _orthogonalize(v, block)
    # Project again: rounding of the projection must not let excluded directions in.
    v, _ = _orthogonalize(op.project(v), block)
    norm = float(torch.linalg.vector_norm(v))
    if norm <= _breakdown_threshold(op.dtype, block.shape[0]) * start:
        return None
    return v / norm


def _project_rows(op: SymmetricOperator, block: Tensor) -> Tensor:
    """``op.project`` applied to every row of ``block`` (b, n)."""
    return torch.stack([op.project(row) for row in block])


def _residual_scale(values: np.ndarray, anorm: float, dtype: torch.dtype) -> np.ndarray:
    """``max(|theta|, tiny)`` with ``tiny = eps * ||A||``: an eigenvalue below rounding counts as zero."""
    tiny = max(anorm * torch.finfo(dtype).eps, np.finfo(np.float64).tiny)
    return np.maximum(np.abs(values), tiny)


def _canonical_signs(vectors: Tensor) -> Tensor:
    """Flip rows of ``vectors`` (k, n) so each one's largest-magnitude entry is positive (reproducible)."""
    idx = vectors.abs().argmax(dim=1)
    signs = torch.sign(vectors[torch.arange(vectors.shape[0], device=vectors.device), idx])
    signs[signs == 0] = 1
    return vectors * signs[:, None]


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
    products = _project_rows(op, op.matmat(vectors)).double()
    vecs = vectors.double()
    if values is None:
        values = (vecs * products).sum(dim=1).cpu()
    norms = torch.linalg.vector_norm(products - values.to(vecs.device)[:, None] * vecs, dim=1).cpu()
    anorm = float(values.abs().max())
    scale = torch.from_numpy(_residual_scale(values.numpy(), anorm, op.dtype))
    return values, norms / scale


def _top_ritz(alphas: list[float], betas: list[float], k: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Largest ``min(k, m)`` eigenpairs of the ``m x m`` tridiagonal ``T`` (float64).

    Returns:
        Ritz values ``(k',)`` descending, their eigenvectors ``(m, k')`` as columns, and a Gershgorin
        bound on ``||T||``.
    """
    d = np.asarray(alphas)
    e = np.asarray(betas)
    m = d.shape[0]
    # Only the top k are computed: a full tridiagonal solve costs O(m^2) per iteration.
    values, vectors = eigh_tridiagonal(d, e, select="i", select_range=(max(m - k, 0), m - 1))
    off = np.abs(np.concatenate([[0.0], e])) + np.abs(np.concatenate([e, [0.0]]))
    anorm = float(np.max(np.abs(d) + off))
    return values[::-1].copy(), vectors[:, ::-1].copy(), anorm


def lanczos(
    op: SymmetricOperator,
    k: int = 1,
    tol: float = 1e-6,
    max_iter: int | None = None,
    v0: Tensor | None = None,
    generator: torch.Generator | None = None,
    progress: bool | None = None,
) -> EigenResult:
    """The ``k`` largest algebraic eigenpairs of a symmetric operator by Lanczos.

    One operator product per iteration; the Krylov basis is kept orthonormal by full
    reorthogonalization (classical Gram-Schmidt twice) and stored in the operator's dtype and device
    (``max_iter`` vectors of size ``n`` at most). The tridiagonal eigenproblem is solved in float64.
    The start vector and every product go through ``op.project``, so the spectrum is that of the
    operator restricted to its subspace.

    Stopping rule: after iteration ``j`` (Krylov dimension ``m = j + 1 >= k``), the ``k`` largest Ritz
    values ``theta_i`` all have Ritz residual estimates
    ``|beta_m * s_{m,i}| <= tol * max(|theta_i|, eps * ||T||)``, where ``s_{m,i}`` is the last entry of
    the ``i``-th eigenvector of the tridiagonal ``T`` and ``eps`` the operator dtype's rounding unit.
    When the next Lanczos vector vanishes (invariant subspace, or the basis filled the subspace) the
    Ritz values are exact; if fewer than ``k`` are known the Krylov space is restarted with a random
    vector orthogonal to the basis. ``converged=False`` is returned, with the current Ritz pairs, when
    ``max_iter`` is reached first.

    Single-vector Krylov methods see one copy of a repeated eigenvalue until the Krylov space is
    exhausted: for top-k problems with exact multiplicities use :func:`power_iteration` (deflation).

    Args:
        op: the symmetric operator, size ``n``.
        k: number of eigenpairs.
        tol: relative tolerance of the Ritz residual estimates.
        max_iter: Krylov dimension limit, at least ``k``; default ``min(n, max(300, 2 k + 20))``
            (capped at ``n`` in any case).
        v0: ``(n,)`` start vector (projected); random by default.
        generator: random source for the start vector and restarts.
        progress: show a progress bar (``None``: only on a terminal).

    Returns:
        ``EigenResult`` with ``eigenvalues`` ``(k,)`` float64 descending, unit ``eigenvectors``
        ``(k, n)`` in the operator's dtype, true relative ``residuals`` from one final ``op.matmat``
        (counted in ``n_matvec``), one history record per iteration and, in ``info``, the final
        Krylov dimension and the number of restarts.

    Raises:
        ValueError: bad ``k``/``max_iter``, a ``v0`` with no component in the subspace, or ``k``
            larger than the dimension of the subspace the operator lives on.
    """
    started = time.perf_counter()
    n = op.size
    _check_k(k, n)
    if max_iter is None:
        max_iter = max(300, 2 * k + 20)
    if max_iter < k:
        raise ValueError(f"max_iter={max_iter} is smaller than k={k}; Lanczos needs at least k iterations")
    max_iter = min(int(max_iter), n)
    matvecs_before = op.n_matvec

    if v0 is None:
        q = _fresh_direction(op, torch.empty(0, n, dtype=op.dtype, device=op.device), generator)
        if q is None:
            raise ValueError("the operator's subspace is {0}: project() maps a random vector to zero")
    else:
        q = op.project(_as_vector(v0, op))
        norm = float(torch.linalg.vector_norm(q))
        if norm == 0.0:
            raise ValueError("v0 has no component in the operator's subspace; pass another v0 or none")
        q = q / norm

    basis = torch.empty(min(max_iter, _INITIAL_CAPACITY), n, dtype=op.dtype, device=op.device)
    basis[0] = q
    m = 1
    alphas: list[float] = []
    betas: list[float] = []  # betas[j] couples basis[j] and basis[j + 1]
    history: list[dict] = []
    converged = False
    restarts = 0

    with progress_bar(max_iter, "lanczos", progress) as bar:
        while True:
            w = op.project(op.matvec(basis[m - 1]))
            w_norm = float(torch.linalg.vector_norm(w))
            w, coeffs = _orthogonalize(w, basis[:m])
            # Rounding of the projection must not let excluded directions into the basis.
            w = op.project(w)
            alphas.append(float(coeffs[m - 1]))
            beta = float(torch.linalg.vector_norm(w))
            if beta <= _breakdown_threshold(op.dtype, m) * w_norm:
                beta = 0.0

            theta, s, anorm = _top_ritz(alphas, betas, k)
            estimates = beta * np.abs(s[-1])
            relative = estimates / _residual_scale(theta, anorm, op.dtype)
            worst = float(relative.max())
            history.append({"iteration": m, "eigenvalues": theta.tolist(), "residual": worst})
            bar.update(1)
            bar.set_postfix(residual=f"{worst:.1e}", refresh=False)

            if m >= k and worst <= tol:
                converged = True
                break
            if m == max_iter:
                break
            if beta == 0.0:
                # Fewer than k exact Ritz values so far: continue in a fresh direction.
                nxt = _fresh_direction(op, basis[:m], generator)
                if nxt is None:
                    raise ValueError(
                        f"k={k} eigenpairs were asked but the operator's subspace has dimension {m}; "
                        f"ask for at most {m}"
                    )
                restarts += 1
            else:
                nxt = w / beta
            betas.append(beta)
            if m == basis.shape[0]:
                grown = torch.empty(min(2 * m, max_iter), n, dtype=op.dtype, device=op.device)
                grown[:m] = basis
                basis = grown
            basis[m] = nxt
            m += 1

    ritz = torch.as_tensor(s.T.copy(), dtype=op.dtype, device=op.device)
    vectors = ritz @ basis[:m]
    vectors = _canonical_signs(vectors / torch.linalg.vector_norm(vectors, dim=1, keepdim=True))
    values, residuals = _true_residuals(op, vectors, torch.from_numpy(theta))
    return EigenResult(
        eigenvalues=values,
        eigenvectors=vectors,
        residuals=residuals,
        n_matvec=op.n_matvec - matvecs_before,
        iterations=m,
        converged=converged,
        history=history,
        method="lanczos",
        tol=tol,
        seconds=time.perf_counter() - started,
        info={"krylov_dimension": m, "restarts": restarts},
    )
