"""Evaluating a caller's module without changing it: its modes, and calls at other parameter values.

Both helpers identify a module's tensors by identity (the tensor object), never by the last name that reaches
it: a module used twice (``s.b2 = s.a``) has one tensor under two names in one slot, and a parameter shared
by two modules (``s.b.weight = s.a.weight``) one tensor in two slots.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import Tensor, nn

# Dropout layers: the identity in eval mode, where every measure evaluates a model (`eval_mode`)
DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)

def input_check(model: nn.Module) -> Callable[[Tensor], None] | None:
    """The check of a model that says which inputs it takes (raising ``ValueError`` with one sentence): the toolkit's
    language models and encoders (``check_tokens``: ids, positions, token types, masks) and vision transformers
    (``check_inputs``: the image size), else ``None``."""
    for name in ("check_tokens", "check_inputs"):
        check = getattr(model, name, None)
        if callable(check):
            return check
    return None


def hooked(module: nn.Module) -> bool:
    """Whether ``module`` has forward (pre-)hooks: a call of it may compute something else than its own forward, so
    the symmetry finders leave it as it is (pinned)."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Evaluate ``model`` in eval mode and give every submodule back the mode it had.

    ``model.train(flag)`` recurses, so restoring only the root's flag would put a frozen part
    (``model.train(); model.backbone.eval()``) back in training mode; each module's own flag is restored,
    also when the body raises or is interrupted.
    """
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


@contextmanager
def kept_buffers(model: nn.Module) -> Iterator[None]:
    """Every buffer of ``model`` is the tensor it was before the block, with its values and shape: a forward that
    updates its buffers (a step counter, in place or reassigned) and runs for an analysis leaves them as found."""
    kept = [
        (m, name, b, b.clone())
        for m in model.modules()
        for name, b in m._buffers.items()
        if b is not None and not b.is_meta
    ]  # fmt: skip  (a meta tensor holds no values to move)
    try:
        yield
    finally:
        with torch.no_grad():
            for m, name, b, before in kept:
                if m._buffers.get(name) is not b:  # reassigned (`self.step = self.step + 1`): the tensor it held
                    m._buffers[name] = b
                if b.shape != before.shape:  # resized in place
                    b.resize_(before.shape)
                if not torch.equal(b, before):
                    b.copy_(before)


def tensor_aliases(module: nn.Module) -> dict[str, tuple[str, ...]]:
    """Every name of every parameter and buffer of ``module`` -> the names of all slots holding that tensor.

    A slot is one attribute of one module object: a module reached under two names (``s.b2 = s.a``) has one slot
    per tensor, so only its first name is kept; a tensor held by two modules (tied weights) has two slots, and
    both names are kept.
    """
    slots: dict[int, dict[tuple[int, str], str]] = {}  # tensor id -> slot -> first name reaching it
    names: dict[str, int] = {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for attr, tensor in (*owner._parameters.items(), *owner._buffers.items()):
            if tensor is None:
                continue
            name = f"{prefix}.{attr}" if prefix else attr
            names[name] = id(tensor)
            slots.setdefault(id(tensor), {}).setdefault((id(owner), attr), name)
    return {name: tuple(slots[tid].values()) for name, tid in names.items()}


def untied(tensors: Mapping[str, Tensor], aliases: Mapping[str, tuple[str, ...]]) -> dict[str, Tensor]:
    """``tensors`` given for every slot of each tensor they name (one name per slot), as
    ``torch.func.functional_call(..., tie_weights=False)`` needs them.

    Raises:
        ValueError: two different values are given for one tensor under two of its names.
    """
    out: dict[str, Tensor] = {}
    source: dict[str, str] = {}
    for name, value in tensors.items():
        for slot in aliases.get(name, (name,)):
            if slot in out and out[slot] is not value:
                raise ValueError(
                    f"two values are given for one tensor of the model, under {source[slot]!r} and {name!r}; "
                    "give it once"
                )
            out[slot], source[slot] = value, name
    return out


def functional_call(
    module: nn.Module,
    tensors: Mapping[str, Tensor] | tuple[Mapping[str, Tensor], ...],
    args: tuple,
    kwargs: Mapping[str, object] | None = None,
    *,
    aliases: Mapping[str, tuple[str, ...]] | None = None,
) -> object:
    """``module(*args, **kwargs)`` with its parameters and buffers replaced by ``tensors`` (functional).

    The same as ``torch.func.functional_call`` with tied weights, except that a module reached under two names
    keeps its own tensors afterwards: torch swaps such a slot once per name and restores it in the same order,
    which leaves the values passed in inside the caller's model.

    Args:
        module: the model; its tensors are the same objects afterwards.
        tensors: ``{name: tensor}`` (or a tuple of such dicts), any of a tensor's names; a tensor held by
            several modules takes the value given under any of its names.
        args: the forward's arguments.
        kwargs: the forward's arguments.
        aliases: `tensor_aliases` of ``module``, when already computed (e.g. outside a compiled
            function).
    """
    if isinstance(tensors, tuple):
        merged: dict[str, Tensor] = {}
        for part in tensors:
            merged.update(part)
        tensors = merged
    aliases = tensor_aliases(module) if aliases is None else aliases
    return torch.func.functional_call(module, untied(tensors, aliases), args, kwargs, tie_weights=False)
