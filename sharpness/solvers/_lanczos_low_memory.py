"""Lanczos without a stored Krylov basis: a few parameter-sized vectors of memory, whatever the number of
iterations (two passes per eigenpair, deflation between pairs)."""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import Tensor

from sharpness._progress import progress_bar
from sharpness._results import EigenResult
from sharpness.products._operator import SymmetricOperator
from sharpness.solvers._lanczos import _top_ritz
from sharpness.solvers._vectors import (
    KrylovBasis,
    _breakdown_threshold,
    _canonical_signs,
    _check_k,
    _near_zero,
    _orthogonalize,
    _reprojected,
    _residual_scale,
    _start_vector,
)

# Restarts of a pair's first pass from its own Ritz vector when that vector's true residual misses tol.
_MAX_RESTARTS = 3


class _Recurrence:
    """The three-term Lanczos step of ``B = D P A P D`` (``P`` = ``op.project``, ``D`` = projection
    orthogonal to the rows of ``found``) on two vectors: the current one and the previous one, whose
    storage receives the next product ([`SymmetricOperator.matvec_add`][sharpness.SymmetricOperator.matvec_add])."""

    def __init__(self, op: SymmetricOperator, found: KrylovBasis):
        self.op, self.found = op, found

    def step(self, q: Tensor, previous: Tensor | None, beta_prev: float, alpha: float | None,
             index: int, project: bool = False) -> tuple[Tensor, float]:  # fmt: skip
        """``w = B q - alpha q - beta_prev previous``, unnormalized, consuming ``previous``.

        ``alpha=None`` computes it (``q^T B q``, with one local re-orthogonalization against ``q``);
        a given ``alpha`` replays a step of the first pass. ``index``: the step's position in its pass, and
        ``project``: re-project this product whatever the operator claims (the replay re-projects where the first
        pass did).

        Returns:
            ``(w, alpha)``.
        """
        start = torch.zeros_like(q) if previous is None else previous.mul_(-beta_prev)
        w = self.op.matvec_add(q, start, in_subspace=True)  # q and previous are combinations of projected vectors
        if alpha is None:
            alpha = float(torch.dot(q, w))
            w.sub_(q, alpha=alpha)
            # One more pass against q: the subtraction above cancels most of w when q is nearly an eigenvector.
            correction = float(torch.dot(q, w))
            w.sub_(q, alpha=correction)
            alpha += correction
        else:
            w.sub_(q, alpha=alpha)
        # Project and deflate last, so the rounding the subtractions leave along excluded and found
        # directions is removed every step instead of growing with the recurrence.
        w = _reprojected(self.op, w, index, always=project)
        if self.found.size:
            w, _ = _orthogonalize(w, self.found, overwrite=True)
        return w, alpha


def _first_pass(
    rec: _Recurrence,
    q0: Tensor,
    tol: float,
    max_iter: int,
    norm_floor: float,
    history: list[dict],
    found_values: list[float],
    bar,
    projected: list[bool],
) -> tuple[list[float], list[float], float, np.ndarray, bool, float]:
    """Lanczos coefficients until the top Ritz pair of ``B`` meets ``tol``; the vectors are dropped.

    ``norm_floor``: a known lower bound on ``||A||`` (from earlier pairs), so that the residual scale
    ``eps ||A||`` does not collapse once deflation has removed every nonzero eigenvalue. ``projected`` (empty)
    receives, per step, whether its product was re-projected because the top Ritz value was near or below 0
    (`_near_zero`), for the replay.

    Returns:
        ``alphas`` ``(m,)``, ``betas`` ``(m-1,)``, the top Ritz value, its ``T``-eigenvector ``(m,)``,
            whether its estimate met ``tol`` (or the Krylov space became invariant), and ``||T||``.
    """
    op = rec.op
    q, previous, beta = q0.clone(), None, 0.0
    alphas: list[float] = []
    betas: list[float] = []
    theta_now, norm_now = None, norm_floor
    while True:
        projected.append(op.products_in_subspace and _near_zero(theta_now, norm_now))
        w, alpha = rec.step(q, previous, beta, None, len(alphas), projected[-1])
        alphas.append(alpha)
        beta = float(torch.linalg.vector_norm(w))
        theta, s, anorm = _top_ritz(alphas, betas, 1)
        scale_norm = max(anorm, norm_floor)
        theta_now, norm_now = float(theta[0]), scale_norm
        # Breakdown is judged on this Krylov space's own scale: a large eigenvalue deflated earlier must not
        # make a residual of the current pair look like rounding; unless the whole space is rounding next
        # to ||A|| (deflation removed every nonzero eigenvalue).
        threshold = _breakdown_threshold(op.dtype, 2)
        invariant = beta <= threshold * max(anorm, abs(alpha)) or max(beta, anorm) <= threshold * norm_floor
        estimate = 0.0 if invariant else beta * abs(float(s[-1, 0]))
        relative = estimate / float(_residual_scale(theta, scale_norm, op.dtype)[0])
        history.append({"iteration": len(history) + 1, "eigenvalues": [*found_values, float(theta[0])],
                        "residual": relative})  # fmt: skip
        bar.update(1)
        bar.set_postfix(residual=f"{relative:.1e}", refresh=False)
        if op.comm.agree(invariant or relative <= tol or len(alphas) == max_iter):
            return alphas, betas, float(theta[0]), s[:, 0], invariant or relative <= tol, anorm
        betas.append(beta)
        previous, q = q, w.mul_(1.0 / beta)


def _true_residual(op: SymmetricOperator, y: Tensor, theta: float, norm: float) -> float:
    """``||P (A y - theta y)|| / max(|theta|, eps norm)`` for a unit ``y``, with one product (two vectors)."""
    r = _reprojected(op, op.matvec_add(y, y * -theta, in_subspace=True))  # y is projected
    return float(torch.linalg.vector_norm(r)) / float(_residual_scale(np.array([theta]), norm, op.dtype)[0])


def _ritz_vector(rec: _Recurrence, q0: Tensor, alphas: list[float], betas: list[float], s: np.ndarray,
                 projected: list[bool]) -> Tensor:  # fmt: skip
    """``sum_j s_j q_j`` over the Lanczos vectors of the first pass, regenerated with its coefficients
    (``len(alphas) - 1`` more products, re-projected where the first pass did: ``projected``); returned with unit
    norm. Consumes ``q0``'s storage."""
    q, previous = q0, None
    y = q0 * float(s[0])
    for j in range(len(alphas) - 1):
        w, _ = rec.step(q, previous, betas[j - 1] if j else 0.0, alphas[j], j, projected[j])
        previous, q = q, w.mul_(1.0 / betas[j])
        y.add_(q, alpha=float(s[j + 1]))
    del q, previous  # before y is scaled: the peak is three vectors
    return y.div_(torch.linalg.vector_norm(y))


def low_memory_lanczos(
    op: SymmetricOperator,
    k: int = 1,
    tol: float = 1e-6,
    max_iter: int | None = None,
    v0: Tensor | None = None,
    generator: torch.Generator | None = None,
    progress: bool | None = None,
) -> EigenResult:
    """The ``k`` largest algebraic eigenpairs of a symmetric operator by Lanczos without a stored basis.

    For models whose parameters dominate memory (a Krylov basis of ``m`` vectors costs ``m`` parameter
    vectors): apart from the ``k`` vectors it returns, this solver holds three vectors of size ``n``
    (two, plus what the operator's ``matvec_add`` needs, in the first pass) however many iterations it
    runs, against ``m + 2`` for [`lanczos`][sharpness.lanczos]. The price is operator products: about twice as many.

    Pairs are found one after the other, each by two passes over the same Krylov space of
    ``B = D P A P D`` (``P`` = ``op.project``, ``D`` = projection orthogonal to the pairs already
    found, so a repeated eigenvalue is found once per copy):

    1. the three-term recurrence alone (each vector is re-orthogonalized against the current one only)
       runs until the top Ritz value of the tridiagonal ``T`` meets the stopping rule of
       [`lanczos`][sharpness.lanczos]: ``|beta_m s_m| <= tol * max(|theta|, eps ||T||)``. The vectors are not kept.
       Without full reorthogonalization they lose orthogonality once ``theta`` converges and ``T`` then
       gains copies of it ("ghosts", Paige 1976), which leave the top Ritz value itself unchanged. Products an
       operator says are projected already (``products_in_subspace``) are re-projected every 4th step, and every
       step while ``theta`` is not clearly above 0 (at most ``1e-3 ||T||``): directions the projection excludes may
       lie in the operator's kernel (the node measure's do), and their rounding would then surface as a false
       eigenvalue 0 above a negative wanted one;
    2. the same recurrence is replayed from the same start vector with the stored coefficients, to
       sum the Ritz vector ``sum_j s_j q_j`` (``m - 1`` products);
    3. one more product gives the true residual ``||A y - theta y||`` of that vector. When a large
       eigenvalue of the other sign has converged first, the replay can miss the Ritz vector; the
       pair is then restarted from ``y`` (at most 3 times) until the true residual meets ``tol``
       (or ``10 eps ||A|| / |theta|``, the rounding floor of the products).

    Args:
        op: the symmetric operator, size ``n``.
        k: number of eigenpairs.
        tol: relative tolerance of the residual of each pair.
        max_iter: first-pass iteration limit of each pair, at least 1; default 300.
        v0: ``(n,)`` start vector of the first pair (projected); random otherwise.
        generator: random source for start vectors.
        progress: show a progress bar (``None``: only on a terminal).

    Returns:
        ``EigenResult`` with ``eigenvalues`` ``(k,)`` float64 descending (top Ritz values), unit
            ``eigenvectors`` ``(k, n)`` in the operator's dtype, their true relative ``residuals``, one
            history record per first-pass iteration, ``converged`` when every pair met ``tol``, and in
            ``info`` the first-pass Krylov dimension and the number of restarts of each pair.

    Raises:
        ValueError: bad ``k``/``max_iter``, a ``v0`` with no component in the subspace,
            or ``k`` larger than the dimension of the subspace the operator lives on.
    """
    started = time.perf_counter()
    _check_k(k, op.size)
    max_iter = 300 if max_iter is None else int(max_iter)
    if max_iter < 1:
        raise ValueError(f"max_iter must be at least 1, got {max_iter}")
    matvecs_before = op.n_matvec
    found = KrylovBasis(op.size, op.dtype, op.device, block_rows=1)  # one exact-size row per pair
    values: list[float] = []
    true_residuals: list[float] = []
    dimensions: list[int] = []
    restarts: list[int] = []
    history: list[dict] = []
    converged = True
    norm_floor = 0.0  # largest ||T|| so far: a lower bound on ||A||
    eps = torch.finfo(op.dtype).eps

    with progress_bar(None, "low-memory lanczos", progress) as bar:
        for i in range(k):
            bar.set_description(f"low-memory lanczos {i + 1}/{k}")
            rec = _Recurrence(op, found)
            start = _start_vector(op, found, v0 if i == 0 else None, generator)
            for attempt in range(_MAX_RESTARTS + 1):
                projected: list[bool] = []
                alphas, betas, theta, s, ok, anorm = _first_pass(
                    rec, start, tol, max_iter, norm_floor, history, values, bar, projected
                )
                norm_floor = max(norm_floor, anorm, abs(theta))
                y = _ritz_vector(rec, start, alphas, betas, s, projected)
                start = None  # its storage was consumed by the replay
                # Exactly orthogonal to the pairs found so far before it deflates the next runs.
                y, _ = _orthogonalize(op.project(y), found, overwrite=True)
                y.div_(torch.linalg.vector_norm(y))
                residual = _true_residual(op, y, theta, norm_floor)
                # Once a large eigenvalue of the other sign has converged the vectors are no longer
                # orthogonal and the replayed sum can miss the Ritz vector: a restart from it repairs that.
                accepted = residual <= max(tol, 10 * eps * norm_floor / max(abs(theta), eps * norm_floor))
                if op.comm.agree(accepted or not ok or attempt == _MAX_RESTARTS):
                    break
                start = y
            found.append(y)
            del y
            values.append(theta)
            true_residuals.append(residual)
            dimensions.append(len(alphas))
            restarts.append(attempt)
            converged = converged and ok and accepted

    order = np.argsort(values)[::-1].copy()
    vectors = torch.stack([found[j] for j in order])
    del found, rec  # the recurrence holds the basis too
    vectors = _canonical_signs(vectors)
    return EigenResult(
        eigenvalues=torch.tensor(values, dtype=torch.float64)[order],
        eigenvectors=vectors,
        residuals=torch.tensor(true_residuals, dtype=torch.float64)[order],
        n_matvec=op.n_matvec - matvecs_before,
        iterations=len(history),
        converged=converged,
        history=history,
        method="low-memory-lanczos",
        tol=tol,
        seconds=time.perf_counter() - started,
        info={"krylov_dimensions": [dimensions[j] for j in order], "restarts": [restarts[j] for j in order],
              "residuals": "true"},  # fmt: skip
    )
