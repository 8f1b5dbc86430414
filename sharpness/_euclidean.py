"""Euclidean sharpness: the top eigenvalues of the Hessian of the whole-data-set loss."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from sharpness._data_span import data_span_hessian
from sharpness._hessian import HessianOperator
from sharpness._objective import Objective
from sharpness._results import EigenResult
from sharpness._solve import SolveSettings

# Eigenvectors found in data-span coordinates are mapped back through H v, so their eigenvalues must stand
# this many rounding units (of the largest one) above zero.
_NONZERO_ULPS = 100.0


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
    data_span: bool | None = None,
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
        data_span: solve with the first ``Linear`` layer's weight in coordinates of the span of its inputs
            (exact, and cheaper when there are fewer samples than input features: see
            :mod:`sharpness._data_span`); ``None`` where that applies, ``True`` requires it, ``False`` never.

    Returns:
        :class:`EigenResult` with ``.value`` the largest eigenvalue (units of the loss per squared
        parameter unit), eigenvectors mappable to parameters with ``.parameter_vectors()``, and
        ``info`` holding ``loss``, ``n_params``, ``n_samples``, ``hvp_strategy``, ``metric`` and ``data_span``.
    """
    obj = objective or Objective(model, loss_fn, data, chunk_size=chunk_size, dtype=dtype, device=device)
    start = time.perf_counter()
    result = solve_euclidean(obj, SolveSettings(k, method, tol, max_iter, hvp, seed, progress), data_span)
    return result.replace(
        layout=obj.layout, seconds=time.perf_counter() - start, info={**result.info, **euclidean_info(obj)}
    )


def solve_euclidean(objective: Objective, settings: SolveSettings, data_span: bool | None = None) -> EigenResult:
    """Top eigenpairs of the Hessian of ``objective`` under ``settings``, with the first layer in data-span
    coordinates where they apply (``data_span=None``; ``True`` raises where they do not, ``False`` never uses
    them; see :mod:`sharpness._data_span`); ``info`` gains ``hvp_strategy`` and ``data_span`` (the samples and
    input features of the data-span coordinates the pairs were found in, or ``None``).

    In data-span coordinates the Hessian's exact null space outside the span is left out, so when one of the
    ``k`` eigenvalues found there is not positive (zeros from outside the span may rank above it), or ``k``
    exceeds the span operator's size, the pairs are solved in full coordinates, whatever ``data_span`` says;
    ``n_matvec`` counts both solves and the products that map the eigenvectors back. The residuals and history
    reported are those of the solve that found the pairs: in data-span coordinates, of ``u``, while the
    eigenvector returned is ``H v / lambda`` normalized (``v`` the parameters ``u`` stands for), whose residual
    is of the same order.
    """
    op = HessianOperator(objective, settings.hvp)
    span = None if data_span is False else data_span_hessian(op)
    if span is None and data_span:
        raise ValueError(
            "data-span coordinates need R-operator products with the chunk states in memory, a first Linear "
            "layer and fewer samples than its input features, by enough to pay for their set-up; pass "
            "data_span=None or False"
        )
    spent = 0
    if span is not None and settings.k <= span.size:
        result = settings.solve(span)
        values = result.eigenvalues
        if float(values.min()) > _NONZERO_ULPS * torch.finfo(span.dtype).eps * float(values.abs().max()):
            return result.replace(
                eigenvectors=span.lift(result.eigenvectors),
                n_matvec=result.n_matvec + result.k,
                info={**result.info, "hvp_strategy": op.strategy, "data_span": span.info()},
            )
        spent = result.n_matvec
    result = settings.solve(op)
    return result.replace(
        n_matvec=result.n_matvec + spent, info={**result.info, "hvp_strategy": op.strategy, "data_span": None}
    )


def euclidean_info(obj: Objective) -> dict:
    """What every Euclidean-Hessian result records about its objective."""
    return {"metric": "euclidean", "loss": float(obj.value()), "n_params": obj.layout.size, "n_samples": obj.n_samples}
