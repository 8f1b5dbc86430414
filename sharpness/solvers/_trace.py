"""Hutchinson's stochastic trace estimator with Rademacher probes."""

from __future__ import annotations

import math
import time

import torch

from sharpness._progress import progress_bar
from sharpness._results import TraceResult
from sharpness.products._operator import SymmetricOperator
from sharpness.solvers._vectors import _project_rows


def hutchinson_trace(
    op: SymmetricOperator,
    n_probes: int = 100,
    batch_size: int = 10,
    generator: torch.Generator | None = None,
    progress: bool | None = None,
) -> TraceResult:
    """Trace of a symmetric operator on its subspace, ``E[z^T A z]`` over Rademacher probes ``z``.

    Probes are projected with ``op.project`` (and so are the products), so the estimate is the trace of
    the operator restricted to its subspace, ``tr(P A P)``. They are applied ``batch_size`` at a time
    through ``op.matmat``. For a diagonal operator without projection every probe gives the exact trace.

    Args:
        op: the symmetric operator, size ``n``.
        n_probes: number of probes.
        batch_size: probes per ``op.matmat`` call (memory: ``batch_size`` vectors of size ``n``).
        generator: random source for the probes.
        progress: show a progress bar (``None``: only on a terminal).

    Returns:
        ``TraceResult``: ``estimate`` = mean of the ``samples`` ``z_i^T A z_i`` (``(n_probes,)`` float64
            CPU tensor), ``stderr`` = their sample standard deviation over ``sqrt(n_probes)`` (NaN for a
            single probe).

    Raises:
        ValueError: ``n_probes`` or ``batch_size`` below 1.
    """
    if n_probes < 1:
        raise ValueError(f"n_probes must be at least 1, got {n_probes}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    started = time.perf_counter()
    matvecs_before = op.n_matvec
    device = op.device if generator is None else generator.device
    chunks = []
    with progress_bar(n_probes, "hutchinson", progress) as bar:
        for first in range(0, n_probes, batch_size):
            b = min(batch_size, n_probes - first)
            signs = torch.randint(0, 2, (b, op.size), generator=generator, device=device, dtype=op.dtype)
            probes = _project_rows(op, op.comm.broadcast_((2 * signs - 1).to(op.device)))  # process 0's draw
            products = _project_rows(op, op.matmat(probes))
            chunks.append((probes.double() * products.double()).sum(dim=1).cpu())
            bar.update(b)
    samples = torch.cat(chunks)
    stderr = float(samples.std() / math.sqrt(n_probes)) if n_probes > 1 else float("nan")
    return TraceResult(
        estimate=float(samples.mean()),
        stderr=stderr,
        n_probes=n_probes,
        n_matvec=op.n_matvec - matvecs_before,
        samples=samples,
        seconds=time.perf_counter() - started,
    )
