"""Choose an eigen-solver by name, and the solver settings every sharpness measure shares."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sharpness._lanczos import lanczos
from sharpness._lanczos_low_memory import low_memory_lanczos
from sharpness._operator import SymmetricOperator
from sharpness._power import power_iteration
from sharpness._results import EigenResult

SOLVERS = ("lanczos", "low-memory-lanczos", "power")


def top_eigenpairs(
    op: SymmetricOperator,
    k: int = 1,
    method: str = "lanczos",
    tol: float = 1e-6,
    max_iter: int | None = None,
    generator: torch.Generator | None = None,
    progress: bool | None = None,
) -> EigenResult:
    """The ``k`` largest algebraic eigenpairs of ``op`` with ``method`` in :data:`SOLVERS`."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if method == "lanczos":
        return lanczos(op, k=k, tol=tol, max_iter=max_iter, generator=generator, progress=progress)
    if method == "low-memory-lanczos":
        return low_memory_lanczos(op, k=k, tol=tol, max_iter=max_iter, generator=generator, progress=progress)
    if method == "power":
        kwargs = {} if max_iter is None else {"max_iter": max_iter}
        return power_iteration(op, k=k, tol=tol, generator=generator, progress=progress, **kwargs)
    raise ValueError(f"unknown method {method!r}; choose one of {', '.join(SOLVERS)}")


@dataclass(frozen=True)
class SolveSettings:
    """How the eigenpairs are searched for (see :func:`sharpness.euclidean_sharpness`)."""

    k: int = 1
    method: str = "lanczos"
    tol: float = 1e-6
    max_iter: int | None = None
    hvp: str = "auto"
    seed: int = 0
    progress: bool | None = None

    def solve(self, op: SymmetricOperator) -> EigenResult:
        """Top ``k`` eigenpairs of ``op``, from a start vector drawn with ``seed``."""
        generator = torch.Generator(device=op.device).manual_seed(self.seed)
        return top_eigenpairs(op, self.k, self.method, self.tol, self.max_iter, generator, self.progress)
