"""Lanczos with full reorthogonalization: the default solver for the top eigenpairs of a symmetric operator."""

from __future__ import annotations

import math
import time

import numpy as np
import torch
from scipy.linalg import eigh_tridiagonal
from scipy.linalg.lapack import dstev as _stev
from torch import Tensor

from sharpness._progress import progress_bar
from sharpness._results import EigenResult
from sharpness.products._operator import SymmetricOperator
from sharpness.solvers._vectors import (
    _DGKS_ETA,
    KrylovBasis,
    _as_vector,
    _breakdown_threshold,
    _canonical_signs,
    _check_k,
    _fresh_direction,
    _gram_schmidt,
    _reprojected,
    _residual_scale,
    _subtract_combination,
    _true_residuals,
)

RESIDUALS = ("estimate", "true")

# Tridiagonal matrices up to this size are solved whole (LAPACK stev), larger ones with scipy's selective solver.
_WHOLE_RITZ = 64


def _top_ritz(alphas: list[float], betas: list[float], k: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Largest ``min(k, m)`` eigenpairs of the ``m x m`` tridiagonal ``T`` (float64).

    Returns:
        Ritz values ``(k',)`` descending, their eigenvectors ``(m, k')`` as columns, and a Gershgorin
            bound on ``||T||``.
    """
    d = np.array(alphas, dtype=np.float64)
    e = np.array(betas, dtype=np.float64)
    m = d.shape[0]
    if m == 1:
        values, vectors = d, np.ones((1, 1))
    elif m <= _WHOLE_RITZ:
        # LAPACK's tridiagonal solver called directly: a few microseconds, where building a dense T
        # or scipy's eigh_tridiagonal wrapper costs several times that on every Lanczos step.
        values, vectors, info = _stev(d, e, compute_v=1)
        if info != 0:
            raise np.linalg.LinAlgError(f"the tridiagonal eigen-solver did not converge (LAPACK stev info={info})")
        values, vectors = values[max(m - k, 0) :], vectors[:, max(m - k, 0) :]
    else:  # only the top k: a full tridiagonal solve costs O(m^2) per iteration
        values, vectors = eigh_tridiagonal(d, e, select="i", select_range=(max(m - k, 0), m - 1))
    off = np.abs(e)
    bound = np.abs(d)
    bound[:-1] += off
    bound[1:] += off
    return values[::-1].copy(), vectors[:, ::-1].copy(), float(bound.max())


def lanczos_step(op: SymmetricOperator, basis: KrylovBasis, beta_prev: float) -> tuple[Tensor, float, float]:
    """One fully reorthogonalized Lanczos step from the last row ``q_m`` of ``basis``.

    Args:
        op: the operator (its ``project`` is applied to the new vector, every few steps only when its products are
            projected already: see `_reprojected`).
        basis: the orthonormal Lanczos vectors so far, ``m >= 1`` rows.
        beta_prev: the coefficient coupling rows ``m - 1`` and ``m`` (ignored when ``m == 1``).

    Returns:
        ``(w, alpha, beta)``: the next Lanczos vector ``(n,)``, of unit norm (built in the basis's next row,
            so ``basis.append(w)`` copies nothing, unless every block was full and it lives in the spare vector, or
            the operator's projection made a new one), ``alpha = q_m^T A q_m`` and ``beta``, its norm before
            normalization; ``beta`` is 0 when that vector is rounding (the Krylov space is invariant), and ``w``
            is then meaningless.
    """
    m = basis.size
    q = basis[m - 1]
    # The next vector is built in its own basis row: the product is added onto -beta q_{m-1} there
    # (no product-sized temporary, no copy into the basis).
    row = basis.next_row()
    if m > 1:
        torch.mul(basis[m - 2], -beta_prev, out=row)
    else:
        row.zero_()
    product = op.matvec_add(q, row, in_subspace=True)  # q and row are combinations of projected vectors
    w = _reprojected(op, product, m)
    # The three-term recurrence first removes the large components (alpha q_m, beta q_{m-1}); one
    # Gram-Schmidt pass against the whole basis then removes the rest, which is small, so its
    # second pass (DGKS) is rarely needed: about one pass over the basis per step instead of two.
    alpha = float(torch.dot(q, w))
    w.sub_(q, alpha=alpha)
    if w is product:  # nothing projected (project returns v itself then): two passes over the basis
        w, coeffs, beta, before = _orthonormalize(w, basis)
    else:
        w, coeffs, _, before = _gram_schmidt(w, basis, overwrite=True)
        w = op.project(w)  # rounding of the projection must not let excluded directions into the basis
        beta = float(torch.linalg.vector_norm(w))
        if beta > 0.0:
            w.div_(beta)
    # ||A q_m||, the scale of the breakdown test, without a pass over a vector: A q_m is
    # beta_prev q_{m-1} + alpha q_m + (what Gram-Schmidt was given), three orthogonal parts.
    scale = math.sqrt((beta_prev if m > 1 else 0.0) ** 2 + alpha**2 + before**2)
    if beta <= _breakdown_threshold(op.dtype, m) * scale:
        beta = 0.0
    return w, alpha + float(coeffs[m - 1]), beta


def _orthonormalize(w: Tensor, basis: KrylovBasis) -> tuple[Tensor, Tensor, float, float]:
    """Gram-Schmidt of ``w`` (the basis's next row, consumed) against ``basis``, normalized: ``(unit w, summed
    coefficients, the norm beta it had before normalizing, the norm it had before Gram-Schmidt)``.

    One pass gives the coefficients and ``||w||^2`` together; when one Gram-Schmidt pass is enough (DGKS),
    ``beta^2 = ||w||^2 - ||coefficients||^2`` loses at most a few rounding units, and a second pass subtracts
    and normalizes at once. Otherwise the general `_gram_schmidt` (a repeated pass, explicit norm).
    """
    coeffs, before_sq = basis.coefficients_and_norm(w)
    after_sq = before_sq - float(torch.dot(coeffs, coeffs))
    if after_sq > _DGKS_ETA**2 * before_sq:
        beta = math.sqrt(after_sq)
        _subtract_combination(w, basis.blocks(), coeffs, scale=1.0 / beta)
        return w, coeffs, beta, math.sqrt(before_sq)
    w, coeffs, beta, before = _gram_schmidt(w, basis, overwrite=True)
    return (w.div_(beta) if beta > 0.0 else w), coeffs, beta, before


def lanczos(
    op: SymmetricOperator,
    k: int = 1,
    tol: float = 1e-6,
    max_iter: int | None = None,
    v0: Tensor | None = None,
    generator: torch.Generator | None = None,
    progress: bool | None = None,
    residuals: str = "estimate",
) -> EigenResult:
    """The ``k`` largest algebraic eigenpairs of a symmetric operator by Lanczos.

    One operator product per iteration; the Krylov basis is kept orthonormal by full
    reorthogonalization (classical Gram-Schmidt, repeated when one pass loses most of the vector) and
    stored in the operator's dtype and device, allocated in blocks of 8 vectors as it grows (one
    vector of size ``n`` per iteration). The tridiagonal eigenproblem is solved in float64.
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
    exhausted: for top-k problems with exact multiplicities use `power_iteration` (deflation).

    Args:
        op: the symmetric operator, size ``n``.
        k: number of eigenpairs.
        tol: relative tolerance of the Ritz residual estimates.
        max_iter: Krylov dimension limit, at least ``k``; default ``min(n, max(300, 2 k + 20))``
            (capped at ``n`` in any case).
        v0: ``(n,)`` start vector (projected); random by default.
        generator: random source for the start vector and restarts.
        progress: show a progress bar (``None``: only on a terminal).
        residuals: ``"estimate"`` reports the Ritz residual estimates ``|beta_m s_{m,i}|`` (relative),
            which with a reorthogonalized basis equal the true residuals up to rounding of order
            ``eps ||A||``; ``"true"`` spends one more ``op.matmat`` of the ``k`` vectors (counted in
            ``n_matvec``) to compute ``||A v - theta v||`` directly.

    Returns:
        ``EigenResult`` with ``eigenvalues`` ``(k,)`` float64 descending, unit ``eigenvectors``
            ``(k, n)`` in the operator's dtype, relative ``residuals`` (see ``residuals``), one history
            record per iteration and, in ``info``, the final Krylov dimension, the number of restarts
            and which residuals were reported.

    Raises:
        ValueError: bad ``k``/``max_iter``, a ``v0`` with no component in the subspace, or ``k``
            larger than the dimension of the subspace the operator lives on.
    """
    started = time.perf_counter()
    n = op.size
    _check_k(k, n)
    if residuals not in RESIDUALS:
        raise ValueError(f"residuals must be one of {', '.join(RESIDUALS)}, got {residuals!r}")
    if max_iter is None:
        max_iter = max(300, 2 * k + 20)
    if max_iter < k:
        raise ValueError(f"max_iter={max_iter} is smaller than k={k}; Lanczos needs at least k iterations")
    max_iter = min(int(max_iter), n)
    matvecs_before = op.n_matvec

    if v0 is None:
        q = _fresh_direction(op, KrylovBasis(n, op.dtype, op.device), generator)
        if q is None:
            raise ValueError("the operator's subspace is {0}: project() maps a random vector to zero")
    else:
        q = op.project(_as_vector(v0, op))
        norm = float(torch.linalg.vector_norm(q))
        if norm == 0.0:
            raise ValueError("v0 has no component in the operator's subspace; pass another v0 or none")
        q = q / norm

    basis = KrylovBasis(n, op.dtype, op.device)
    basis.append(q)
    m = 1
    alphas: list[float] = []
    betas: list[float] = []  # betas[j] couples basis[j] and basis[j + 1]
    history: list[dict] = []
    converged = False
    restarts = 0

    with progress_bar(max_iter, "lanczos", progress) as bar:
        while True:
            w, alpha, beta = lanczos_step(op, basis, betas[-1] if m > 1 else 0.0)
            alphas.append(alpha)

            theta, s, anorm = _top_ritz(alphas, betas, k)
            estimates = beta * np.abs(s[-1])
            relative = estimates / _residual_scale(theta, anorm, op.dtype)
            worst = float(relative.max())
            history.append({"iteration": m, "eigenvalues": theta.tolist(), "residual": worst})
            bar.update(1)
            bar.set_postfix(residual=f"{worst:.1e}", refresh=False)

            if op.comm.agree(m >= k and worst <= tol):
                converged = True
                break
            if m == max_iter:
                break
            if beta == 0.0:
                # Fewer than k exact Ritz values so far: continue in a fresh direction.
                nxt = _fresh_direction(op, basis, generator)
                if nxt is None:
                    raise ValueError(
                        f"k={k} eigenpairs were asked but the operator's subspace has dimension {m}; "
                        f"ask for at most {m}"
                    )
                restarts += 1
                basis.append(nxt)
            else:
                basis.append(w)
            betas.append(beta)
            m += 1

    vectors = _canonical_signs(
        basis.combine(torch.as_tensor(s.copy(), dtype=op.dtype, device=op.device)), normalize=True
    )
    values = torch.from_numpy(theta)
    if residuals == "true":
        values, relative = _true_residuals(op, vectors, values)
    else:
        relative = torch.from_numpy(relative)
    return EigenResult(
        eigenvalues=values,
        eigenvectors=vectors,
        residuals=relative,
        n_matvec=op.n_matvec - matvecs_before,
        iterations=m,
        converged=converged,
        history=history,
        method="lanczos",
        tol=tol,
        seconds=time.perf_counter() - started,
        info={"krylov_dimension": m, "restarts": restarts, "residuals": residuals},
    )
