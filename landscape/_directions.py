"""Directions in parameter space for lines and planes around a point.

* Random Gaussian directions with filter normalization (Li et al. 2018: each output row of a
  weight matrix / each output filter of a convolution is rescaled to the norm of the matching row /
  filter of the point ``theta``) or layer normalization (each tensor rescaled to the norm of the
  matching tensor of ``theta``, as in the flatness paper's Fig. 2). One-dimensional tensors
  (biases) are zeroed (``bias="zero"``, Li et al.'s default) or kept and normalized as a whole
  (``bias="keep"``).
* The top eigenvectors of the Euclidean Hessian or of the node-wise (or layer-wise) Riemannian
  Hessian, from :mod:`sharpness`.
* The segment from one checkpoint to another (``theta + alpha (theta_1 - theta)``).

Every direction set is a flat ``(k, n)`` tensor in the objective's parameter layout plus a record
of how it was made (seeds, normalization, eigenvalues), saved with the surface.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from manifolds import ParamLayout
from sharpness import Objective, euclidean_sharpness, invariant_sharpness

NORMALIZATIONS = ("filter", "layer", "none")
BIAS_MODES = ("zero", "keep")
EIGEN_METRICS = ("euclidean", "node", "layer")


@dataclass(frozen=True)
class Directions:
    """``k`` directions in parameter space and how they were obtained.

    Attributes:
        vectors: ``(k, n)`` flat directions in the parameter layout of the point they belong to.
        kind: ``"random"``, ``"eigen"``, ``"invariant-eigen"`` or ``"segment"``.
        labels: axis label of each direction.
        info: JSON-serialisable record (seeds, normalization, bias handling, eigenvalues ...).
    """

    vectors: Tensor
    kind: str
    labels: tuple[str, ...]
    info: dict = field(default_factory=dict)

    @property
    def k(self) -> int:
        return int(self.vectors.shape[0])

    def to_dict(self) -> dict:
        return {"kind": self.kind, "labels": list(self.labels), "norms": self.vectors.norm(dim=1).tolist(), **self.info}


def normalize_direction(
    direction: Mapping[str, Tensor], theta: Mapping[str, Tensor], norm: str = "filter", bias: str = "zero"
) -> dict[str, Tensor]:
    """Rescale a direction to the scale of ``theta``, tensor by tensor.

    Args:
        direction: ``{name: tensor}`` shaped like ``theta``.
        theta: the point the direction is drawn at.
        norm: ``"filter"``: each slice ``d[i]`` along the first (output) dimension of a tensor with
            two or more dimensions gets the norm of ``theta[i]``; ``"layer"``: each tensor gets the
            norm of the matching tensor of ``theta``; ``"none"``: unchanged.
        bias: one-dimensional tensors (biases): ``"zero"`` sets them to 0, ``"keep"`` keeps them,
            rescaled as a whole to the norm of ``theta``'s tensor (under ``"filter"`` and ``"layer"``).

    Returns:
        A new ``{name: tensor}``; rows or tensors where ``theta`` or ``d`` is zero become zero.
    """
    if norm not in NORMALIZATIONS:
        raise ValueError(f"unknown direction normalization {norm!r}; choose one of {', '.join(NORMALIZATIONS)}")
    if bias not in BIAS_MODES:
        raise ValueError(f"unknown bias handling {bias!r}; choose one of {', '.join(BIAS_MODES)}")
    out = {}
    for name, d in direction.items():
        t = theta[name]
        if d.dim() <= 1 and bias == "zero":
            out[name] = torch.zeros_like(d)
        elif norm == "none":
            out[name] = d.clone()
        elif norm == "filter" and d.dim() >= 2:
            dn = d.flatten(1).norm(dim=1)
            tn = t.flatten(1).norm(dim=1)
            factor = torch.where(dn > 0, tn / torch.where(dn > 0, dn, 1), 0)
            out[name] = d * factor.reshape(-1, *([1] * (d.dim() - 1)))
        else:
            dn = d.norm()
            out[name] = d * (t.norm() / dn) if dn > 0 else torch.zeros_like(d)
    return out


def random_directions(
    params: Mapping[str, Tensor], k: int = 2, seed: int = 0, norm: str = "filter", bias: str = "zero"
) -> Directions:
    """``k`` independent Gaussian directions at ``params``, normalized by :func:`normalize_direction`.

    Direction ``i`` is drawn from a CPU ``torch.Generator`` seeded with ``seed + i`` (in float64,
    then cast), so it does not depend on the device, the dtype or the other directions.

    Returns:
        :class:`Directions` of kind ``"random"``; ``info`` holds ``seeds``, ``normalization`` and ``bias``.
    """
    if k < 1:
        raise ValueError(f"need at least one direction, got k={k}")
    layout = ParamLayout.from_tensors(params)
    ref = next(iter(params.values()))
    vectors = []
    for i in range(k):
        g = torch.Generator().manual_seed(seed + i)
        raw = {
            n: torch.randn(t.shape, generator=g, dtype=torch.float64).to(ref.device, t.dtype) for n, t in params.items()
        }
        vectors.append(layout.flatten(normalize_direction(raw, params, norm, bias)))
    names = ("δ", "η", "ζ")
    return Directions(
        vectors=torch.stack(vectors),
        kind="random",
        labels=tuple(names[i] if i < len(names) else f"d{i + 1}" for i in range(k)),
        info={"seeds": [seed + i for i in range(k)], "normalization": norm, "bias": bias, "distribution": "gaussian"},
    )


def eigen_directions(
    objective: Objective,
    k: int = 2,
    metric: str = "euclidean",
    tol: float = 1e-4,
    seed: int = 0,
    progress: bool | None = None,
) -> Directions:
    """The top ``k`` Hessian eigenvectors at the objective's parameters.

    ``metric="euclidean"``: eigenvectors of the Euclidean Hessian (unit Euclidean norm).
    ``metric="node"`` / ``"layer"``: eigenvectors of the Riemannian Hessian on the node-wise /
    layer-wise quotient (:func:`sharpness.invariant_sharpness`): horizontal tangent vectors of unit
    ``g``-norm, so a coordinate step of 1 is a unit step in the invariant metric (for ``"node"``,
    ``sum_k (xi_k / w_k)^2 = 1``: relative changes of the weights). Planes along them are drawn as
    straight lines ``theta + a xi_1 + b xi_2``, the first-order retraction.

    Returns:
        :class:`Directions` of kind ``"eigen"`` or ``"invariant-eigen"``; ``info`` holds
        ``metric``, ``eigenvalues``, ``residuals``, ``converged`` and ``n_hvp``.
    """
    if metric not in EIGEN_METRICS:
        raise ValueError(f"unknown eigenvector metric {metric!r}; choose one of {', '.join(EIGEN_METRICS)}")
    if metric == "euclidean":
        result = euclidean_sharpness(
            objective.model, objective.loss_fn, None, k=k, tol=tol, seed=seed, progress=progress, objective=objective
        )
    else:
        result = invariant_sharpness(
            objective.model, objective.loss_fn, None, metric=metric, k=k, tol=tol, seed=seed, progress=progress,
            objective=objective,
        )  # fmt: skip
    values = result.eigenvalues.tolist()
    prefix = "v" if metric == "euclidean" else "ξ"
    return Directions(
        vectors=result.eigenvectors.to(objective.dtype),
        kind="eigen" if metric == "euclidean" else "invariant-eigen",
        labels=tuple(f"{prefix}{i + 1} (λ{i + 1} = {v:.3g})" for i, v in enumerate(values)),
        info={
            "metric": metric,
            "eigenvalues": values,
            "residuals": result.residuals.tolist(),
            "converged": bool(result.converged),
            "n_hvp": int(result.n_matvec),
            "seed": seed,
            "normalization": "unit Euclidean norm" if metric == "euclidean" else "unit norm in the quotient metric",
        },
    )


def segment_direction(theta0: Mapping[str, Tensor], theta1: Mapping[str, Tensor]) -> Directions:
    """The direction ``theta1 - theta0``: coordinate 0 is ``theta0``, coordinate 1 is ``theta1``."""
    missing = [n for n in theta0 if n not in theta1]
    if missing:
        raise ValueError(f"the second point has no parameter {missing[0]!r}; both points need the same parameters")
    shapes = [n for n in theta0 if theta0[n].shape != theta1[n].shape]
    if shapes:
        raise ValueError(
            f"parameter {shapes[0]!r} has shape {tuple(theta0[shapes[0]].shape)} at the first point and "
            f"{tuple(theta1[shapes[0]].shape)} at the second"
        )
    layout = ParamLayout.from_tensors(theta0)
    d = layout.flatten({n: theta1[n].to(t) - t for n, t in theta0.items()})
    return Directions(
        vectors=d[None], kind="segment", labels=("α",), info={"distance": float(d.norm()), "normalization": "none"}
    )


def trainable(model: nn.Module) -> dict[str, Tensor]:
    """Detached ``{name: tensor}`` of ``model``'s trainable parameters (the model is not touched)."""
    return {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}

