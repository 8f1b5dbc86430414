"""One entry point for every sharpness measure registered in :data:`sharpness._invariant.METRICS`."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from sharpness._euclidean import euclidean_sharpness
from sharpness._invariant import MEASURE_FUNCTIONS, METRICS, invariant_sharpness
from sharpness._results import EigenResult

# Options that only quotient-type measures read; the Euclidean Hessian does not depend on them.
_QUOTIENT_ONLY_OPTIONS = ("structure", "zero_blocks")


def check_metric(metric: str) -> None:
    """Raise ``ValueError`` unless ``metric`` is registered and has a measure function."""
    if metric not in METRICS:
        raise ValueError(f"unknown sharpness metric {metric!r}; choose one of {', '.join(METRICS)}")
    if metric != "euclidean" and metric not in MEASURE_FUNCTIONS:
        raise ValueError(
            f"metric {metric!r} is listed in METRICS but has no entry in MEASURE_FUNCTIONS; "
            "register its measure function there"
        )


def measure_sharpness(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    data: object,
    metric: str,
    **kwargs,
) -> EigenResult:
    """Top Hessian eigenvalues of the loss under any registered metric, by name.

    ``"euclidean"`` goes to :func:`euclidean_sharpness`, every other name in ``METRICS`` to
    :func:`invariant_sharpness` (which dispatches through ``MEASURE_FUNCTIONS``), so metrics
    registered later are measured here without changes.

    Args:
        model, loss_fn, data: as for :class:`Objective`.
        metric: a key of :data:`METRICS`, e.g. ``"euclidean"``, ``"layer"`` or ``"node"``.
        **kwargs: solver and evaluation options shared by the measures (``k``, ``method``, ``tol``,
            ``max_iter``, ``chunk_size``, ``dtype``, ``device``, ``hvp``, ``seed``, ``progress``,
            ``objective``) and the quotient options ``structure`` and ``zero_blocks``, which the
            Euclidean measure ignores (its Hessian does not depend on them).

    Returns:
        The measure's :class:`EigenResult`; ``info["metric"]`` names the metric.

    Raises:
        ValueError: ``metric`` is not registered.
    """
    check_metric(metric)
    if metric == "euclidean":
        options = {key: value for key, value in kwargs.items() if key not in _QUOTIENT_ONLY_OPTIONS}
        return euclidean_sharpness(model, loss_fn, data, **options)
    return invariant_sharpness(model, loss_fn, data, metric, **kwargs)
