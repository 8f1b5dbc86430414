"""What "the caller's model is left exactly as found" means, as a test helper.

:func:`snapshot` records every parameter and buffer slot of a model (the tensor object held and its bits),
``requires_grad`` flags and the mode of every submodule; :func:`assert_unchanged` checks all of them.
Slots are read per module object and attribute, so a module used twice and a weight tied between two
modules are checked as what they are: one tensor reached from several places.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (a bitwise comparison: NaN payloads and signed zeros included)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).clone()


@dataclass
class Snapshot:
    slots: list[tuple[nn.Module, str, str, object, torch.Tensor | None, bool | None]]
    modes: list[tuple[str, nn.Module, bool]]


def snapshot(model: nn.Module) -> Snapshot:
    """Every ``(module, attribute)`` slot of a parameter or buffer with the object it holds, its bits and its
    ``requires_grad``, and every submodule's training flag (submodules reached twice listed once per name)."""
    slots, modes = [], []
    for prefix, module in model.named_modules(remove_duplicate=False):
        modes.append((prefix, module, module.training))
        for kind, table in (("parameter", module._parameters), ("buffer", module._buffers)):
            for attr, tensor in table.items():
                bits = None if tensor is None else _bits(tensor)
                grad = None if tensor is None else tensor.requires_grad
                slots.append((module, attr, f"{kind} {prefix + '.' if prefix else ''}{attr}", tensor, bits, grad))
    return Snapshot(slots, modes)


def assert_unchanged(model: nn.Module, snap: Snapshot) -> None:
    """Fail unless ``model`` holds the same tensor objects with the same bits, flags and modes as in ``snap``."""
    assert [m for _, m, _ in snap.modes] == [m for _, m in model.named_modules(remove_duplicate=False)], (
        "the module tree changed"
    )
    for module, attr, label, tensor, bits, grad in snap.slots:
        table = module._parameters if label.startswith("parameter") else module._buffers
        assert attr in table, f"{label} was removed"
        now = table[attr]
        assert now is tensor, f"{label} is another object now ({type(now).__name__})"
        if tensor is not None:
            assert torch.equal(_bits(now), bits), f"{label} changed its values"
            assert now.requires_grad == grad, f"{label} changed requires_grad"
    changed = [name or "<root>" for name, module, training in snap.modes if module.training != training]
    assert not changed, f"modes changed: {changed}"
