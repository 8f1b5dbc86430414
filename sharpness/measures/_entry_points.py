"""The public entry points of the measures: any measure by name or object, and the invariant ones."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from sharpness._results import EigenResult
from sharpness.measures._measure import Measure
from sharpness.measures._registry import get_measure
from sharpness.products._objective import Objective, build_objective
from sharpness.solvers._solve import Solver


def measure_sharpness(
    model: nn.Module | None,
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None,
    data: object,
    measure: str | Measure,
    k: int = 1,
    *,
    solver: Solver | None = None,
    dtype: torch.dtype | None = None,
    objective: Objective | None = None,
    progress: bool | None = None,
) -> EigenResult:
    """Top ``k`` eigenvalues of the curvature operator of any measure, by name or object.

    The same as ``get_measure(measure).sharpness(objective, k, solver, progress)``.

    Args:
        model: as for [`Objective`][sharpness.Objective] (not used when ``objective`` is given).
        loss_fn: as for [`Objective`][sharpness.Objective] (not used when ``objective`` is given).
        data: as for [`Objective`][sharpness.Objective] (not used when ``objective`` is given).
        measure: a key of [`MEASURES`][sharpness.MEASURES] (``"euclidean"``, ``"layer"``, ``"node"``, ``"fixed"``,
            ``"minnorm"``, ``"gspace"``) or a `Measure` with its options (e.g. ``Layer("exclude")``).
        k: number of eigenpairs.
        solver: eigen-solver settings (default ``Solver()``).
        dtype: evaluation dtype (``None``: the model's).
        objective: an existing objective instead of a new one.
        progress: show a progress bar (``None``: only on a terminal).

    Returns:
        The measure's [`EigenResult`][sharpness.EigenResult]; ``info["metric"]`` names the measure.

    Raises:
        ValueError: an unknown measure name.
        UnsupportedModelError: an invariant measure on a model whose hidden units cannot be rescaled.
    """
    objective = build_objective(model, loss_fn, data, objective, dtype=dtype)
    return get_measure(measure).sharpness(objective, k, solver, progress)


def invariant_sharpness(
    model: nn.Module | None,
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None,
    data: object,
    metric: str | Measure = "node",
    k: int = 1,
    *,
    solver: Solver | None = None,
    dtype: torch.dtype | None = None,
    objective: Objective | None = None,
    progress: bool | None = None,
) -> EigenResult:
    """Largest ``k`` eigenvalues of a rescaling-invariant curvature operator (default: the node-wise one).

    ``metric="node"``: the node-wise quotient (``g = sum xi_k^2 / w_k^2``), invariant under every
    positive rescaling of hidden units or channels (and so under layer-wise rescaling).
    ``metric="layer"``: the layer-wise quotient of Rangamani et al., invariant under layer-wise
    rescaling only; a node-wise rescaling changes it (see [`verify_invariance`][sharpness.verify_invariance]).
    Both use the exact Levi-Civita Hessian, so values are right away from critical points too.
    ``"minnorm"``, ``"fixed"`` and ``"gspace"`` are invariant through a canonical representative or
    invariant coordinates (see [`MEASURES`][sharpness.MEASURES]).

    ``Solver(method="power")`` is the Riemannian power method (Rangamani et al., Algorithm 1) on horizontal
    vectors; ``"lanczos"`` (default) needs far fewer Hessian-vector products, and ``"low-memory-lanczos"``
    trades twice the products for a memory of three parameter vectors.

    Args:
        model: as for `Objective`. Any differentiable model: the measure's rescaling
            group is found on its fx graph (residual connections, BatchNorm, concatenation, weight sharing).
        loss_fn: as for `Objective`.
        data: as for `Objective`.
        metric: a measure name or object that claims some invariance (not ``"euclidean"``).
        k: as for [`measure_sharpness`][sharpness.measure_sharpness].
        solver: as for [`measure_sharpness`][sharpness.measure_sharpness].
        dtype: as for [`measure_sharpness`][sharpness.measure_sharpness].
        objective: as for [`measure_sharpness`][sharpness.measure_sharpness].
        progress: as for [`measure_sharpness`][sharpness.measure_sharpness].

    Returns:
        `EigenResult` whose ``.value`` is the invariant sharpness. For the quotient metrics it is
            dimensionless (loss units per squared relative change of the weights), eigenvectors are
            unit-``g``-norm horizontal tangent vectors (``coordinates="tangent"``), and ``info`` holds
            ``metric``, ``loss``, ``n_params``, ``n_samples``, ``riemannian_grad_norm`` (0 at a critical point)
            and ``hvp_strategy``.

    Raises:
        ValueError: an unknown or a non-invariant measure.
    """
    measure = get_measure(metric)
    if not measure.invariant_under:
        raise ValueError(
            f"the {measure.name!r} measure is not invariant under any rescaling; use euclidean_sharpness or "
            "measure_sharpness for it"
        )
    objective = build_objective(model, loss_fn, data, objective, dtype=dtype)
    return measure.sharpness(objective, k, solver, progress)
