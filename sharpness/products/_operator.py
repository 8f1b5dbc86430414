"""Symmetric linear operators on flat vectors, the common input of every eigen-solver.

An operator maps ``(n,)`` vectors to ``(n,)`` vectors (``matvec``) and ``(k, n)`` blocks to
``(k, n)`` blocks (``matmat``). It may restrict itself to a subspace (e.g. the horizontal space of
a quotient) through ``project``: solvers project their start vectors and every product, so vectors
outside the subspace never enter the spectrum. An operator whose products are projected already says so
(``products_in_subspace``), and then solvers re-project only every few products, against rounding; a solver
that applies it to its own (projected) vectors says so (``in_subspace=True``), so the operator may skip
projecting them again.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np
import scipy.sparse.linalg as spla
import torch
from torch import Tensor

from sharpness.products._distributed import SINGLE_PROCESS, Communicator


class SymmetricOperator(ABC):
    """Base class. Subclasses implement `_matvec` (and optionally `_matmat`).

    Attributes:
        size: dimension ``n``.
        dtype: of the vectors it accepts and returns.
        device: of the vectors it accepts and returns.
        n_matvec: number of vectors the operator has been applied to so far.
        comm: the processes that apply it together (products of a data set shared among processes): solvers
            draw their random vectors and take their stopping decisions through it, so every process does
            the same.
        products_in_subspace: whether every product (`matvec`, `matvec_add` onto a vector of the subspace,
            `matmat`) already lies in the subspace of `project`, to rounding (``False`` by default). Solvers
            then skip re-projecting the products, except every few steps against the drift of rounding.
    """

    products_in_subspace: bool = False

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 comm: Communicator = SINGLE_PROCESS):  # fmt: skip
        self.size = int(size)
        self.dtype = dtype
        self.device = torch.device(device)
        self.n_matvec = 0
        self.comm = comm

    @abstractmethod
    def _matvec(self, v: Tensor) -> Tensor:
        """``A @ v`` without counting."""

    def _matmat(self, vs: Tensor) -> Tensor:
        return torch.stack([self._matvec(v) for v in vs])

    def matvec(self, v: Tensor, in_subspace: bool = False) -> Tensor:
        """``A @ v`` for ``v`` of shape ``(n,)``.

        ``in_subspace=True`` is the caller's promise that ``v`` lies in the subspace of `project` (to rounding):
        an operator ``A = P B P`` may then skip projecting ``v``. The result is ``A v`` either way (up to
        rounding); without the promise every ``v`` is taken as it is.
        """
        self.n_matvec += 1
        return self._matvec_in_subspace(v) if in_subspace else self._matvec(v)

    def matvec_add(self, v: Tensor, out: Tensor, in_subspace: bool = False) -> Tensor:
        """``out += A @ v`` in place and return ``out`` (both ``(n,)``, not sharing storage).

        Operators that can add their product straight into ``out`` (`HessianOperator`) spare a
        product-sized temporary: low-memory solvers keep one vector fewer that way. ``in_subspace=True``:
        both ``v`` and ``out`` lie in the subspace of `project` (to rounding); see `matvec`.
        """
        self.n_matvec += 1
        return self._matvec_add_in_subspace(v, out) if in_subspace else self._matvec_add(v, out)

    def _matvec_add(self, v: Tensor, out: Tensor) -> Tensor:
        return out.add_(self._matvec(v))

    def _matvec_in_subspace(self, v: Tensor) -> Tensor:
        """``A @ v`` for ``v`` in the subspace (default: as any ``v``)."""
        return self._matvec(v)

    def _matvec_add_in_subspace(self, v: Tensor, out: Tensor) -> Tensor:
        """``out += A @ v`` for ``v`` and ``out`` in the subspace (default: as any)."""
        return self._matvec_add(v, out)

    def matmat(self, vs: Tensor) -> Tensor:
        """``(A @ vs.T).T`` for a block ``vs`` of shape ``(k, n)``."""
        self.n_matvec += vs.shape[0]
        return self._matmat(vs)

    def start_hint(self) -> Tensor | None:
        """The loss gradient in the operator's coordinates, ``(n,)``, or ``None`` where the operator offers none (the
        default). Eigen-solvers started with [`Solver(start="gradient")`][sharpness.Solver] add it, at unit length,
        to their random unit start vector: the top eigenvectors of a loss's curvature lean towards its gradient
        away from critical points, so the Krylov space holds them sooner; elsewhere it costs little (see
        `Solver`). Computed when called (a gradient pass at most), identical on every process."""
        return None

    def project(self, v: Tensor) -> Tensor:
        """Orthogonal projection onto the subspace the operator lives on (identity by default).

        Contract the solvers rely on: ``v`` is never modified; the result is ``v`` itself when the operator has
        no projection, and a new tensor otherwise."""
        return v

    def to_scipy(self) -> spla.LinearOperator:
        """A float64 ``scipy.sparse.linalg.LinearOperator`` view (for ``eigsh`` and friends)."""

        def mv(x: np.ndarray) -> np.ndarray:
            v = torch.as_tensor(np.ascontiguousarray(x).reshape(-1), dtype=self.dtype, device=self.device)
            return self.matvec(v).detach().cpu().double().numpy()

        return spla.LinearOperator((self.size, self.size), matvec=mv, rmatvec=mv, dtype=np.float64)


class DenseOperator(SymmetricOperator):
    """A symmetric matrix given explicitly, shape ``(n, n)`` (tests, small problems)."""

    def __init__(self, matrix: Tensor, project: Callable[[Tensor], Tensor] | None = None):
        if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
            raise ValueError(f"a square matrix is needed, got shape {tuple(matrix.shape)}")
        super().__init__(matrix.shape[0], matrix.dtype, matrix.device)
        self.matrix = matrix
        self._project = project

    def _matvec(self, v: Tensor) -> Tensor:
        return self.matrix @ v

    def _matmat(self, vs: Tensor) -> Tensor:
        return vs @ self.matrix.T

    def project(self, v: Tensor) -> Tensor:
        return v if self._project is None else self._project(v)


class CallableOperator(SymmetricOperator):
    """Wraps ``matvec`` (and optionally a batched ``matmat``) functions on flat vectors.

    Args:
        matvec: ``(n,) -> (n,)``, the product of any vector.
        size: ``n``.
        dtype: of the vectors.
        device: of the vectors.
        matmat: ``(k, n) -> (k, n)``, a batched product (default: ``matvec`` row by row).
        project: the orthogonal projection onto the operator's subspace (default: none).
        comm: the processes that apply it together.
        matvec_in_subspace: ``(v, out=None) -> A v`` for ``v`` in the subspace of ``project``, added to ``out`` in
            place when given (``out`` in the subspace too) and returned: the product without projecting ``v``
            again (default: ``matvec``).
        products_in_subspace: whether every product of ``matvec``, ``matmat`` and ``matvec_in_subspace`` is
            already projected (see [`SymmetricOperator`][sharpness.SymmetricOperator]).
        start_hint: ``() -> (n,) or None``, the loss gradient in the operator's coordinates (see
            [`SymmetricOperator.start_hint`][sharpness.SymmetricOperator.start_hint]; default: none).
    """

    def __init__(
        self,
        matvec: Callable[[Tensor], Tensor],
        size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        matmat: Callable[[Tensor], Tensor] | None = None,
        project: Callable[[Tensor], Tensor] | None = None,
        comm: Communicator = SINGLE_PROCESS,
        matvec_in_subspace: Callable[..., Tensor] | None = None,
        products_in_subspace: bool = False,
        start_hint: Callable[[], Tensor | None] | None = None,
    ):
        super().__init__(size, dtype, device, comm)
        self._hint = start_hint
        self._mv = matvec
        self._mm = matmat
        self._project = project
        self._mv_in_subspace = matvec_in_subspace
        self.products_in_subspace = bool(products_in_subspace)

    def _matvec(self, v: Tensor) -> Tensor:
        return self._mv(v)

    def _matvec_in_subspace(self, v: Tensor) -> Tensor:
        return self._mv(v) if self._mv_in_subspace is None else self._mv_in_subspace(v)

    def _matvec_add_in_subspace(self, v: Tensor, out: Tensor) -> Tensor:
        return self._matvec_add(v, out) if self._mv_in_subspace is None else self._mv_in_subspace(v, out=out)

    def _matmat(self, vs: Tensor) -> Tensor:
        return self._mm(vs) if self._mm is not None else super()._matmat(vs)

    def start_hint(self) -> Tensor | None:
        return None if self._hint is None else self._hint()

    def project(self, v: Tensor) -> Tensor:
        return v if self._project is None else self._project(v)
