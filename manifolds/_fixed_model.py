"""``FixModel``: a network whose fixed weights no optimizer, weight decay or regularizer can move.

The thesis (3.0.6) zeroed the gradients of fixed weights with hooks, which weight decay and momentum
bypass and which stack when applied twice. Here every weight that holds fixed entries is a
`torch.nn.utils.parametrize` parametrization: its free entries are the only Parameter (a 1-D
vector), the fixed entries are a buffer, and the forward pass scatters both into the weight. The
optimizer never sees the fixed entries, so they stay bit-identical, and the trainable parameter count
is ``m - H``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from numbers import Real

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from manifolds._fixed import FixedWeightSpace


class _ScatterFixed(nn.Module):
    """Parametrization ``free entries (numel - k,) -> weight``, with ``k`` fixed entries held in a buffer.

    Args:
        shape: shape of the weight.
        index: ``(k,)`` flat indices of the fixed entries, unit order.
        values: ``(k,)`` their values.
    """

    def __init__(self, shape: torch.Size, index: Tensor, values: Tensor):
        super().__init__()
        free = torch.ones(shape.numel(), dtype=torch.bool, device=index.device)
        free[index] = False
        free_index = free.nonzero().flatten()
        self.shape = tuple(shape)
        self.register_buffer("free_index", free_index)
        self.register_buffer("order", torch.argsort(torch.cat((free_index, index))))
        self.register_buffer("fixed", values.detach().clone())

    def forward(self, free: Tensor) -> Tensor:
        return torch.cat((free, self.fixed.to(free)))[self.order].reshape(self.shape)

    def right_inverse(self, weight: Tensor) -> Tensor:
        return weight.reshape(-1)[self.free_index]


def _owner(name: str) -> tuple[str, str]:
    """``"a.b.weight" -> ("a.b", "weight")``; ``"weight" -> ("", "weight")``."""
    path, _, attr = name.rpartition(".")
    return path, attr


def _fixed_value(fixed_factor: bool | float) -> float | None:
    if fixed_factor is False:
        return None
    if fixed_factor is True:
        return 1.0
    if isinstance(fixed_factor, Real) and math.isfinite(float(fixed_factor)) and float(fixed_factor) != 0:
        return float(fixed_factor)
    raise ValueError(
        f"fixed_factor must be False (keep the values), True (+-1) or a nonzero finite number, got {fixed_factor!r}"
    )


def _same_mask(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


class FixModel(nn.Module):
    """A copy of ``model`` with one outgoing weight per hidden unit (conv channel) fixed (thesis ch. 3).

    Layers are taken in forward order ([`manifolds.analyze`][manifolds.analyze]); which entries are fixed is described
    in `manifolds._fixed`. The wrapped network is ``self.module``; its trainable parameters are the
    free entries only (``m - H`` numbers), so every optimizer, with weight decay or momentum, leaves the
    fixed entries exactly as they are. ``model`` itself is not modified.

    Sign rule: ``fixed_factor=True`` or a number ``b`` sets each fixed entry to ``s * b`` (``b = 1`` for
    ``True``), ``s`` the sign of its current value (+1 for 0); so ``True`` gives +-1, the same signs a
    function-preserving rescaling (`rescale_to_fixed_value`) would give, and a negative ``b`` flips
    them. Setting values changes the network's function; to keep it, rescale first:
    ``rep = rescale_to_fixed_value(model, b)``, then ``FixModel(rep.model, selection=rep.space.mask)``.

    Applying ``FixModel`` to a ``FixModel`` re-fixes the same entries (no second parametrization): with
    ``fixed_factor=False`` the result equals its input.

    Args:
        model: the network (a plain model, or a ``FixModel``).
        fixed_factor: ``False``: keep the current values; ``True``: +-1; a nonzero number ``b``: ``s * b``.
        selection: ``"diagonal"``, ``"hungarian"`` (aiming at ``|b|``) or a mask (see
            `FixedWeightSpace`); ``None``: ``"diagonal"``, or the existing selection of a ``FixModel``.
        example_input: passed to [`manifolds.analyze`][manifolds.analyze] (needed only when fx cannot trace the model).

    Attributes:
        module: the network with its fixed weights in buffers.
        space: `FixedWeightSpace` of the plain parameter names (``space.values`` are the fixed values
            at construction).

    Raises:
        UnsupportedModelError: positive rescaling is not a symmetry of the model (names the offending module).
        ValueError: bad ``fixed_factor`` or selection, a fixed weight that is 0 (a zero weight does not break
            its unit's symmetry), a ``FixModel`` re-fixed with another selection, or the inner ``.module``
            of a ``FixModel`` passed instead of the ``FixModel``.
    """

    def __init__(
        self,
        model: nn.Module,
        fixed_factor: bool | float = False,
        selection: str | Mapping[str, Tensor] | None = None,
        *,
        example_input: Tensor | None = None,
    ):
        super().__init__()
        value = _fixed_value(fixed_factor)
        target = 1.0 if value is None else abs(value)
        if isinstance(model, FixModel):
            plain = model.remove()
            chosen = FixedWeightSpace(
                plain,
                model.space.mask if selection is None else selection,
                value=target,
                structure=model.space.structure,
            )
            if not _same_mask(chosen.mask, model.space.mask):
                raise ValueError(
                    "the model is already a FixModel with another selection of fixed weights; call .remove() "
                    "and fix the plain model to change it"
                )
        else:
            if any(isinstance(m, _ScatterFixed) for m in model.modules()):
                raise ValueError(
                    "the model already has fixed weights (it is the .module of a FixModel); pass the FixModel "
                    "itself to re-fix it, or its .remove() to start from the plain network"
                )
            plain = copy.deepcopy(model)
            chosen = FixedWeightSpace(
                plain, "diagonal" if selection is None else selection, value=target, example_input=example_input
            )
        if value is not None:
            with torch.no_grad():
                for e, signs in zip(chosen.entries, chosen.signs.split(chosen.structure.hidden_units)):
                    weight = plain.get_parameter(e.weight)
                    flat = weight.detach().reshape(-1).clone()
                    flat[e.index.to(flat.device)] = (signs * value).to(flat)
                    weight.copy_(flat.view_as(weight))
        self.space = FixedWeightSpace(plain, chosen.mask, structure=chosen.structure)
        zero = (self.space.values == 0).nonzero().flatten().tolist()
        if zero:
            raise ValueError(
                f"fixed weights {zero} (in unit order) are 0, which does not break their units' rescaling "
                "symmetry; pass a nonzero fixed_factor or another selection"
            )
        for e in self.space.entries:
            path, attr = _owner(e.weight)
            weight = plain.get_parameter(e.weight)
            values = weight.detach().reshape(-1)[e.index.to(weight.device)]
            parametrize.register_parametrization(
                plain.get_submodule(path), attr, _ScatterFixed(weight.shape, e.index.to(weight.device), values)
            )
        self.module = plain
        self.train(plain.training)  # same mode as the model (nn.Module starts in training mode)

    def forward(self, x: Tensor) -> Tensor:
        """``self.module(x)``; one input, as for every chain network `manifolds.analyze` accepts."""
        return self.module(x)

    def _parametrizations(self) -> list[_ScatterFixed]:
        out = []
        for e in self.space.entries:
            path, attr = _owner(e.weight)
            out.append(getattr(self.module.get_submodule(path).parametrizations, attr)[0])
        return out

    @property
    def n_fixed(self) -> int:
        """``H``, the number of fixed weights."""
        return self.space.n_fixed

    @property
    def n_free(self) -> int:
        """Number of trainable parameters (``m - H`` when every parameter of the model is trainable)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def fixed_values(self) -> Tensor:
        """``(H,)`` the current fixed entries, unit order (hidden layers forward, units within)."""
        parts = [p.fixed for p in self._parametrizations()]
        return torch.cat(parts).detach().clone() if parts else self.space.values.clone()  # no hidden units

    def plain_parameters(self) -> dict[str, Tensor]:
        """``{name: tensor}`` with the plain model's names and full weights (fixed entries included), detached."""
        out = {}
        for name in self.space.layout.names:
            path, attr = _owner(name)
            out[name] = getattr(self.module.get_submodule(path), attr).detach().clone()
        return out

    def remove(self) -> nn.Module:
        """A plain copy of the network with the current values (ordinary Parameters, no fixed entries)."""
        twin = copy.deepcopy(self.module)
        for e in self.space.entries:
            path, attr = _owner(e.weight)
            owner = twin.get_submodule(path)
            weight = getattr(owner, attr).detach().clone()
            requires_grad = getattr(owner.parametrizations, attr).original.requires_grad
            # Not parametrize.remove_parametrizations: a deep copy shares its injected "Parametrized..."
            # class with this model, and removal deletes the weight property from that class, breaking
            # this model. Restoring the copy's own class (the injected class's base) leaves it intact.
            owner.__class__ = owner.__class__.__bases__[0]
            del owner._modules["parametrizations"]
            # Linear and Conv2d register the weight before the bias: put it back first so names keep their order.
            others = dict(owner._parameters)
            owner._parameters.clear()
            owner.register_parameter(attr, nn.Parameter(weight, requires_grad=requires_grad))
            owner._parameters.update(others)
        return twin

    def extra_repr(self) -> str:
        return f"fixed={self.n_fixed}, free={self.n_free}"
