"""Training in G-space: a module whose parameters are the coordinates, and an optimizer wrapper.

Both run any ``torch.optim`` optimizer on the G-space coordinates ``v`` with the network computing
with ``w(v)``, so gradients are the exact inverse chain rule of G-SGD and the optimizer's state
(momentum, Adam moments) lives on ``v`` and persists across steps. The designated (skeleton) weights
are buffers, never parameters, so no optimizer, weight decay included, can change them.

Weight decay in G-space decays the coordinates ``v`` (the basis-path values), an L2 penalty on path
values in the spirit of the basis-path regularization the G-SGD paper pairs with G-SGD (appendix
11.5), not on the weights; unlike weight decay on ``w`` it is invariant under rescaling.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import Tensor, nn

from manifolds._gspace import GSpace, GSpaceSingularityError, Skeleton
from manifolds._structure import Layer, NetworkStructure, analyze


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return model.get_submodule(path), attr


class GModel(nn.Module):
    """``model`` reparametrized by its G-space coordinates: ``parameters()`` are the coordinates.

    The forward pass computes the weights ``w(v)`` (:class:`GSpace`) and runs a structural copy of
    ``model`` with them, so ``loss.backward()`` fills the coordinates' gradients directly and any
    optimizer trains in G-space (``torch.optim.SGD(gmodel.parameters(), lr)`` is G-SGD). ``model``
    itself is not modified; :meth:`to_model` returns a trained copy.

    Args:
        model: a rescalable chain of Linear/Conv2d layers (see :class:`GSpace`).
        skeleton: designated and predecessor entries (default: the G-SGD skeleton).
        fused: compute gradients with the hand-written inverse chain rule (fewer operations per step,
            first-order reverse mode only); ``False`` records plain operations, which ``torch.func``
            and double backward need.
        example_input: passed to :func:`manifolds.analyze` when fx cannot trace the model.

    Attributes:
        gspace: the parametrization (its buffers hold the fixed skeleton weights).
        coordinates: ``nn.ParameterList`` of coordinate tensors in ``gspace.layout`` order.

    Raises:
        UnsupportedModelError: the model is not a rescalable chain (the message names the module).
    """

    def __init__(
        self,
        model: nn.Module,
        skeleton: Skeleton | None = None,
        *,
        fused: bool = True,
        example_input: Tensor | None = None,
    ):
        super().__init__()
        structure = analyze(model, example_input)
        params = {k: p.detach() for k, p in model.named_parameters()}
        self.gspace = GSpace(structure, skeleton, params=params)
        self.coordinates = nn.ParameterList(
            nn.Parameter(t.detach().clone()) for t in self.gspace.coordinate_tensors(params).values()
        )
        self.fused = fused
        # A copy of the model without the layers' parameters: the forward pass sets them to w(v).
        self.shell = copy.deepcopy(model)
        self._slots = [_owner(self.shell, name) for name in self.gspace.names]
        for module, attr in self._slots:
            del module._parameters[attr]
            setattr(module, attr, torch.empty(0))

    def weight_tensors(self) -> dict[str, Tensor]:
        """``w(v)`` at the current coordinates, differentiable: ``{name: tensor}`` like ``model``'s."""
        return self.gspace.weights(list(self.coordinates), fused=self.fused)

    def weights(self) -> dict[str, Tensor]:
        """The current weights ``w(v)``, detached copies named like ``model``'s parameters."""
        with torch.no_grad():
            return {k: w.clone() for k, w in self.gspace.weights(list(self.coordinates)).items()}

    def forward(self, *args, **kwargs):
        for (module, attr), weight in zip(self._slots, self.weight_tensors().values()):
            setattr(module, attr, weight)
        try:
            return self.shell(*args, **kwargs)
        finally:
            for module, attr in self._slots:  # keep no graph alive between calls
                setattr(module, attr, torch.empty(0))

    def to_model(self) -> nn.Module:
        """A new copy of the original model carrying the current weights ``w(v)`` as parameters."""
        model = copy.deepcopy(self.shell)
        for name, weight in self.weights().items():
            module, attr = _owner(model, name)
            delattr(module, attr)
            module.register_parameter(attr, nn.Parameter(weight))
        return model


def _linear_chain(tensors: list[Tensor]) -> tuple[NetworkStructure, dict[str, Tensor]]:
    """Read bare parameters as Linear layers in forward order: a 2-D weight, optionally its 1-D bias."""
    layers: list[Layer] = []
    named: dict[str, Tensor] = {}
    k = 0
    while k < len(tensors):
        weight = tensors[k]
        if weight.dim() != 2:
            raise ValueError(
                f"parameter {k} has shape {tuple(weight.shape)}; bare parameters are read as a chain of Linear "
                "layers (a 2-D weight, optionally followed by its 1-D bias): pass the model itself for other layers"
            )
        name = str(len(layers))
        if layers and weight.shape[1] != layers[-1].out_units:
            raise ValueError(
                f"parameter {k} (shape {tuple(weight.shape)}) does not take the {layers[-1].out_units} outputs of "
                "the previous layer; pass the parameters in forward order, or pass the model"
            )
        named[f"{name}.weight"] = weight
        bias = None
        if k + 1 < len(tensors) and tensors[k + 1].dim() == 1:
            if tensors[k + 1].shape[0] != weight.shape[0]:
                raise ValueError(f"parameter {k + 1} is not a bias of the {weight.shape[0]} units of parameter {k}")
            bias = f"{name}.bias"
            named[bias] = tensors[k + 1]
            k += 1
        layers.append(Layer(name, "Linear", f"{name}.weight", bias, weight.shape[0], weight.shape[1], 1))
        k += 1
    return NetworkStructure(tuple(layers), tuple(() for _ in layers[1:]), ()), named


class GOptimizer(torch.optim.Optimizer):
    """Run ``optimizer_class`` in G-space on a model's weights (G-SGD for ``torch.optim.SGD``).

    Use it like the wrapped optimizer on the original model: ``loss.backward()`` on the model, then
    ``step()``. Each step turns the weight gradients into coordinate gradients (inverse chain rule,
    :meth:`GSpace.gradient`), lets the wrapped optimizer update the coordinates, and writes ``w(v)``
    back into the model. The wrapped optimizer keeps its state between steps (so G-Adam is Adam on the
    coordinates); ``param_groups`` are the wrapped optimizer's, so learning-rate schedulers work, and
    ``step(closure)`` supports closures (LBFGS). The model's designated (skeleton) weights never change.

    Args:
        model_or_params: the model (its structure is checked, Conv2d supported), or its parameters in
            forward order, or parameter groups (dicts as for any optimizer, whose options apply to the
            coordinates of those parameters). Bare parameters are read as Linear layers (2-D weight,
            optional 1-D bias); the activations between them cannot be checked then, so they must be
            positively homogeneous (ReLU, LeakyReLU, identity).
        optimizer_class: any ``torch.optim.Optimizer`` subclass.
        skeleton: designated and predecessor entries (default: the G-SGD skeleton).
        example_input: passed to :func:`manifolds.analyze` when fx cannot trace the model.
        **optimizer_kwargs: passed to ``optimizer_class`` (``lr``, ``momentum``, ``betas``,
            ``weight_decay``, ...). ``weight_decay`` decays the coordinates (see the module docstring).

    Attributes:
        optimizer: the wrapped optimizer, acting on ``coordinates``.
        gspace: the parametrization.
        coordinates: the coordinate tensors, ``gspace.layout`` order.

    Raises:
        GSpaceSingularityError: from :meth:`step`, when the update would make a chain value 0 or change
            its sign; the coordinates are then reset to the model's (unchanged) weights.
    """

    def __init__(
        self,
        model_or_params: nn.Module | Iterable[Tensor] | Iterable[dict],
        optimizer_class: type[torch.optim.Optimizer],
        *,
        skeleton: Skeleton | None = None,
        example_input: Tensor | None = None,
        **optimizer_kwargs,
    ):
        if isinstance(model_or_params, GModel):
            raise TypeError(
                "a GModel's parameters already are G-space coordinates: use "
                f"{optimizer_class.__name__}(gmodel.parameters(), ...) instead of GOptimizer"
            )
        if isinstance(model_or_params, nn.Module):
            structure = analyze(model_or_params, example_input)
            named = dict(model_or_params.named_parameters())
            groups = None
        else:
            items = list(model_or_params)
            if not items:
                raise ValueError("GOptimizer got an empty parameter list")
            groups = [dict(g) for g in items] if isinstance(items[0], dict) else [{"params": items}]
            for g in groups:
                g["params"] = [g["params"]] if isinstance(g["params"], Tensor) else list(g["params"])
            structure, named = _linear_chain([t for g in groups for t in g["params"]])
        self.gspace = GSpace(structure, skeleton, params={k: t.detach() for k, t in named.items()})
        self._targets = [named[name] for name in self.gspace.names]
        with torch.no_grad():
            self.coordinates = self._make_coordinates(list(self.gspace.coordinate_tensors(named).values()))
        by_id = {id(named[name]): c for name, c in zip(self.gspace.names, self.coordinates)}
        if groups is None:
            inner_groups = [{"params": self.coordinates}]
        else:
            inner_groups = [{**g, "params": [by_id[id(t)] for t in g["params"]]} for g in groups]
        self.optimizer = optimizer_class(inner_groups, **optimizer_kwargs)
        # The base class supplies hooks and profiling; groups and state are the wrapped optimizer's.
        super().__init__(self.coordinates, dict(self.optimizer.defaults))
        self._share()
        self._refresh(write=False)  # the model already holds w(v); rewriting it would only add rounding

    def _share(self) -> None:
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.defaults = self.optimizer.defaults

    def _make_coordinates(self, values: list[Tensor]) -> list[Tensor]:
        """Leaf coordinate tensors; those of the layers after the first share one flat storage, so a step
        works on them packed without copying (with persistent buffers for the packed weights and gradients).
        """
        hot = self.gspace._hot()
        later = hot.weight_index[1:]
        coords = [t.detach().clone() for t in values]
        if later:
            self._packed_v = torch.cat([coords[i].reshape(-1) for i in later])
            self._packed_g = torch.zeros_like(self._packed_v)
            self._packed_w = hot.packed_skeleton.clone()  # its skeleton entries are never overwritten
            pieces = zip(later, self._packed_v.split(hot.coordinate_sizes), hot.coordinate_shapes)
            for i, piece, shape in pieces:
                coords[i] = piece.view(shape)
            sizes, shapes = hot.coordinate_sizes, hot.coordinate_shapes
            self._grad_views = [g.view(s) for g, s in zip(self._packed_g.split(sizes), shapes)]
            self._weight_views = [w.view(s) for w, s in zip(self._packed_w.split(hot.packed_sizes), hot.later_shapes)]
        return [c.requires_grad_(True) for c in coords]

    def _refresh(self, write: bool) -> None:
        """Recompute ``w(v)`` and the inverse chain rule's cache; with ``write``, put ``w(v)`` in the model.

        Raises :class:`GSpaceSingularityError` before anything is written if a chain value is singular.
        """
        hot = self.gspace._hot()
        coords, targets = self.coordinates, self._targets
        first = hot.weight_index[0]
        with torch.no_grad():
            if len(hot.weight_index) == 1:
                _, self._cache = self.gspace._layer_weights([coords[first]], True, targets[first] if write else None)
            else:
                packed_out = self._packed_w if write else None
                _, self._cache = self.gspace._packed_weights(coords[first], self._packed_v, True, packed_out)
                if write:
                    torch.mul(coords[first], hot.invd_first, out=targets[first])
                    for i, weight in zip(hot.weight_index[1:], self._weight_views):
                        targets[i].copy_(weight)
            if write:
                for i, invd, _ in hot.biases:
                    if invd is None:
                        targets[i].copy_(coords[i])
                    else:
                        torch.mul(coords[i], invd, out=targets[i])
        self._versions = [c._version for c in coords]

    def _push(self) -> None:
        """Write ``w(v)`` into the model."""
        self._refresh(write=True)

    def _pull(self) -> None:
        """Coordinate gradients from the model's weight gradients (None where no gradient exists)."""
        grads = [t.grad for t in self._targets]
        coords = self.coordinates
        if all(g is None for g in grads):
            for c in coords:
                c.grad = None
            return
        if self._versions != [c._version for c in coords]:  # moved outside step()
            self._refresh(write=False)
        hot = self.gspace._hot()
        with torch.no_grad():
            if len(hot.weight_index) == 1:
                for c, g in zip(coords, self.gspace._coordinate_grads(self._cache, grads)):
                    c.grad = g
                return
            weight_grads = [hot.zeros(shape) if grads[i] is None else grads[i] for i, shape in hot.weight_shapes]
            _, first_roots = self.gspace._packed_grads(
                self._cache, self.gspace._pack(weight_grads[1:]), packed_out=self._packed_g
            )
            grad = (weight_grads[0] * hot.invd_first).contiguous()
            coords[hot.weight_index[0]].grad = grad.put_(hot.root_first_pos, first_roots, accumulate=True)
            for i, view in zip(hot.weight_index[1:], self._grad_views):
                coords[i].grad = view
            for i, invd, size in hot.biases:
                g = hot.zeros((size,)) if grads[i] is None else grads[i]
                coords[i].grad = g.clone() if invd is None else g * invd

    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        """One update of the wrapped optimizer in G-space, then the model gets the new weights ``w(v)``.

        Args:
            closure: re-evaluates the model and returns the loss after calling ``backward()`` on it
                (optional for most optimizers, required by LBFGS); it sees the model at the
                coordinates the wrapped optimizer is trying.

        Returns:
            The closure's loss, or None.
        """
        if closure is None:
            self._pull()
            loss = self.optimizer.step()
        else:

            def g_closure():
                self._push()
                with torch.enable_grad():
                    value = closure()
                self._pull()
                return value

            loss = self.optimizer.step(g_closure)
        try:
            self._push()
        except GSpaceSingularityError as err:
            self.resync()
            raise GSpaceSingularityError(
                f"{err}. The update was not applied: the model keeps its weights and the coordinates were "
                "reset to them (the wrapped optimizer's state, e.g. momentum, already includes this step)"
            ) from err
        return loss

    def resync(self) -> None:
        """Re-read the coordinates from the model's current weights (after changing them from outside).

        The next :meth:`step` writes ``w(v)`` back, with the designated weights at their fixed values,
        a function-preserving rescaling of what the model holds.
        """
        with torch.no_grad():
            coords = self.gspace.coordinate_tensors(dict(zip(self.gspace.names, self._targets)))
            for c, new in zip(self.coordinates, coords.values()):
                c.copy_(new)
        self._refresh(write=False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the model's weights and of the coordinates."""
        for t in self._targets:
            if t.grad is None:
                continue
            if set_to_none:
                t.grad = None
            else:
                t.grad.detach_()
                t.grad.zero_()
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict plus ``"gspace"``: the coordinates and the skeleton buffers."""
        state = self.optimizer.state_dict()
        state["gspace"] = {
            "coordinates": [c.detach().clone() for c in self.coordinates],
            "buffers": self.gspace.state_dict(),
        }
        return state

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Restore the wrapped optimizer, the coordinates and the skeleton, and write ``w(v)`` into the model.

        A state dict without ``"gspace"`` (a plain optimizer's) restores the optimizer only and re-reads
        the coordinates from the model.
        """
        state_dict = dict(state_dict)
        saved = state_dict.pop("gspace", None)
        self.optimizer.load_state_dict(state_dict)
        self._share()
        if saved is None:
            self.resync()
            return
        self.gspace.load_state_dict(saved["buffers"])
        with torch.no_grad():
            for c, value in zip(self.coordinates, saved["coordinates"], strict=True):
                c.copy_(value)
        self._push()
