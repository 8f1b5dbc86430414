"""How `sharpness.verify_invariance` draws its function-preserving copies: random elements of the network's
symmetry group, one kind at a time.

=================  ==========================================================================  =====================
kind               what moves (everything else stays)                                          claimed by measures
                                                                                               claiming
=================  ==========================================================================  =====================
``node``           every free class of the diagonal rescaling group (``analyze(model).group``)  ``node``
``layer``          every free module-output class (``analyze(model).layer_group``)              ``layer``
``attention``      every attention head's ``GL(h)`` factors, query/key and value/output, and   ``attention``
                   the biases' translations that keep the function (an unread key bias, a
                   value bias against the output bias, ``u ~ N(0, scale^2)``)
``normalization``  every LayerNorm/RMSNorm affine scale traded against the layers reading it    ``normalization``
``group``          all of it at once: an element of the whole group (``analyze(model).symmetry``)  all four
=================  ==========================================================================  =====================

The matrix kinds use the factors of `manifolds.transformer_symmetry` (a GL factor is ``U diag(e^{scale z})
V^T``, ``U, V`` Haar-orthogonal and ``z`` standard normal clipped to ``[-2, 2]``; scales are ``e^{N(0, scale^2)}``).
A measure claims invariance under ``group`` when it claims every one of ``node``, ``layer``, ``attention`` and
``normalization`` in general: the whole group is more than any of them (token-wise ReLU units found next to
attention belong to it only). Only the trainable parameters move: a factor touching a frozen tensor stays at the
identity, the diagonal group is restricted to the trainable tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from manifolds import MatrixSymmetry, NetworkStructure, RescalingGroup, SymmetryElement, UnsupportedModelError
from manifolds._absorption import random_shifts, shifted
from sharpness.measures._claims import FACTOR_KINDS, factor_claim, first_line, symmetry_unknown, untestable_kinds

DIAGONAL_KINDS = ("node", "layer")
MATRIX_KINDS = ("attention", "normalization", "group")
ALL_KINDS = DIAGONAL_KINDS + MATRIX_KINDS
# what a measure must claim in general to claim the whole group
WHOLE = ("node", "layer", "attention", "normalization")


def general_claim(invariant_under: Iterable[str]) -> tuple[str, ...]:
    """A measure's general claim with ``"group"`` added when it claims every part of the whole group."""
    claim = tuple(invariant_under)
    return claim + ("group",) if set(WHOLE) <= set(claim) else claim


class Draws:
    """The random copies of one network, by kind.

    Args:
        structure: ``analyze(model, example_input)``, its group known.
        params: the trainable parameters (the objective's): nothing else moves.
        kinds: the kinds asked for, or ``None``: ``node`` and ``layer`` always, the matrix kinds where the network
            has factors of them.

    Attributes:
        kinds: the kinds asked for (``None`` resolved).
        untestable: ``kind -> reason`` for the kinds whose group has dimension 0 here (or is unknown).
        symmetry: the whole group restricted to ``params``, or ``None`` when it could not be found.
    """

    def __init__(self, structure: NetworkStructure, params: Mapping[str, Tensor], kinds: tuple[str, ...] | None):
        self.groups: dict[str, RescalingGroup] = {
            "node": structure.group.restricted(params), "layer": structure.layer_group.restricted(params),
        }  # fmt: skip
        self.symmetry, failure = None, None
        try:
            whole = structure.symmetry
        except UnsupportedModelError as err:  # the factors could not be read: only the diagonal kinds are drawn
            whole, failure = None, first_line(err)
        if whole is not None:
            self.symmetry = MatrixSymmetry(whole.restricted(params).factors, self.groups["node"], whole.pins)
        # each factor's claim kind, in the order of the factors (read once: drawing and the summary use it)
        self._factor_claims = () if self.symmetry is None else tuple(map(factor_claim, self.symmetry.factors))
        found = {} if self.symmetry is None else self._found()
        if kinds is None:
            kinds = DIAGONAL_KINDS + tuple(k for k in MATRIX_KINDS if found.get(k))
        self.kinds = tuple(kinds)
        self.untestable = self._untestable(found, failure)

    def _found(self) -> dict[str, bool]:
        kinds = set(self._factor_claims)
        return {"attention": "attention" in kinds, "normalization": "normalization" in kinds,
                "group": bool(self.symmetry.factors)}  # fmt: skip  # without factors it is node's group

    def _untestable(self, found: Mapping[str, bool], failure: str | None) -> dict[str, str]:
        out = dict(untestable_kinds(self.groups))
        for kind in ("attention", "normalization"):
            if failure is not None:
                out[kind] = symmetry_unknown(failure)
            elif not found.get(kind):
                out[kind] = FACTOR_KINDS[kind]
        if failure is not None:
            out["group"] = symmetry_unknown(failure)
        elif self.symmetry.dim == 0:
            out["group"] = "this network's symmetry group has dimension 0 (every scale and basis is pinned)"
        return out

    def draw(self, kind: str, params: Mapping[str, Tensor], scale: float, generator: torch.Generator,
             broadcast) -> dict[str, Tensor]:  # fmt: skip
        """``params`` moved by a random element of ``kind`` (drawn on the CPU with ``generator`` in the params'
        dtype, then shared by ``broadcast(tensor)`` so every process moves the same way)."""
        dtype = next(iter(params.values())).dtype
        if kind in DIAGONAL_KINDS:
            log_scales = self.groups[kind].random_log_scales(scale, generator, dtype=dtype)
            broadcast(log_scales)
            return self.groups[kind].act(params, log_scales)
        element = self.symmetry.random_element(scale, generator, dtype)
        if kind != "group":  # only the factors of this kind move
            keep = [claim == kind for claim in self._factor_claims]
            element = SymmetryElement(
                torch.zeros_like(element.log_scales),
                tuple(m if k else _identity(m) for m, k in zip(element.matrices, keep)),
            )
        for t in (element.log_scales, *element.matrices):
            broadcast(t)
        moved = self.symmetry.act(params, element)
        if kind in ("attention", "group"):  # and the biases' translations (`manifolds._absorption`) of those factors
            source = self.symmetry
            if kind != "group":
                kept = tuple(f for f, claim in zip(source.factors, self._factor_claims) if claim == kind)
                source = MatrixSymmetry(kept, source.diagonal, source.pins)
            shifts = random_shifts(source, moved, scale, generator, dtype)
            for t in shifts:
                broadcast(t)
            moved = shifted(source, moved, shifts)
        return moved

    def summary(self) -> dict:
        """JSON-ready counts of the factors the copies were drawn from (added to the report's ``group``)."""
        if self.symmetry is None:
            return {}
        kinds = self._factor_claims
        return {"symmetry_dim": self.symmetry.dim, "attention_factors": kinds.count("attention"),
                "normalization_factors": kinds.count("normalization")}  # fmt: skip


def _identity(m: Tensor) -> Tensor:
    return torch.eye(m.shape[0], dtype=m.dtype) if m.dim() == 2 else torch.ones_like(m)
