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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from manifolds._layout import ParamLayout
from manifolds._structure import NetworkStructure, analyze


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
        model: the network, or a :class:`NetworkStructure` (then ``params`` is required). It must be
            rescalable (:func:`manifolds.analyze`): grouped convolutions, residual connections,
            normalization layers and non-homogeneous activations are refused, naming the module.
        skeleton: designated and predecessor entries (:class:`Skeleton`); default: the G-SGD skeleton
            described in the module docstring. A given one is validated.
        params: ``{name: tensor}`` to read the skeleton values and reference signs from (default: the
            model's parameters).
        example_input: passed to :func:`manifolds.analyze` (needed only when fx cannot trace the model).

    Attributes:
        structure: the network structure.
        skeleton: the skeleton in use.
        layout: :class:`ParamLayout` of the coordinate tensors, named like the parameters they replace
            (weight coordinates of layer 0 have the weight's shape, of later layers
            ``(out_units * rest - 1, prev_units)``: each column misses its designated entry; biases
            keep their shape).
        dim: number of coordinates, ``m - H`` plus the number of bias entries.
        names: the parameter names that ``weights`` returns (every layer's weight and bias).

    Raises:
        UnsupportedModelError: the model is not a rescalable chain.
        ValueError: a designated weight or a predecessor-chain value is zero, or the skeleton is invalid.
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
                raise ValueError(
                    f"the designated (skeleton) weight of unit {a} of layer '{blocks[j - 1].geometry.name}' is 0 "
                    f"(entry {int(desflat[a])} of {g.weight}); G-space needs a nonzero fixed outgoing weight per "
                    "hidden unit: designate another entry with skeleton=Skeleton(...)"
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

        # Layers after the first, packed into one flat vector so w(v) costs a few operations whatever the
        # depth: packed entry e (unit b, column unit a) is W = v / (c_a d_b) = v * scale[e] / root[e], with
        # root[e] the root coordinate of a's chain and scale[e] = 1 / (factor_a d_b), and goes to pos[e].
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
        roots = self._roots(self._weight_coordinates(params)[0])
        zero = (roots == 0).nonzero().flatten()
        if zero.numel():
            raise ValueError(
                f"{self._describe_root(int(zero[0]))} is 0, so its chain value is 0 and w(v) divides by it; "
                "choose another predecessor for this unit with skeleton=Skeleton(...)"
            )
        self.root_sign.copy_(torch.sign(roots))

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
        self._hot_cache = None  # buffers are replaced by new tensors
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self._hot_cache = None  # load_state_dict(assign=True) replaces buffers
        super()._load_from_state_dict(*args, **kwargs)

    def _hot(self) -> _Hot:
        """Plain references to everything ``w(v)`` needs, so a training step spends no time on lookups."""
        if getattr(self, "_hot_cache", None) is None:
            self._hot_cache = _Hot(self)
        return self._hot_cache

    def _split(self, coords: Tensor | Mapping[str, Tensor] | Sequence[Tensor]) -> list[Tensor]:
        if isinstance(coords, Tensor):
            return list(self.layout.unflatten(coords).values())
        if isinstance(coords, Mapping):
            return [coords[name] for name in self.layout.names]
        coords = list(coords)
        if len(coords) != len(self.layout.names):
            raise ValueError(f"expected {len(self.layout.names)} coordinate tensors, got {len(coords)}")
        return coords

    def _roots(self, weight_coords: Sequence[Tensor]) -> Tensor:
        if len(weight_coords) == 1:
            return weight_coords[0].new_zeros(0)
        return self._packed_roots(weight_coords[0], self._pack(weight_coords[1:]))

    def _packed_roots(self, first: Tensor, packed: Tensor) -> Tensor:
        """The chain roots (layer order) from the first layer's coordinates and the packed later ones."""
        hot = self._hot()
        if not hot.later_roots:
            return first.reshape(-1).index_select(0, hot.root_first_pos)
        later = packed.index_select(0, hot.root_packed_pos)
        return torch.cat([first.reshape(-1).index_select(0, hot.root_first_pos), later]) if hot.first_roots else later

    @staticmethod
    def _pack(tensors: Sequence[Tensor]) -> Tensor:
        flat = [t.reshape(-1) for t in tensors]
        return torch.cat(flat) if len(flat) > 1 else flat[0]

    def _check_roots(self, roots: Tensor) -> None:
        sign = self._hot().root_sign
        if roots.numel() == 0 or (roots * sign).min().item() > 0:  # NaN fails too
            return
        k = int((~(roots.detach() * sign > 0)).nonzero()[0])
        value = float(roots[k].detach())
        what = "is 0" if value == 0 else f"changed sign (now {value:.3g})"
        raise GSpaceSingularityError(
            f"the G-space coordinate of {self._describe_root(k)} {what}: that unit's predecessor-chain value "
            "c = v / d would be 0 or cross 0, where w(v) = v / c is singular; lower the learning rate, or "
            "choose a predecessor with a larger weight for this unit (skeleton=Skeleton(...))"
        )

    def check(self, coords: Tensor | Mapping[str, Tensor] | Sequence[Tensor]) -> None:
        """Raise :class:`GSpaceSingularityError` if a chain value of ``coords`` is 0, NaN or changed sign."""
        self._check_roots(self._roots(self._weight_list(self._split(coords))))

    def _weight_list(self, parts: Sequence[Tensor]) -> list[Tensor]:
        return [parts[i] for i in self._hot().weight_index]

    def _packed_weights(
        self, first: Tensor, packed: Tensor, check: bool, packed_out: Tensor | None = None
    ) -> tuple[Tensor, tuple]:
        """The later layers' weights, packed (``packed_skeleton`` layout), from the coordinates.

        ``first`` (the first layer's coordinates) only supplies chain roots. Returns the packed weights
        and what :meth:`_packed_grads` reuses. ``packed_out`` (no grad mode only) receives the weights in
        place and must already hold the skeleton values, which stay.
        """
        hot = self._hot()
        roots = self._packed_roots(first, packed)
        if check:
            self._check_roots(roots)
        factor = hot.packed_scale / roots.index_select(0, hot.packed_root)
        scaled = packed * factor
        if packed_out is None:
            return hot.packed_skeleton.scatter(0, hot.packed_pos, scaled), (roots, factor, scaled)
        return packed_out.scatter_(0, hot.packed_pos, scaled), (roots, factor, scaled)

    def _packed_grads(
        self, cache: tuple, grad_packed_w: Tensor, packed_out: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Inverse chain rule for the packed later layers: ``(dL/dv packed, root terms of the first layer)``.

        The first layer's gradient is ``dL/dW_1 / d`` plus the returned terms at ``root_first_pos``.
        """
        hot = self._hot()
        roots, factor, scaled = cache
        grad_scaled = grad_packed_w.index_select(0, hot.packed_pos)
        grad_packed = torch.mul(grad_scaled, factor, out=packed_out)
        # scaled = v * scale / root: its derivative in the root is -scaled / root.
        grad_roots = torch.zeros_like(roots).scatter_add_(0, hot.packed_root, grad_scaled * scaled)
        grad_roots = grad_roots.div_(roots).neg_()
        if not hot.later_roots:
            return grad_packed, grad_roots
        grad_packed.index_add_(0, hot.root_packed_pos, grad_roots[hot.first_roots :])
        return grad_packed, grad_roots[: hot.first_roots]

    def _layer_weights(
        self, weight_coords: Sequence[Tensor], check: bool, first_out: Tensor | None = None
    ) -> tuple[list[Tensor], tuple]:
        """Weights of the weight coordinates and the intermediates the inverse chain rule reuses."""
        hot = self._hot()
        if len(weight_coords) == 1:
            if first_out is not None:
                return [first_out.copy_(weight_coords[0])], ()
            return [weight_coords[0].view_as(weight_coords[0])], ()
        packed_w, cache = self._packed_weights(weight_coords[0], self._pack(weight_coords[1:]), check)
        first = torch.mul(weight_coords[0], hot.invd_first, out=first_out)
        return [first, *(w.view(s) for w, s in zip(packed_w.split(hot.packed_sizes), hot.later_shapes))], cache

    def _layer_grads(self, cache: tuple, weight_grads: Sequence[Tensor]) -> list[Tensor]:
        """Inverse chain rule: gradients w.r.t. the weight coordinates from those w.r.t. the weights."""
        hot = self._hot()
        if len(weight_grads) == 1:
            return [weight_grads[0].clone()]
        packed, first_roots = self._packed_grads(cache, self._pack(weight_grads[1:]))
        first = (weight_grads[0] * hot.invd_first).contiguous().put_(hot.root_first_pos, first_roots, accumulate=True)
        return [first, *(g.view(s) for g, s in zip(packed.split(hot.coordinate_sizes), hot.coordinate_shapes))]

    def _coordinate_grads(self, cache: tuple, grads: Sequence[Tensor | None]) -> list[Tensor]:
        """Coordinate gradients (``layout`` order) from parameter gradients (``names`` order, None = 0)."""
        hot = self._hot()
        weight_grads = [hot.zeros(shape) if grads[i] is None else grads[i] for i, shape in hot.weight_shapes]
        out = list(grads)
        for i, g in zip(hot.weight_index, self._layer_grads(cache, weight_grads)):
            out[i] = g
        for i, invd, size in hot.biases:
            g = hot.zeros((size,)) if grads[i] is None else grads[i]
            out[i] = g.clone() if invd is None else g * invd
        return out

    def weights(
        self, coords: Tensor | Mapping[str, Tensor] | Sequence[Tensor], check: bool = True, fused: bool = False
    ) -> dict[str, Tensor]:
        """The weights ``w(v)`` (designated entries at their fixed values), differentiable in ``v``.

        Vectorized over units and layers: one gather gives every chain value ``c``, the first layer is
        one broadcast product, and all later layers together one division and one scatter.

        Args:
            coords: a flat ``(dim,)`` vector, ``{name: tensor}`` or a sequence in ``layout`` order.
            check: raise :class:`GSpaceSingularityError` when a chain value is 0 or changed sign (reads
                one value back; switch off inside ``torch.func`` transforms and check once outside).
            fused: differentiate with the hand-written inverse chain rule (:meth:`gradient`) instead of
                recording every operation: the same values and gradients with fewer operations per
                training step, but first-order reverse mode only (no ``torch.func``, no double
                backward). The default records plain operations and supports every kind of
                differentiation.

        Returns:
            ``{name: tensor}`` for every layer's weight and bias, shaped like the model's parameters.
        """
        parts = self._split(coords)
        hot = self._hot()
        weight_coords = [parts[i] for i in hot.weight_index]
        if fused:
            weights = _FusedWeights.apply(self, check, *weight_coords)
        else:
            weights = self._layer_weights(weight_coords, check)[0]
        out = list(parts)
        for i, w in zip(hot.weight_index, weights):
            out[i] = w
        for i, invd, _ in hot.biases:
            out[i] = parts[i].view_as(parts[i]) if invd is None else parts[i] * invd
        return dict(zip(self.names, out))

    def gradient(
        self, coords: Tensor | Mapping[str, Tensor] | Sequence[Tensor], weight_grads: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """Gradient w.r.t. the coordinates from the gradient w.r.t. the weights at ``w(coords)``.

        This is the inverse chain rule of G-SGD (``dL/dv = J^T dL/dw`` with ``J = dw/dv``), vectorized:
        for a straight MLP with the default skeleton it gives the formulas of the thesis's Tables 2.1
        (skeleton weights 1) and 2.3 (any skeleton weights).

        Args:
            coords: the point, as for :meth:`weights`.
            weight_grads: ``{name: dL/dw}`` for every name in ``names`` (missing ones count as 0).

        Returns:
            ``{name: dL/dv}`` in ``layout`` order.
        """
        with torch.no_grad():
            _, cache = self._layer_weights(self._weight_list(self._split(coords)), check=False)
            grads = self._coordinate_grads(cache, [weight_grads.get(name) for name in self.names])
        return dict(zip(self.layout.names, grads))

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


class _Hot:
    """Plain references to a :class:`GSpace`'s buffers and sizes (rebuilt whenever the buffers move)."""

    def __init__(self, gspace: GSpace):
        blocks = list(gspace.blocks)
        self.weight_index: list[int] = []
        self.weight_shapes: list[tuple[int, tuple[int, ...]]] = []
        self.biases: list[tuple[int, Tensor | None, int]] = []  # (position, 1 / d or None at the output, size)
        k = 0
        for i, blk in enumerate(blocks):
            g = blk.geometry
            self.weight_index.append(k)
            self.weight_shapes.append((k, g.shape))
            k += 1
            if g.bias is not None:
                self.biases.append((k, None if i == len(blocks) - 1 else blk.invd, g.out))
                k += 1
        self.invd_first = blocks[0].invd_w
        self.root_first_pos, self.root_packed_pos = gspace.root_first_pos, gspace.root_packed_pos
        self.first_roots, self.later_roots = self.root_first_pos.numel(), self.root_packed_pos.numel()
        self.root_sign = gspace.root_sign
        self.packed_root, self.packed_scale = gspace.packed_root, gspace.packed_scale
        self.packed_skeleton, self.packed_pos = gspace.packed_skeleton, gspace.packed_pos
        self.packed_sizes = [blk.skelflat.numel() for blk in blocks[1:]]
        self.later_shapes = [blk.geometry.shape for blk in blocks[1:]]
        self.coordinate_sizes = [blk.row_unit.numel() for blk in blocks[1:]]
        self.coordinate_shapes = [tuple(blk.row_unit.shape) for blk in blocks[1:]]

    def zeros(self, shape: tuple[int, ...]) -> Tensor:
        return torch.zeros(shape, dtype=self.invd_first.dtype, device=self.invd_first.device)


class _FusedWeights(torch.autograd.Function):
    """``w(v)`` for the weight coordinates with the hand-written inverse chain rule as its backward."""

    @staticmethod
    def forward(ctx, gspace: GSpace, check: bool, *weight_coords: Tensor) -> tuple[Tensor, ...]:
        weights, cache = gspace._layer_weights(weight_coords, check)
        ctx.gspace, ctx.cache = gspace, cache
        return tuple(weights)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *weight_grads: Tensor | None) -> tuple[Tensor | None, ...]:
        hot = ctx.gspace._hot()
        grads = [hot.zeros(shape) if g is None else g for g, (_, shape) in zip(weight_grads, hot.weight_shapes)]
        return (None, None, *ctx.gspace._layer_grads(ctx.cache, grads))
