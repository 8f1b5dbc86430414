"""G-space: values of basis paths, coordinates of a ReLU network that no positive rescaling changes.

Every hidden unit (or conv channel) ``a`` gets one *designated* outgoing weight entry (its fixed
skeleton weight) and one *predecessor* entry among its incoming weights. With

- ``d_l[b]``: the product of the designated weights on the chain from unit ``b`` of layer ``l`` to the
  output (``1`` for output units),
- ``c_l[a]``: the product of the predecessor weights on the chain from the input to unit ``a``,

every weight entry that is not designated, ``W_l[b, a, r]`` (``r`` indexes kernel taps or flattened
positions), has the coordinate

    v_l[b, a, r] = c_{l-1}[a] * W_l[b, a, r] * d_l[b]          (c_{-1} = 1 for the input),

the value of the input-to-output path "predecessor chain to ``a``, the edge, designated chain from
``b``": a product of weights along a path, hence unchanged by every positive rescaling. A bias ``b_l``
gets ``u_l = b_l * d_l``. The inverse rebuilds the weights layer by layer,
``W_l = v_l / (c_{l-1} d_l)`` with the designated entries set to their fixed values, because ``c_{l-1}``
only involves earlier layers: the log-Jacobian is triangular with unit diagonal, so for fixed signs of
the chain values this is a bijection between G-space and the weights whose designated entries have the
fixed values. There are ``m - H`` weight coordinates (``m`` weights, ``H`` hidden units) plus one per
bias. The designated values may be anything nonzero (a trained network keeps its own: the constant
path factor of the thesis, section 2.2.2); the network function of ``w(v)`` does not depend on them,
only on ``v`` and the signs.

With the default skeleton on a straight MLP (equal hidden widths) this is the G-SGD construction of
Meng et al. (2019): designated weights on the diagonal, hidden unit ``i`` of the first layer fed by
input ``i mod d``, hidden unit ``i`` of the last hidden layer designated to output ``i mod K``; the
coordinates are the thesis's ``v_j`` (first-layer predecessor entries), ``v_h`` (other first-layer
entries) and ``v_i`` (later non-designated entries), Tables 2.1-2.3. Other widths use the same rule
modulo the widths (one designated outgoing entry per hidden unit, one predecessor per unit).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from manifolds._layout import ParamLayout
from manifolds._structure import DegeneratePointError, NetworkStructure, analyze


class GSpaceSingularityError(ValueError):
    """A predecessor-chain value ``c`` is zero or has changed sign, so ``w(v)`` would divide by zero or
    jump across a singularity of the parametrization."""


@dataclass(frozen=True)
class Skeleton:
    """Which weight entry is designated (fixed) and which is the predecessor, for every hidden unit.

    Layer ``l``'s weight is viewed as ``(out_units, prev_units, rest)``: ``prev_units`` is the number of
    units of layer ``l - 1`` (1 for the first layer), ``rest`` the entries per (unit, previous unit)
    pair (1 for a Linear layer, the kernel size for a Conv2d, the spatial positions for a Linear after
    Flatten, all inputs for the first layer).

    Attributes:
        designated: one integer tensor per hidden layer ``i``, shape ``(hidden_units[i],)``: for unit
            ``a`` the entry ``b * rest + r`` of layer ``i + 1`` that is its fixed outgoing weight
            ``W_{i+1}[b, a, r]``. For Linear layers simply the target unit ``b``.
        predecessor: one integer tensor per hidden layer ``i``, shape ``(hidden_units[i],)``: for unit
            ``b`` the entry ``a * rest + r`` of its own row of layer ``i`` that continues its chain to
            the input, ``W_i[b, a, r]``. For Linear layers simply the source unit ``a`` (an input
            feature in the first layer).
    """

    designated: tuple[Tensor, ...]
    predecessor: tuple[Tensor, ...]

    def __post_init__(self):
        object.__setattr__(self, "designated", tuple(torch.as_tensor(t) for t in self.designated))
        object.__setattr__(self, "predecessor", tuple(torch.as_tensor(t) for t in self.predecessor))


@dataclass(frozen=True)
class _Geometry:
    name: str
    weight: str
    bias: str | None
    shape: tuple[int, ...]
    out: int
    prev: int
    rest: int


def _geometry(structure: NetworkStructure, shapes: Mapping[str, torch.Size]) -> list[_Geometry]:
    geometry = []
    for i, layer in enumerate(structure.layers):
        shape = tuple(shapes[layer.weight])
        prev = 1 if i == 0 else structure.layers[i - 1].out_units
        numel = int(torch.Size(shape).numel())
        if numel % (layer.out_units * prev):
            raise ValueError(f"the weight {layer.weight} of shape {shape} does not split into {prev} input units")
        rest = numel // (layer.out_units * prev)
        geometry.append(_Geometry(layer.name, layer.weight, layer.bias, shape, layer.out_units, prev, rest))
    return geometry


def _default_skeleton(geometry: list[_Geometry]) -> Skeleton:
    designated, predecessor = [], []
    for i, g in enumerate(geometry[:-1]):
        nxt = geometry[i + 1]
        units = torch.arange(g.out)
        # Designated: unit a -> unit (a mod out) of the next layer, middle tap (the diagonal for equal widths).
        designated.append((units % nxt.out) * nxt.rest + nxt.rest // 2)
        # Predecessor: input (b mod d) in the first layer (G-SGD), unit (b mod prev) afterwards.
        predecessor.append(units % g.rest if i == 0 else (units % g.prev) * g.rest + g.rest // 2)
    return Skeleton(tuple(designated), tuple(predecessor))


def _check_skeleton(skeleton: Skeleton, geometry: list[_Geometry]) -> None:
    hidden = len(geometry) - 1
    for field, entries in (("designated", skeleton.designated), ("predecessor", skeleton.predecessor)):
        if len(entries) != hidden:
            raise ValueError(f"skeleton.{field} needs one tensor per hidden layer ({hidden}), got {len(entries)}")
        for i, t in enumerate(entries):
            g = geometry[i]
            if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
                raise ValueError(f"skeleton.{field}[{i}] must hold integer entry indices, got dtype {t.dtype}")
            if tuple(t.shape) != (g.out,):
                raise ValueError(
                    f"skeleton.{field}[{i}] must have shape ({g.out},) (one entry per unit of layer '{g.name}'), "
                    f"got {tuple(t.shape)}"
                )
            # Designated entries live in the next layer's (out, rest) slab, predecessors in the own (prev, rest) row.
            size = geometry[i + 1].out * geometry[i + 1].rest if field == "designated" else g.prev * g.rest
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= size):
                where = f"layer '{geometry[i + 1].name}'" if field == "designated" else f"a row of layer '{g.name}'"
                raise ValueError(f"skeleton.{field}[{i}] has entries outside [0, {size}) (the entries of {where})")


class _Block(nn.Module):
    """Index and scale buffers of one layer (moved and cast with the module)."""

    def __init__(self, geometry: _Geometry):
        super().__init__()
        self.geometry = geometry


class GSpace(nn.Module):
    """The G-space parametrization ``v -> w(v)`` of a chain of Linear/Conv2d layers.

    Conv2d layers are handled per channel (a channel is a unit, every kernel tap an entry), and a
    Linear after Flatten groups its columns by channel. Calling the module maps coordinates to weights
    (``forward = weights``), differentiably, so ``L(w(v))`` can be differentiated with autograd or
    ``torch.func``; the gradient is exactly the inverse chain rule of G-SGD.

    Args:
        model: the network, or a `NetworkStructure` (then ``params`` is required). It must be
            rescalable ([`manifolds.analyze`][manifolds.analyze]): grouped convolutions, residual connections,
            normalization layers and non-homogeneous activations are refused, naming the module.
        skeleton: designated and predecessor entries ([`Skeleton`][manifolds.Skeleton]); default: the G-SGD skeleton
            described in the module docstring. A given one is validated.
        params: ``{name: tensor}`` to read the skeleton values and reference signs from (default: the
            model's parameters).
        example_input: passed to [`manifolds.analyze`][manifolds.analyze] (needed only when fx cannot trace the model).

    Attributes:
        structure: the network structure.
        skeleton: the skeleton in use.
        layout: [`ParamLayout`][manifolds.ParamLayout] of the coordinate tensors, named like the parameters they replace
            (weight coordinates of layer 0 have the weight's shape, of later layers
            ``(out_units * rest - 1, prev_units)``: each column misses its designated entry; biases
            keep their shape).
        dim: number of coordinates, ``m - H`` plus the number of bias entries.
        names: the parameter names that ``weights`` returns (every layer's weight and bias).

    Raises:
        UnsupportedModelError: the model is not a rescalable chain.
        ValueError: the skeleton is invalid; DegeneratePointError (a ValueError) where a designated weight or a
            predecessor-chain value is zero.
    """

    def __init__(
        self,
        model: nn.Module | NetworkStructure,
        skeleton: Skeleton | None = None,
        *,
        params: Mapping[str, Tensor] | None = None,
        example_input: Tensor | None = None,
    ):
        super().__init__()
        if isinstance(model, NetworkStructure):
            if params is None:
                raise ValueError("GSpace built from a NetworkStructure needs params={name: tensor}")
            structure, module = model, None
        else:
            structure, module = analyze(model, example_input), model
            if params is None:
                params = dict(model.named_parameters())
        structure.require_rescalable("the G-space parametrization")
        object.__setattr__(self, "_model", module)  # not a submodule: its parameters are not ours
        self.structure = structure
        params = {k: t.detach() for k, t in params.items()}
        missing = [n for layer in structure.layers for n in (layer.weight, layer.bias) if n and n not in params]
        if missing:
            raise ValueError(f"params lack {', '.join(missing)}")
        geometry = _geometry(structure, {k: t.shape for k, t in params.items()})
        skeleton = skeleton if skeleton is not None else _default_skeleton(geometry)
        _check_skeleton(skeleton, geometry)
        self.skeleton = Skeleton(
            tuple(t.detach().to(torch.long).cpu().clone() for t in skeleton.designated),
            tuple(t.detach().to(torch.long).cpu().clone() for t in skeleton.predecessor),
        )
        self.blocks = nn.ModuleList(_Block(g) for g in geometry)
        self.names = tuple(n for g in geometry for n in (g.weight, g.bias) if n is not None)
        self.n_hidden = structure.n_hidden
        ref = params[geometry[0].weight]
        self._build({k: t.to(ref.device) for k, t in params.items()}, ref.dtype)
        self.layout = ParamLayout.from_tensors(self._coordinate_shapes())
        self.dim = self.layout.size

    # ----------------------------------------------------------------------------------------------
    # construction
    def _build(self, params: Mapping[str, Tensor], dtype: torch.dtype) -> None:
        blocks = list(self.blocks)
        n = len(blocks)
        device = params[blocks[0].geometry.weight].device
        flat = [params[b.geometry.weight].reshape(-1).to(dtype) for b in blocks]
        designated = [t.to(device) for t in self.skeleton.designated]
        predecessor = [t.to(device) for t in self.skeleton.predecessor]

        # Designated entries of layer j >= 1 (one per unit of layer j - 1) and the chains to the output.
        skel: list[Tensor | None] = [None] * n
        for j in range(1, n):
            g, blk = blocks[j].geometry, blocks[j]
            units = torch.arange(g.prev, device=device)
            target = designated[j - 1] // g.rest
            desflat = target * g.prev * g.rest + units * g.rest + designated[j - 1] % g.rest
            skel[j] = flat[j][desflat]
            zero = (skel[j] == 0).nonzero().flatten()
            if zero.numel():
                a = int(zero[0])
                raise DegeneratePointError(
                    f"the designated (skeleton) weight of unit {a} of layer '{blocks[j - 1].geometry.name}' is 0 "
                    f"(entry {int(desflat[a])} of {g.weight}); G-space needs a nonzero fixed outgoing weight per "
                    "hidden unit: designate another entry with skeleton=Skeleton(...)",
                    short="zero skeleton weight",
                )
            blk.register_buffer("desflat", desflat)
            blk.register_buffer("target", target)
        d: list[Tensor] = [torch.ones(0)] * n
        d[n - 1] = torch.ones(blocks[-1].geometry.out, dtype=dtype, device=device)
        for i in range(n - 2, -1, -1):
            d[i] = skel[i + 1] * d[i + 1][blocks[i + 1].target]
        dcomp: list[Tensor] = [torch.ones(0)] * n  # d of the row unit of every compact entry
        for i, blk in enumerate(blocks):
            g = blk.geometry
            blk.register_buffer("invd", 1.0 / d[i])
            if i == 0:
                blk.register_buffer("invd_w", (1.0 / d[0]).reshape(g.out, *[1] * (len(g.shape) - 1)))
                continue
            # Column a of the compact coordinates holds the (out, rest) slab of unit a without its designated entry.
            rows = torch.arange(g.out * g.rest - 1, device=device)[:, None]
            slab = rows + (rows >= designated[i - 1][None, :]).long()
            units = torch.arange(g.prev, device=device)[None, :]
            rows_unit = slab // g.rest
            blk.register_buffer("pos", (rows_unit * g.prev * g.rest + units * g.rest + slab % g.rest).reshape(-1))
            blk.register_buffer("row_unit", rows_unit)
            dcomp[i] = d[i][rows_unit]
            skelflat = torch.zeros(flat[i].numel(), dtype=dtype, device=device)
            blk.register_buffer("skelflat", skelflat.index_put((blk.desflat,), skel[i]))

        # Predecessor chains: c_i[b] = root coordinate * constant factor, where the root is the first
        # non-designated predecessor entry on the chain (c_i[b] = v / d_i[b] there) and the factor
        # multiplies the designated weights met after it. One gather then gives every c.
        root_index, root_factor, offset = [], [], 0
        for i, blk in enumerate(blocks[:-1]):
            g = blk.geometry
            units = torch.arange(g.out, device=device)
            src = predecessor[i] // g.rest
            tap = predecessor[i] % g.rest
            predflat = units * g.prev * g.rest + src * g.rest + tap
            blk.register_buffer("predflat", predflat)
            blk.register_buffer("src", src)
            if i == 0:
                on_skeleton = torch.zeros(g.out, dtype=torch.bool, device=device)
                compact = predflat
            else:
                on_skeleton = blk.desflat[src] == predflat
                slab = units * g.rest + tap
                compact = (slab - (slab > designated[i - 1][src]).long()) * g.prev + src
            roots = (~on_skeleton).nonzero().flatten()
            blk.register_buffer("root_pos", compact[roots])
            new_index = offset + torch.cumsum((~on_skeleton).long(), 0) - 1
            offset += roots.numel()
            if i == 0:
                index, factor = new_index, blk.invd
            else:
                index = torch.where(on_skeleton, root_index[-1][src], new_index)
                factor = torch.where(on_skeleton, root_factor[-1][src] * skel[i][src], blk.invd)
            root_index.append(index)
            root_factor.append(factor)
        self._root_layers = [i for i, blk in enumerate(blocks[:-1]) if blk.root_pos.numel()]
        empty_long = torch.zeros(0, dtype=torch.long, device=device)

        # Everything but the first layer's weight is packed into one flat vector, so w(v) costs a few
        # operations whatever the depth: packed entry e is W = v * scale[e] / root[packed_root[e]], placed at
        # packed_pos[e] of the packed weights (the later layers' weights in their own layout, then every
        # bias). A weight entry (unit b, column unit a) has the root coordinate of a's chain and
        # scale = 1 / (factor_a d_b); a bias entry of unit b has scale 1 / d_b and the constant root 1,
        # an extra last root slot, so biases cost no operation of their own.
        chain_index = torch.cat(root_index) if root_index else empty_long
        chain_factor = torch.cat(root_factor) if root_factor else torch.ones(0, dtype=dtype, device=device)
        hidden_offset, weight_offset = 0, 0
        positions, roots_of, scales, skeletons = [], [], [], []
        for i, blk in enumerate(blocks[1:], start=1):
            column = (hidden_offset + torch.arange(blk.geometry.prev, device=device)).expand(blk.row_unit.shape)
            positions.append(blk.pos + weight_offset)
            roots_of.append(chain_index[column].reshape(-1))
            scales.append((1.0 / (chain_factor[column] * dcomp[i])).reshape(-1))
            skeletons.append(blk.skelflat)
            hidden_offset += blk.geometry.prev
            weight_offset += blk.skelflat.numel()
        for blk in blocks:
            if blk.geometry.bias is not None:
                units = blk.geometry.out
                positions.append(weight_offset + torch.arange(units, device=device))
                roots_of.append(torch.full((units,), offset, dtype=torch.long, device=device))
                scales.append(blk.invd)  # 1 / d_b (1 at the output)
                skeletons.append(torch.zeros(units, dtype=dtype, device=device))
                weight_offset += units
        no_float = torch.ones(0, dtype=dtype, device=device)
        self.register_buffer("packed_pos", torch.cat(positions) if positions else empty_long)
        self.register_buffer("packed_root", torch.cat(roots_of) if roots_of else empty_long)
        self.register_buffer("packed_scale", torch.cat(scales) if scales else no_float)
        self.register_buffer("packed_skeleton", torch.cat(skeletons) if skeletons else no_float)
        # Roots (layer order): first-layer ones index the first coordinate tensor, later ones the packed vector.
        packed_offsets = [0]
        for blk in blocks[1:]:
            packed_offsets.append(packed_offsets[-1] + blk.row_unit.numel())
        later_roots = [blocks[i].root_pos + packed_offsets[i - 1] for i in self._root_layers if i > 0]
        self.register_buffer("root_first_pos", blocks[0].root_pos if n > 1 else empty_long)
        self.register_buffer("root_packed_pos", torch.cat(later_roots) if later_roots else empty_long)
        self.register_buffer("root_sign", torch.ones(offset, dtype=dtype, device=device))
        coords = self._weight_coordinates(params)[0]
        kernel = self._kernel()
        roots = kernel.roots(coords[0], kernel.pack([coords[i] for i in range(1, n)]))[:-1]
        zero = (roots == 0).nonzero().flatten()
        if zero.numel():
            raise DegeneratePointError(
                f"{self._describe_root(int(zero[0]))} is 0, so its chain value is 0 and w(v) divides by it; "
                "choose another predecessor for this unit with skeleton=Skeleton(...)",
                short="zero predecessor weight",
            )
        self.root_sign.copy_(torch.sign(roots))
        self._kernel_cache = None  # built before the signs were known

    def _coordinate_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {}
        for i, blk in enumerate(self.blocks):
            g = blk.geometry
            shapes[g.weight] = g.shape if i == 0 else (g.out * g.rest - 1, g.prev)
            if g.bias is not None:
                shapes[g.bias] = (g.out,)
        return {k: torch.empty(s, device="meta") for k, s in shapes.items()}

    def _describe_root(self, k: int) -> str:
        for i in self._root_layers:
            blk = self.blocks[i]
            count = blk.root_pos.numel()
            if k < count:
                g = blk.geometry
                units = (~self._on_skeleton(i)).nonzero().flatten()
                b = int(units[k])
                entry = int(blk.predflat[b])
                return f"the predecessor weight of unit {b} of layer '{g.name}' (entry {entry} of {g.weight})"
            k -= count
        raise IndexError(k)

    def _on_skeleton(self, i: int) -> Tensor:
        blk = self.blocks[i]
        if i == 0:
            return torch.zeros(blk.geometry.out, dtype=torch.bool, device=blk.predflat.device)
        return blk.desflat[blk.src] == blk.predflat

    # ----------------------------------------------------------------------------------------------
    # coordinates of given weights
    def _params(self, params: Mapping[str, Tensor] | None) -> Mapping[str, Tensor]:
        if params is not None:
            return params
        if self._model is None:
            raise ValueError("this GSpace was built from a structure; pass params={name: tensor}")
        return dict(self._model.named_parameters())

    def _weight_coordinates(self, params: Mapping[str, Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """Weight coordinates of ``params`` and their chains to the output ``d`` (read from ``params``)."""
        blocks = list(self.blocks)
        flat = [params[b.geometry.weight].reshape(-1) for b in blocks]
        n = len(blocks)
        d = [torch.ones(0)] * n
        d[n - 1] = torch.ones_like(flat[-1][: blocks[-1].geometry.out])
        for i in range(n - 2, -1, -1):
            d[i] = flat[i + 1][blocks[i + 1].desflat] * d[i + 1][blocks[i + 1].target]
        coords, c_prev = [], None
        for i, blk in enumerate(blocks):
            g = blk.geometry
            if i == 0:
                w = params[g.weight]
                coords.append(w * d[0].reshape(g.out, *[1] * (w.dim() - 1)))
            else:
                coords.append(flat[i][blk.pos].reshape(blk.row_unit.shape) * d[i][blk.row_unit] * c_prev[None, :])
            if i < n - 1:
                chain = flat[i][blk.predflat]
                c_prev = chain if i == 0 else chain * c_prev[blk.src]
        return coords, d

    def coordinate_tensors(self, params: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
        """G-space coordinates of ``params`` (default: the model's current parameters), shaped as ``layout``.

        Works for any weights, not only those whose designated entries have the fixed values: the
        coordinates are path values, so a rescaled network gets the same coordinates. Differentiable.

        Args:
            params: ``{name: tensor}`` holding every layer's weight and bias.

        Returns:
            ``{name: coordinate tensor}`` in ``layout`` order.
        """
        params = self._params(params)
        coords, d = self._weight_coordinates(params)
        out: dict[str, Tensor] = {}
        for i, blk in enumerate(self.blocks):
            g = blk.geometry
            out[g.weight] = coords[i]
            if g.bias is not None:
                out[g.bias] = params[g.bias] * d[i]
        return out

    def coordinates(self, params: Mapping[str, Tensor] | None = None) -> Tensor:
        """The flat vector ``(dim,)`` of basis-path values of ``params`` (default: the model's)."""
        return self.layout.flatten(self.coordinate_tensors(params))

    # ----------------------------------------------------------------------------------------------
    # weights of given coordinates
    def _apply(self, fn, recurse=True):
        self._kernel_cache = None  # buffers are replaced by new tensors
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self._kernel_cache = None  # load_state_dict(assign=True) replaces buffers
        super()._load_from_state_dict(*args, **kwargs)

    def _kernel(self) -> _Kernel:
        """The precomputed hot path (rebuilt after the buffers move), so a step spends no time on lookups."""
        kernel = self.__dict__.get("_kernel_cache")
        if kernel is None:
            kernel = self._kernel_cache = _Kernel(self)
        return kernel

    def _split(self, coords: Tensor | Mapping[str, Tensor] | Sequence[Tensor]) -> list[Tensor]:
        if isinstance(coords, Tensor):
            return list(self.layout.unflatten(coords).values())
        if isinstance(coords, Mapping):
            return [coords[name] for name in self.layout.names]
        coords = list(coords)
        if len(coords) != len(self.layout.names):
            raise ValueError(f"expected {len(self.layout.names)} coordinate tensors, got {len(coords)}")
        return coords

    def _raise_singular(self, roots: Tensor) -> None:
        """Raise `GSpaceSingularityError` for the first chain root (``roots``, layer order) that is
        0, NaN or of the wrong sign."""
        k = int((~(roots.detach() * self.root_sign > 0)).nonzero()[0])
        value = float(roots[k].detach())
        what = "is 0" if value == 0 else f"changed sign (now {value:.3g})"
        raise GSpaceSingularityError(
            f"the G-space coordinate of {self._describe_root(k)} {what}: that unit's predecessor-chain value "
            "c = v / d would be 0 or cross 0, where w(v) = v / c is singular. From PyTorch's default "
            "initialization the chain values are products of small weights, so almost any step crosses 0: start "
            "from manifolds.gsgd_init_(model) (or GOptimizer/GModel(..., init='gsgd')), which sets every chain value "
            "to 1, as the G-SGD paper does; or "
            "lower the learning rate, or choose a predecessor with a larger weight for this unit "
            "(skeleton=Skeleton(...))"
        )

    def check(self, coords: Tensor | Mapping[str, Tensor] | Sequence[Tensor]) -> None:
        """Raise `GSpaceSingularityError` if a chain value of ``coords`` is 0, NaN or changed sign."""
        kernel, parts = self._kernel(), self._split(coords)
        with torch.no_grad():
            kernel.check(kernel.roots(parts[0], kernel.pack([parts[i] for i in kernel.packed_index]))[:-1])

    def weights(
        self, coords: Tensor | Mapping[str, Tensor] | Sequence[Tensor], check: bool = True, fused: bool = False
    ) -> dict[str, Tensor]:
        """The weights ``w(v)`` (designated entries at their fixed values), differentiable in ``v``.

        Vectorized over units and layers: one gather gives every chain value ``c``, the first layer is
        one broadcast product, and all later layers and biases together a few vectorized operations.

        Args:
            coords: a flat ``(dim,)`` vector, ``{name: tensor}`` or a sequence in ``layout`` order.
            check: raise `GSpaceSingularityError` when a chain value is 0 or changed sign (reads
                one value back; switch off inside ``torch.func`` transforms and check once outside).
            fused: differentiate with the hand-written inverse chain rule (`gradient`) instead of
                recording every operation: the same values and gradients with fewer operations per
                training step, but first-order reverse mode only (no ``torch.func``, no double
                backward). The default records plain operations and supports every kind of
                differentiation.

        Returns:
            ``{name: tensor}`` for every layer's weight and bias, shaped like the model's parameters.
        """
        kernel, parts = self._kernel(), self._split(coords)
        packed_parts = [parts[i] for i in kernel.packed_index]
        if fused:
            weights = _FusedWeights.apply(kernel, check, None, None, parts[0], *packed_parts)
        else:
            weights = kernel.weights(parts[0], kernel.pack(packed_parts), check)
        return dict(zip(kernel.names, kernel.unpermute(weights)))

    def gradient(
        self, coords: Tensor | Mapping[str, Tensor] | Sequence[Tensor], weight_grads: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """Gradient w.r.t. the coordinates from the gradient w.r.t. the weights at ``w(coords)``.

        This is the inverse chain rule of G-SGD (``dL/dv = J^T dL/dw`` with ``J = dw/dv``), vectorized:
        for a straight MLP with the default skeleton it gives the formulas of the thesis's Tables 2.1
        (skeleton weights 1) and 2.3 (any skeleton weights).

        Args:
            coords: the point, as for [`weights`][manifolds.GSpace.weights].
            weight_grads: ``{name: dL/dw}`` for every name in ``names`` (missing ones count as 0).

        Returns:
            ``{name: dL/dv}`` in ``layout`` order.
        """
        kernel, parts = self._kernel(), self._split(coords)
        with torch.no_grad():
            first, packed, ws = parts[0], kernel.pack([parts[i] for i in kernel.packed_index]), kernel.workspace()
            kernel.forward(first, packed, ws, check=False)
            grads = kernel.filled(
                [weight_grads.get(self.names[k]) for k in kernel.order], [first.shape, *kernel.weight_shapes]
            )
            grad_first, grad_packed = kernel.scale_first(grads[0]), kernel.empty()
            kernel.backward(kernel.pack(grads[1:]), ws, grad_first, grad_packed)
        return dict(zip(self.layout.names, kernel.unpermute([grad_first, *kernel.split_coordinates(grad_packed)])))

    forward = weights

    # ----------------------------------------------------------------------------------------------
    # inspection
    def skeleton_values(self) -> list[Tensor]:
        """The fixed designated weights, one ``(hidden_units[i],)`` tensor per hidden layer."""
        return [blk.skelflat[blk.desflat] for blk in list(self.blocks)[1:]]

    def skeleton_masks(self) -> dict[str, Tensor]:
        """``{weight name: bool tensor}`` marking the designated (fixed) entries of every weight."""
        masks = {}
        for i, blk in enumerate(self.blocks):
            g = blk.geometry
            mask = torch.zeros(int(torch.Size(g.shape).numel()), dtype=torch.bool, device=blk.invd.device)
            if i > 0:
                mask[blk.desflat] = True
            masks[g.weight] = mask.view(g.shape)
        return masks

    def predecessor_masks(self) -> dict[str, Tensor]:
        """``{weight name: bool tensor}`` marking every hidden unit's predecessor entry (its chain to the input)."""
        masks = {}
        blocks = list(self.blocks)
        for i, blk in enumerate(blocks):
            g = blk.geometry
            mask = torch.zeros(int(torch.Size(g.shape).numel()), dtype=torch.bool, device=blk.invd.device)
            if i < len(blocks) - 1:
                mask[blk.predflat] = True
            masks[g.weight] = mask.view(g.shape)
        return masks

    def to_edges(
        self, coords: Tensor | Mapping[str, Tensor] | Sequence[Tensor], fill: float = 0.0
    ) -> dict[str, Tensor]:
        """Place every coordinate at the weight entry of its path's free edge (designated entries get
        ``fill``): a linear, invertible relabelling useful to compare with per-weight formulas or plot.

        Returns:
            ``{name: tensor}`` shaped like the parameters.
        """
        parts = self._split(coords)
        out: dict[str, Tensor] = {}
        k = 0
        for i, blk in enumerate(self.blocks):
            g = blk.geometry
            v = parts[k]
            k += 1
            if i == 0:
                out[g.weight] = v
            else:
                base = torch.full((blk.skelflat.numel(),), fill, dtype=v.dtype, device=v.device)
                out[g.weight] = base.scatter(0, blk.pos, v.reshape(-1)).view(g.shape)
            if g.bias is not None:
                out[g.bias] = parts[k]
                k += 1
        return out

    def extra_repr(self) -> str:
        return f"dim={self.dim}, layers={len(self.blocks)}, hidden_units={self.n_hidden}"


def gsgd_init_(model: nn.Module, skeleton: Skeleton | None = None, *, example_input: Tensor | None = None) -> nn.Module:
    """Set every designated (skeleton) weight and every hidden unit's predecessor weight of ``model`` to 1,
    in place: the initialization of the G-SGD paper.

    The weight tensors keep their shapes (``(out, in)`` for a Linear layer, ``(out, in, kh, kw)`` for a
    Conv2d); what changes are the entries marked by ``GSpace(model, skeleton).skeleton_masks()`` and
    ``.predecessor_masks()`` (boolean tensors shaped like the weights; one designated entry per hidden
    unit, in the next layer's weight, and one predecessor entry per hidden unit, in its own row). Then
    every chain value starts at 1, far from the singularity at 0, and the first layer's weights equal
    their G-space coordinates. This changes the network function (it is a new initialization, not a
    rescaling).

    Args:
        model: a rescalable chain of Linear/Conv2d layers (see [`GSpace`][manifolds.GSpace]).
        skeleton: designated and predecessor entries (default: the G-SGD skeleton).
        example_input: passed to [`manifolds.analyze`][manifolds.analyze] when fx cannot trace the model.

    Returns:
        ``model`` itself.
    """
    set_gsgd_entries_(GSpace(model, skeleton, example_input=example_input), dict(model.named_parameters()))
    return model


GSPACE_INITS = ("model", "gsgd")  # GOptimizer/GModel's init: the model's weights, or gsgd_init_ of them


def check_init(init: str) -> None:
    if init not in GSPACE_INITS:
        raise ValueError(f"init must be 'model' (start from the model's weights) or 'gsgd' (set every skeleton and "
                         f"predecessor weight to 1 first, as gsgd_init_ does), got {init!r}")


def set_gsgd_entries_(gspace: GSpace, tensors: Mapping[str, Tensor]) -> None:
    """Set the designated and predecessor entries of ``gspace`` in ``tensors`` (``{name: weight}``) to 1, in place;
    ``gspace`` must then be rebuilt from them, since it holds the designated values it was built with."""
    designated, predecessor = gspace.skeleton_masks(), gspace.predecessor_masks()
    with torch.no_grad():
        for name, mask in designated.items():
            tensors[name][mask | predecessor[name]] = 1.0


class _Kernel:
    """The hot path of ``w(v)`` and of its inverse chain rule, precomputed once per [`GSpace`][manifolds.GSpace].

    Coordinates come in two parts: ``first``, the first layer's weight coordinates (its weight is
    ``first * invd_first``, a row scaling), and ``packed``, one flat vector of everything else in
    ``packed_index`` order (the later layers' weight coordinates, then every bias). Their weights are
    ``packed_w``, flat too (the later weights in their own layout, then the biases), with the designated
    entries at their fixed values. ``roots`` has one slot per chain root (layer order) and a last slot
    holding 1, the root of the bias entries.

    On a small network every tensor operation costs a fixed dispatch overhead that dwarfs its
    arithmetic, and the tensors a step touches between forward and backward passes are out of cache, so
    the hot path counts operations and bytes: `forward`, `packed_weights` and
    `backward` run without autograd into tensors the caller keeps (`_Workspace`, views made
    once), and the structure of straight networks with the default skeleton (``columns``,
    ``unit_scale``, ``root_step``, ``block_cols``) replaces gathers and scatters by broadcasts, column
    sums and strided views. `weights` is the same map in plain differentiable operations
    (``torch.func``, double backward).
    """

    def __init__(self, gspace: GSpace):
        blocks = list(gspace.blocks)
        self.gspace = gspace
        self.names = gspace.names
        where = {name: k for k, name in enumerate(self.names)}
        geometry = [blk.geometry for blk in blocks]
        later = [(g.weight, (g.out * g.rest - 1, g.prev), g.shape) for g in geometry[1:]]
        biases = [(g.bias, (g.out,), (g.out,)) for g in geometry if g.bias is not None]
        #: names position of every packed item, and its coordinate and weight shapes
        self.packed_index = [where[name] for name, _, _ in later + biases]
        self.order = [0, *self.packed_index]  # names position of the kernel's outputs
        self.coordinate_shapes = [shape for _, shape, _ in later + biases]
        self.weight_shapes = [shape for _, _, shape in later + biases]
        self.coordinate_sizes = [int(torch.Size(s).numel()) for s in self.coordinate_shapes]
        self.weight_sizes = [int(torch.Size(s).numel()) for s in self.weight_shapes]
        self.bias_sizes = [shape[0] for _, shape, _ in biases]
        self.n_weights = sum(self.coordinate_sizes[: len(later)])  # weight entries of packed
        self.n_weights_w = sum(self.weight_sizes[: len(later)])  # and of packed_w
        self.first_shape = geometry[0].shape
        self.invd_first = blocks[0].invd_w
        self.dtype, self.device = self.invd_first.dtype, self.invd_first.device
        self.root_first_pos, self.root_packed_pos = gspace.root_first_pos, gspace.root_packed_pos
        self.root_sign = gspace.root_sign
        self.packed_pos, self.packed_root = gspace.packed_pos, gspace.packed_root
        self.packed_scale, self.packed_skeleton = gspace.packed_scale, gspace.packed_skeleton
        # packed_w gathered instead of scattered: entry e of packed_w is entry gather_pos[e] of
        # [scaled, skeleton values] (one pass, every entry written once, no copy of the skeleton first).
        designated = (self.packed_skeleton != 0).nonzero().flatten()  # the fixed values are nonzero
        gather_pos = torch.empty_like(self.packed_skeleton, dtype=torch.long)
        gather_pos[self.packed_pos] = torch.arange(self.packed_pos.numel(), device=self.device)
        gather_pos[designated] = self.packed_pos.numel() + torch.arange(designated.numel(), device=self.device)
        self.gather_pos, self.skeleton_values = gather_pos, self.packed_skeleton[designated]
        self.n_first, self.n_roots = self.root_first_pos.numel(), self.root_sign.numel()
        self.later_roots = self.n_roots > self.n_first
        self.signs = self.root_sign.tolist()
        self.positive = all(s > 0 for s in self.signs)  # then the check needs no sign product
        self.size = self.packed_scale.numel()
        self.one = torch.ones(1, dtype=self.dtype, device=self.device)
        # All skeleton weights on the first layer's chains 1 (G-SGD's initialization): W_1 = first.
        self.unit_first = bool((self.invd_first == 1).all())
        # Every later layer a Linear layer on the same P units: its weight, (out, P), and coordinates,
        # (out - 1, P), are consecutive row blocks of packed_w and packed viewed with P columns.
        cols = {g.prev for g in geometry[1:]}
        flat_layers = all(len(g.shape) == 2 and g.rest == 1 for g in geometry[1:])
        self.block_cols = cols.pop() if len(cols) == 1 and flat_layers else 0
        self.weight_rows = [g.out for g in geometry[1:]]
        self.coordinate_rows = [g.out - 1 for g in geometry[1:]]
        # Straight nets with the default skeleton: the chain of column a of every later layer (unit a of
        # the layer before) has root a. Then the packed weight entries, viewed as rows of n_roots, need
        # no gather by root (a broadcast division) and no scatter-add (a column reduction).
        n, n_weights = self.n_roots, self.n_weights
        self.columns = bool(n and n_weights and n_weights % n == 0 and not self.later_roots) and bool(
            (self.packed_root[:n_weights].view(-1, n) == torch.arange(n, device=self.device)).all()
        )
        if self.columns:
            self.scale_rows = self.packed_scale[:n_weights].view(-1, n)
        # ... with every scale 1 (skeleton weights 1, no biases), W = v * (1 / root): no factor tensor.
        self.unit_scale = self.columns and not self.bias_sizes and bool((self.packed_scale == 1).all())
        # ... and the roots are evenly spaced entries of the first layer's coordinates (unit b fed by
        # input b: the diagonal): (start, step) of a strided view of them.
        self.root_step: tuple[int, int] | None = None
        pos = self.root_first_pos.cpu()
        if self.columns:
            step = int(pos[1] - pos[0]) if self.n_first > 1 else 1
            if step > 0 and torch.equal(pos, pos[0] + step * torch.arange(self.n_first)):
                self.root_step = (int(pos[0]), step)

    # ---------------------------------------------------------------------------------- layout
    def empty(self, shape: int | Sequence[int] | None = None) -> Tensor:
        """An uninitialized tensor, by default of the packed coordinates' size."""
        return torch.empty(self.size if shape is None else shape, dtype=self.dtype, device=self.device)

    def zeros(self, shape: Sequence[int]) -> Tensor:
        return torch.zeros(tuple(shape), dtype=self.dtype, device=self.device)

    def pack(self, parts: Sequence[Tensor]) -> Tensor:
        """``packed`` (or its gradient, or ``packed_w``'s) from its parts, as one flat tensor."""
        if not parts:
            return self.empty(0)
        return torch.cat([t.reshape(-1) for t in parts]) if len(parts) > 1 else parts[0].reshape(-1)

    def pack_weight_grads(self, grads: Sequence[Tensor]) -> Tensor:
        """``packed_w``'s gradient from the parameters' gradients (``packed_index`` order, shaped like the
        parameters): with row blocks one concatenation, no reshapes."""
        if self.block_cols and not self.bias_sizes:
            return torch.cat(list(grads)).view(-1)
        return self.pack(grads)

    def _split(self, flat: Tensor, rows: list[int], n: int, sizes: list[int], shapes: list) -> list[Tensor]:
        if not self.block_cols:
            return [t.view(s) for t, s in zip(flat.split(sizes), shapes)]
        if not self.bias_sizes:
            return list(flat.view(-1, self.block_cols).split(rows))
        return [*flat[:n].view(-1, self.block_cols).split(rows), *flat[n:].split(self.bias_sizes)]

    def split_coordinates(self, packed: Tensor) -> list[Tensor]:
        """Views of ``packed`` (or of its gradient), one per item, shaped as the coordinates."""
        return self._split(packed, self.coordinate_rows, self.n_weights, self.coordinate_sizes, self.coordinate_shapes)

    def split_weights(self, packed_w: Tensor) -> list[Tensor]:
        """Views of ``packed_w`` (or of its gradient), one per item, shaped as the parameters."""
        return self._split(packed_w, self.weight_rows, self.n_weights_w, self.weight_sizes, self.weight_shapes)

    def unpermute(self, outputs: Sequence[Tensor]) -> list[Tensor]:
        """``[first, *packed items]`` back into ``names`` order."""
        out: list[Tensor] = [outputs[0]] * len(self.names)
        for k, t in zip(self.order, outputs):
            out[k] = t
        return out

    def filled(self, grads: Sequence[Tensor | None], shapes: Sequence) -> list[Tensor]:
        """``grads`` with zeros for None (a parameter the loss does not reach)."""
        if all(g is not None for g in grads):
            return list(grads)
        return [self.zeros(s) if g is None else g for g, s in zip(grads, shapes)]

    def root_view(self, first: Tensor) -> Tensor:
        """The roots' entries of ``first`` (contiguous, shaped like the first layer's coordinates, or
        their gradient) as one strided view; needs ``root_step``."""
        start, step = self.root_step
        return first.as_strided((self.n_roots,), (step,), first.storage_offset() + start)

    def _first_roots(self, first: Tensor) -> Tensor:
        """The roots, all held by ``first`` in the columns case: a view where possible."""
        if self.root_step is not None and first.is_contiguous():
            return self.root_view(first)
        return first.reshape(-1).index_select(0, self.root_first_pos)

    def workspace(self) -> _Workspace:
        return _Workspace(self)

    # ---------------------------------------------------------------------------------- w(v)
    def roots(self, first: Tensor, packed: Tensor) -> Tensor:
        """The chain roots (layer order) followed by the constant 1, differentiably."""
        parts = [first.reshape(-1).index_select(0, self.root_first_pos)]
        if self.later_roots:
            parts.append(packed.index_select(0, self.root_packed_pos))
        return torch.cat([*parts, self.one])

    def check(self, roots: Tensor, inverse: Tensor | None = None) -> None:
        """Every root (without the constant slot) keeps its sign and is not 0 (nor NaN): one read-back of
        the few values, compared in Python (cheaper than a reduction and a read-back). With ``inverse``
        (``1 / roots``, same signs, infinite for a zero root) that is what is read."""
        values = (roots if inverse is None else inverse).tolist()
        if not values:
            return
        if not self.positive:
            values = [v * s for v, s in zip(values, self.signs)]
        # min > 0: every sign kept, no zero root; the sum catches a NaN (and a zero root's infinite 1 / root).
        total = sum(values)
        finite = math.isfinite(total) if inverse is not None else not math.isnan(total)
        if not (min(values) > 0 and finite):
            self.gspace._raise_singular(roots)

    def weights(self, first: Tensor, packed: Tensor, check: bool) -> list[Tensor]:
        """``[W_1, *packed weights]`` in plain differentiable operations."""
        roots = self.roots(first, packed)
        if check:
            self.check(roots[:-1])
        scaled = packed * (self.packed_scale / roots.index_select(0, self.packed_root))
        packed_w = self.packed_skeleton.scatter(0, self.packed_pos, scaled)
        return [first * self.invd_first, *self.split_weights(packed_w)]

    def first_weight(self, first: Tensor) -> Tensor:
        """``W_1 = first * invd_first`` as an output of an autograd Function: a view when it is ``first``."""
        return first.view_as(first) if self.unit_first else first * self.invd_first

    def scale_first(self, tensor: Tensor, out: Tensor | None = None) -> Tensor:
        """``tensor * invd_first``: the first layer's weight from its coordinates, and its coordinates'
        gradient (before the roots' terms) from the weight's gradient. A copy when the factor is 1."""
        if self.unit_first:
            return tensor.clone(memory_format=torch.contiguous_format) if out is None else out.copy_(tensor)
        return torch.mul(tensor, self.invd_first, out=out)

    def forward(self, first: Tensor, packed: Tensor, ws: _Workspace, check: bool = True) -> None:
        """``w(v)``'s intermediates, without autograd, into ``ws``: the roots (``1 / root`` in the columns
        case), ``factor = scale / root`` (unless every scale is 1) and ``scaled = packed * factor`` (the
        packed weights' values, see `packed_weights`); raises `GSpaceSingularityError` if a
        chain value is singular."""
        if self.columns:
            # 1 / root per column, contiguous (broadcasting a strided operand is slow), then broadcasts.
            roots = ws.roots_source if ws.bound else self._first_roots(first)
            torch.reciprocal(roots, out=ws.inv_roots)
            if check:
                self.check(roots, ws.inv_roots)
            if self.unit_scale:
                rows = ws.packed_rows if ws.bound else packed.view(-1, self.n_roots)
                torch.mul(rows, ws.inv_roots, out=ws.scaled_rows)
                return
            torch.mul(self.scale_rows, ws.inv_roots, out=ws.factor_rows)  # the biases' part is constant
        else:
            if self.n_roots:
                torch.index_select(first.reshape(-1), 0, self.root_first_pos, out=ws.roots_first)
                if self.later_roots:
                    torch.index_select(packed, 0, self.root_packed_pos, out=ws.roots_later)
                if check:
                    self.check(ws.roots_all)
            torch.index_select(ws.roots, 0, self.packed_root, out=ws.factor)
            torch.div(self.packed_scale, ws.factor, out=ws.factor)
        torch.mul(packed, ws.factor, out=ws.scaled)

    def packed_weights(self, ws: _Workspace, out: Tensor | None = None) -> Tensor:
        """The packed weights from `forward`'s ``ws``, as a new tensor or into ``out``."""
        return torch.index_select(ws.scaled_ext, 0, self.gather_pos, out=out)

    def backward(self, grad_packed_w: Tensor, ws: _Workspace, grad_first: Tensor, grad_packed: Tensor) -> None:
        """The inverse chain rule without autograd, at the point `forward` left in ``ws``.

        ``grad_first`` (contiguous; the one ``ws`` is bound to, if so) holds ``scale_first(dL/dW_1)``
        and receives the roots' terms in place; ``grad_packed`` is overwritten with ``dL/dv`` of the
        packed coordinates, from ``grad_packed_w``, the gradient w.r.t. the packed weights (flat). Every
        packed entry is ``W = v * factor`` with ``factor = scale / root``, so ``dL/dv = dL/dW * factor``,
        and the root of every entry collects ``dL/dW * dW/droot = -dL/dW * scaled / root``.
        """
        grad_scaled = torch.index_select(grad_packed_w, 0, self.packed_pos, out=ws.work)
        if self.unit_scale:
            rows = ws.grad_rows if ws.grads_bound else grad_packed.view(-1, self.n_roots)
            torch.mul(ws.work_rows, ws.inv_roots, out=rows)
        else:
            torch.mul(grad_scaled, ws.factor, out=grad_packed)
        if not self.n_roots:
            return
        if self.columns:  # column sums, and the roots' entries of grad_first viewed: one fused update
            torch.sum(ws.work_rows.mul_(ws.scaled_rows), 0, out=ws.grad_roots_all)
            if self.root_step is not None:
                target = ws.grad_first_roots if ws.grads_bound else self.root_view(grad_first)
                target.addcmul_(ws.grad_roots_all, ws.inv_roots, value=-1)
                return
            ws.grad_roots_all.mul_(ws.inv_roots)
        else:
            ws.grad_roots.zero_().scatter_add_(0, self.packed_root, grad_scaled.mul_(ws.scaled))
            torch.div(ws.grad_roots_all, ws.roots_all, out=ws.grad_roots_all)
        grad_first.view(-1).index_add_(0, self.root_first_pos, ws.grad_roots_first, alpha=-1)
        if self.later_roots:
            grad_packed.index_add_(0, self.root_packed_pos, ws.grad_roots_later, alpha=-1)


class _Workspace:
    """The tensors `_Kernel.forward` and `_Kernel.backward` fill, with their views made once:
    a caller that steps repeatedly keeps one and allocates nothing per step.

    ``stamp`` counts the forward passes that filled it (see `_FusedWeights`).
    """

    def __init__(self, kernel: _Kernel):
        n_first, n_roots, n_weights = kernel.n_first, kernel.n_roots, kernel.n_weights
        self.kernel, self.bound, self.grads_bound, self.stamp = kernel, False, False, 0
        self.roots = torch.ones(n_roots + 1, dtype=kernel.dtype, device=kernel.device)  # last slot: constant 1
        self.roots_first, self.roots_later, self.roots_all = (
            self.roots[:n_first],
            self.roots[n_first:n_roots],
            self.roots[:n_roots],
        )
        self.factor, self.work = kernel.empty(), kernel.empty()
        # scaled followed by the skeleton values: what _Kernel.packed_weights gathers the weights from
        self.scaled_ext = torch.cat([kernel.empty(), kernel.skeleton_values])
        self.scaled = self.scaled_ext[: kernel.size]
        self.grad_roots = torch.zeros_like(self.roots)
        self.grad_roots_first, self.grad_roots_later, self.grad_roots_all = (
            self.grad_roots[:n_first],
            self.grad_roots[n_first:n_roots],
            self.grad_roots[:n_roots],
        )
        if kernel.columns:
            rows = (-1, n_roots)
            self.inv_roots = torch.ones(n_roots, dtype=kernel.dtype, device=kernel.device)
            self.factor_rows = self.factor[:n_weights].view(rows)
            self.scaled_rows = self.scaled[:n_weights].view(rows)
            self.work_rows = self.work[:n_weights].view(rows)
            self.factor[n_weights:] = kernel.packed_scale[n_weights:]  # biases: root 1

    def bind(self, first: Tensor, packed: Tensor) -> None:
        """Make once the views of the coordinates that every `_Kernel.forward` needs, when the
        kernel works on them (``root_step``), for a caller whose coordinates live in fixed contiguous
        tensors; the forward must then get these ``first`` and ``packed``."""
        kernel = self.kernel
        if kernel.root_step is None:
            return
        self.roots_source = kernel.root_view(first)
        self.packed_rows = packed[: kernel.n_weights].view(-1, kernel.n_roots)
        self.bound = True

    def bind_grads(self, grad_first: Tensor, grad_packed: Tensor) -> None:
        """The same for the gradients `_Kernel.backward` writes, when they are fixed tensors too."""
        kernel = self.kernel
        if kernel.root_step is None:
            return
        self.grad_first_roots = kernel.root_view(grad_first)
        self.grad_rows = grad_packed[: kernel.n_weights].view(-1, kernel.n_roots)
        self.grads_bound = True


class _FusedWeights(torch.autograd.Function):
    """``w(v)`` (``[W_1, *packed weights]``) with the hand-written inverse chain rule as its backward.

    ``ws`` is a workspace the caller keeps across calls (GModel), or None for a fresh one. The backward
    reads what its forward left there, unless a later forward refilled it meanwhile: then it recomputes
    its own point from the saved coordinates (autograd checks they were not modified in place).
    ``packed`` is the packed coordinates as one flat tensor when the caller keeps the packed coordinate
    tensors as views of it (GModel), saving a copy per call; otherwise None.
    """

    @staticmethod
    def forward(
        ctx,
        kernel: _Kernel,
        check: bool,
        ws: _Workspace | None,
        packed: Tensor | None,
        first: Tensor,
        *packed_coords: Tensor,
    ) -> tuple[Tensor, ...]:
        if packed is None:
            packed = kernel.pack(packed_coords)
        if ws is None:
            ws = kernel.workspace()
        kernel.forward(first, packed, ws, check)
        ws.stamp += 1
        ctx.kernel, ctx.ws, ctx.stamp = kernel, ws, ws.stamp
        ctx.save_for_backward(first, *packed_coords)
        return (kernel.first_weight(first), *kernel.split_weights(kernel.packed_weights(ws)))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_first_w: Tensor | None, *grad_items: Tensor | None) -> tuple[Tensor | None, ...]:
        kernel, ws = ctx.kernel, ctx.ws
        if ws.stamp != ctx.stamp:  # refilled by a later forward: recompute this call's point
            first, *packed_coords = ctx.saved_tensors
            ws = kernel.workspace()
            kernel.forward(first, kernel.pack(packed_coords), ws, check=False)
        if grad_first_w is None:
            grad_first_w = kernel.zeros(kernel.first_shape)
        grad_first, grad_packed = kernel.scale_first(grad_first_w), kernel.empty()
        grad_packed_w = kernel.pack_weight_grads(kernel.filled(grad_items, kernel.weight_shapes))
        kernel.backward(grad_packed_w, ws, grad_first, grad_packed)
        return (None, None, None, None, grad_first, *kernel.split_coordinates(grad_packed))
