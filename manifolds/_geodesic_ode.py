"""Geodesics of a metric without a closed-form exponential map: the geodesic equation integrated numerically.

A geodesic ``x(t)`` of a metric ``G`` solves ``x'' = -Gamma_x(x', x')`` (``Gamma`` the Christoffel symbols of
``G``). ``Exp_w(xi) = x(1)`` for ``x(0) = w``, ``x'(0) = xi``. The same curves solve Hamilton's equations of
``H(x, p) = 1/2 p^T K(x) p`` with the inverse metric ``K = G^-1`` and the momentum ``p = G(x) x'``:

    ``x' = K(x) p``,   ``p' = -1/2 grad_x <p, K(x) p>``,

which is what is integrated here: one VJP of ``x -> K(x) p`` gives both right-hand sides, where the second-order
form needs the derivative of ``G`` along ``x'`` (a JVP or a second reverse pass) and a solve with ``G`` per
evaluation; ``-Gamma_x(v, v)`` is the acceleration these equations imply (tested against
`manifolds.MetricQuotient.second_order_geodesic`, which uses it, to third order). The equations are integrated by
the classical fixed-step Runge-Kutta method (RK4, global error ``O(h^4)``) for a whole batch of initial
velocities at once (metrics with ``batched=True``) or row by row under ``torch.func.vmap``. RK4 is equivariant
under every linear map of the parameters that is an isometry of the metric (a group element acting linearly, as
rescalings and attention's GL factors do, moving ``p`` by the inverse transpose): the discrete geodesics of a
transformed network are the transformed discrete geodesics, discretization error included.

The step count of a [`GeodesicMap`][manifolds.GeodesicMap] is chosen once, by doubling from a few steps until
the end points of the longest geodesics it will be asked for (the corners of the coordinate box) move by at most
``tol`` between ``N/2`` and ``N`` steps, measured in the metric at the starting point; that change is the stated
error estimate (about 15 times RK4's error at ``N`` steps, so a safe bound).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from manifolds._connection import Metric

# Default error estimate allowed, in the metric at the starting point: about the rounding of float32 parameters
# (relative 6e-8 per entry) summed over a small network; RK4's actual error is about 15 times smaller.
GEODESIC_TOL = 1e-6
GEODESIC_MAX_STEPS = 1024


def hamiltonian_field(metric: Metric) -> Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """``(x (B, n), p (B, n)) -> (x', p')``: Hamilton's equations of the geodesics, each row at its own point.

    ``x' = K(x) p`` and ``p' = -1/2 grad_x <p, K(x) p>`` from one VJP of ``x -> K(x) p`` (``K = G^-1``:
    ``metric.solve``, or a dense solve of ``G(x)`` where the metric gives none, small ``n`` only). A metric with
    ``batched=True`` takes the whole batch of points at once (the rows do not interact, so one VJP of the batch
    gives every row's); any other is mapped over the rows with ``torch.func.vmap``.
    """

    def cometric(x: Tensor, p: Tensor) -> Tensor:
        if metric.solve is not None:
            return metric.solve(x, p)
        eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
        return torch.linalg.solve(torch.func.vmap(lambda e: metric.apply(x, e))(eye), p)

    def field(x: Tensor, p: Tensor) -> tuple[Tensor, Tensor]:
        velocity, pull = torch.func.vjp(lambda y: cometric(y, p), x)
        return velocity, -0.5 * pull(p)[0]

    return field if metric.batched else torch.func.vmap(field)


def integrate_geodesic(metric: Metric, x: Tensor, v: Tensor, steps: int) -> Tensor:
    """End points ``x(1)`` ``(B, n)`` of the geodesics from ``x`` ``(B, n)`` with velocities ``v`` ``(B, n)``.

    Args:
        metric: the metric (`hamiltonian_field`).
        x: starting points.
        v: initial velocities.
        steps: RK4 steps on ``t in [0, 1]``.
    """
    f = hamiltonian_field(metric)
    p = metric.apply(x, v) if metric.batched else torch.func.vmap(metric.apply)(x, v)
    h = 1.0 / steps
    for _ in range(steps):
        x1, p1 = f(x, p)
        x2, p2 = f(x + 0.5 * h * x1, p + 0.5 * h * p1)
        x3, p3 = f(x + 0.5 * h * x2, p + 0.5 * h * p2)
        x4, p4 = f(x + h * x3, p + h * p3)
        x, p = x + h / 6 * (x1 + 2 * x2 + 2 * x3 + x4), p + h / 6 * (p1 + 2 * p2 + 2 * p3 + p4)
    return x


class GeodesicMap:
    """``c (B, k) -> Exp_w(c @ directions)`` ``(B, n)`` by RK4 on the geodesic equation of a metric.

    Computed in float64 whatever the dtype of ``point`` (the result is cast back), so the stated error is the
    integrator's, not rounding's.

    Args:
        metric: the metric (its ``apply`` differentiable in the point by ``torch.func``).
        point: the starting point ``w``, ``(n,)``.
        directions: tangent vectors at ``w``, ``(k, n)``.
        radius: the largest ``|c_i|`` the map will be asked for (the half-width of the grid); the step count
            is chosen on the corners ``c in {-radius, radius}^k``.
        tol: largest error estimate accepted, in the metric at ``w``.
        max_steps: the most steps tried.

    Attributes:
        steps: RK4 steps used.
        error: the error estimate at ``steps``: the largest ``||x_N(1) - x_{N/2}(1)||_{g(w)}`` over the corners.
        detail: one sentence for figures and metadata: the path, the steps and the error estimate.

    Raises:
        ValueError: ``radius`` not positive, or no step count up to ``max_steps`` meets ``tol`` (the geodesics
            leave the region where the metric is defined, or the span is far too large for the metric).
    """

    def __init__(self, metric: Metric, point: Tensor, directions: Tensor, radius: float = 1.0,
                 tol: float = GEODESIC_TOL, max_steps: int = GEODESIC_MAX_STEPS):  # fmt: skip
        if not (math.isfinite(radius) and radius > 0):
            raise ValueError(f"the radius of a geodesic map must be positive and finite, got {radius}")
        self.metric = metric
        self.dtype = point.dtype
        self.point = point.detach().to(torch.float64)
        self.directions = directions.detach().to(torch.float64)
        k = self.directions.shape[0]
        corners = torch.tensor(list(itertools.product((-radius, radius), repeat=k)), dtype=torch.float64,
                               device=self.point.device)  # fmt: skip
        steps, previous = 4, self._ends(corners, 4)
        while True:
            steps *= 2
            ends = self._ends(corners, steps)
            gap = torch.stack([self._norm(e) for e in ends - previous])
            error = float(gap.max()) if bool(torch.isfinite(gap).all()) else math.inf
            if error <= tol:
                break
            if steps >= max_steps:
                raise ValueError(
                    f"the geodesics of the {metric.name} metric to the corners of the grid (coordinates up to "
                    f"{radius:g}) do not converge with up to {max_steps} RK4 steps (error estimate {error:.3g} > "
                    f"{tol:g}): the span leaves the region where the metric is defined or well behaved; use a smaller "
                    "span or the straight path"
                )
            previous = ends
        self.steps, self.error, self.radius = steps, error, radius
        self.detail = (f"geodesics of the {metric.name} metric: RK4 on the geodesic equation with {steps} steps, "
                       f"error estimate {error:.2g} (in the metric at the centre; change from {steps // 2} steps, at "
                       f"the grid's corners)")  # fmt: skip

    def _norm(self, xi: Tensor) -> Tensor:
        return torch.dot(xi, self.metric.apply(self.point, xi)).clamp_min(0).sqrt()

    def _ends(self, c: Tensor, steps: int) -> Tensor:
        v = c @ self.directions
        return integrate_geodesic(self.metric, self.point.expand_as(v).clone(), v, steps)

    def __call__(self, c: Tensor) -> Tensor:
        """``(B, k)`` coordinates -> ``(B, n)`` points, in the dtype of the starting point."""
        c = c.to(self.point.device, torch.float64)
        return self._ends(c, self.steps).to(self.dtype)
