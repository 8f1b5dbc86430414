"""Loss planes of real models under different fixed-weight values (both readings of docs/math.md, "Fixed weights").

For each value ``b`` the plane is centered at

* reading (a): the model's parameters with every fixed weight set to ``b`` (with the sign rule of
  [`manifolds.FixedWeightSpace`][manifolds.FixedWeightSpace], ``signs * b``): the network function changes with ``b``;
* reading (b): the function-preserving node-wise rescaling of the model after which every fixed weight
  is ``+-b``: the same network, only the gauge differs.

The two random directions use the same seeds for every ``b``; they are normalized against that
center and then zeroed on the fixed entries, so every plane lies in the free-weight subspace.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from landscape._directions import Directions, random_directions, require_chain
from landscape._settings import DirectionSpec, Grid
from landscape._surface import Surface
from landscape._surfaces import _describe, loss_plane
from manifolds import FixedWeightSpace
from sharpness import Objective, build_objective

READINGS = ("a", "b")


def reading_text(reading: str, value: float) -> str:
    """The title phrase naming the reading and the value ``b``."""
    if reading == "a":
        return f"reading (a): fixed weights set to {value:g}, the function changes"
    return f"reading (b): same network rescaled so fixed weights are ±{value:g}, only the gauge differs"


def _check_values(values: Sequence[float]) -> tuple[float, ...]:
    out = tuple(float(v) for v in values)
    if not out:
        raise ValueError("give at least one fixed-weight value")
    bad = [v for v in out if not (math.isfinite(v) and v > 0)]
    if bad:
        raise ValueError(f"fixed-weight values must be positive finite numbers, got {bad[0]:g}")
    return out


def _check_representable(b: float, reading: str, center: Mapping[str, Tensor], d: Directions, dtype) -> None:
    """Refuse a value ``b`` that ``dtype`` cannot hold, or whose plane (center, directions) overflows in it: under
    reading (b) the other weights are scaled by powers of ``b``, so ``1e-30`` takes them to ``1e29``, whose squares
    (direction norms) overflow float32.

    Raises:
        ValueError: naming the value, the dtype and the fix.
    """
    name = str(dtype).removeprefix("torch.")
    held = float(torch.tensor(b, dtype=dtype))
    if not math.isfinite(held) or held < torch.finfo(dtype).tiny:
        problem = f"{name} cannot hold it"
    elif not all(bool(torch.isfinite(t).all()) for t in center.values()) or not bool(torch.isfinite(d.vectors).all()):
        problem = ("rescaling the network so that every fixed weight is ±b" if reading == "b" else
                   "setting the fixed weights to b") + f" takes its weights or their plane out of the range of {name}"
    else:
        return
    raise ValueError(f"the fixed-weight value {b:g} cannot be drawn in {name}: {problem}; use values nearer 1"
                     + (" or dtype float64 (--dtype float64)" if dtype != torch.float64 else ""))  # fmt: skip


def fixed_weight_centers(
    objective: Objective, space: FixedWeightSpace, values: Sequence[float], reading: str = "a"
) -> list[dict[str, Tensor]]:
    """The plane centers ``{name: tensor}`` (objective's dtype and device) for each value, by ``reading``."""
    if reading not in READINGS:
        raise ValueError(f"unknown reading {reading!r}; choose 'a' (set the fixed weights) or 'b' (rescale)")
    flat = objective.layout.flatten(objective.params)
    free = space.free_vector(flat)
    centers = []
    for b in values:
        if reading == "a":
            params = space.params_from_free(free, b)
        else:
            params = space.rescale_to_fixed_value(objective.params, b).params
        centers.append({k: v.detach().to(objective.device, objective.dtype) for k, v in params.items()})
    return centers


def free_plane_directions(
    center: Mapping[str, Tensor], space: FixedWeightSpace, seed: int = 0, norm: str = "filter", bias: str = "zero"
) -> Directions:
    """Two random directions (seeds ``seed``, ``seed + 1``) normalized against ``center``, zero on the fixed entries."""
    raw = random_directions(center, 2, seed, norm, bias)
    vectors = raw.vectors.clone()
    vectors[:, ~space.free_mask.to(vectors.device)] = 0
    return Directions(vectors, raw.kind, raw.labels, {**raw.info, "fixed_entries": "zeroed"})


def fixed_weight_planes(
    model: nn.Module | None,
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None,
    data: object,
    values: Sequence[float] = (0.5, 1.0, 2.0),
    *,
    reading: str = "a",
    selection: str | Mapping[str, Tensor] = "diagonal",
    directions: DirectionSpec | None = None,
    grid: Grid | None = None,
    dtype: torch.dtype | None = None,
    objective: Objective | None = None,
    progress: bool | None = None,
) -> list[Surface]:
    """One loss plane in the free-weight subspace per fixed-weight value ``b``.

    Args:
        model: as for [`landscape.loss_plane`][landscape.loss_plane] (the model is read, never modified).
        loss_fn: as for [`landscape.loss_plane`][landscape.loss_plane] (the model is read, never modified).
        data: as for [`landscape.loss_plane`][landscape.loss_plane] (the model is read, never modified).
        values: the fixed-weight values ``b > 0``.
        reading: ``"a"``: center = the parameters with every fixed weight set to ``signs * b`` (the
            function changes with ``b``); ``"b"``: center = the function-preserving rescaling with
            every fixed weight ``+-b`` (same function, another gauge).
        selection: which weights are fixed (``"diagonal"``, ``"hungarian"`` or a mask), chosen once at
            the model's parameters (the Hungarian selection aims at the geometric mean of ``values``).
        directions: random directions only (``DirectionSpec(norm=..., bias=..., seed=...)``; default filter
            normalization): the directions of every plane use seeds ``seed`` and ``seed + 1``, are normalized
            against that plane's center and are zero on the fixed entries.
        grid: span, points per axis and strategy (default ``Grid(steps=31)``).
        dtype: as for [`landscape.loss_plane`][landscape.loss_plane].
        objective: as for [`landscape.loss_plane`][landscape.loss_plane].
        progress: as for [`landscape.loss_plane`][landscape.loss_plane].

    Returns:
        One [`Surface`][landscape.Surface] per value, with the title naming the reading and ``b``, ``extras["fixed"]``
            holding ``b`` and metadata ``reading``, ``plane`` (what the two directions are), ``fixed_value``,
            ``selection``, ``n_fixed``, ``n_free``.
    """
    spec, grid = directions or DirectionSpec(), grid or Grid(steps=31)
    grid.require_memory(2)
    if spec.kind != "random" or spec.path != "straight":
        raise ValueError("fixed-weight planes use random straight directions in the free weights; set only their "
                         "norm, bias and seed")  # fmt: skip
    values = _check_values(values)
    if reading not in READINGS:
        raise ValueError(f"unknown reading {reading!r}; choose 'a' (set the fixed weights) or 'b' (rescale)")
    base = build_objective(model, loss_fn, data, objective, dtype=dtype)
    target = math.exp(sum(math.log(v) for v in values) / len(values))
    structure = require_chain(base.model, "fixed-weight planes")
    space = FixedWeightSpace(base.model, selection, value=target, params=base.params, structure=structure)
    centers = fixed_weight_centers(base, space, values, reading)
    planes = [free_plane_directions(c, space, spec.seed, spec.normalization, spec.bias) for c in centers]
    for b, center, d in zip(values, centers, planes):  # all of them before the first grid
        _check_representable(b, reading, center, d, base.dtype)
    surfaces = []
    for b, center, d in zip(values, centers, planes):
        s = loss_plane(None, None, None, d, grid=grid, objective=base.with_params(center), progress=progress)
        selection_name = selection if isinstance(selection, str) else "mask"
        plane = _describe(d)
        surfaces.append(
            s.replace(
                title=f"{reading_text(reading, b)}\nloss on the free-weight plane of {plane}",
                extras={**s.extras, "fixed": np.asarray(b)},
                metadata={
                    **s.metadata,
                    "reading": reading,
                    "reading_text": reading_text(reading, b),
                    "plane": plane,
                    "fixed_value": b,
                    "selection": selection_name,
                    "n_fixed": space.n_fixed,
                    "n_free": space.n_free,
                },
            )  # fmt: skip
        )
    return surfaces
