"""Euclidean sharpness: the top eigenvalues of the Hessian of the whole-data-set loss."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from sharpness._hessian import HessianOperator
from sharpness._objective import Objective
from sharpness._results import EigenResult
from sharpness._solve import SolveSettings


def euclidean_sharpness(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    data: object,
    k: int = 1,
    method: str = "lanczos",
    tol: float = 1e-6,
    *,
    max_iter: int | None = None,
    chunk_size: int | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    hvp: str = "auto",
    seed: int = 0,
    progress: bool | None = None,
    objective: Objective | None = None,
) -> EigenResult:
    """Largest ``k`` eigenvalues of the Euclidean Hessian of the loss over the whole data set.

    Not invariant under rescalings of a ReLU network (Dinh et al. 2017): see
    :func:`invariant_sharpness` for measures that are.

    Args:
        model, loss_fn, data: as for :class:`Objective` (``data``: ``(X, y)``, a DataLoader or an
            iterable of batches).
        k: number of eigenpairs.
        method: ``"lanczos"`` (default; keeps its Krylov basis, one parameter vector per iteration),
            ``"low-memory-lanczos"`` (three parameter vectors whatever the iteration count, about twice
            the Hessian-vector products; see :func:`low_memory_lanczos`) or ``"power"`` (deflated power
            iteration).
        tol: relative residual tolerance (Lanczos) or relative change of the Rayleigh quotient (power).
        max_iter: solver iteration cap (solver default if ``None``).
        chunk_size, dtype, device: evaluation settings of the objective.
        hvp: Hessian-vector product strategy (see :meth:`Objective.hvp`).
        seed: seed of the random start vector.
        progress: show a progress bar (``None``: only on a terminal).
        objective: reuse an existing objective instead of building one.

    Returns:
        :class:`EigenResult` with ``.value`` the largest eigenvalue (units of the loss per squared
        parameter unit), eigenvectors mappable to parameters with ``.parameter_vectors()``, and
        ``info`` holding ``loss``, ``n_params``, ``n_samples``, ``hvp_strategy`` and ``metric``.
    """
    obj = objective or Objective(model, loss_fn, data, chunk_size=chunk_size, dtype=dtype, device=device)
    start = time.perf_counter()
    op = HessianOperator(obj, hvp)
    result = SolveSettings(k, method, tol, max_iter, hvp, seed, progress).solve(op)
    return result.replace(
        layout=obj.layout,
        seconds=time.perf_counter() - start,
        info={**result.info, **euclidean_info(obj, op)},
    )


def euclidean_info(obj: Objective, op: HessianOperator) -> dict:
    """What every Euclidean-Hessian result records about its objective and products."""
    return {
        "metric": "euclidean",
        "loss": float(obj.value()),
        "n_params": obj.layout.size,
        "n_samples": obj.n_samples,
        "hvp_strategy": op.strategy,
    }
