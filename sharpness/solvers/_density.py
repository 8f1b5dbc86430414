"""Spectral density of a symmetric operator by stochastic Lanczos quadrature (SLQ).

For a unit probe ``v``, ``m`` Lanczos steps give a tridiagonal ``T`` whose eigenvalues ``theta_i``
(nodes) and squared first eigenvector entries ``w_i`` (weights) form the Gauss quadrature of the
measure ``sum_j (u_j^T v)^2 delta(lambda_j)``: ``sum_i w_i theta_i^p = v^T A^p v`` for every
``p <= 2m - 1``. Averaged over random probes, this measure is the eigenvalue density ``(1/n) sum_j
delta(lambda_j)`` in expectation (Lin, Saad and Yang 2016; Ghorbani, Krishnan and Xiao 2019, whose
PyHessian implementation calls the removed ``torch.eig`` and fails on current torch).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

from sharpness._progress import progress_bar
from sharpness._results import jsonable, write_text_atomic
from sharpness.products._hessian import HessianOperator
from sharpness.products._objective import Objective, build_objective
from sharpness.products._operator import SymmetricOperator
from sharpness.solvers._lanczos import lanczos_step
from sharpness.solvers._vectors import KrylovBasis, _as_vector, _breakdown_threshold, _random


@dataclass(frozen=True)
class SpectralDensity:
    """Gauss quadratures of the spectral measure, one per probe, and the smoothed density they give.

    Attributes:
        nodes: per probe, the Ritz values ``(m_i,)`` float64 (eigenvalue units of the operator);
            ``m_i < n_steps`` when the probe's Krylov space was invariant.
        weights: per probe, the quadrature weights ``(m_i,)`` float64, summing to 1.
        n_steps: Lanczos steps asked per probe.
        n_matvec: operator products spent.
        seconds: wall time.
        info: free-form facts (metric, loss, hvp strategy ...), JSON-serialisable.
    """

    nodes: list[Tensor]
    weights: list[Tensor]
    n_steps: int
    n_matvec: int
    seconds: float = 0.0
    info: dict = field(default_factory=dict)

    @property
    def n_probes(self) -> int:
        return len(self.nodes)

    def moment(self, p: int) -> tuple[float, float | None]:
        """Estimate of ``tr(A^p) / n`` and its standard error over the probes (``None`` for one probe).

        With ``p <= 2 n_steps - 1`` each probe's value is exactly ``v^T A^p v`` for its unit probe
        ``v``; ``p = 1`` is the Hutchinson estimate of the mean eigenvalue.
        """
        per_probe = np.array([float((w * t**p).sum()) for t, w in zip(self.nodes, self.weights)])
        stderr = float(per_probe.std(ddof=1) / math.sqrt(len(per_probe))) if len(per_probe) > 1 else None
        return float(per_probe.mean()), stderr

    def default_sigma(self) -> float:
        """Gaussian width used when none is given: 1% of the range of the nodes (eigenvalue units)."""
        nodes = torch.cat(self.nodes)
        spread = float(nodes.max() - nodes.min())
        return 0.01 * spread if spread > 0 else 1e-3 * max(float(nodes.abs().max()), 1.0)

    def grid(self, points: int = 1000, sigma: float | None = None) -> Tensor:
        """``points`` evenly spaced values ``(points,)`` float64 covering the nodes and 5 ``sigma`` beyond."""
        sigma = self.default_sigma() if sigma is None else sigma
        nodes = torch.cat(self.nodes)
        return torch.linspace(float(nodes.min()) - 5 * sigma, float(nodes.max()) + 5 * sigma, points,
                              dtype=torch.float64)  # fmt: skip

    def density(self, grid: Tensor | np.ndarray, sigma: float | None = None) -> Tensor:
        """The density ``(g,)`` float64 at the points ``grid`` ``(g,)``: every quadrature smoothed by a
        Gaussian of width ``sigma`` (default `default_sigma`), averaged over the probes. It
        integrates to 1 (per unit of eigenvalue)."""
        sigma = self.default_sigma() if sigma is None else float(sigma)
        if not sigma > 0:
            raise ValueError(f"sigma must be positive, got {sigma}")
        grid = grid.cpu() if isinstance(grid, torch.Tensor) else grid
        t = torch.as_tensor(np.asarray(grid), dtype=torch.float64).reshape(-1, 1)
        total = torch.zeros(t.shape[0], dtype=torch.float64)
        for nodes, weights in zip(self.nodes, self.weights):
            total += (weights * torch.exp(-0.5 * ((t - nodes) / sigma) ** 2)).sum(dim=1)
        return total / (self.n_probes * sigma * math.sqrt(2 * math.pi))

    def to_dict(self) -> dict:
        """JSON-serialisable form: the quadratures, the first two moments and how they were obtained."""
        mean, mean_err = self.moment(1)
        second, second_err = self.moment(2)
        return jsonable({
            "nodes": self.nodes,
            "weights": self.weights,
            "n_probes": self.n_probes,
            "n_steps": self.n_steps,
            "n_hvp": self.n_matvec,
            "seconds": self.seconds,
            "mean_eigenvalue": mean,
            "mean_eigenvalue_stderr": mean_err,
            "mean_squared_eigenvalue": second,
            "mean_squared_eigenvalue_stderr": second_err,
            "default_sigma": self.default_sigma(),
            **self.info,
        })  # fmt: skip

    def save_json(self, path: str | os.PathLike) -> None:
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2))

    def plot(
        self,
        ax=None,
        sigma: float | None = None,
        points: int = 1000,
        log: bool = True,
        title: str | None = None,
        floor: float = 1e-10,
        **line_kwargs,
    ):
        """Matplotlib line of `density` on `grid` (log scale by default, as spectra of trained
        networks span many decades); returns the axes.

        On the log scale the smoothed density underflows far from every node: values below ``floor``
        times the peak are not drawn (gaps in the line, not a flat floor of made-up data), and the
        axes say so. ``title``: what was measured (model, data), above the method's line.
        """
        from matplotlib.figure import Figure

        if ax is None:
            ax = Figure(figsize=(5.4, 3.8), layout="constrained").add_subplot()
        sigma = self.default_sigma() if sigma is None else sigma
        grid = self.grid(points, sigma)
        values = self.density(grid, sigma).numpy()
        method = f"SLQ: {self.n_probes} probes × {self.n_steps} Lanczos steps, Gaussian σ = {sigma:.2g}"
        if log:
            cut = floor * float(values.max())
            hidden = values < cut
            values[hidden] = np.nan
            ax.set_yscale("log")
            if hidden.any():
                method += f"; density < {floor:.0e} × peak not drawn"
        ax.plot(grid.numpy(), values, **line_kwargs)
        ax.set_xlabel("eigenvalue")
        ax.set_ylabel("density" + (" (log scale)" if log else ""))
        method = textwrap.fill(method, 72)
        ax.set_title(method if title is None else f"{title}\n{method}", fontsize=8.5)
        return ax


def _quadrature(alphas: list[float], betas: list[float]) -> tuple[Tensor, Tensor]:
    """Nodes and weights of the tridiagonal ``T``: its eigenvalues and the squared first entries of its
    eigenvectors, float64."""
    d = np.asarray(alphas)
    e = np.asarray(betas)
    values, vectors = np.linalg.eigh(np.diag(d) + np.diag(e, 1) + np.diag(e, -1))
    return torch.from_numpy(values.copy()), torch.from_numpy(vectors[0] ** 2)


def spectral_density(
    op: SymmetricOperator,
    n_probes: int = 10,
    n_steps: int = 64,
    probes: Tensor | None = None,
    generator: torch.Generator | None = None,
    progress: bool | None = None,
) -> SpectralDensity:
    """Spectral density of a symmetric operator by stochastic Lanczos quadrature.

    Each probe runs ``n_steps`` Lanczos steps with full reorthogonalization (a basis of ``n_steps``
    vectors of size ``n`` per probe, freed before the next) and keeps the Gauss quadrature of its
    spectral measure. The probes are Rademacher vectors (or the rows of ``probes``), projected with
    ``op.project`` and normalized, so a projected operator gives the density of its restriction.

    Args:
        op: the symmetric operator, size ``n``.
        n_probes: random probes, at least 1 (ignored when ``probes`` is given).
        n_steps: Lanczos steps per probe, at least 1 (capped at ``n``): resolves the spectrum's
            moments up to order ``2 n_steps - 1`` exactly for each probe.
        probes: ``(p, n)`` start vectors instead of random ones.
        generator: random source of the probes.
        progress: show a progress bar (``None``: only on a terminal).

    Returns:
        [`SpectralDensity`][sharpness.SpectralDensity]; ``n_matvec = sum_i m_i``.

    Raises:
        ValueError: bad counts, a probe of the wrong size, or one with no component in the subspace.
    """
    started = time.perf_counter()
    if probes is None and (isinstance(n_probes, bool) or not isinstance(n_probes, (int, np.integer)) or n_probes < 1):
        raise ValueError(f"n_probes must be a positive integer, got {n_probes!r}")
    if isinstance(n_steps, bool) or not isinstance(n_steps, (int, np.integer)) or n_steps < 1:
        raise ValueError(f"n_steps must be a positive integer, got {n_steps!r}")
    if probes is not None and (probes.dim() != 2 or probes.shape[0] < 1 or probes.shape[1] != op.size):
        raise ValueError(f"probes must have shape (p >= 1, {op.size}), got {tuple(probes.shape)}")
    steps = min(int(n_steps), op.size)
    count = n_probes if probes is None else probes.shape[0]
    matvecs_before = op.n_matvec
    nodes: list[Tensor] = []
    weights: list[Tensor] = []
    with progress_bar(count * steps, "spectral density", progress) as bar:
        for i in range(count):
            if probes is None:
                start = _random((op.size,), op, generator).sign_()  # Rademacher (a zero draw is measure-zero)
            else:
                start = _as_vector(probes[i], op)
            before = float(torch.linalg.vector_norm(start))
            start = op.project(start)
            norm = float(torch.linalg.vector_norm(start))
            if norm <= _breakdown_threshold(op.dtype, 1) * before:
                raise ValueError(f"probe {i} has no component in the operator's subspace")
            basis = KrylovBasis(op.size, op.dtype, op.device)
            basis.append(start, 1.0 / norm)
            alphas: list[float] = []
            betas: list[float] = []
            for _ in range(steps):
                w, alpha, beta = lanczos_step(op, basis, betas[-1] if betas else 0.0)
                alphas.append(alpha)
                bar.update(1)
                if len(alphas) == steps or beta == 0.0:
                    break  # an invariant Krylov space makes the quadrature exact with fewer nodes
                basis.append(w)
                betas.append(beta)
            del basis, w
            t, wt = _quadrature(alphas, betas)
            nodes.append(t)
            weights.append(wt)
    return SpectralDensity(nodes, weights, n_steps, op.n_matvec - matvecs_before, time.perf_counter() - started)


def hessian_spectral_density(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    data: object,
    n_probes: int = 10,
    n_steps: int = 64,
    *,
    hvp: str = "auto",
    seed: int = 0,
    dtype: torch.dtype | None = None,
    objective: Objective | None = None,
    progress: bool | None = None,
) -> SpectralDensity:
    """Eigenvalue density of the Euclidean Hessian of the loss over the whole data set (SLQ, see
    `spectral_density`); ``info`` holds ``loss``, ``n_params``, ``n_samples`` and ``hvp_strategy``.

    Args:
        model: as for [`euclidean_sharpness`][sharpness.euclidean_sharpness].
        loss_fn: as for [`euclidean_sharpness`][sharpness.euclidean_sharpness].
        data: as for [`euclidean_sharpness`][sharpness.euclidean_sharpness].
        dtype: as for [`euclidean_sharpness`][sharpness.euclidean_sharpness].
        objective: as for [`euclidean_sharpness`][sharpness.euclidean_sharpness].
        progress: as for [`euclidean_sharpness`][sharpness.euclidean_sharpness].
        hvp: Hessian-vector product strategy (see [`Objective.hvp`][sharpness.Objective.hvp]).
        n_probes: as for [`spectral_density`][sharpness.spectral_density].
        n_steps: as for [`spectral_density`][sharpness.spectral_density].
        seed: seed of the random probes.
    """
    obj = build_objective(model, loss_fn, data, objective, dtype=dtype)
    op = HessianOperator(obj, hvp)
    generator = torch.Generator(device=op.device).manual_seed(seed)
    result = spectral_density(op, n_probes, n_steps, generator=generator, progress=progress)
    return dataclasses.replace(result, info={"metric": "euclidean", **obj.facts(), "hvp_strategy": op.strategy})
