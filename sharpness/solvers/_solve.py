"""Choose an eigen-solver by name, and the solver settings every sharpness measure shares (`Solver`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from sharpness._results import EigenResult
from sharpness.products._objective import HVP_STRATEGIES
from sharpness.products._operator import SymmetricOperator
from sharpness.solvers._lanczos import lanczos
from sharpness.solvers._lanczos_low_memory import low_memory_lanczos
from sharpness.solvers._power import power_iteration
from sharpness.solvers._vectors import _random

SOLVERS = ("lanczos", "low-memory-lanczos", "power")
# How a solve's start vector is made (`Solver.start`).
STARTS = ("gradient", "random")


def top_eigenpairs(
    op: SymmetricOperator,
    k: int = 1,
    method: str = "lanczos",
    tol: float = 1e-6,
    max_iter: int | None = None,
    generator: torch.Generator | None = None,
    progress: bool | None = None,
    v0: Tensor | None = None,
) -> EigenResult:
    """The ``k`` largest algebraic eigenpairs of ``op`` with ``method`` in [`SOLVERS`][sharpness.SOLVERS] (``v0``: the
    start vector of the first pair, ``(n,)``; random by default)."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if method == "lanczos":
        return lanczos(op, k=k, tol=tol, max_iter=max_iter, v0=v0, generator=generator, progress=progress)
    if method == "low-memory-lanczos":
        return low_memory_lanczos(op, k=k, tol=tol, max_iter=max_iter, v0=v0, generator=generator, progress=progress)
    if method == "power":
        kwargs = {} if max_iter is None else {"max_iter": max_iter}
        return power_iteration(op, k=k, tol=tol, v0=v0, generator=generator, progress=progress, **kwargs)
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
        start: ``"random"`` (default): the start vector is a random unit vector; ``"gradient"``: the random unit
            vector plus the loss's gradient in the operator's coordinates at unit length, where the operator offers
            one ([`SymmetricOperator.start_hint`][sharpness.SymmetricOperator.start_hint]: every measure's operator
            does). Away from a critical point the top eigenvectors of the Hessian lean towards the gradient
            (Gur-Ari, Roberts and Dyer, "Gradient descent happens in a tiny subspace", 2018), so the Krylov space
            holds them sooner: on the built-in transformer and a small CNN briefly trained
            (`bench/_workloads.py`: cosines 0.90 and 0.86 between the gradient and the top eigenvector) Lanczos at
            ``tol=2e-3`` needed 4 products instead of 5-7. It is not the default because it can miss the top
            eigenvalue: the stopping rule certifies that a Ritz pair has converged, not that it is the top one, and
            where the gradient leans towards another eigenvector whose eigenvalue is close to the top (within a few
            percent) while it is nearly orthogonal to the top one, the start holds that other eigenvector many times
            more than the top one (about ``sqrt(n)`` times), and the solve can stop on it, reporting it converged. A
            random start gives every eigenvector a comparable share, so that is unlikely there. Use it for fast
            solves away from a minimum (cross-check against a random start where the top eigenvalues cluster).
            The gradient is read off the products' kept state where it holds every layer's error (graphs of
            Linear, Conv and BatchNorm layers, chains) or the autograd graph the products keep, else it costs one
            forward and backward pass (not counted in ``n_matvec``); the start vector is one parameter vector more
            held during the solve (``low-memory-lanczos``: four instead of three). Density and trace estimates never
            use it.
            ``EigenResult.info["start"]`` says which start a solve had.

    Raises:
        ValueError: an unknown ``method``, ``hvp`` or ``start``, a ``tol`` that is not a positive number, or a
            ``max_iter`` below 1.
    """

    method: str = "lanczos"
    tol: float = 1e-6
    max_iter: int | None = None
    hvp: str = "auto"
    seed: int = 0
    start: str = "random"

    def __post_init__(self) -> None:
        if self.method not in SOLVERS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(SOLVERS)}")
        if self.start not in STARTS:
            raise ValueError(f"unknown start {self.start!r}; choose one of {', '.join(STARTS)}")
        if self.hvp not in HVP_STRATEGIES:
            raise ValueError(f"unknown hvp strategy {self.hvp!r}; choose one of {', '.join(HVP_STRATEGIES)}")
        if isinstance(self.tol, bool) or not isinstance(self.tol, (int, float)) or not (0 < self.tol < math.inf):
            raise ValueError(f"tol must be a positive number, got {self.tol!r}")
        if self.max_iter is not None and (isinstance(self.max_iter, bool) or not isinstance(self.max_iter, int)
                                          or self.max_iter < 1):  # fmt: skip
            raise ValueError(f"max_iter must be a positive integer or None, got {self.max_iter!r}")

    def solve(self, op: SymmetricOperator, k: int = 1, progress: bool | None = None) -> EigenResult:
        """Top ``k`` eigenpairs of ``op``, from a start vector drawn with ``seed`` and made as ``start`` says
        (``progress``: show a progress bar; ``None``: only on a terminal)."""
        generator = torch.Generator(device=op.device).manual_seed(self.seed)
        v0 = self._start_vector(op, generator) if self.start == "gradient" else None
        result = top_eigenpairs(op, k, self.method, self.tol, self.max_iter, generator, progress, v0)
        return result.replace(info={**result.info, "start": "random" if v0 is None else "gradient"})

    @staticmethod
    def _start_vector(op: SymmetricOperator, generator: torch.Generator) -> Tensor | None:
        """A random unit vector of ``op``'s subspace plus its projected `start_hint` at unit length, or ``None``
        where there is no hint, or it vanishes in the subspace or is not finite (the solver then draws its own
        random start from the same ``generator``, as with ``start="random"``)."""
        hint = op.start_hint()
        if hint is None:
            return None
        hint = op.project(hint.to(device=op.device, dtype=op.dtype))
        norm = float(torch.linalg.vector_norm(hint))
        if not (0.0 < norm < math.inf):
            return None
        state = generator.get_state()
        random = op.project(_random((op.size,), op, generator))
        length = float(torch.linalg.vector_norm(random))
        if length == 0.0:  # a subspace of dimension 0: the solver says so from its own draw
            generator.set_state(state)
            return None
        return random.div_(length).add_(hint, alpha=1.0 / norm)

    def to_dict(self) -> dict:
        """The settings as a JSON-serialisable dictionary."""
        return dataclasses.asdict(self)
