"""Settings of a line or plane: how its directions are made (`DirectionSpec`) and its grid (`Grid`)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from landscape._directions import BIAS_MODES, GSPACE_ROOTS, Directions, check_normalization
from landscape._grid import STRATEGIES, check_compile
from sharpness import Measure, get_measure

DIRECTION_KINDS = ("random", "eigen", "invariant-eigen", "gspace")
PATHS = ("straight", "geodesic")


@dataclass(frozen=True)
class DirectionSpec:
    """How the directions of a line or plane through ``theta`` are made, and the path along them.

    Attributes:
        kind: ``"random"`` (Gaussian, normalized by ``norm``), ``"eigen"`` (top Euclidean Hessian
            eigenvectors), ``"invariant-eigen"`` (top eigenvectors of the Riemannian Hessian of ``metric``),
            ``"gspace"`` (random in G-space coordinates), or precomputed `Directions` (used as they are).
        norm: normalization of random directions: ``"filter"`` (default; Li et al. 2018), ``"layer"``,
            ``"element"`` or ``"none"``; of G-space directions ``"element"`` (default), ``"layer"`` or ``"none"``.
        bias: ``"zero"`` (default) or ``"keep"`` for one-dimensional tensors of random directions.
        metric: the measure of ``"invariant-eigen"`` directions (``"node"`` or ``"layer"``, or a
            [`sharpness.Measure`][sharpness.Measure]).
        path: ``"straight"`` (``theta + a d1 + b d2``) or ``"geodesic"`` (``Exp_theta(a xi1 + b xi2)``, the exact
            exponential map of ``metric``; invariant-eigen directions only).
        roots: G-space directions only: ``"fixed"`` (default) holds the chain-root coordinates at the centre's
            values, so ``w(v)`` has no singular line on the plane; ``"free"`` moves them too.
        seed: seed of random directions (direction ``i`` uses ``seed + i``) or of the eigen-solver.

    Raises:
        ValueError: an unknown value, or a combination that does not exist (``roots`` for directions other than
            G-space, a geodesic path for directions other than invariant-eigen, a normalization the kind lacks).
    """

    kind: str | Directions = "random"
    norm: str | None = None
    bias: str = "zero"
    metric: str | Measure = "node"
    path: str = "straight"
    roots: str = "fixed"
    seed: int = 0

    def __post_init__(self) -> None:
        kind = self.kind_name
        if kind not in DIRECTION_KINDS and not isinstance(self.kind, Directions):
            raise ValueError(f"unknown direction kind {kind!r}; choose one of {', '.join(DIRECTION_KINDS)}")
        if self.path not in PATHS:
            raise ValueError(f"unknown path {self.path!r}; choose one of {', '.join(PATHS)}")
        if self.roots not in GSPACE_ROOTS:
            raise ValueError(f"unknown chain-root handling {self.roots!r}; choose one of {', '.join(GSPACE_ROOTS)}")
        if self.bias not in BIAS_MODES:
            raise ValueError(f"bias must be one of {', '.join(BIAS_MODES)}, got {self.bias!r}")
        if self.norm is not None:
            check_normalization(self.norm, gspace=kind == "gspace")
        if self.roots != "fixed" and kind != "gspace":
            raise ValueError(f"roots={self.roots!r} applies to G-space directions only, not to {kind} directions")
        if self.path == "geodesic" and kind != "invariant-eigen":
            raise ValueError(
                f"the geodesic path follows the quotient metric of invariant-eigen directions, not of {kind} "
                "directions; use invariant-eigen directions or the straight path"
            )
        get_measure(self.metric)  # an unknown measure name is refused here, before any computation

    @property
    def kind_name(self) -> str:
        """The kind as a name (that of given [`Directions`][landscape.Directions] included)."""
        return self.kind.kind if isinstance(self.kind, Directions) else self.kind

    @property
    def normalization(self) -> str:
        """The normalization in use: ``norm``, or the kind's default (filter; element in G-space)."""
        if self.norm is not None:
            return self.norm
        return "element" if self.kind_name == "gspace" else "filter"


def as_direction_spec(directions: str | Directions | DirectionSpec) -> DirectionSpec:
    """``directions`` as a `DirectionSpec` (a kind name or given `Directions` with the defaults)."""
    return directions if isinstance(directions, DirectionSpec) else DirectionSpec(directions)


# Bytes a grid keeps per point whatever the batch: float64 coordinates (2), loss, accuracy, and as many again
# for the figure's and the JSON's copies.
BYTES_PER_POINT = 64


def physical_memory() -> int | None:
    """This machine's physical memory in bytes, or ``None`` where the system does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass(frozen=True)
class Grid:
    """The grid of a line or plane and how it is evaluated.

    Attributes:
        span: half-width of the square (or of the line) in direction units, ``> 0``.
        steps: grid points per axis, ``>= 2``; the grid always contains the centre (inserted when ``steps`` is
            even).
        strategy: ``"auto"``, ``"first-layer"``, ``"vmap"`` or ``"loop"`` (see `landscape.evaluate_grid`;
            curved planes use `landscape.evaluate_points`, where ``"auto"`` and ``"first-layer"`` mean
            the loop on CPU and vmap elsewhere).
        compile: evaluate each grid point's forward pass compiled with ``torch.compile``, one point at a time
            (see `landscape.evaluate_grid`): worth it on large grids of convolutional or residual networks.

    Raises:
        ValueError: a span that is not a positive finite number, fewer than 2 steps, an unknown strategy, or
            ``compile`` with strategy ``"vmap"``.
    """

    span: float = 1.0
    steps: int = 51
    strategy: str = "auto"
    compile: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.span, bool) or not isinstance(self.span, (int, float)) or not (0 < self.span < math.inf):
            raise ValueError(f"the span must be positive, got {self.span}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 2:
            raise ValueError(f"steps must be an integer of at least 2, got {self.steps!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown grid strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}")
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be True or False, got {self.compile!r}")
        check_compile(self.compile, self.strategy)

    def require_memory(self, dims: int) -> None:
        """Refuse, before anything is computed, a grid whose results alone would not fit in memory.

        A grid of ``steps ** dims`` points keeps about `BYTES_PER_POINT` bytes per point (coordinates,
        loss, accuracy and the figure's arrays); more than half of this machine's physical memory is refused.

        Args:
            dims: 1 for a line, 2 for a plane.

        Raises:
            ValueError: naming the points, the bytes and the memory.
        """
        points = self.steps**dims
        need = points * BYTES_PER_POINT
        have = physical_memory()
        if have is not None and need > have / 2:
            shape = "x".join([str(self.steps)] * dims)
            raise ValueError(
                f"a {shape} grid has {points:,} points whose results alone take {need / 2**30:,.1f} GiB, more than "
                f"half of this machine's {have / 2**30:,.1f} GiB of memory; use fewer steps"
            )
