"""The diagonal rescaling group of a network: its free log-scales and how they act on the parameters.

A group element is a vector ``s`` of log-scales, one per free class of channels (see
`manifolds._group_discovery` for the rules that form the classes); it maps every parameter tensor
``t`` to ``t * exp(power * (s[plus] - s[minus]))`` entry-wise, with ``plus`` / ``minus`` the classes of
the output / input channel the entry connects (for example ``W[o, i] -> W[o, i] e^{s(o) - s(i)}``).
An elementwise product of two parameters ``p * q`` gives each entry of ``p`` a ``plus`` class and the matching
entry of ``q`` the same class as ``minus`` (``p -> p e^s``, ``q -> q e^-s``).
Every entry has at most one ``plus`` and one ``minus`` class, which is what makes the min-norm gauge's
updates exact and the symmetry's generator a sparse ``+1 / -1`` matrix.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from manifolds._group_discovery import Discovery, Pin, Record


def check_scale(scale: object) -> float:
    """``scale`` as a float: the standard deviation of random log-scales, a finite number ``>= 0``.

    Raises:
        ValueError: ``scale`` is not a real number (a bool included), is NaN or infinite, or is negative.
    """
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale < 0:
        raise ValueError(f"scale (the log-scales' standard deviation) must be a finite number >= 0, got {scale!r}")
    return float(scale)


def check_generator(generator: object) -> None:
    """Raise ``ValueError`` unless ``generator`` is a ``torch.Generator`` or ``None``."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")


@dataclass(frozen=True)
class Action:
    """How the group acts on one tensor: ``t -> t * exp(power * (s[plus] - s[minus]))``.

    Attributes:
        name: parameter (or buffer) name in ``model.named_parameters()``.
        shape: the tensor's shape.
        plus: int64 class indices broadcastable to ``shape``; the index ``dim`` (one past the last
            class) means "no term" (a pinned channel), and ``None`` no term at all.
        minus: as ``plus``.
        power: 1, or 2 for a BatchNorm running variance.
        role: ``"weight"``, ``"bias"`` or ``"buffer"``.
        module: the module owning the tensor.
    """

    name: str
    shape: tuple[int, ...]
    plus: Tensor | None
    minus: Tensor | None
    power: int
    role: str
    module: str

    def log_factor(self, s: Tensor) -> Tensor:
        """``power * (s[plus] - s[minus])`` broadcastable to ``shape`` for ``s`` of shape ``(..., dim + 1)``.

        The trailing entry of ``s`` must be 0 (the "no term" class).
        """
        batch = s.shape[:-1]
        out = s.new_zeros(*batch, *[1] * len(self.shape))
        if self.plus is not None:
            out = out + s[..., self.plus.to(s.device)]
        if self.minus is not None:
            out = out - s[..., self.minus.to(s.device)]
        return self.power * out if self.power != 1 else out


def _relabelled(source: Record | Action, index: Tensor) -> Action:
    """``source``'s action with its variable (or class) indices mapped through ``index``."""
    return Action(
        source.name,
        source.shape,
        index[source.plus] if source.plus is not None else None,
        index[source.minus] if source.minus is not None else None,
        source.power,
        source.role,
        source.module,
    )


class RescalingGroup:
    """The diagonal positive rescalings that leave a network's function unchanged, as found on its graph.

    Built by `manifolds.analyze` (``structure.group`` node-wise, ``structure.layer_group`` with one scale
    per module output); not meant to be constructed by hand.

    Attributes:
        level: ``"node"`` (one scale per channel class) or ``"layer"`` (one per module output class).
        dim: number of free log-scales (the group's dimension).
        actions: how it acts on each parameter tensor it touches (and on BatchNorm buffers when discovered
            with ``buffers=True``).
        pins: every set of channels whose scale is fixed, with the reason.
        unknown: operations the rules do not know (their inputs and outputs are pinned).
        products: ``(p, q, where)`` for each elementwise product of two parameters ``p * q`` whose factors trade
            scales entry by entry (``p -> p e^s``, ``q -> q e^-s``).
    """

    def __init__(self, discovery: Discovery, level: str = "node"):
        if level not in ("node", "layer"):
            raise ValueError(f"level must be 'node' or 'layer', got {level!r}")
        d = discovery.copy()
        if level == "layer":  # one scale per module output, and one per tensor's inputs
            for ids in d.module_outputs.values():
                d.union_all(ids)
            for record in d.records:
                if record.minus is not None:
                    d.union_all(record.minus)
        roots = [d.find(a) for a in range(len(d.parent))]
        free = sorted({r for r in roots if not d.pinned[r]})
        index = {r: i for i, r in enumerate(free)}
        self.level = level
        self.dim = len(free)
        cls = torch.tensor([index.get(r, self.dim) for r in roots], dtype=torch.long)
        self._class_of_variable = cls
        self._labels = d.labels
        self.pins: tuple[Pin, ...] = tuple(d.pins)
        self.unknown: tuple[str, ...] = tuple(dict.fromkeys(d.unknown))
        self.products: tuple[tuple[str, str, str], ...] = tuple(d.products)
        self.actions: tuple[Action, ...] = tuple(_relabelled(r, cls) for r in d.records)

    def restricted(self, names: Iterable[str]) -> RescalingGroup:
        """The subgroup that leaves every parameter outside ``names`` unchanged (e.g. frozen parameters).

        Every free scale acting on a tensor outside ``names`` is pinned, and the actions on those tensors are left
        out (also where no free scale acts on them: a bias of the output layer); buffers are kept. Returns
        ``self`` when nothing changes.
        """
        kept = set(names)
        outside = [a for a in self.parameter_actions if a.name not in kept]
        if not outside:
            return self
        banned: set[int] = set()
        for a in outside:
            for index in (a.plus, a.minus):
                if index is not None:
                    banned.update(int(c) for c in index.unique() if int(c) < self.dim)
        remaining = [c for c in range(self.dim) if c not in banned]
        new_index = torch.full((self.dim + 1,), len(remaining), dtype=torch.long)
        new_index[remaining] = torch.arange(len(remaining))
        twin = object.__new__(RescalingGroup)
        twin.level, twin.dim = self.level, len(remaining)
        twin._class_of_variable = new_index[self._class_of_variable]
        twin._labels = self._labels
        twin.pins = self.pins
        if banned:
            twin.pins = (*self.pins, Pin("parameters outside the given ones", len(banned), "they must stay unchanged"))
        twin.unknown = self.unknown
        twin.products = self.products
        twin.actions = tuple(
            _relabelled(a, new_index) for a in self.actions if a.name in kept or a.role == "buffer"
        )
        return twin

    @cached_property
    def classes(self) -> tuple[tuple[str, ...], ...]:
        """Which channels share a scale: per free class, its channels as ``"<tensor>[<channel>]"``."""
        members: list[list[str]] = [[] for _ in range(self.dim)]
        for label, start, count in self._labels:
            for channel in range(count):
                c = int(self._class_of_variable[start + channel])
                if c < self.dim:
                    members[c].append(f"{label}[{channel}]")
        return tuple(tuple(m) for m in members)

    @property
    def parameter_actions(self) -> tuple[Action, ...]:
        """The actions on parameters (buffers left out)."""
        return tuple(a for a in self.actions if a.role != "buffer")

    def __repr__(self) -> str:
        return (
            f"RescalingGroup(level={self.level!r}, dim={self.dim}, pins={len(self.pins)}, unknown={len(self.unknown)})"
        )

    def describe(self) -> str:
        """A readable report: dimension, acted-on tensors, pinned channels with reasons, unknown operations."""
        lines = [
            f"{self.level}-wise rescaling group of dimension {self.dim}, acting on "
            f"{len(self.parameter_actions)} parameter tensor(s)"
        ]
        sizes = sorted((len(c) for c in self.classes), reverse=True)
        if sizes:
            lines.append(f"channels per free scale: largest {sizes[0]}, smallest {sizes[-1]}")
        for p, q, where in self.products:
            plus = next((a.plus for a in self.actions if a.name == p), None)
            free = 0 if plus is None else int((plus.unique() < self.dim).sum())
            trade = f"'{p}' <- '{p}' e^s, '{q}' <- '{q}' e^-s"
            lines.append(f"{where}: {free} free scale(s) traded entry by entry, {trade}")
        if self.pins:
            lines.append("pinned:")
            lines.extend(f"  {pin}" for pin in self.pins)
        if self.unknown:
            lines.append("operations the rules do not know (inputs and outputs pinned):")
            lines.extend(f"  {op}" for op in self.unknown)
        return "\n".join(lines)

    def extended(self, log_scales: Tensor) -> Tensor:
        """``(..., dim) -> (..., dim + 1)``: append the zero of the "no term" class."""
        if log_scales.shape[-1] != self.dim:
            raise ValueError(
                f"expected {self.dim} log-scales in the last dimension, got shape {tuple(log_scales.shape)}"
            )
        return torch.cat([log_scales, log_scales.new_zeros(*log_scales.shape[:-1], 1)], dim=-1)

    def act(self, tensors: Mapping[str, Tensor], log_scales: Tensor) -> dict[str, Tensor]:
        """Apply the group element ``exp(log_scales)`` to ``{name: tensor}`` (functional).

        Args:
            tensors: parameters (and buffers); tensors the group does not act on pass through, and every
                tensor it acts on must be present.
            log_scales: ``(dim,)`` log-scales, cast to each tensor's dtype and device.

        Returns:
            A new dictionary with the same keys.
        """
        if log_scales.dim() != 1:
            raise ValueError(f"log_scales must have shape ({self.dim},), got {tuple(log_scales.shape)}")
        s = self.extended(log_scales)
        out = dict(tensors)
        missing = [a.name for a in self.actions if a.name not in tensors]
        if missing:
            raise KeyError(f"the tensors lack {', '.join(missing)}, which the rescaling group acts on")
        for a in self.actions:
            t = tensors[a.name]
            out[a.name] = t * torch.exp(a.log_factor(s.to(t.device, t.dtype)))
        return out

    def random_log_scales(
        self, scale: float = 1.0, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64
    ) -> Tensor:
        """``(dim,)`` i.i.d. ``N(0, scale^2)`` log-scales (a random group element).

        Raises:
            ValueError: ``scale`` is not a finite number ``>= 0``, or ``generator`` is no ``torch.Generator``.
        """
        scale = check_scale(scale)
        check_generator(generator)
        device = None if generator is None else generator.device  # a generator draws on its own device
        return scale * torch.randn(self.dim, generator=generator, dtype=dtype, device=device).cpu()
