"""Directions in parameter space for lines and planes around a point.

* Random Gaussian directions with filter normalization (Li et al. 2018: each output row of a
  weight matrix / each output filter of a convolution is rescaled to the norm of the matching row /
  filter of the point ``theta``) or layer normalization (each tensor rescaled to the norm of the
  matching tensor of ``theta``, as in the flatness paper's Fig. 2). One-dimensional tensors
  (biases) are zeroed (``bias="zero"``, Li et al.'s default) or kept and normalized as a whole
  (``bias="keep"``).
* The top eigenvectors of the Euclidean Hessian or of the node-wise (or layer-wise) Riemannian
  Hessian, from `sharpness`.
* The segment from one checkpoint to another (``theta + alpha (theta_1 - theta)``).
* Random Gaussian directions in G-space (basis-path coordinates, [`manifolds.GSpace`][manifolds.GSpace]), by
  default with the chain-root coordinates held fixed (so ``w(v)`` has no singularity on the plane),
  each coordinate block rescaled to the norm of the centre's block.

Every direction set is a flat ``(k, n)`` tensor in the objective's parameter layout (for G-space
directions: in the ``GSpace.layout`` of the coordinates, length ``dim``) plus a record of how it was
made (seeds, normalization, eigenvalues), saved with the surface.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from manifolds import GSpace, NetworkStructure, ParamLayout, UnsupportedModelError, analyze
from sharpness import MEASURES, Measure, Objective, Solver, get_measure

NORMALIZATIONS = ("filter", "layer", "element", "none")
BIAS_MODES = ("zero", "keep")
GSPACE_NORMALIZATIONS = ("element", "layer", "none")
GSPACE_ROOTS = ("fixed", "free")


def check_normalization(norm: str, gspace: bool = False) -> None:
    """Refuse a normalization that random (or, with ``gspace``, G-space) directions do not have."""
    if gspace and norm not in GSPACE_NORMALIZATIONS:
        raise ValueError(
            f"G-space directions are normalized per coordinate ('element'), per coordinate block ('layer') or not at "
            f"all ('none'), not {norm!r}: "
            "the coordinates of later layers are not arranged by output unit, so there are no filters"
        )
    if not gspace and norm not in NORMALIZATIONS:
        raise ValueError(f"unknown direction normalization {norm!r}; choose one of {', '.join(NORMALIZATIONS)}")


def require_chain(model: nn.Module, what: str) -> NetworkStructure:
    """The structure of ``model``, refused unless it is a chain of Linear/Conv2d layers with positively homogeneous
    operations between them, which ``what`` (e.g. ``"fixed-weight planes"``) needs.

    Raises:
        manifolds.UnsupportedModelError: naming the first reasons, and the landscapes that apply to any model.
    """
    structure = analyze(model)
    if structure.problems:
        raise UnsupportedModelError(
            f"{what} need a chain of Linear/Conv2d layers with positively homogeneous operations between them, "
            f"which this model is not: {structure.problem_summary}; planes and lines along random or eigen "
            "directions (python -m landscape plane or line, landscape.loss_plane or loss_line) apply to any model"
        )
    return structure


@dataclass(frozen=True)
class Directions:
    """``k`` directions in parameter space and how they were obtained.

    Attributes:
        vectors: ``(k, n)`` flat directions in the parameter layout of the point they belong to
            (kind ``"gspace"``: ``(k, dim)`` in the layout of the G-space coordinates).
        kind: ``"random"``, ``"eigen"``, ``"invariant-eigen"``, ``"segment"`` or ``"gspace"``.
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
            norm of the matching tensor of ``theta``; ``"element"``: each entry is multiplied by
            ``|theta|`` there (relative changes, as in adaptive sharpness: a positive rescaling of
            ``theta`` rescales the direction with it, so the plane of a rescaled network is the same
            function of the coordinates); ``"none"``: unchanged.
        bias: one-dimensional tensors (biases): ``"zero"`` sets them to 0, ``"keep"`` keeps them,
            rescaled as a whole to the norm of ``theta``'s tensor (under ``"filter"`` and ``"layer"``).

    Returns:
        A new ``{name: tensor}``; rows or tensors where ``theta`` or ``d`` is zero become zero.
    """
    check_normalization(norm)
    if bias not in BIAS_MODES:
        raise ValueError(f"unknown bias handling {bias!r}; choose one of {', '.join(BIAS_MODES)}")
    out = {}
    for name, d in direction.items():
        t = theta[name]
        if d.dim() <= 1 and bias == "zero":
            out[name] = torch.zeros_like(d)
        elif norm == "none":
            out[name] = d.clone()
        elif norm == "element":
            out[name] = d * t.abs()
        elif norm == "filter" and d.dim() >= 2:
            dn = d.flatten(1).norm(dim=1)
            tn = t.flatten(1).norm(dim=1)
            factor = torch.where(dn > 0, tn / torch.where(dn > 0, dn, 1), 0)
            out[name] = d * factor.reshape(-1, *([1] * (d.dim() - 1)))
        else:
            dn = d.norm()
            out[name] = d * (t.norm() / dn) if dn > 0 else torch.zeros_like(d)
    return out


def _gaussian(params: Mapping[str, Tensor], seed: int) -> dict[str, Tensor]:
    """One raw Gaussian direction shaped like ``params``: drawn in float64 from a CPU generator seeded with
    ``seed``, then cast to each tensor's device and dtype."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.device, t.dtype) for n, t in params.items()}


def _labels(k: int, prefix: str = "") -> tuple[str, ...]:
    names = ("δ", "η", "ζ")
    return tuple(prefix + (names[i] if i < len(names) else f"d{i + 1}") for i in range(k))


def random_directions(
    params: Mapping[str, Tensor], k: int = 2, seed: int = 0, norm: str = "filter", bias: str = "zero"
) -> Directions:
    """``k`` independent Gaussian directions at ``params``, normalized by `normalize_direction`.

    Direction ``i`` is drawn from a CPU ``torch.Generator`` seeded with ``seed + i`` (in float64,
    then cast), so it does not depend on the device, the dtype or the other directions.

    Returns:
        `Directions` of kind ``"random"``; ``info`` holds ``seeds``, ``normalization`` and ``bias``.

    Raises:
        ValueError: ``k < 1``, or a direction that normalization makes zero (every weight it is scaled to is
            zero, e.g. an all-zero checkpoint): its surface would be flat whatever the loss.
    """
    if k < 1:
        raise ValueError(f"need at least one direction, got k={k}")
    layout = ParamLayout.from_tensors(params)
    vectors = [layout.flatten(normalize_direction(_gaussian(params, seed + i), params, norm, bias)) for i in range(k)]
    labels = _labels(k)
    for label, vector in zip(labels, vectors):
        if not bool(vector.any()):
            raise ValueError(
                f"the random direction {label} vanishes under {norm!r} normalization with bias={bias!r}, because every "
                "weight it is scaled to is zero (an all-zero checkpoint?), so the surface would be flat whatever the "
                "loss; use a point with nonzero weights, or normalization 'none' (--norm none)"
            )
    return Directions(
        vectors=torch.stack(vectors),
        kind="random",
        labels=labels,
        info={"seeds": [seed + i for i in range(k)], "normalization": norm, "bias": bias, "distribution": "gaussian"},
    )


def eigen_directions(
    objective: Objective,
    k: int = 2,
    metric: str | Measure = "euclidean",
    tol: float = 1e-4,
    seed: int = 0,
    progress: bool | None = None,
) -> Directions:
    """The top ``k`` Hessian eigenvectors of a measure at the objective's parameters.

    ``metric="euclidean"``: eigenvectors of the Euclidean Hessian (unit Euclidean norm).
    ``metric="node"`` / ``"layer"`` / ``"symmetry"``: eigenvectors of the Riemannian Hessian on the node-wise /
    layer-wise quotient (`sharpness.invariant_sharpness`) or on the quotient by the network's whole symmetry group
    (attention heads' GL factors, normalization scales, ReLU units: `sharpness.Symmetry`): horizontal tangent
    vectors of unit ``g``-norm, so a coordinate step of 1 is a unit step in the invariant metric (for ``"node"``,
    ``sum_k (xi_k / w_k)^2 = 1``: relative changes of the weights). Planes along them are drawn as
    straight lines ``theta + a xi_1 + b xi_2`` (the first-order retraction), or with
    ``path="geodesic"`` ([`landscape.loss_plane`][landscape.loss_plane]) along the metric's geodesics.
    Any measure whose eigenvectors are tangent vectors at the point (`sharpness.Measure.tangent_eigenvectors`)
    works, by name or object; the others return vectors at another point (a canonical representative) or in other
    coordinates.

    Each eigenvector is oriented so that the loss rises along it to first order (``grad L . v >= 0``): a sign
    that every symmetry of the loss preserves (the solver's own convention, the sign of the largest whitened
    entry, is not preserved by attention's GL factors), so a transformed network gets the transformed plane, not
    a mirrored one. Where ``|grad L . v|`` is at rounding level (an exact critical point) the solver's sign stays.

    Returns:
        `Directions` of kind ``"eigen"`` (a measure without invariance) or ``"invariant-eigen"``;
            ``info`` holds ``metric``, ``eigenvalues``, ``residuals``, ``converged``, ``n_hvp``, ``orientation``,
            ``slopes`` (``grad L . v`` of each direction), ``invariant_under`` (the rescalings of this network the
            directions are invariant under) and, where the measure claims more than the network has,
            ``invariance_note``.
    """
    measure = get_measure(metric)
    if not measure.tangent_eigenvectors:
        eligible = ", ".join(name for name, m in MEASURES.items() if m.tangent_eigenvectors)
        raise ValueError(
            f"eigenvector directions need tangent vectors at the point; the {measure.name!r} measure returns vectors "
            f"at another point or in other coordinates (choose one of {eligible})"
        )
    result = measure.sharpness(objective, k, Solver(tol=tol, seed=seed), progress)
    values = result.eigenvalues.tolist()
    vectors = result.eigenvectors.to(objective.dtype)
    grad = objective.gradient()
    slopes = vectors @ grad
    rounding = (vectors.abs() @ grad.abs()) * vectors.shape[1] * torch.finfo(vectors.dtype).eps
    flip = (slopes < 0) & (slopes.abs() > rounding)
    vectors = torch.where(flip[:, None], -vectors, vectors)
    slopes = torch.where(flip, -slopes, slopes)  # negating a dot product is exact: no second pass
    invariant = bool(measure.invariant_under)
    prefix = "ξ" if invariant else "v"
    return Directions(
        vectors=vectors,
        kind="invariant-eigen" if invariant else "eigen",
        labels=tuple(f"{prefix}{i + 1} (λ{i + 1} = {v:.3g})" for i, v in enumerate(values)),
        info={
            "metric": measure.name,
            "eigenvalues": values,
            "residuals": result.residuals.tolist(),
            "converged": bool(result.converged),
            "n_hvp": int(result.n_matvec),
            "seed": seed,
            "normalization": f"unit norm in the {measure.name} metric",
            "orientation": "the loss rises along each direction to first order (grad L . v >= 0)",
            "slopes": slopes.tolist(),
            # what the plane is invariant under on this network (the measure's claim cut to the group it has)
            **{key: result.info[key] for key in ("invariant_under", "invariance_note") if key in result.info},
        },
    )


def chain_root_mask(gspace: GSpace) -> Tensor:
    """``(dim,)`` bool: which G-space coordinates are chain roots.

    The chain value ``c`` of a hidden unit (the product of the predecessor weights from the input to
    it, by which ``w(v)`` divides) is its chain root times a factor of skeleton weights. The root is the
    coordinate of the first predecessor edge met going from the unit towards the input that is not a
    designated (skeleton) edge: the value of the path along predecessor edges from the input to that
    edge and along designated edges from it to the output. Every first-layer unit's predecessor entry
    is a root; a later unit has its own root only where its predecessor entry is not the designated
    weight of the unit it comes from (otherwise it shares that unit's root). Moving any other
    coordinate leaves every chain value as it is.
    """
    pred, skeleton = gspace.predecessor_masks(), gspace.skeleton_masks()
    device = next(iter(pred.values())).device
    # to_edges places coordinate j at its free edge: label the coordinates 1..dim (exact in float64) and read
    # the labels at the roots' edges (predecessor entries that are not designated; designated ones get 0)
    labels = gspace.to_edges(torch.arange(1, gspace.dim + 1, dtype=torch.float64, device=device), fill=0.0)
    index = torch.cat([labels[n][pred[n] & ~skeleton[n]] for n in pred]).long() - 1
    mask = torch.zeros(gspace.dim, dtype=torch.bool, device=device)
    mask[index] = True
    return mask


def gspace_directions(
    gspace: GSpace,
    center: Tensor,
    k: int = 2,
    seed: int = 0,
    norm: str = "element",
    bias: str = "zero",
    roots: str = "fixed",
) -> Directions:
    """``k`` random Gaussian directions in G-space at the coordinates ``center``.

    Drawn exactly like `random_directions` (direction ``i`` from a CPU generator seeded with
    ``seed + i``, in float64), in the coordinate layout ``gspace.layout``: one block per layer's
    weight coordinates and one per bias.

    ``roots="fixed"`` (default) sets the components on the chain roots (`chain_root_mask`) to
    exactly 0, so no hidden unit's chain value changes anywhere on the plane ``w(v + a d1 + b d2)``:
    ``w`` never divides by a value that crosses 0, and the plane has no singular lines whatever its
    span. ``roots="free"`` moves every coordinate; a root then crosses 0 a distance of about
    ``|v_root| / |d_root|`` from the centre, and with the per-block scaling below most of a plane of
    span 0.3 of a real model already lies beyond such a singular line.

    ``norm="element"`` (default) multiplies every coordinate's draw by ``|v_j|``: each basis-path
    value changes by the same relative amount in distribution, so no path whose value is small is
    moved by many times its size (with per-block scaling the planes of trained networks are steep
    far inside a unit span). ``norm="layer"`` rescales every block so that ``||d_B|| = ||v_B||``,
    both norms taken over the coordinates the direction moves (with fixed roots: the block without
    its roots). Bias blocks are zeroed (``bias="zero"``) or kept and normalized likewise (``"keep"``).
    The coordinates, the roots and these directions are unchanged by every positive rescaling of the
    network, so the plane is too.

    Args:
        gspace: the parametrization ([`manifolds.GSpace`][manifolds.GSpace]) of the network.
        center: ``(dim,)`` flat G-space coordinates of the centre (``gspace.coordinates(params)``).
        k: number of directions.
        seed: seed of the first direction.
        norm: ``"element"`` (relative, default), ``"layer"`` (per coordinate block) or ``"none"``.
            Filter normalization has no meaning here: the blocks of later layers are not arranged by unit.
        bias: ``"zero"`` or ``"keep"``.
        roots: ``"fixed"`` (default: the chain roots stay at the centre's values) or ``"free"``.

    Returns:
        [`Directions`][landscape.Directions] of kind ``"gspace"``, vectors ``(k, dim)``; ``info`` holds ``space``,
            ``seeds``, ``normalization``, ``bias``, ``distribution``, ``roots``, ``fixed_coordinates``,
            ``dim`` and ``blocks``.
    """
    check_normalization(norm, gspace=True)
    if roots not in GSPACE_ROOTS:
        raise ValueError(f"unknown chain-root handling {roots!r}; choose one of {', '.join(GSPACE_ROOTS)}")
    if k < 1:
        raise ValueError(f"need at least one direction, got k={k}")
    center = torch.as_tensor(center).detach()
    if tuple(center.shape) != (gspace.dim,):
        raise ValueError(f"the G-space centre must be a flat vector of length {gspace.dim}, got {tuple(center.shape)}")
    layout = gspace.layout
    blocks = layout.unflatten(center)
    fixed = chain_root_mask(gspace).to(center.device) if roots == "fixed" else None
    if fixed is not None:  # hold the roots: zero them in the draws and leave them out of the block norms
        held = layout.unflatten(fixed)
        blocks = {n: torch.where(held[n], 0, t) for n, t in blocks.items()}
    vectors = []
    for i in range(k):
        raw = _gaussian(blocks, seed + i)
        if fixed is not None:
            raw = {n: torch.where(held[n], 0, t) for n, t in raw.items()}
        vectors.append(layout.flatten(normalize_direction(raw, blocks, norm, bias)))
    moved = "the coordinates it moves (chain roots held)" if fixed is not None else "all its coordinates"
    return Directions(
        vectors=torch.stack(vectors),
        kind="gspace",
        labels=_labels(k, "G-space "),
        info={
            "seeds": [seed + i for i in range(k)],
            "normalization": norm,
            "bias": bias,
            "distribution": "gaussian",
            "space": "gspace",
            "roots": roots,
            "fixed_coordinates": 0 if fixed is None else int(fixed.sum()),
            "dim": gspace.dim,
            "blocks": list(layout.names),
            "block_normalization": {
                "element": f"d_j = g_j |v_j| on {moved}",
                "layer": f"||d_B|| = ||v_B|| per coordinate block, over {moved}",
                "none": "none",
            }[norm],
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
