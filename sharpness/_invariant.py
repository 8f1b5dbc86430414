"""Scale-invariant sharpness: top eigenvalues of the Riemannian Hessian on a quotient manifold."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from manifolds import LayerScaleQuotient, NetworkStructure, NodeScaleQuotient, analyze
from sharpness._fixed_sharpness import fixed_sharpness
from sharpness._gauged import minnorm_sharpness
from sharpness._gspace_sharpness import gspace_sharpness
from sharpness._hessian import HessianOperator
from sharpness._objective import Objective
from sharpness._operator import CallableOperator
from sharpness._results import EigenResult
from sharpness._solve import SolveSettings

QUOTIENT_METRICS = {"layer": LayerScaleQuotient, "node": NodeScaleQuotient}


@dataclass(frozen=True)
class MetricSpec:
    """What a sharpness measure is and which rescalings (``"node"``, ``"layer"``) leave it unchanged."""

    name: str
    description: str
    invariant_under: tuple[str, ...]


METRICS: dict[str, MetricSpec] = {
    spec.name: spec
    for spec in (
        MetricSpec("euclidean", "top eigenvalue of the Euclidean Hessian (not rescaling-invariant)", ()),
        MetricSpec(
            "layer",
            "layer-wise quotient metric (Rangamani et al.): invariant under layer-wise rescaling only",
            ("layer",),
        ),
        MetricSpec(
            "node",
            "node-wise quotient metric: invariant under node-, channel- and layer-wise rescaling",
            ("node", "layer"),
        ),
        MetricSpec(
            "fixed",
            "Hessian restricted to the free weights at the representative whose fixed weights (one outgoing "
            "weight per hidden unit, diagonal selection) are all +-1: invariant under node-, channel- and "
            "layer-wise rescaling",
            ("node", "layer"),
        ),
        MetricSpec(
            "minnorm",
            "Euclidean Hessian at the minimum-l2-norm gauge (canonical representative): invariant under "
            "node-, channel- and layer-wise rescaling",
            ("node", "layer"),
        ),
        MetricSpec(
            "gspace",
            "Hessian of L(w(v)) in G-space (basis-path values): invariant under node- and layer-wise rescaling, "
            "but coordinate-dependent (it changes with the skeleton), unlike the metric measures",
            ("node", "layer"),
        ),
    )
}


def build_quotient(
    objective: Objective, metric: str, structure: NetworkStructure | None = None, zero_blocks: str = "error"
) -> LayerScaleQuotient | NodeScaleQuotient:
    """The quotient geometry ``metric`` (``"layer"`` or ``"node"``) at ``objective.params``."""
    if metric not in QUOTIENT_METRICS:
        raise ValueError(f"unknown quotient metric {metric!r}; choose one of {', '.join(QUOTIENT_METRICS)}")
    structure = structure or analyze(objective.model)
    if metric == "layer":
        return LayerScaleQuotient(objective.params, structure, objective.layout, zero_blocks=zero_blocks)
    return NodeScaleQuotient(objective.params, structure, objective.layout)


def riemannian_hessian_operator(
    objective: Objective, quotient: LayerScaleQuotient | NodeScaleQuotient, hvp: str = "auto"
) -> tuple[CallableOperator, Tensor]:
    """The whitened Riemannian Hessian as a symmetric operator restricted to the horizontal space.

    Returns:
        ``(operator, egrad)``: the operator on whitened ``(n,)`` vectors (its ``project`` is the
        horizontal projection) and the Euclidean gradient it was built with.
    """
    hessian = HessianOperator(objective, hvp)
    egrad = objective.gradient()
    apply: Callable[[Tensor], Tensor] = quotient.whitened_hessian(egrad, hessian.matvec)
    op = CallableOperator(
        apply, objective.layout.size, objective.dtype, objective.device, project=quotient.whitened_projection
    )
    op.strategy = hessian.strategy
    return op, egrad


def quotient_sharpness(
    obj: Objective, metric: str, settings: SolveSettings, structure: NetworkStructure | None, zero_blocks: str
) -> EigenResult:
    """Top eigenpairs of the Riemannian Hessian on the ``"layer"`` or ``"node"`` quotient."""
    quotient = build_quotient(obj, metric, structure, zero_blocks)
    op, egrad = riemannian_hessian_operator(obj, quotient, settings.hvp)
    result = settings.solve(op)
    return result.replace(
        eigenvectors=quotient.unwhiten(result.eigenvectors),
        coordinates="tangent",
        info={
            **result.info,
            "riemannian_grad_norm": float(quotient.norm(quotient.egrad2rgrad(egrad))),
            "hvp_strategy": op.strategy,
        },
    )


# metric name -> function(objective, metric, settings, structure, zero_blocks) -> EigenResult
MEASURE_FUNCTIONS: dict[str, Callable[..., EigenResult]] = {
    "layer": quotient_sharpness,
    "node": quotient_sharpness,
    "minnorm": minnorm_sharpness,
    "fixed": fixed_sharpness,
    "gspace": gspace_sharpness,
}


def invariant_sharpness(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    data: object,
    metric: str = "node",
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
    structure: NetworkStructure | None = None,
    zero_blocks: str = "error",
) -> EigenResult:
    """Largest ``k`` eigenvalues of the Riemannian Hessian of the loss on a rescaling quotient.

    ``metric="node"``: the node-wise quotient (``g = sum xi_k^2 / w_k^2``), invariant under every
    positive rescaling of hidden units or channels (and so under layer-wise rescaling).
    ``metric="layer"``: the layer-wise quotient of Rangamani et al., invariant under layer-wise
    rescaling only; a node-wise rescaling changes it (see :func:`verify_invariance`).
    Both use the exact Levi-Civita Hessian, so values are right away from critical points too.

    ``method="power"`` is the Riemannian power method (Rangamani et al., Algorithm 1) on horizontal
    vectors, returning the largest algebraic eigenvalue; ``"lanczos"`` (default) needs far fewer
    Hessian-vector products, and ``"low-memory-lanczos"`` trades twice the products for a memory of
    three parameter vectors.

    Args:
        model, loss_fn, data: as for :class:`Objective`. The model must be a chain of Linear/Conv2d
            layers with positively homogeneous operations between them; anything else is refused
            (:class:`manifolds.UnsupportedModelError`) because the measure would not be invariant.
        metric: ``"node"`` or ``"layer"``.
        k, method, tol, max_iter, chunk_size, dtype, device, hvp, seed, progress, objective: as for
            :func:`euclidean_sharpness`.
        structure: a precomputed :func:`manifolds.analyze` result.
        zero_blocks: layer-wise metric only: ``"error"`` or ``"exclude"`` for zero-norm tensors.

    Returns:
        :class:`EigenResult` whose ``.value`` is the invariant sharpness (dimensionless: loss units
        per squared relative change of the weights), eigenvectors are unit-``g``-norm horizontal
        tangent vectors (``coordinates="tangent"``), and ``info`` holds ``metric``, ``loss``,
        ``n_params``, ``n_samples``, ``riemannian_grad_norm`` (0 at a critical point) and
        ``hvp_strategy``.
    """
    if metric not in MEASURE_FUNCTIONS:
        raise ValueError(
            f"unknown invariant metric {metric!r}; choose one of {', '.join(MEASURE_FUNCTIONS)} "
            "(or use euclidean_sharpness for the Euclidean Hessian)"
        )
    obj = objective or Objective(model, loss_fn, data, chunk_size=chunk_size, dtype=dtype, device=device)
    settings = SolveSettings(k, method, tol, max_iter, hvp, seed, progress)
    start = time.perf_counter()
    result = MEASURE_FUNCTIONS[metric](obj, metric, settings, structure, zero_blocks)
    return result.replace(
        layout=obj.layout,
        seconds=time.perf_counter() - start,
        info={
            **result.info,
            "metric": metric,
            "loss": float(obj.value()),
            "n_params": obj.layout.size,
            "n_samples": obj.n_samples,
        },
    )
