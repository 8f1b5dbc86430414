"""Power iteration with deflation for the top eigenpairs, negative-dominant spectra included.

The Riemannian power method of the scale-invariant flatness paper (Algorithm 1: apply, normalize,
stop on relative change) made to return the largest *algebraic* eigenvalues: the iterate is kept
orthogonal to the pairs already found (projection deflation), and when the dominant eigenvalue left
is negative the run is repeated on ``A - theta I``, whose dominant eigenvalue is the largest one.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from sharpness._progress import progress_bar
from sharpness._results import EigenResult
from sharpness.products._operator import SymmetricOperator
from sharpness.solvers._vectors import (
    _breakdown_threshold,
    _canonical_signs,
    _check_k,
    _orthogonalize,
    _reprojected,
    _start_vector,
    _true_residuals,
)


def _run(
    apply: Callable[[Tensor, float], Tensor],
    agree: Callable[[bool], bool],
    x: Tensor,
    shift: float,
    tol: float,
    vector_tol: float | None,
    max_iter: int,
    eps: float,
    history: list[dict],
    found_values: list[float],
    bar: tqdm,
) -> tuple[Tensor, bool]:
    """Power iteration on ``apply(., shift)`` (the deflated ``A - shift I``) from the unit vector ``x``.

    Args:
        agree: the operator's [`agree`][sharpness.Communicator.agree] (every process that
            applies the operator stops where process 0 does).
        eps: rounding unit of the operator's dtype.

    Returns:
        The last unit iterate ``(n,)`` and whether the stopping rule was met within ``max_iter``.
    """
    theta_prev = None
    # Below this, an eigenvalue estimate is zero to rounding (relative to the shift, if any).
    floor = max(eps * abs(shift), np.finfo(np.float64).tiny)
    for _ in range(max_iter):
        y = apply(x, shift)
        rho = float(torch.dot(x, y))
        theta = rho + shift
        y_norm = float(torch.linalg.vector_norm(y))
        scale = max(abs(theta), floor)
        change = abs(theta - theta_prev) / scale if theta_prev is not None else float("inf")
        history.append(
            {
                "iteration": len(history) + 1,
                "eigenvalues": [*found_values, theta],
                "residual": float(torch.linalg.vector_norm(y - rho * x)) / scale,
                "change": change,
            }
        )
        bar.update(1)
        bar.set_postfix(change=f"{change:.1e}", refresh=False)
        if agree(y_norm <= _breakdown_threshold(x.dtype, 1) * abs(shift)):
            # x is in the kernel of the iterated operator (to rounding), which a random start only
            # meets when it vanishes on the whole complement: x is an eigenvector with eigenvalue shift.
            return x, True
        x_next = y / y_norm
        if vector_tol is None:
            done = change < tol
        else:
            # Sign-aligned: a negative dominant eigenvalue flips the iterate every step.
            step = min(
                float(torch.linalg.vector_norm(x_next - x)), float(torch.linalg.vector_norm(x_next + x))
            )
            done = step < vector_tol
        x = x_next
        theta_prev = theta
        if agree(done):
            return x, True
    return x, False


def power_iteration(
    op: SymmetricOperator,
    k: int = 1,
    tol: float = 1e-6,
    max_iter: int = 1000,
    vector_tol: float | None = None,
    v0: Tensor | None = None,
    generator: torch.Generator | None = None,
    progress: bool | None = None,
) -> EigenResult:
    """The ``k`` largest algebraic eigenpairs of a symmetric operator by deflated power iteration.

    Pairs are found one after the other. Each power run iterates ``x <- B x / ||B x||`` with
    ``B = D P A P D`` (``P`` = ``op.project``, ``D`` = projection orthogonal to the pairs already
    found), so repeated eigenvalues are found once per copy. When the dominant eigenvalue ``theta`` of
    ``B`` comes out negative, a second run iterates ``B - theta I`` on the same complement, whose
    dominant eigenvalue is ``lambda_max - theta``. The most negative eigenvalue stays in every later
    complement, so later pairs iterate the shifted operator directly. ``info["shifts"]`` records the
    shift used for each pair (``None``: no shift).

    Stopping rule of each run: the relative change of the Rayleigh quotient ``theta_t = x_t^T A x_t``
    between consecutive iterations, ``|theta_t - theta_{t-1}| / |theta_t|``, is below ``tol``; or, when
    ``vector_tol`` is given, the sign-aligned change of the unit iterate,
    ``min(||x_{t+1} - x_t||, ||x_{t+1} + x_t||)``, is below ``vector_tol``. The Rayleigh quotient
    converges twice as fast (in digits) as the vector, so ``tol`` reaches a given eigenvalue accuracy
    in about half the iterations ``vector_tol`` needs for the same number on the vector. Both rules
    only watch progress: slow convergence (close eigenvalues) can meet them early, which the true
    ``residuals`` of the result then show.

    Args:
        op: the symmetric operator, size ``n``.
        k: number of eigenpairs.
        tol: relative Rayleigh-quotient change that ends a run.
        max_iter: iteration limit of each run (each pair, and again for its shifted run if any).
        vector_tol: when given, stop on the change of the unit vector instead.
        v0: ``(n,)`` start vector of the first pair (projected); random otherwise.
        generator: random source for start vectors.
        progress: show a progress bar (``None``: only on a terminal).

    Returns:
        ``EigenResult`` with ``eigenvalues`` ``(k,)`` float64 descending (Rayleigh quotients of the
            returned vectors), unit ``eigenvectors`` ``(k, n)`` in the operator's dtype, true relative
            ``residuals`` from one final ``op.matmat`` (counted in ``n_matvec``), one history record per
            iteration (``residual``: relative residual of the iterate, ``change``: the Rayleigh-quotient
            change), ``converged`` when every run met its rule, and ``info["shifts"]``.

    Raises:
        ValueError: bad ``k``/``max_iter``/``v0``, or ``k`` larger than the dimension of the subspace
            the operator lives on.
    """
    started = time.perf_counter()
    _check_k(k, op.size)
    if max_iter < 1:
        raise ValueError(f"max_iter must be at least 1, got {max_iter}")
    matvecs_before = op.n_matvec
    eps = torch.finfo(op.dtype).eps
    found = torch.empty(0, op.size, dtype=op.dtype, device=op.device)
    found_values: list[float] = []
    shifts: list[float | None] = []
    history: list[dict] = []
    converged = True
    shift = 0.0

    steps = itertools.count()

    def apply(x: Tensor, shift: float) -> Tensor:
        y = op.matvec(x, in_subspace=True)  # x is a projected start vector or a projected product
        if shift != 0.0:
            y = y - shift * x
        # Project and deflate after shifting: excluded and found directions have eigenvalue -shift in
        # A - shift I, which would otherwise amplify any rounding that leaks into them.
        y, _ = _orthogonalize(_reprojected(op, y, next(steps)), found)
        return y

    with progress_bar(None, "power", progress) as bar:
        for i in range(k):
            bar.set_description(f"power {i + 1}/{k}")
            start = v0 if i == 0 else None
            x = _start_vector(op, found, start, generator)
            ok = True
            if shift == 0.0:
                x, ok = _run(apply, op.comm.agree, x, 0.0, tol, vector_tol, max_iter, eps, history, found_values, bar)
                if history[-1]["eigenvalues"][-1] < 0.0:
                    shift = history[-1]["eigenvalues"][-1]
                    x = _start_vector(op, found, start, generator)
            if shift != 0.0:
                x, ok_shifted = _run(
                    apply, op.comm.agree, x, shift, tol, vector_tol, max_iter, eps, history, found_values, bar
                )
                ok = ok and ok_shifted
            converged = converged and ok
            # Keep the new vector exactly orthogonal to the found ones before it deflates the next runs.
            x, _ = _orthogonalize(x, found)
            x = x / torch.linalg.vector_norm(x)
            found = torch.cat([found, x[None]])
            found_values.append(history[-1]["eigenvalues"][-1])
            shifts.append(shift if shift != 0.0 else None)

    values, residuals = _true_residuals(op, found)
    order = torch.argsort(values, descending=True)
    return EigenResult(
        eigenvalues=values[order],
        eigenvectors=_canonical_signs(found[order.to(found.device)]),
        residuals=residuals[order],
        n_matvec=op.n_matvec - matvecs_before,
        iterations=len(history),
        converged=converged,
        history=history,
        method="power",
        tol=tol,
        seconds=time.perf_counter() - started,
        info={
            "shifts": [shifts[j] for j in order.tolist()],
            "stopping_rule": "rayleigh_quotient" if vector_tol is None else "vector",
            "vector_tol": vector_tol,
        },
    )
