"""The value bias of attention absorbed into the output bias: the representative of a translation orbit.

Every row of softmax attention weights ``P`` sums to one, so adding ``u`` to a value head's bias adds ``u`` to every
row of the head's output ``P v``, which the output projection turns into ``Wo_h u`` (``Wo_h`` its columns reading
the head, summed over the query heads reading a shared value head). Hence

    ``bv_h <- bv_h + u``,   ``bo <- bo - Wo_h u``

keeps the network's function, for every ``u``: a translation, mixed with the output projection's columns, that no
matrix factor on parameter blocks can express. The network depends on ``bv_h`` and ``bo`` only through
``bo + Wo_h bv_h``. Each orbit of these translations holds exactly one point with ``bv_h = 0``, reached by
``bo <- bo + Wo_h bv_h``, ``bv_h <- 0``; the matrix factors map such points to such points (``bv_h = 0`` stays zero
under ``B^T``, and ``bo + Wo_h bv_h`` is kept by ``Wo_h B^-T B^T bv_h``, scaled with ``bo`` by a layer scale). A
measure taken at that representative is therefore the same for every point of the orbit (a gauge, fixed, as the
minimum-norm measure fixes the rescaling's), and stays invariant under the rest of the group.

Which factors allow it is recorded by the group finder (`Factor.absorption`: the value bias block and the output
bias's name).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from manifolds._matrix_group import Block, MatrixSymmetry


def _columns(factor) -> list[Block]:
    """The output projection's column blocks a value/output factor moves (those reading its value head)."""
    return [b for b in factor.blocks if b.axis == 1 and b.how == "invT"]


def _output_shift(columns: list[Block], tensors: Mapping[str, Tensor], u: Tensor) -> Tensor:
    """``Wo_h u``: the output projection's ``columns`` of ``tensors`` (each read as its ``(out, in)`` matrix, a
    leading batch axis kept) times the value bias shift ``u``, summed over the blocks."""
    total = 0
    for block in columns:
        w = tensors[block.name]
        if block.transposed:  # stored (..., in, out)
            w = w.transpose(-1, -2)
        total = total + torch.einsum("...oi,i->...o", w[..., list(block.index)], u)
    return total


def _moves(symmetry: MatrixSymmetry, params: Mapping[str, Tensor]) -> list[tuple[Block, str, list[Block]]]:
    """``(value bias block, output bias name, output column blocks)`` of every factor whose translation can move
    ``params``: both biases among them (a frozen one stays as it is) and the value bias not already zero."""
    found = []
    for factor in symmetry.factors:
        if factor.absorption is None:
            continue
        value, output = factor.absorption
        if value.name not in params or output not in params:
            continue
        if not bool(params[value.name][list(value.index)].ne(0).any()):
            continue
        found.append((value, output, _columns(factor)))
    return found


def absorbed(symmetry: MatrixSymmetry, params: Mapping[str, Tensor]) -> dict[str, Tensor] | None:
    """``params`` at the representative of their translation orbit: every value bias ``symmetry``'s factors allow
    moved into the output bias (``bo <- bo + Wo_h bv_h``, ``bv_h <- 0``), new tensors for those changed; ``None``
    where nothing moves (no such factor, a frozen bias, or the value biases already zero).

    Args:
        symmetry: the group (`manifolds.transformer_symmetry`, restricted to the trainable parameters).
        params: the point, ``{name: tensor}``; the column blocks' tensors must be among them or equal the model's.
    """
    moves = _moves(symmetry, params)
    if not moves:
        return None
    out = dict(params)
    shifts: dict[str, Tensor] = {}
    for value, output, columns in moves:  # every shift from the original values, then applied
        shifts[output] = shifts.get(output, 0) + _output_shift(columns, params, params[value.name][list(value.index)])
    for value, _, _ in moves:
        if out[value.name] is params[value.name]:
            out[value.name] = params[value.name].clone()
        out[value.name][list(value.index)] = 0
    for output, shift in shifts.items():
        out[output] = params[output] + shift
    return out


def to_point(symmetry: MatrixSymmetry, params: Mapping[str, Tensor], tangents: Mapping[str, Tensor]) -> dict:
    """Tangent vectors at the representative (`absorbed`) carried to ``params`` by the translation's differential:
    ``dbo <- dbo - dWo_h bv_h`` with ``bv_h`` the value bias at ``params`` (the translation moves ``bo`` by
    ``-Wo_h u``, which varies with ``Wo_h``). ``tangents`` may hold a leading batch axis."""
    return _carried(symmetry, params, tangents, -1.0)


def to_representative(symmetry: MatrixSymmetry, params: Mapping[str, Tensor], tangents: Mapping[str, Tensor]) -> dict:
    """The inverse of `to_point`: tangent vectors at ``params`` carried to the representative."""
    return _carried(symmetry, params, tangents, 1.0)


def from_representative(symmetry: MatrixSymmetry, params: Mapping[str, Tensor], points: Mapping[str, Tensor]) -> dict:
    """Points near the representative of ``params`` (``{name: (..., *shape)}``) moved by the translation that takes
    the representative back to ``params``: ``bv_h + u`` and ``bo - Wo_h u`` with ``u`` the value bias at ``params``
    and ``Wo_h`` each point's own (the same function at every point)."""
    out = dict(points)
    for value, output, columns in _moves(symmetry, params):
        u = params[value.name][list(value.index)]
        moved = out[value.name].clone()
        moved[..., list(value.index)] += u
        out[value.name] = moved
        out[output] = out[output] - _output_shift(columns, points, u)  # each point's own Wo_h
    return out


def _carried(symmetry: MatrixSymmetry, params: Mapping[str, Tensor], tangents: Mapping[str, Tensor], sign: float):
    """``dbo <- dbo + sign dWo_h bv_h`` for every absorbed value head (`to_point`, `to_representative`)."""
    out = dict(tangents)
    for value, output, columns in _moves(symmetry, params):
        out[output] = out[output] + sign * _output_shift(columns, tangents, params[value.name][list(value.index)])
    return out


def random_shifts(symmetry: MatrixSymmetry, params: Mapping[str, Tensor], scale: float, generator: torch.Generator,
                  dtype: torch.dtype) -> list[Tensor]:  # fmt: skip
    """Random shifts for `shifted`, drawn on the CPU: one ``u ~ N(0, scale^2)`` per value head whose bias the
    output bias can absorb and per unread key bias (`Factor.unread`), where the tensors are among ``params``."""
    out = []
    for factor in symmetry.factors:
        for name, entries, other in _shiftable(factor):
            if name in params and (other is None or other in params):
                out.append(scale * torch.randn(len(entries), generator=generator, dtype=dtype))
    return out


def shifted(symmetry: MatrixSymmetry, params: Mapping[str, Tensor], shifts: list[Tensor]) -> dict[str, Tensor]:
    """``params`` moved by the translations that keep the function: ``bv_h + u`` with ``bo - Wo_h u`` (the output
    projection's columns read at ``params``), and ``bk_h + u`` where the key bias is not read; ``shifts`` from
    `random_shifts` (the same order), on any device."""
    out = dict(params)
    moves = iter(shifts)
    for factor in symmetry.factors:
        for name, entries, other in _shiftable(factor):
            if name not in params or (other is not None and other not in params):
                continue
            u = next(moves).to(params[name])
            out[name] = out[name].clone()
            out[name][list(entries)] += u
            if other is not None:
                out[other] = out[other] - _output_shift(_columns(factor), params, u)
    return out


def _shiftable(factor) -> list[tuple[str, tuple[int, ...], str | None]]:
    """``(bias, entries, output bias or None)`` of the translations a factor records."""
    found = []
    if factor.absorption is not None:
        found.append((factor.absorption[0].name, factor.absorption[0].index, factor.absorption[1]))
    if factor.unread is not None:
        found.append((*factor.unread, None))
    return found


__all__ = ["absorbed", "from_representative", "random_shifts", "shifted", "to_point", "to_representative"]
