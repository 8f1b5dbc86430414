"""Linear algebra of a rescaling group in log coordinates ``u = log|w|``.

The group element ``exp(t c)`` adds ``t (c[plus] - c[minus])`` to ``u`` entry-wise (see
`manifolds.RescalingGroup`), so the orbit through any point is an affine subspace ``u + range(J)``
with a constant ``(n, dim)`` matrix ``J`` whose rows hold at most one ``+1`` and one ``-1``.
[`NodeSymmetry`][manifolds.NodeSymmetry] applies ``J``, its transpose, its Gram matrix and the projection onto
``range(J)^perp`` without forming ``J``: each tensor's class indices broadcast against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from manifolds._group import RescalingGroup
from manifolds._layout import ParamLayout

# Above this many classes the Gram matrix is factored as a sparse matrix on the CPU.
_DENSE_LIMIT = 4096


@dataclass(frozen=True)
class _Block:
    where: slice  # position of the tensor in the flat vector
    shape: tuple[int, ...]
    plus: Tensor | None  # class indices broadcastable to shape; dim = "no term"
    minus: Tensor | None


def _reduce_to(x: Tensor, index: Tensor, batch: int) -> Tensor:
    """Sum ``x`` ``(k, *shape)`` over the axes along which ``index`` broadcasts: ``(k, index.numel())``."""
    dims = tuple(batch + i for i, size in enumerate(index.shape) if size == 1 and x.shape[batch + i] != 1)
    if dims:
        x = x.sum(dim=dims, keepdim=True)
    return x.reshape(x.shape[0], index.numel())


class NodeSymmetry:
    """The infinitesimal action ``J`` (``(n, dim)``) of a rescaling group in log coordinates.

    Args:
        group: the group ([`manifolds.NetworkStructure.group`][manifolds.NetworkStructure] or ``.layer_group``).
        layout: flat layout of the parameters. Parameters the group does not act on get zero rows of ``J``;
            scales acting on a tensor outside the layout (a frozen parameter) are left out, as it must not move.

    Attributes:
        dim: number of columns of ``J`` (the group's dimension).
        size: ``n``, the length of the flat parameter vector.
    """

    def __init__(self, group: RescalingGroup, layout: ParamLayout):
        group = group.restricted(layout.names)  # parameters outside the layout (frozen ones) must stay fixed
        actions = group.parameter_actions
        self.dim = group.dim
        self.size = layout.size
        self._blocks = tuple(_Block(layout.slice(a.name), a.shape, a.plus, a.minus) for a in actions)
        self._factor: dict[torch.device, object] = {}
        self._on_device: dict[torch.device, list[tuple[Tensor | None, Tensor | None]]] = {}

    def _indices(self, device: torch.device) -> list[tuple[Tensor | None, Tensor | None]]:
        """Every block's ``(plus, minus)`` class indices on ``device``, copied once (a copy per product would wait
        for the device each time)."""
        if device not in self._on_device:
            self._on_device[device] = [
                tuple(None if index is None else index.to(device) for index in (b.plus, b.minus)) for b in self._blocks
            ]
        return self._on_device[device]

    def apply(self, c: Tensor) -> Tensor:
        """``J c``: the derivative of ``log|w|`` along the rescaling ``exp(t c)`` at ``t = 0``.

        Args:
            c: ``(dim,)`` or ``(k, dim)``.

        Returns:
            ``(n,)`` or ``(k, n)``.
        """
        if c.shape[-1] != self.dim:
            raise ValueError(f"expected a last dimension of {self.dim}, got shape {tuple(c.shape)}")
        batch = c.shape[:-1]
        ext = torch.cat([c, c.new_zeros(*batch, 1)], dim=-1)
        out = c.new_zeros(*batch, self.size)
        for b, (plus, minus) in zip(self._blocks, self._indices(c.device)):
            value = ext.new_zeros(*batch, *[1] * len(b.shape))
            if plus is not None:
                value = value + ext[..., plus]
            if minus is not None:
                value = value - ext[..., minus]
            out[..., b.where] = value.expand(*batch, *b.shape).reshape(*batch, b.where.stop - b.where.start)
        return out

    def apply_transpose(self, v: Tensor) -> Tensor:
        """``J^T v``, the exact adjoint of [`apply`][manifolds.NodeSymmetry.apply].

        Args:
            v: ``(n,)`` or ``(k, n)``.

        Returns:
            ``(dim,)`` or ``(k, dim)``.
        """
        if v.shape[-1] != self.size:
            raise ValueError(f"expected a last dimension of {self.size}, got shape {tuple(v.shape)}")
        batch = v.shape[:-1]
        flat = v.reshape(-1, self.size)
        out = flat.new_zeros(flat.shape[0], self.dim + 1)
        for b, (plus, minus) in zip(self._blocks, self._indices(v.device)):
            block = flat[:, b.where].reshape(flat.shape[0], *b.shape)
            for index, sign in ((plus, 1.0), (minus, -1.0)):
                if index is not None:
                    idx = index.expand(*index.shape)
                    reduced = _reduce_to(block, idx, 1)
                    out.index_add_(1, idx.reshape(-1), reduced if sign > 0 else -reduced)
        return out[:, : self.dim].reshape(*batch, self.dim)

    def _counts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Pairs ``(plus, minus)`` of class indices over all entries, with multiplicities."""
        keys, weights = [], []
        none = self.dim
        for b in self._blocks:
            plus = b.plus if b.plus is not None else torch.full((1,) * len(b.shape), none)
            minus = b.minus if b.minus is not None else torch.full((1,) * len(b.shape), none)
            joint = torch.broadcast_shapes(plus.shape, minus.shape)
            multiplicity = int(np.prod(b.shape)) // int(np.prod(joint))
            pair = plus.expand(joint).reshape(-1) * (none + 1) + minus.expand(joint).reshape(-1)
            unique, count = torch.unique(pair, return_counts=True)
            keys.append(unique)
            weights.append(count * multiplicity)
        if not keys:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, np.zeros(0)
        key, weight = torch.cat(keys), torch.cat(weights).to(torch.float64)
        return (key // (none + 1)).numpy(), (key % (none + 1)).numpy(), weight.numpy()

    def gram(self) -> Tensor:
        """``J^T J``, ``(dim, dim)`` float64 (dense).

        Row ``e_p - e_m`` of an entry contributes ``+1`` to both diagonals and ``-1`` off the diagonal.
        """
        return torch.from_numpy(self._sparse_gram().toarray())

    def _sparse_gram(self):
        from scipy import sparse

        p, m, w = self._counts()
        n = self.dim + 1
        counts = sparse.coo_matrix((w, (p, m)), shape=(n, n)).tocsr()
        gram = sparse.diags(np.asarray(counts.sum(axis=1)).ravel() + np.asarray(counts.sum(axis=0)).ravel())
        gram = (gram - counts - counts.T).tocsc()
        return gram[: self.dim, : self.dim]

    def _solve(self, rhs: Tensor) -> Tensor:
        """``(J^T J)^{-1} rhs`` for ``rhs`` ``(k, dim)`` float64, factored once per device."""
        factor = self._factor.get(rhs.device)
        if factor is None:
            if self.dim <= _DENSE_LIMIT:
                gram = torch.from_numpy(self._sparse_gram().toarray())
                factor, info = torch.linalg.cholesky_ex(gram)
                if int(info):  # dependent scales (a degenerate graph): the pseudo-inverse, as a (1, dim, dim) stack
                    factor = torch.linalg.pinv(gram, hermitian=True)[None]
                factor = factor.to(rhs.device)
            else:
                from scipy.sparse.linalg import splu

                factor = splu(self._sparse_gram().tocsc())
            self._factor[rhs.device] = factor
        if isinstance(factor, Tensor):
            if factor.dim() == 3:
                return rhs @ factor[0]
            return torch.cholesky_solve(rhs.T, factor).T
        return torch.from_numpy(factor.solve(rhs.T.cpu().numpy())).T.to(rhs.device)

    def project_out(self, v: Tensor) -> Tensor:
        """``v - J (J^T J)^{-1} J^T v``: Euclidean projection onto the orthogonal complement of ``range(J)``.

        Args:
            v: ``(n,)`` or ``(k, n)``.

        Returns:
            Same shape and dtype as ``v``; solved in float64 with a factor computed once.
        """
        if self.dim == 0:
            return v.clone()
        rhs = self.apply_transpose(v).to(torch.float64)
        coef = self._solve(rhs.reshape(-1, self.dim)).reshape(rhs.shape)
        return v - self.apply(coef.to(v.dtype))
