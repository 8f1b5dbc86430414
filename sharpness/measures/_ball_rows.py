"""Geodesic and adaptive sharpness as rows of `sharpness.verify_invariance`'s table (``balls=rho``).

Each row's value is the worst loss increase its ascent finds in a ball of radius ``rho``, recomputed on every copy
like a measure's top eigenvalue. The ascent starts from the centre only (no random or eigenvector starts): its
normalized steps are then carried by every isometry of the ball's metric, so an invariant value is reproduced to
rounding, not merely to the ascent's tolerance.

* ``geodesic``: second-order geodesic sharpness on the metric of the ``symmetry`` measure (horizontal ball);
  claims what that measure claims (the whole group).
* ``adaptive``: adaptive sharpness (l2, ``w + |w| z``); every positive entry-wise scaling maps its ball onto
  itself, so it claims ``node``, ``layer`` and ``normalization``; a ``GL(h)`` element is no such scaling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sharpness.measures._adaptive import Ascent, adaptive_sharpness
from sharpness.measures._geodesic import geodesic_sharpness
from sharpness.measures._symmetry import Symmetry
from sharpness.products._objective import Objective
from sharpness.solvers._solve import Solver

# centre start only, few steps: covariant under the group, cheap
ASCENT = Ascent(steps=5, restarts=0, eigen_start=False)


@dataclass(frozen=True)
class _Value:
    eigenvalues: torch.Tensor
    converged: bool = True
    # No solver error to bound: a fixed ascent from the centre is reproduced to rounding on an isometric copy, so
    # verify's noise floor for these rows is its rounding floor alone (and the jitter below float64).
    residuals: torch.Tensor = torch.zeros(1, dtype=torch.float64)


@dataclass(frozen=True)
class BallRow:
    """One ball measure, with the interface `sharpness.verify_invariance` reads from a measure.

    Attributes:
        name: ``"geodesic"`` or ``"adaptive"``.
        rho: the radius (the symmetry metric's norm, or the relative l2 radius of adaptive sharpness).
        invariant_under: the general claim.
        ascent: the search settings.
    """

    name: str
    rho: float
    invariant_under: tuple[str, ...]
    ascent: Ascent = ASCENT

    def solve(self, objective: Objective, k: int, solver: Solver, progress: bool | None = None) -> _Value:
        """``(value,)`` in ``eigenvalues`` (``k`` and ``solver`` do not apply: one value, no eigen-solve)."""
        if self.name == "geodesic":
            value = geodesic_sharpness(None, None, None, self.rho, metric="symmetry", order=2, ascent=self.ascent,
                                       objective=objective, progress=False).value  # fmt: skip
        else:
            value = adaptive_sharpness(None, None, None, self.rho, ascent=self.ascent, objective=objective,
                                       progress=False).value  # fmt: skip
        return _Value(torch.tensor([value], dtype=torch.float64))


def ball_rows(rho: float) -> tuple[BallRow, BallRow]:
    """The ``geodesic`` and ``adaptive`` rows at radius ``rho``.

    Raises:
        ValueError: ``rho`` is not a positive finite number.
    """
    if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not 0 < rho < float("inf"):
        raise ValueError(f"balls must be a positive radius, got {rho!r}")
    return (BallRow("geodesic", float(rho), Symmetry.invariant_under),
            BallRow("adaptive", float(rho), ("node", "layer", "normalization")))  # fmt: skip
