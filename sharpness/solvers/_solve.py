"""Choose an eigen-solver by name, and the solver settings every sharpness measure shares (`Solver`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from sharpness._results import EigenResult
from sharpness.products._objective import HVP_STRATEGIES
from sharpness.products._operator import SymmetricOperator
from sharpness.solvers._lanczos import lanczos
from sharpness.solvers._lanczos_low_memory import low_memory_lanczos
from sharpness.solvers._power import power_iteration

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
    """The ``k`` largest algebraic eigenpairs of ``op`` with ``method`` in [`SOLVERS`][sharpness.SOLVERS]."""
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
class Solver:
    """How the top eigenpairs of a curvature operator are searched for: one settings object shared by every
    sharpness measure, epsilon-sharpness, invariance verification and eigenvector directions.

    Attributes:
        method: ``"lanczos"`` (default; keeps its Krylov basis, one parameter vector per iteration),
            ``"low-memory-lanczos"`` (three parameter vectors whatever the iteration count, about twice the
            Hessian-vector products; see `sharpness.low_memory_lanczos`) or ``"power"`` (deflated power
            iteration; on a quotient this is the Riemannian power method of Rangamani et al., Algorithm 1).
        tol: relative residual tolerance (Lanczos) or relative change of the Rayleigh quotient (power).
        max_iter: iteration cap (``None``: the solver's default). A solve that stops on it says
            ``converged=False``.
        hvp: Hessian-vector product strategy (see `sharpness.Objective.hvp`): ``"auto"``, ``"rop"``,
            ``"graph"``, ``"double_backward"`` or ``"jvp"``.
        seed: seed of the random start vector.

    Raises:
        ValueError: an unknown ``method`` or ``hvp``, a ``tol`` that is not a positive number, or a
            ``max_iter`` below 1.
    """

    method: str = "lanczos"
    tol: float = 1e-6
    max_iter: int | None = None
    hvp: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in SOLVERS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(SOLVERS)}")
        if self.hvp not in HVP_STRATEGIES:
            raise ValueError(f"unknown hvp strategy {self.hvp!r}; choose one of {', '.join(HVP_STRATEGIES)}")
        if isinstance(self.tol, bool) or not isinstance(self.tol, (int, float)) or not (0 < self.tol < math.inf):
            raise ValueError(f"tol must be a positive number, got {self.tol!r}")
        if self.max_iter is not None and (isinstance(self.max_iter, bool) or not isinstance(self.max_iter, int)
                                          or self.max_iter < 1):  # fmt: skip
            raise ValueError(f"max_iter must be a positive integer or None, got {self.max_iter!r}")

    def solve(self, op: SymmetricOperator, k: int = 1, progress: bool | None = None) -> EigenResult:
        """Top ``k`` eigenpairs of ``op``, from a start vector drawn with ``seed`` (``progress``: show a
        progress bar; ``None``: only on a terminal)."""
        generator = torch.Generator(device=op.device).manual_seed(self.seed)
        return top_eigenpairs(op, k, self.method, self.tol, self.max_iter, generator, progress)

    def to_dict(self) -> dict:
        """The settings as a JSON-serialisable dictionary."""
        return dataclasses.asdict(self)
