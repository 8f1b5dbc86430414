"""Linear algebra of the node-wise rescaling symmetry in log coordinates ``u = log|w|``.

Rescaling hidden unit ``a`` by ``exp(t c_a)`` adds ``t c_a`` to ``u`` on its incoming weights and bias and
subtracts it on its outgoing weights, so the orbit through any point is an affine subspace
``u + range(J)`` with a constant ``(n, H)`` matrix ``J`` of entries ``+1, -1, 0``. :class:`NodeSymmetry`
applies ``J``, its transpose, its Gram matrix and the projection onto ``range(J)^perp`` without forming
``J``: every weight block is viewed as ``(out_units, prev_units, rest)`` and handled by broadcasting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from manifolds._layout import ParamLayout
from manifolds._structure import NetworkStructure


@dataclass(frozen=True)
class _Block:
    weight: slice  # position of the weight in the flat vector
    bias: slice | None
    out_units: int
    prev_units: int  # units of the previous layer (1 for the first layer: no column factor)
    rest: int  # weight entries per (output unit, previous unit) pair: in_group * kernel size
    row: int | None  # offset of this layer's units among the H hidden units (None for the last layer)
    col: int | None  # offset of the previous layer's units (None for the first layer)


class NodeSymmetry:
    """The infinitesimal node-wise rescaling ``J`` (``(n, H)``) of a rescalable network in log coordinates.

    Args:
        structure: from :func:`manifolds.analyze`; must be rescalable.
        layout: flat layout of the parameters; must contain every layer's weight and bias. Parameters
            outside the layers get zero rows of ``J``.

    Attributes:
        dim: ``H``, the number of hidden units (columns of ``J``).
        size: ``n``, the length of the flat parameter vector (rows of ``J``).
    """

    def __init__(self, structure: NetworkStructure, layout: ParamLayout):
        structure.require_rescalable("the node-wise rescaling symmetry")
        missing = [
            name
            for layer in structure.layers
            for name in (layer.weight, layer.bias)
            if name is not None and name not in layout.names
        ]
        if missing:
            raise ValueError(f"the parameter layout lacks {', '.join(missing)}; include every layer's parameters")
        self.dim = structure.n_hidden
        self.size = layout.size
        offsets = [0]
        for h in structure.hidden_units:
            offsets.append(offsets[-1] + h)
        n_layers = len(structure.layers)
        blocks = []
        for i, layer in enumerate(structure.layers):
            numel = layout.shapes[layout.names.index(layer.weight)].numel()
            prev = structure.hidden_units[i - 1] if i > 0 else 1
            blocks.append(
                _Block(
                    weight=layout.slice(layer.weight),
                    bias=layout.slice(layer.bias) if layer.bias is not None else None,
                    out_units=layer.out_units,
                    prev_units=prev,
                    rest=numel // (layer.out_units * prev),
                    row=offsets[i] if i < n_layers - 1 else None,
                    col=offsets[i - 1] if i > 0 else None,
                )
            )
        self._blocks = tuple(blocks)
        self._cholesky: dict[torch.device, Tensor] = {}

    def apply(self, c: Tensor) -> Tensor:
        """``J c``: the derivative of ``log|w|`` along the rescaling by ``exp(t c)`` at ``t = 0``.

        Args:
            c: ``(H,)`` or ``(k, H)``.

        Returns:
            ``(n,)`` or ``(k, n)``: ``+c[a]`` on the incoming weights and bias of unit ``a``, ``-c[a]`` on
            its outgoing weights, 0 on parameters outside the layers.
        """
        if c.shape[-1] != self.dim:
            raise ValueError(f"expected a last dimension of {self.dim}, got shape {tuple(c.shape)}")
        batch = c.shape[:-1]
        out = c.new_zeros(*batch, self.size)
        for b in self._blocks:
            value = c.new_zeros(())
            if b.row is not None:
                rows = c[..., b.row : b.row + b.out_units]
                value = value + rows[..., :, None, None]
                if b.bias is not None:
                    out[..., b.bias] = rows
            if b.col is not None:
                value = value - c[..., None, b.col : b.col + b.prev_units, None]
            shape = (*batch, b.out_units, b.prev_units, b.rest)
            out[..., b.weight] = value.expand(shape).reshape(*batch, -1)
        return out

    def apply_transpose(self, v: Tensor) -> Tensor:
        """``J^T v``, the exact adjoint of :meth:`apply`.

        Args:
            v: ``(n,)`` or ``(k, n)``.

        Returns:
            ``(H,)`` or ``(k, H)``.
        """
        if v.shape[-1] != self.size:
            raise ValueError(f"expected a last dimension of {self.size}, got shape {tuple(v.shape)}")
        batch = v.shape[:-1]
        out = v.new_zeros(*batch, self.dim)
        for b in self._blocks:
            block = v[..., b.weight].reshape(*batch, b.out_units, b.prev_units, b.rest)
            if b.row is not None:
                rows = block.sum(dim=(-2, -1))
                if b.bias is not None:
                    rows = rows + v[..., b.bias]
                out[..., b.row : b.row + b.out_units] += rows
            if b.col is not None:
                out[..., b.col : b.col + b.prev_units] -= block.sum(dim=(-3, -1))
        return out

    def gram(self) -> Tensor:
        """``J^T J``, ``(H, H)`` float64: block tridiagonal over layers.

        A unit's diagonal entry counts its incoming weights, bias and outgoing weights; units of
        adjacent layers share ``rest`` weights, each contributing ``(+1)(-1)``; all else is 0.
        """
        gram = torch.zeros(self.dim, self.dim, dtype=torch.float64)
        diagonal = torch.zeros(self.dim, dtype=torch.float64)
        for b in self._blocks:
            if b.row is not None:
                diagonal[b.row : b.row + b.out_units] += b.prev_units * b.rest + (b.bias is not None)
            if b.col is not None:
                diagonal[b.col : b.col + b.prev_units] += b.out_units * b.rest
            if b.row is not None and b.col is not None:
                gram[b.row : b.row + b.out_units, b.col : b.col + b.prev_units] = -b.rest
                gram[b.col : b.col + b.prev_units, b.row : b.row + b.out_units] = -b.rest
        return gram + torch.diag(diagonal)

    def project_out(self, v: Tensor) -> Tensor:
        """``v - J (J^T J)^{-1} J^T v``: Euclidean projection onto the orthogonal complement of ``range(J)``.

        Args:
            v: ``(n,)`` or ``(k, n)``.

        Returns:
            Same shape and dtype as ``v``; solved in float64 with a Cholesky factor computed once.
        """
        if self.dim == 0:
            return v.clone()
        chol = self._cholesky.get(v.device)
        if chol is None:
            chol = torch.linalg.cholesky(self.gram()).to(v.device)
            self._cholesky[v.device] = chol
        rhs = self.apply_transpose(v).to(torch.float64)
        coef = torch.cholesky_solve(rhs.reshape(-1, self.dim).T, chol).T.reshape(rhs.shape)
        return v - self.apply(coef.to(v.dtype))
