"""Fixed weights (thesis ch. 3): one outgoing weight per hidden unit held fixed, and the rescaling to +-b.

Rescaling hidden unit ``j`` by ``c > 0`` divides all its outgoing weights by ``c``; holding one of them
fixed (at a nonzero value) therefore leaves no rescaling freedom, and fixing one per hidden unit or conv
channel (``H`` in all) removes the whole node-wise symmetry, leaving ``m - H`` free parameters.

Which entries. View the weight of the layer after hidden layer ``l`` as ``(out_units, units_l, rest)``:
entry ``[r, j, p]`` joins unit ``j`` to unit ``r`` of the next layer, and ``rest`` counts the entries per
such pair (1 after a Linear, the ``kh * kw`` kernel entries of a Conv2d, the ``in_group`` spatial columns
of a Linear after Flatten). Every unit owns its own slice ``[:, j, :]``, so any choice of one entry per
unit fixes exactly ``H`` distinct weights. Selections:

- ``"diagonal"``: unit ``j`` fixes its weight to unit ``r = j mod out_units`` of the next layer, at the
  middle position ``p = rest // 2`` (the kernel centre for odd kernels; the middle spatial column of the
  channel after Flatten). For equal widths this is the thesis's diagonal skeleton (3.0.3); the thesis's
  formula indexes rows (``W[k, k mod c]``) and so fixes ``H`` weights only when widths agree, while
  indexing columns gives one per hidden unit for any widths. It depends on the shapes only, so it is
  the same at every point of a rescaling orbit.
- ``"hungarian"`` (thesis 6.3.1, "advanced skeleton selection"): going from the last layer backwards,
  unit ``j``'s rescaling factor when entry ``[r, j, p]`` is fixed at ``+-b`` is
  ``f_j = |W[r, j, p]| f_r / b`` (``f_r``: factor of the next layer's unit, 1 for outputs). Each pair
  ``(r, j)`` takes its best ``p``; `scipy.optimize.linear_sum_assignment` then matches units to
  next-layer units minimizing ``sum_j |log f_j|``, each next-layer unit taking at most
  ``ceil(units_l / out_units)`` fixed weights (a permutation for equal widths, as in the thesis). The
  diagonal selection is one feasible matching, so per layer (given the later layers) the sum is never
  larger than the diagonal's; the range of all factors is usually, not provably, narrower.
  It depends on the weights, hence on the gauge: a node-wise rescaling by ``a`` shifts the costs of
  unit ``j`` inside the absolute value by ``log a_j``, which can change the matching. Use it to
  reparametrize a given checkpoint gently, not where a rescaling-invariant choice is needed.
- a mask: ``{weight name: bool tensor}`` with exactly one ``True`` in each unit's slice (the format of
  [`FixedWeightSpace.mask`][manifolds.FixedWeightSpace.mask], so a selection can be reused on a rescaled copy).

Sign rule. Positive rescalings never change a sign, so "fix at ``b``" means: the entry becomes
``s * b`` with ``s`` the sign of its current value (+1 for 0). ``b = 1`` gives the +-1 of the thesis's
reparametrization; a negative ``b`` flips every sign.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from manifolds._layout import ParamLayout
from manifolds._structure import DegeneratePointError, NetworkStructure, analyze, rescale_parameters

SELECTIONS = ("diagonal", "hungarian")

# Cost of fixing a zero weight in the Hungarian matching: never preferred, and finite for scipy.
_FORBIDDEN = 1e30


@dataclass(frozen=True)
class FixedEntries:
    """The fixed weights of the units of one hidden layer.

    Attributes:
        layer: name of the hidden layer whose units (channels) they belong to.
        weight: parameter that holds them, the weight of the next layer.
        index: ``(units,)`` long: unit ``j``'s fixed weight is ``weight.reshape(-1)[index[j]]``.
        rows: ``(units,)`` long: the unit of the next layer that each fixed weight feeds.
    """

    layer: str
    weight: str
    index: Tensor
    rows: Tensor


def _shape_of(params: Mapping[str, Tensor], name: str) -> torch.Size:
    if name not in params:
        raise ValueError(f"the parameters lack {name!r}; pass every layer's weight")
    return params[name].shape


def _pair_view(shape: torch.Size, units: int) -> tuple[int, int, int]:
    """``(out_units, units, rest)`` of a next-layer weight of ``shape`` fed by ``units`` units."""
    return shape[0], units, shape.numel() // (shape[0] * units)


def _diagonal(structure: NetworkStructure, params: Mapping[str, Tensor]) -> list[Tensor]:
    indices = []
    for layer, nxt in zip(structure.layers[:-1], structure.layers[1:]):
        out, units, rest = _pair_view(_shape_of(params, nxt.weight), layer.out_units)
        j = torch.arange(units)
        indices.append((j % out) * units * rest + j * rest + rest // 2)
    return indices


def _hungarian(structure: NetworkStructure, params: Mapping[str, Tensor], value: float) -> list[Tensor]:
    layers = structure.layers
    indices: list[Tensor] = [torch.empty(0)] * (len(layers) - 1)
    log_next = torch.zeros(layers[-1].out_units, dtype=torch.float64)  # outputs are never rescaled
    for i in reversed(range(len(layers) - 1)):
        nxt = layers[i + 1]
        out, units, rest = _pair_view(_shape_of(params, nxt.weight), layers[i].out_units)
        weight = params[nxt.weight].detach().to("cpu", torch.float64).reshape(out, units, rest)
        # log f_j if entry [r, j, p] is fixed; -inf for zero weights, which cannot be rescaled to +-b.
        log_f = weight.abs().log() + log_next[:, None, None] - math.log(value)
        cost, best_p = log_f.abs().min(dim=2)
        dead = torch.isinf(cost).all(dim=0).nonzero().flatten().tolist()
        if dead:
            raise ValueError(
                f"units {dead} of layer '{layers[i].name}' have all outgoing weights zero, so no fixed weight "
                "can break their rescaling symmetry; remove these units first"
            )
        cost = torch.where(torch.isinf(cost), torch.full_like(cost, _FORBIDDEN), cost)
        copies = -(-units // out)  # each next-layer unit may take up to ceil(units / out) fixed weights
        from scipy.optimize import linear_sum_assignment  # deferred: scipy.optimize is slow to import

        row_ind, col_ind = linear_sum_assignment(np.tile(cost.numpy(), (copies, 1)))
        rows = torch.empty(units, dtype=torch.long)
        rows[torch.as_tensor(col_ind)] = torch.as_tensor(row_ind % out, dtype=torch.long)
        j = torch.arange(units)
        p = best_p[rows, j]
        indices[i] = rows * units * rest + j * rest + p
        log_next = log_f[rows, j, p]
    return indices


def _from_mask(structure: NetworkStructure, params: Mapping[str, Tensor], mask: Mapping[str, Tensor]) -> list[Tensor]:
    holders = {nxt.weight for nxt in structure.layers[1:]}
    first = structure.layers[0].weight
    for name, m in mask.items():
        if name not in holders and (name != first or bool(torch.as_tensor(m).any())):
            raise ValueError(
                f"the selection mask marks {name!r}, which holds no outgoing weights of hidden units; mark "
                f"entries of {', '.join(sorted(holders))} only"
            )
    indices = []
    for layer, nxt in zip(structure.layers[:-1], structure.layers[1:]):
        shape = _shape_of(params, nxt.weight)
        if nxt.weight not in mask:
            raise ValueError(f"the selection mask lacks {nxt.weight!r} (fixed weights of layer '{layer.name}')")
        m = torch.as_tensor(mask[nxt.weight])
        if m.dtype != torch.bool or m.shape != shape:
            raise ValueError(
                f"mask[{nxt.weight!r}] must be a bool tensor of shape {tuple(shape)}, got {m.dtype} {tuple(m.shape)}"
            )
        out, units, rest = _pair_view(shape, layer.out_units)
        per_unit = m.reshape(out, units, rest).transpose(0, 1).reshape(units, out * rest).cpu()
        counts = per_unit.sum(dim=1)
        wrong = (counts != 1).nonzero().flatten().tolist()
        if wrong:
            raise ValueError(
                f"mask[{nxt.weight!r}] must mark exactly one outgoing weight per unit of layer '{layer.name}'; "
                f"units {wrong} have {counts[wrong].tolist()}"
            )
        k = per_unit.to(torch.uint8).argmax(dim=1)
        j = torch.arange(units)
        indices.append((k // rest) * units * rest + j * rest + k % rest)
    return indices


def _check_value(value: float, what: str) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{what} must be a positive finite number (signs are kept), got {value}")
    return value


class FixedWeightSpace:
    """The fixed-weight subspace of a network: which entries are fixed, and maps to and from free coordinates.

    A flat parameter vector (``ParamLayout`` order, length ``n``) splits into ``n - H`` free entries (in
    layout order) and ``H`` fixed ones (ordered by unit: hidden layers in forward order, units within).

    Args:
        model: the network; used to find the structure (unless ``structure`` is given) and, unless
            ``params`` is given, the values (its trainable parameters).
        selection: ``"diagonal"``, ``"hungarian"`` or a mask (see the module docstring).
        value: the fixed value ``b`` the Hungarian selection aims for (factors ``|W| f_r / b``).
        params: ``{name: tensor}`` to use instead of the model's parameters (same names).
        structure: a precomputed [`manifolds.analyze`][manifolds.analyze] result.
        example_input: passed to [`manifolds.analyze`][manifolds.analyze] (needed only when fx cannot trace the model).

    Attributes:
        structure: the network structure.
        layout: flat layout of the parameters.
        entries: one [`FixedEntries`][manifolds.FixedEntries] per hidden layer.
        fixed_positions: ``(H,)`` long, positions of the fixed entries in the flat vector, unit order.
        free_positions: ``(n - H,)`` long, positions of the free entries, ascending.
        values: ``(H,)`` the fixed entries of the parameters the space was built from.
        signs: ``(H,)`` their signs (+1 for 0), which every positive rescaling keeps.

    Raises:
        UnsupportedModelError: positive rescaling is not a symmetry of the model (there is nothing to fix).
        ValueError: bad selection or mask; a unit whose outgoing weights are all zero (Hungarian).
    """

    def __init__(
        self,
        model: nn.Module,
        selection: str | Mapping[str, Tensor] = "diagonal",
        *,
        value: float = 1.0,
        params: Mapping[str, Tensor] | None = None,
        structure: NetworkStructure | None = None,
        example_input: Tensor | None = None,
    ):
        structure = structure or analyze(model, example_input)
        structure.require_rescalable("fixed weights")
        if params is None:
            params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
        if isinstance(selection, str):
            if selection == "diagonal":
                indices = _diagonal(structure, params)
            elif selection == "hungarian":
                indices = _hungarian(structure, params, _check_value(value, "the Hungarian target value"))
            else:
                raise ValueError(f"unknown selection {selection!r}; use one of {', '.join(SELECTIONS)} or a mask")
        else:
            indices = _from_mask(structure, params, selection)
        self.structure = structure
        self.layout = ParamLayout.from_tensors(params)
        entries, positions = [], []
        for layer, nxt, index in zip(structure.layers[:-1], structure.layers[1:], indices):
            _, units, rest = _pair_view(params[nxt.weight].shape, layer.out_units)
            entries.append(FixedEntries(layer.name, nxt.weight, index, index // (units * rest)))
            positions.append(self.layout.slice(nxt.weight).start + index)
        self.entries = tuple(entries)
        self.fixed_positions = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long)
        self.free_positions = self.free_mask.nonzero().flatten()
        # full[order] interleaves cat(free, fixed) back into layout order.
        self._order = torch.argsort(torch.cat((self.free_positions, self.fixed_positions)))
        self.values = self.fixed_vector(params).detach().clone()
        self.signs = torch.where(self.values < 0, -1.0, 1.0).to(self.values)

    @property
    def n_fixed(self) -> int:
        """``H``, the number of fixed weights (one per hidden unit or channel)."""
        return int(self.fixed_positions.numel())

    @property
    def n_free(self) -> int:
        """``n - H``, the number of free parameters."""
        return self.layout.size - self.n_fixed

    @property
    def free_mask(self) -> Tensor:
        """``(n,)`` bool, ``True`` at free entries of the flat parameter vector."""
        mask = torch.ones(self.layout.size, dtype=torch.bool)
        mask[self.fixed_positions] = False
        return mask

    @property
    def mask(self) -> dict[str, Tensor]:
        """``{weight name: bool tensor of its shape}``, ``True`` at fixed entries; usable as ``selection``."""
        out = {}
        for e in self.entries:
            m = torch.zeros(self.layout.shapes[self.layout.names.index(e.weight)], dtype=torch.bool)
            m.view(-1)[e.index] = True
            out[e.weight] = m
        return out

    def _flat(self, params: Mapping[str, Tensor] | Tensor) -> Tensor:
        return params if isinstance(params, Tensor) else self.layout.flatten(params)

    def free_vector(self, params: Mapping[str, Tensor] | Tensor) -> Tensor:
        """The free entries of ``params`` (a dict or a flat ``(..., n)`` vector), ``(..., n - H)``."""
        flat = self._flat(params)
        return flat[..., self.free_positions.to(flat.device)]

    def fixed_vector(self, params: Mapping[str, Tensor] | Tensor) -> Tensor:
        """The fixed entries of ``params`` (a dict or a flat ``(..., n)`` vector), ``(..., H)`` in unit order."""
        flat = self._flat(params)
        return flat[..., self.fixed_positions.to(flat.device)]

    def params_from_free(self, free: Tensor, fixed_value: float | Tensor | None = None) -> dict[str, Tensor]:
        """Parameters with the given free entries and fixed entries set to ``fixed_value`` (differentiable).

        The map a landscape in the fixed-weight subspace evaluates: reading (a) of docs/math.md "Fixed weights" is
        ``params_from_free(free, b)`` for each ``b`` (the function changes with ``b``); for reading (b) use
        the free vector of `rescale_to_fixed_value` and the same ``b``.

        Args:
            free: ``(..., n - H)`` free entries (leading batch dims allowed, e.g. a grid of points).
            fixed_value: ``None``: `values`; a number ``b``: ``signs * b`` (the sign rule of the
                module docstring; 0 is allowed here); a tensor: ``(H,)`` (or broadcastable) values.

        Returns:
            ``{name: tensor}`` shaped like the parameters with the leading dims of ``free``.
        """
        if free.shape[-1] != self.n_free:
            raise ValueError(f"expected {self.n_free} free entries in the last dimension, got {tuple(free.shape)}")
        if fixed_value is None:
            fixed = self.values
        elif isinstance(fixed_value, Tensor):
            fixed = fixed_value
        else:
            fixed = self.signs * float(fixed_value)
        fixed = fixed.to(free).expand(*free.shape[:-1], self.n_fixed)
        full = torch.cat((free, fixed), dim=-1)[..., self._order.to(free.device)]
        return self.layout.unflatten(full)

    def rescale_to_fixed_value(self, params: Mapping[str, Tensor], value: float = 1.0) -> Reparametrization:
        """The function-preserving node-wise rescaling of ``params`` that makes every fixed weight ``+-value``.

        Thesis 6.3.1 (there with ``value = 1``): from the last layer backwards, unit ``j`` whose fixed weight
        ``W[r, j, p]`` feeds unit ``r`` (factor ``f_r``, 1 for outputs) gets ``f_j = |W[r, j, p]| f_r / value``;
        its incoming weights and bias are multiplied by ``f_j``, its outgoing weights divided by it (the
        thesis's ``D`` matrices), so the fixed weight becomes ``W f_r / f_j = sign(W) * value``. The fixed
        entries are then written as exactly ``sign * value`` (they differ from it by rounding only).

        Args:
            params: ``{name: tensor}`` with the names of `layout` (e.g. a rescaled copy's).
            value: the target ``b > 0``.

        Returns:
            The [`Reparametrization`][manifolds.Reparametrization] (``model`` is ``None``).

        Raises:
            ValueError: ``value`` not positive, or a factor overflows float64; DegeneratePointError (a
                ValueError) where a fixed weight is zero.
        """
        value = _check_value(value, "the fixed value")
        layers = self.structure.layers
        factors: list[Tensor] = [torch.empty(0)] * (len(layers) - 1)
        log_next = torch.zeros(layers[-1].out_units, dtype=torch.float64)
        for i in reversed(range(len(self.entries))):
            e = self.entries[i]
            fixed = params[e.weight].detach().reshape(-1)[e.index.to(params[e.weight].device)].cpu().double()
            zero = (fixed == 0).nonzero().flatten().tolist()
            if zero:
                raise DegeneratePointError(
                    f"the fixed weights of units {zero} of layer '{e.layer}' are 0, and no rescaling makes 0 "
                    "equal +-value; choose another selection (e.g. 'hungarian')",
                    short="zero fixed weight",
                )
            log_next = fixed.abs().log() + log_next[e.rows] - math.log(value)
            factors[i] = torch.exp(log_next)
            if not bool(torch.isfinite(factors[i]).all()) or not bool((factors[i] > 0).all()):
                raise ValueError(
                    f"the rescaling factors of layer '{e.layer}' leave the float64 range (largest |log factor| "
                    f"{float(log_next.abs().max()):.1f}); use selection='hungarian' or balance the network first"
                )
        out = rescale_parameters(params, self.structure, factors)
        for e in self.entries:
            weight = out[e.weight]
            signs = torch.where(params[e.weight].reshape(-1)[e.index.to(weight.device)] < 0, -1.0, 1.0)
            flat = weight.reshape(-1).clone()
            flat[e.index.to(weight.device)] = (signs * value).to(flat)
            out[e.weight] = flat.reshape(weight.shape)
        return Reparametrization(params=out, factors=tuple(factors), value=value, space=self)


@dataclass(frozen=True)
class Reparametrization:
    """A function-preserving rescaling after which every fixed weight is ``+-value``.

    Attributes:
        params: the rescaled parameters ``{name: tensor}``.
        factors: node factors, one float64 ``(hidden_units[l],)`` tensor per hidden layer, in the convention
            of `manifolds.rescale_parameters` (rows times ``f``, next layer's columns divided by ``f``).
        value: the target ``b``.
        space: the fixed-weight space (its ``mask`` reproduces the selection on the rescaled copy).
        model: the rescaled deep copy, when a model was given; else ``None``.
    """

    params: dict[str, Tensor]
    factors: tuple[Tensor, ...]
    value: float
    space: FixedWeightSpace
    model: nn.Module | None = None

    def _all_factors(self) -> Tensor:
        # A network without hidden units is its own representative: factor 1.
        return torch.cat(self.factors) if self.factors else torch.ones(1, dtype=torch.float64)

    @property
    def factor_range(self) -> tuple[float, float]:
        """``(smallest, largest)`` rescaling factor over all hidden units."""
        flat = self._all_factors()
        return float(flat.min()), float(flat.max())

    @property
    def max_log_factor(self) -> float:
        """``max |log f|``: how far the most rescaled unit moved (0 when nothing changed)."""
        return float(self._all_factors().log().abs().max())


def rescale_to_fixed_value(
    model_or_params: nn.Module | Mapping[str, Tensor],
    value: float = 1.0,
    selection: str | Mapping[str, Tensor] = "diagonal",
    *,
    space: FixedWeightSpace | None = None,
    example_input: Tensor | None = None,
) -> Reparametrization:
    """A function-identical copy in which every fixed weight is ``+-value`` (thesis 6.3.1 for ``value = 1``).

    Reading (b) of docs/math.md "Fixed weights": the network is the same, only the gauge differs. See
    `FixedWeightSpace.rescale_to_fixed_value` for the algorithm; ``result.factor_range`` reports
    how far units were rescaled, which the Hungarian selection keeps small.

    Args:
        model_or_params: a model (a rescaled deep copy is returned in ``.model``; the model is untouched)
            or ``{name: tensor}`` (needs ``space``).
        value: the target ``b > 0``.
        selection: ``"diagonal"``, ``"hungarian"`` (aiming at ``value``) or a mask; ignored when ``space``
            is given.
        space: a [`FixedWeightSpace`][manifolds.FixedWeightSpace] to use (its selection).
        example_input: passed to [`manifolds.analyze`][manifolds.analyze] (needed only when fx cannot trace the model).

    Returns:
        The [`Reparametrization`][manifolds.Reparametrization].

    Raises:
        UnsupportedModelError: positive rescaling is not a symmetry of the model.
        ValueError: parameters without ``space``, ``value`` not positive, a fixed weight is zero.
    """
    if isinstance(model_or_params, nn.Module):
        model = model_or_params
        params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
        space = space or FixedWeightSpace(model, selection, value=value, params=params, example_input=example_input)
        result = space.rescale_to_fixed_value(params, value)
        twin = copy.deepcopy(model)
        with torch.no_grad():
            for name, tensor in result.params.items():
                twin.get_parameter(name).copy_(tensor)
        return Reparametrization(result.params, result.factors, result.value, space, twin)
    if space is None:
        raise ValueError("rescaling a parameter dictionary needs space=FixedWeightSpace(model, ...)")
    return space.rescale_to_fixed_value(model_or_params, value)
