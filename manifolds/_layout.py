"""Flat-vector view of a named set of parameter tensors.

Solvers and metrics work on one flat vector of length ``n`` (all parameters concatenated in a
fixed order); users see dictionaries ``{name: tensor}`` shaped like ``model.named_parameters()``.
[`ParamLayout`][manifolds.ParamLayout] converts between the two without copying more than needed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class ParamLayout:
    """Names, shapes and offsets of parameter tensors packed into one flat vector.

    Attributes:
        names: parameter names in packing order (the order of ``model.named_parameters()``).
        shapes: shape of each tensor.
        offsets: start of each tensor in the flat vector; ``offsets[i] + numel(shapes[i])`` is its end.
        size: total number of entries ``n``.
    """

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    size: int

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, Tensor]) -> ParamLayout:
        names = tuple(tensors)
        shapes = tuple(torch.Size(t.shape) for t in tensors.values())
        offsets, total = [], 0
        for shape in shapes:
            offsets.append(total)
            total += shape.numel()
        return cls(names, shapes, tuple(offsets), total)

    @classmethod
    def from_module(cls, module: torch.nn.Module) -> ParamLayout:
        """Layout of the parameters of ``module`` that require gradients."""
        return cls.from_tensors({k: p for k, p in module.named_parameters() if p.requires_grad})

    def slice(self, name: str) -> slice:
        """Slice of the flat vector that holds tensor ``name``."""
        i = self.names.index(name)
        return slice(self.offsets[i], self.offsets[i] + self.shapes[i].numel())

    def flatten(self, tensors: Mapping[str, Tensor]) -> Tensor:
        """Concatenate ``tensors`` (any extra leading batch dims allowed) into ``(..., n)``."""
        parts = []
        for name, shape in zip(self.names, self.shapes):
            t = tensors[name]
            batch = t.shape[: t.dim() - len(shape)]
            parts.append(t.reshape(*batch, shape.numel()))
        return torch.cat(parts, dim=-1)

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """Split a ``(..., n)`` vector into views shaped like the parameters (leading dims kept)."""
        if flat.shape[-1] != self.size:
            raise ValueError(f"expected a vector of length {self.size}, got shape {tuple(flat.shape)}")
        batch = flat.shape[:-1]
        out = {}
        for name, shape, start in zip(self.names, self.shapes, self.offsets):
            out[name] = flat[..., start : start + shape.numel()].reshape((*batch, *shape))
        return out

    def blocks(self, flat: Tensor) -> Iterable[tuple[str, Tensor]]:
        """Yield ``(name, flat_block)`` pairs: 1-D (or ``(..., numel)``) views of ``flat``."""
        for name, shape, start in zip(self.names, self.shapes, self.offsets):
            yield name, flat[..., start : start + shape.numel()]
