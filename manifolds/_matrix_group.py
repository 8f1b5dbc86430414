"""A symmetry group made of matrix factors (GL(k) and positive diagonal) next to the diagonal rescaling group.

A `Factor` is one copy of ``GL(k)`` (an invertible ``k x k`` matrix ``M``) or of the positive diagonal
group (a vector ``c > 0``, read as ``M = diag(c)``), together with the parameter blocks it moves. A
`Block` is a ``k``-long set of rows (``axis=0``; the entries of a vector) or columns (``axis=1``) of one
parameter tensor, optionally restricted to some indices of the other axis, and how ``M`` moves it:

=============  ===================  ===============================  =====================
``how``        rows (``axis=0``)    columns (``axis=1``)             tangent at ``exp(t Omega)``
=============  ===================  ===============================  =====================
``"T"``        ``X <- M^T X``       ``X <- X M^T``                   ``Omega^T``
``"inv"``      ``X <- M^-1 X``      ``X <- X M^-1``                  ``-Omega``
``"invT"``     ``X <- M^-T X``      ``X <- X M^-T``                  ``-Omega^T``
=============  ===================  ===============================  =====================

PyTorch stores a Linear's weight as ``(out, in)`` and computes ``x W^T + b``, so moving a head's output
features by ``y -> y M`` (row vectors) is ``W_rows <- M^T W_rows, b <- M^T b`` and undoing it in the next
layer is ``W_cols <- W_cols M^-T``. The vertical (orbit) tangent at a point along ``Omega`` (``k x k`` for GL,
a vector ``s`` with ``Omega = diag(s)`` for a diagonal factor) is the derivative of the block's map at
``M = I``: ``D X`` for rows and ``X D`` for columns, ``D`` the table's last column.

`MatrixSymmetry` holds the factors, the diagonal rescaling group of `manifolds._group` (which
acts on other tensors or other sides of them: nothing is claimed twice) and the reasons everything else is
pinned. The whole group's Lie algebra has coordinates ``xi = (log-scales of the diagonal group, vec(Omega_1),
..., s_j, ...)`` (row-major ``Omega``), in the order of ``factors``; a factor that is a subgroup of ``GL(k)`` (one
commuting with rotary position maps) has the coefficients on its algebra's basis instead (`Factor.algebra`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor, nn

from manifolds._group import RescalingGroup
from manifolds._group_discovery import Pin
from manifolds._layout import ParamLayout

_HOWS = ("T", "inv", "invT")
# the reason recorded for a factor left out because the diagonal rescaling group moves the same features
COVERED = "the diagonal rescaling group already moves these features"
# the reason recorded for a factor left out of a restriction (`MatrixSymmetry.restricted`): it moves a fixed tensor
FIXED = "it moves a parameter that must stay unchanged (frozen)"
_SYMBOL = {"T": "^T", "inv": "^-1", "invT": "^-T"}
_SYMBOL_TRANSPOSED = {"T": "", "inv": "^-T", "invT": "^-1"}  # the same action on the stored transpose


@dataclass(frozen=True)
class Block:
    """``k`` rows or columns of one parameter tensor that a factor moves.

    Attributes:
        name: the parameter's name in ``model.named_parameters()``.
        axis: 0 (rows of a matrix, entries of a vector) or 1 (columns of a matrix).
        index: the ``k`` rows (or columns), in the factor's order.
        other: the indices of the other axis the block covers (``None``: all of them).
        how: ``"T"``, ``"inv"`` or ``"invT"`` (see the module docstring).
        transposed: the tensor stores the layer's matrix transposed, ``(in, out)`` (HuggingFace's ``Conv1D``, a raw
            ``x @ W``): ``axis`` and ``index`` then refer to the ``(out, in)`` matrix, whose rows are the stored
            columns.
    """

    name: str
    axis: int
    index: tuple[int, ...]
    other: tuple[int, ...] | None
    how: str
    transposed: bool = False

    @property
    def stored_axis(self) -> int:
        """The axis of the stored tensor the block's ``index`` runs along."""
        return 1 - self.axis if self.transposed else self.axis

    def __post_init__(self):
        if self.how not in _HOWS or self.axis not in (0, 1):
            raise ValueError(f"invalid block {self}")

    def describe(self, symbol: str, diagonal: bool = False) -> str:
        """One line in the stored tensor's own terms (a transposed block's rows are its stored columns, acted on by
        the transposed matrix)."""
        span, axis = _span(self.index), self.stored_axis
        part = f"rows {span}" if axis == 0 else f"columns {span}"
        if self.other is not None:
            part += f" (within {'columns' if axis == 0 else 'rows'} {_span(self.other)})"
        if diagonal:
            mat = f"diag({symbol})" + ("" if self.how == "T" else "^-1")
        else:
            mat = f"{symbol}{(_SYMBOL_TRANSPOSED if self.transposed else _SYMBOL)[self.how]}"
        return f"{self.name} {part} <- {mat} (.)" if axis == 0 else f"{self.name} {part} <- (.) {mat}"


def _span(index: tuple[int, ...]) -> str:
    if index == tuple(range(index[0], index[0] + len(index))):
        return f"{index[0]}:{index[0] + len(index)}"
    return str(list(index))


@dataclass(frozen=True)
class Factor:
    """One factor of the group: ``GL(size)`` or a subgroup of it (``kind="GL"``), or positive diagonal
    (``kind="diagonal"``).

    Attributes:
        kind: ``"GL"`` or ``"diagonal"``.
        size: ``k``, the matrix size (GL) or the number of scales (diagonal).
        blocks: the parameter blocks it moves.
        label: what it is, e.g. ``"attention 'attn' head 0: query/key"``.
        symbol: the letter used in descriptions (``"A"``, ``"B"`` or ``"c"``).
        algebra: ``None`` for the whole ``GL(size)``; for a subgroup (the invertible matrices commuting with a
            query's and key's rotary position maps, `manifolds._rotary`), a basis of its Lie algebra, each element a
            ``k x k`` matrix given by its nonzero entries ``(row, column, value)``. The factor's coordinates are then
            the coefficients on this basis.
        absorption: for a value/output factor whose attention weights sum to one over the keys, ``(the value bias
            block, the output bias's name)``: adding ``u`` to the head's value bias and ``-Wo_h u`` to the output bias
            keeps the function (`manifolds._absorption`); else ``None``.
        unread: for a query/key factor that leaves the keys' bias unmoved because the output does not read it,
            ``(its name, the head's entries)`` (a parameter; ``None`` otherwise): any shift of them keeps the function.
    """

    kind: str
    size: int
    blocks: tuple[Block, ...]
    label: str
    symbol: str
    algebra: tuple[tuple[tuple[int, int, float], ...], ...] | None = None
    absorption: tuple[Block, str] | None = None
    unread: tuple[str, tuple[int, ...]] | None = None

    @property
    def dim(self) -> int:
        """The factor's dimension: ``size^2`` for GL, the basis size for a subgroup, ``size`` for a diagonal factor."""
        if self.algebra is not None:
            return len(self.algebra)
        return self.size * self.size if self.kind == "GL" else self.size

    @cached_property
    def _basis(self) -> Tensor:
        """The algebra's basis as a dense ``(dim, k, k)`` float64 tensor (a subgroup only)."""
        basis = torch.zeros(len(self.algebra), self.size, self.size, dtype=torch.float64)
        for i, element in enumerate(self.algebra):
            for a, b, value in element:
                basis[i, a, b] = value
        return basis

    def omega(self, coordinates: Tensor) -> Tensor:
        """The Lie-algebra matrices ``(..., k, k)`` of GL-factor coordinates ``(..., dim)`` (row-major for the whole
        ``GL(k)``, basis coefficients for a subgroup)."""
        if self.algebra is None:
            return coordinates.reshape(*coordinates.shape[:-1], self.size, self.size)
        basis = self._basis.to(coordinates.device, coordinates.dtype)
        return torch.einsum("...d,dab->...ab", coordinates, basis)

    def nonzeros(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The algebra's basis as entries ``(coordinate, row, column, value)`` (long, long, long, float64): for the
        whole ``GL(k)`` coordinate ``a k + b`` is ``E_ab``."""
        if self.algebra is None:
            t = torch.arange(self.size * self.size)
            return t, t // self.size, t % self.size, torch.ones(t.shape, dtype=torch.float64)
        entries = [(i, a, b, v) for i, element in enumerate(self.algebra) for a, b, v in element]
        i, a, b, v = zip(*entries) if entries else ((), (), (), ())
        return (torch.tensor(i, dtype=torch.long), torch.tensor(a, dtype=torch.long),
                torch.tensor(b, dtype=torch.long), torch.tensor(v, dtype=torch.float64))  # fmt: skip

    def describe(self) -> str:
        if self.kind == "diagonal":
            group = f"positive diagonal ({self.size})"
        elif self.algebra is None:
            group = f"GL({self.size})"
        else:
            group = f"the subgroup of GL({self.size}) commuting with its position maps"
        lines = [f"{self.label}: {group}, dimension {self.dim}"]
        lines.extend(f"    {b.describe(self.symbol, self.kind == 'diagonal')}" for b in self.blocks)
        if self.absorption is not None:  # a translation beside the factor (`manifolds._absorption`)
            bias, output = self.absorption
            readers = ", ".join(f"{b.name} columns {_span(b.index)}" for b in self.blocks if b.axis == 1)
            lines.append(f"    and the shift {bias.name} rows {_span(bias.index)} <- (.) + u, {output} <- (.) - W u "
                         f"(W: {readers})")  # fmt: skip
        return "\n".join(lines)


@dataclass(frozen=True)
class SymmetryElement:
    """One element of a [`MatrixSymmetry`][manifolds.MatrixSymmetry].

    Attributes:
        log_scales: ``(diagonal_dim,)`` log-scales of the diagonal rescaling group.
        matrices: one entry per factor: an invertible ``(k, k)`` matrix (GL) or a positive ``(k,)`` vector.
    """

    log_scales: Tensor
    matrices: tuple[Tensor, ...]


def _transform(m: Tensor, how: str, diagonal: bool) -> Tensor:
    """``M^T``, ``M^-1`` or ``M^-T`` (for a diagonal factor, the vector ``c`` or ``1 / c``)."""
    if diagonal:
        return m if how == "T" else 1.0 / m
    if how == "T":
        return m.T
    inv = torch.linalg.inv(m)
    return inv if how == "inv" else inv.T


def _grid(block: Block, shape: tuple[int, ...], device: torch.device) -> tuple[Tensor, ...]:
    """Index tensors selecting the block as a ``(k, m)`` (rows) / ``(m, k)`` (columns) / ``(k,)`` array of the
    ``(out, in)`` matrix, whatever the stored layout: a transposed tensor is read (and written back) through the same
    grid with its two index tensors swapped, so no caller sees the layout."""
    idx = torch.tensor(block.index, dtype=torch.long, device=device)
    if len(shape) == 1:
        return (idx,)
    other_size = shape[block.axis] if block.transposed else shape[1 - block.axis]
    other = torch.arange(other_size, device=device) if block.other is None else torch.tensor(block.other, device=device)
    rows, columns = (idx[:, None], other[None, :]) if block.axis == 0 else (other[:, None], idx[None, :])
    return (columns, rows) if block.transposed else (rows, columns)


def _apply(x: Tensor, t: Tensor, axis: int, diagonal: bool) -> Tensor:
    """``t @ x`` (rows) or ``x @ t`` (columns); ``t`` a vector for a diagonal factor."""
    if diagonal:
        return t.reshape(-1, *([1] * (x.dim() - 1))) * x if axis == 0 else x * t
    return t @ x if axis == 0 else x @ t


class MatrixSymmetry:
    """The function-preserving group of a network: diagonal rescalings times GL and diagonal matrix factors.

    Built by `manifolds.transformer_symmetry`; see `manifolds._attention` for what is found and why
    it preserves the function.

    Attributes:
        factors: the matrix factors.
        diagonal: the diagonal rescaling group (``analyze(model).group``), or ``None``.
        pins: everything that is fixed, with the reason (the matrix part's; the diagonal group has its own).
        dim: the whole group's dimension, ``diagonal.dim + sum(factor.dim)``.
        matrix_dim: the factors' part of it.
    """

    def __init__(self, factors: tuple[Factor, ...], diagonal: RescalingGroup | None, pins: tuple[Pin, ...]):
        self.factors = factors
        self.diagonal = diagonal
        self.pins = pins
        self.diagonal_dim = 0 if diagonal is None else diagonal.dim
        self.matrix_dim = sum(f.dim for f in factors)
        self.dim = self.diagonal_dim + self.matrix_dim

    def __repr__(self) -> str:
        return (
            f"MatrixSymmetry(dim={self.dim}, diagonal_dim={self.diagonal_dim}, factors={len(self.factors)}, "
            f"pins={len(self.pins)})"
        )

    @property
    def names(self) -> tuple[str, ...]:
        """Every parameter the group acts on (diagonal group included), in first-seen order."""
        names = [] if self.diagonal is None else [a.name for a in self.diagonal.parameter_actions]
        names.extend(b.name for f in self.factors for b in f.blocks)
        return tuple(dict.fromkeys(names))

    def describe(self) -> str:
        """A readable report: dimensions, every factor with the blocks it moves, and what is pinned."""
        n_gl = sum(f.kind == "GL" for f in self.factors)
        lines = [
            f"symmetry group of dimension {self.dim}: diagonal rescalings {self.diagonal_dim}, "
            f"{n_gl} GL factor(s) and {len(self.factors) - n_gl} diagonal factor(s) of total dimension "
            f"{self.matrix_dim}"
        ]
        lines.extend(f.describe() for f in self.factors)
        pinned = [pin for pin in self.pins if pin.reason != COVERED]
        covered = [pin.where for pin in self.pins if pin.reason == COVERED]
        if covered:  # not pinned: free, in the diagonal group's dimension
            lines.append(f"moved by the diagonal rescaling group instead: {'; '.join(covered)}")
        if pinned:
            lines.append("pinned:")
            lines.extend(f"  {pin}" for pin in pinned)
        unknown = () if self.diagonal is None else self.diagonal.unknown
        if unknown:  # why the diagonal group may be smaller than a reader expects (on a transformer the factors above
            # may move what they pin: attention, einsums)
            lines.append(f"the diagonal rescaling group pins the inputs and outputs of {len(unknown)} operation(s) its "
                         "rules do not know: see .diagonal.describe()")  # fmt: skip
        return "\n".join(lines)

    def restricted(self, names: Iterable[str]) -> MatrixSymmetry:
        """The subgroup that leaves every parameter outside ``names`` unchanged (e.g. frozen parameters).

        A factor moving any tensor outside ``names`` is left out whole, with the reason in ``pins``: at a generic
        point no element of it but the identity leaves that tensor as it is (``W_Q A = W_Q`` forces ``A = I`` where
        ``W_Q`` has full column rank, ``gamma c = gamma`` forces ``c = 1`` where no scale is zero). The diagonal group
        is restricted likewise (`manifolds.RescalingGroup.restricted`). Returns ``self`` when nothing changes.

        Args:
            names: the parameters that may move (e.g. the trainable ones, or a ``{name: tensor}`` mapping of them).
        """
        kept = set(names)
        factors = tuple(f for f in self.factors if all(b.name in kept for b in f.blocks))
        diagonal = None if self.diagonal is None else self.diagonal.restricted(kept)
        if len(factors) == len(self.factors) and diagonal is self.diagonal:
            return self
        pins = self.pins + tuple(Pin(f.label, f.size, FIXED) for f in self.factors if f not in factors)
        return MatrixSymmetry(factors, diagonal, pins)

    # -- elements ------------------------------------------------------------------------------------------
    def identity(self, dtype: torch.dtype = torch.float64) -> SymmetryElement:
        """The identity element."""
        return self.exp(torch.zeros(self.dim, dtype=dtype))

    def exp(self, xi: Tensor) -> SymmetryElement:
        """The element ``exp(xi)`` for Lie-algebra coordinates ``xi`` of shape ``(dim,)`` (module docstring)."""
        if xi.shape != (self.dim,):
            raise ValueError(f"xi must have shape ({self.dim},), got {tuple(xi.shape)}")
        parts = torch.split(xi, [self.diagonal_dim, *[f.dim for f in self.factors]])
        matrices = tuple(
            torch.linalg.matrix_exp(f.omega(p)) if f.kind == "GL" else torch.exp(p)
            for f, p in zip(self.factors, parts[1:])
        )
        return SymmetryElement(parts[0], matrices)

    def random_element(
        self, scale: float = 1.0, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64
    ) -> SymmetryElement:
        """A random, well-conditioned element.

        Log-scales (diagonal group and diagonal factors) are i.i.d. ``N(0, scale^2)``. A GL factor is
        ``U diag(exp(scale z)) V^T`` with ``U``, ``V`` Haar-random orthogonal and ``z`` standard normal clipped to
        ``[-2, 2]``, so its condition number is at most ``exp(4 scale)``. A subgroup's factor is ``exp(Omega)``,
        ``Omega`` a combination of its algebra's basis with standard normal coefficients scaled to the spectral norm
        ``2 scale``: the same bound.

        Args:
            scale: spread of the log-scales and log-singular values.
            generator: random generator (CPU), or ``None`` for the global one.
            dtype: dtype of the element.
        """
        log_scales = scale * torch.randn(self.diagonal_dim, generator=generator, dtype=dtype)
        matrices = []
        for f in self.factors:
            if f.kind == "diagonal":
                matrices.append(torch.exp(scale * torch.randn(f.size, generator=generator, dtype=dtype)))
                continue
            if f.algebra is not None:
                omega = f.omega(torch.randn(f.dim, generator=generator, dtype=dtype))
                norm = torch.linalg.matrix_norm(omega, 2)
                matrices.append(torch.linalg.matrix_exp(omega * (2 * scale / norm) if norm > 0 else omega))
                continue
            u, v = (_orthogonal(f.size, generator, dtype) for _ in range(2))
            z = torch.randn(f.size, generator=generator, dtype=dtype).clamp(-2.0, 2.0)
            matrices.append(u @ torch.diag(torch.exp(scale * z)) @ v.T)
        return SymmetryElement(log_scales, tuple(matrices))

    # -- action ---------------------------------------------------------------------------------------------
    def act(self, params: Mapping[str, Tensor], element: SymmetryElement) -> dict[str, Tensor]:
        """Apply ``element`` to ``{name: tensor}`` (functional and differentiable; nothing is modified).

        Args:
            params: parameters; tensors the group does not act on pass through, and every tensor it acts on
                must be present.
            element: the group element (cast to each tensor's dtype and device).

        Returns:
            A new dictionary with the same keys.

        Raises:
            KeyError: a tensor the group acts on is missing.
            ValueError: ``element`` does not match the factors.
        """
        if len(element.matrices) != len(self.factors):
            raise ValueError(f"the element has {len(element.matrices)} matrices for {len(self.factors)} factors")
        missing = [n for n in self.names if n not in params]
        if missing:
            raise KeyError(f"the tensors lack {', '.join(missing)}, which the symmetry group acts on")
        out = dict(params)
        if self.diagonal is not None and self.diagonal_dim:
            out = self.diagonal.act(out, element.log_scales)
        for f, m in zip(self.factors, element.matrices):
            expected = (f.size, f.size) if f.kind == "GL" else (f.size,)
            if tuple(m.shape) != expected:
                raise ValueError(f"{f.label}: expected a matrix of shape {expected}, got {tuple(m.shape)}")
            diagonal = f.kind == "diagonal"
            for b in f.blocks:
                t = out[b.name]
                grid = _grid(b, tuple(t.shape), t.device)
                # inverted in the element's dtype (float64 by default): bfloat16 and float16 have no inverse in torch
                mt = _transform(m.to(t.device), b.how, diagonal).to(t.dtype)
                out[b.name] = torch.index_put(t, grid, _apply(t[grid], mt, b.axis, diagonal))
        return out

    def transformed(self, model: nn.Module, element: SymmetryElement) -> nn.Module:
        """A deep copy of ``model`` with ``element`` applied to its parameters (the same function)."""
        twin = copy.deepcopy(model)
        own = dict(twin.named_parameters(remove_duplicate=False))
        new = self.act({n: own[n].detach() for n in self.names}, element)
        with torch.no_grad():
            for name in self.names:
                own[name].copy_(new[name])
        return twin

    # -- vertical space ---------------------------------------------------------------------------------------
    def vertical(self, params: Mapping[str, Tensor], xi: Tensor) -> dict[str, Tensor]:
        """The orbit tangent ``d/dt act(params, exp(t xi))`` at ``t = 0``, in the stored parameter layout.

        Args:
            params: the point (every tensor the group acts on).
            xi: ``(dim,)`` Lie-algebra coordinates.

        Returns:
            ``{name: tangent}`` for every tensor the group acts on (zeros outside the blocks).
        """
        if xi.shape != (self.dim,):
            raise ValueError(f"xi must have shape ({self.dim},), got {tuple(xi.shape)}")
        out = {n: torch.zeros_like(params[n]) for n in self.names}
        parts = torch.split(xi, [self.diagonal_dim, *[f.dim for f in self.factors]])
        if self.diagonal is not None and self.diagonal_dim:
            s = self.diagonal.extended(parts[0])
            for a in self.diagonal.parameter_actions:
                t = params[a.name]
                out[a.name] = out[a.name] + t * a.log_factor(s.to(t.device, t.dtype))
        for f, p in zip(self.factors, parts[1:]):
            diagonal = f.kind == "diagonal"
            omega = p if diagonal else f.omega(p)
            for b in f.blocks:
                t = params[b.name]
                om = omega.to(t.device, t.dtype)
                d = om if b.how == "T" else -om
                if not diagonal and b.how in ("T", "invT"):
                    d = d.T
                grid = _grid(b, tuple(t.shape), t.device)
                out[b.name] = torch.index_put(out[b.name], grid, _apply(t[grid], d, b.axis, diagonal), accumulate=True)
        return out

    def vertical_adjoint(self, params: Mapping[str, Tensor], tangent: Mapping[str, Tensor]) -> Tensor:
        """The transpose of `vertical`: ``(dim,)`` with entry ``i`` the inner product of ``tangent`` with
        the orbit tangent of the ``i``-th coordinate (tensors missing from ``tangent`` count as zero)."""
        names = [n for n in self.names if n in tangent]
        first = next(iter(params.values()))
        xi0 = torch.zeros(self.dim, dtype=first.dtype, device=first.device)  # the coordinates live with the point

        def flat(xi: Tensor) -> dict[str, Tensor]:
            v = self.vertical(params, xi)
            return {n: v[n] for n in names}

        _, pullback = torch.func.vjp(flat, xi0)
        (out,) = pullback({n: tangent[n] for n in names})
        return out

    def vertical_basis(self, params: Mapping[str, Tensor]) -> Tensor:
        """The dense ``(n, dim)`` matrix of orbit tangents, rows in the flat order of ``params``
        ([`manifolds.ParamLayout`][manifolds.ParamLayout]); for small models and checks."""
        layout = ParamLayout.from_tensors(params)
        first = next(iter(params.values()))
        dtype = first.dtype
        eye = torch.eye(self.dim, dtype=dtype, device=first.device)
        columns = []
        for i in range(self.dim):
            v = self.vertical(params, eye[i])
            columns.append(layout.flatten({n: v.get(n, torch.zeros_like(t)) for n, t in params.items()}))
        return torch.stack(columns, dim=1) if columns else torch.zeros(layout.size, 0, dtype=dtype, device=first.device)


def _orthogonal(k: int, generator: torch.Generator | None, dtype: torch.dtype) -> Tensor:
    """A Haar-random ``k x k`` orthogonal matrix (QR of a Gaussian matrix with the sign fix)."""
    q, r = torch.linalg.qr(torch.randn(k, k, generator=generator, dtype=dtype))
    return q * torch.sign(torch.diagonal(r))
