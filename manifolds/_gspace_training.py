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
from torch.autograd.graph import increment_version
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from manifolds._gspace import GSpace, GSpaceSingularityError, Skeleton, _FusedWeights, check_init, set_gsgd_entries_
from manifolds._structure import Layer, NetworkStructure, analyze

_EMPTY = torch.empty(0)  # what the shell holds between forward passes


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return model.get_submodule(path), attr


class GModel(nn.Module):
    """``model`` reparametrized by its G-space coordinates: ``parameters()`` are the coordinates.

    The forward pass computes the weights ``w(v)`` ([`GSpace`][manifolds.GSpace]) and runs a structural copy of
    ``model`` with them, so ``loss.backward()`` fills the coordinates' gradients directly and any
    optimizer trains in G-space (``torch.optim.SGD(gmodel.parameters(), lr)`` is G-SGD). ``model``
    itself is not modified; [`to_model`][manifolds.GModel.to_model] returns a trained copy.

    Args:
        model: a rescalable chain of Linear/Conv2d layers (see [`GSpace`][manifolds.GSpace]).
        skeleton: designated and predecessor entries (default: the G-SGD skeleton).
        fused: compute gradients with the hand-written inverse chain rule (fewer operations per step,
            first-order reverse mode only); ``False`` records plain operations, which ``torch.func``
            and double backward need.
        example_input: passed to [`manifolds.analyze`][manifolds.analyze] when fx cannot trace the model.
        init: ``"model"`` starts from the model's weights; ``"gsgd"`` from them with every skeleton and
            predecessor weight set to 1 (`manifolds.gsgd_init_`, the G-SGD paper's initialization; the
            model itself is left as it is). From PyTorch's default initialization the chain values are
            products of small weights, so G-SGD needs ``"gsgd"`` or a tiny learning rate.

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
        init: str = "model",
    ):
        super().__init__()
        check_init(init)
        structure = analyze(model, example_input)
        params = {k: p.detach() for k, p in model.named_parameters()}
        self.gspace = GSpace(structure, skeleton, params=params)
        if init == "gsgd":
            params = {k: t.clone() for k, t in params.items()}
            set_gsgd_entries_(self.gspace, params)
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
            setattr(module, attr, _EMPTY)
        self._link()

    def _link(self) -> None:
        """Make the packed coordinates (all but the first layer's weight) views of one flat tensor, so the
        fused ``w(v)`` reads them without copying, and a workspace reused by every pass with its views of
        the coordinates made once (see _FusedWeights). Redone by `forward` if their storage moved."""
        kernel = self.gspace._kernel()
        coords = list(self.coordinates)
        params = [coords[k] for k in kernel.packed_index]
        with torch.no_grad():
            self._packed = kernel.pack(params).clone()
        for p, view in zip(params, kernel.split_coordinates(self._packed)):
            p.data = view
        self._linked = (tuple(map(id, coords)), [p.data_ptr() for p in coords])
        self._ws = kernel.workspace()
        if coords[0].is_contiguous():  # detached: a view of the parameter made with grad mode on is no leaf
            self._ws.bind(coords[0].detach(), self._packed)

    def weight_tensors(self) -> dict[str, Tensor]:
        """``w(v)`` at the current coordinates, differentiable: ``{name: tensor}`` like ``model``'s."""
        kernel = self.gspace._kernel()
        return dict(zip(kernel.names, kernel.unpermute(self._weight_list())))

    def _weight_list(self) -> list[Tensor]:
        """``w(v)`` in the kernel's order: the first layer's weight, then ``packed_index`` order."""
        kernel = self.gspace._kernel()
        # The current coordinates (torch.func.functional_call may have swapped others in).
        coords = list(self.coordinates._parameters.values())
        if not self.fused:
            weights = self.gspace.weights(coords)
            return [weights[kernel.names[k]] for k in kernel.order]
        packed_coords = [coords[k] for k in kernel.packed_index]
        if tuple(map(id, coords)) != self._linked[0]:  # not ours: no shared workspace, no flat tensor
            return _FusedWeights.apply(kernel, True, None, None, coords[0], *packed_coords)
        if [p.data_ptr() for p in coords] != self._linked[1] or self._ws.kernel is not kernel:
            self._link()  # the coordinates or the gspace's buffers moved, e.g. by .to()
        return _FusedWeights.apply(kernel, True, self._ws, self._packed, coords[0], *packed_coords)

    def weights(self) -> dict[str, Tensor]:
        """The current weights ``w(v)``, detached copies named like ``model``'s parameters."""
        with torch.no_grad():
            return {k: w.clone() for k, w in self.gspace.weights(list(self.coordinates)).items()}

    def forward(self, *args, **kwargs):
        kernel = self.gspace._kernel()
        slots = self._slots
        # The shell's slots are plain attributes (their parameters were deleted): set them directly.
        for k, weight in zip(kernel.order, self._weight_list()):
            module, attr = slots[k]
            module.__dict__[attr] = weight
        try:
            return self.shell(*args, **kwargs)
        finally:
            for module, attr in slots:  # keep no graph alive between calls
                module.__dict__[attr] = _EMPTY

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


def _wrapped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s step must run in the base class's wrapper: a profiler records, or a step
    hook (the optimizer's own or a global one) is registered."""
    return bool(
        torch._C._autograd._profiler_enabled()
        or optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
        or _global_optimizer_pre_hooks
        or _global_optimizer_post_hooks
    )


class GOptimizer(torch.optim.Optimizer):
    """Run ``optimizer_class`` in G-space on a model's weights (G-SGD for ``torch.optim.SGD``).

    Use it like the wrapped optimizer on the original model: ``loss.backward()`` on the model, then
    ``step()``. Each step turns the weight gradients into coordinate gradients (inverse chain rule,
    `GSpace.gradient`), lets the wrapped optimizer update the coordinates, and writes ``w(v)``
    back into the model. The wrapped optimizer keeps its state between steps (so G-Adam is Adam on the
    coordinates); ``param_groups`` are the wrapped optimizer's, so learning-rate schedulers work, and
    ``step(closure)`` supports closures (LBFGS). The model's designated (skeleton) weights never change.

    The model's weights after the first layer (and its biases) become views of one flat tensor that
    ``w(v)`` is computed into, as flat-buffer optimizers keep parameters, so writing them back costs no
    copy; each step bumps their version counters as any in-place update does. They stay the same tensor
    objects; if their storage moves later (``model.to(...)``), steps copy into them instead.

    Args:
        model_or_params: the model (its structure is checked, Conv2d supported), or its parameters in
            forward order, or parameter groups (dicts as for any optimizer, whose options apply to the
            coordinates of those parameters). Bare parameters are read as Linear layers (2-D weight,
            optional 1-D bias); the activations between them cannot be checked then, so they must be
            positively homogeneous (ReLU, LeakyReLU, identity).
        optimizer_class: any ``torch.optim.Optimizer`` subclass.
        skeleton: designated and predecessor entries (default: the G-SGD skeleton).
        example_input: passed to [`manifolds.analyze`][manifolds.analyze] when fx cannot trace the model.
        init: ``"model"`` starts from the model's weights; ``"gsgd"`` first sets every skeleton and predecessor
            weight of the model (or of the given parameters) to 1, in place, as `manifolds.gsgd_init_`
            does (the G-SGD paper's initialization; it changes the network function). From PyTorch's default
            initialization the chain values are products of small weights, so G-SGD needs ``"gsgd"`` or a
            tiny learning rate.
        **optimizer_kwargs: passed to ``optimizer_class`` (``lr``, ``momentum``, ``betas``,
            ``weight_decay``, ...). ``weight_decay`` decays the coordinates (see the module docstring).

    Attributes:
        optimizer: the wrapped optimizer, acting on ``coordinates``.
        gspace: the parametrization.
        coordinates: the coordinate tensors, ``gspace.layout`` order.

    Raises:
        GSpaceSingularityError: from `step`, when the update would make a chain value 0 or change
            its sign; the coordinates are then reset to the model's (unchanged) weights.
    """

    def __init__(
        self,
        model_or_params: nn.Module | Iterable[Tensor] | Iterable[dict],
        optimizer_class: type[torch.optim.Optimizer],
        *,
        skeleton: Skeleton | None = None,
        example_input: Tensor | None = None,
        init: str = "model",
        **optimizer_kwargs,
    ):
        check_init(init)
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
        if init == "gsgd":
            set_gsgd_entries_(self.gspace, named)
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
        self._link()

    def _share(self) -> None:
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.defaults = self.optimizer.defaults

    def _make_coordinates(self, values: list[Tensor]) -> list[Tensor]:
        """Leaf coordinate tensors, and the persistent tensors of a step, so a step allocates nothing.

        All coordinates but the first layer's weight are views of one flat tensor (``packed``), their
        gradients views of another, and the model's weights after the first are computed into a third
        (``packed_w``; see _link). Every view is made here once.
        """
        kernel = self.gspace._kernel()
        coords = [t.detach().clone(memory_format=torch.contiguous_format) for t in values]
        self._packed_v = kernel.pack([coords[k] for k in kernel.packed_index]).clone()
        for k, view in zip(kernel.packed_index, kernel.split_coordinates(self._packed_v)):
            coords[k] = view
        self._packed_coords = [coords[k] for k in kernel.packed_index]
        self._packed_targets = [self._targets[k] for k in kernel.packed_index]
        self._first_g = torch.zeros_like(coords[0])
        self._packed_g = torch.zeros_like(self._packed_v)
        self._grad_views = kernel.split_coordinates(self._packed_g)
        self._packed_w = kernel.packed_skeleton.clone()
        self._weight_views = kernel.split_weights(self._packed_w)
        self._packed_gw = torch.zeros_like(self._packed_w)  # the model's gradients of the packed weights
        self._gw_views = kernel.split_weights(self._packed_gw)
        self._ws = kernel.workspace()  # w(v)'s intermediates, kept for the inverse chain rule
        self._ws.bind(coords[0], self._packed_v)
        self._ws.bind_grads(self._first_g, self._packed_g)
        # What one _foreach_copy_ reads from the model's gradients (with W_1's when its factor is 1) ...
        self._read_index = [0, *kernel.packed_index] if kernel.unit_first else kernel.packed_index
        self._read_buffers = ([self._first_g] if kernel.unit_first else []) + self._gw_views
        # ... and writes into its weights (until _link makes the later ones views of packed_w).
        self._first_coordinates = coords[0]
        self._set_writes(linked=False)
        return [c.requires_grad_(True) for c in coords]

    def _set_writes(self, linked: bool) -> None:
        """The model tensors one _foreach_copy_ writes ``w(v)`` into, and their sources: ``W_1`` when it
        equals the first layer's coordinates, and the later weights unless they are ``packed_w``'s views."""
        pairs = [(self._targets[0], self._first_coordinates)] if self.gspace._kernel().unit_first else []
        if not linked:
            pairs += zip(self._packed_targets, self._weight_views)
        self._write_targets, self._write_sources = [t for t, _ in pairs], [s for _, s in pairs]
        self._linked = [t.data_ptr() for t in self._packed_targets] if linked else []

    def _link(self) -> None:
        """Make the model's weights after the first views of ``packed_w`` (holding their current values),
        so that computing them writes them, with no copy: the way flat-buffer optimizers keep
        parameters. The model's tensors stay the same objects; as writing through ``packed_w`` bypasses
        their version counters, `_refresh` bumps those, as any in-place update would. Where the
        model's tensors moved since (``.to()``, a new ``.data``), steps copy into them instead."""
        targets = self._packed_targets
        if not targets or any(not t.is_leaf or t._base is not None for t in targets):
            return
        if any(t.dtype != self._packed_w.dtype or t.device != self._packed_w.device for t in targets):
            return
        with torch.no_grad():
            for t, view in zip(targets, self._weight_views):
                view.copy_(t)  # the skeleton entries equal the fixed values already
                t.data = view
        self._set_writes(linked=True)

    def _refresh(self, write: bool) -> None:
        """Recompute ``w(v)``'s intermediates for the inverse chain rule; with ``write``, put ``w(v)`` in
        the model.

        Raises `GSpaceSingularityError` before anything is written if a chain value is singular.
        """
        kernel = self.gspace._kernel()
        first = self.coordinates[0]
        with torch.no_grad():
            kernel.forward(first, self._packed_v, self._ws)
            if write:
                if self._linked and [t.data_ptr() for t in self._packed_targets] != self._linked:
                    self._set_writes(linked=False)  # the model's tensors moved away from packed_w
                kernel.packed_weights(self._ws, out=self._packed_w)
                for t in self._packed_targets if self._linked else ():
                    increment_version(t)
                if not kernel.unit_first:
                    torch.mul(first, kernel.invd_first, out=self._targets[0])
                if self._write_targets:
                    torch._foreach_copy_(self._write_targets, self._write_sources)  # one dispatch for all
        # The packed coordinates share one version counter: two numbers tell whether v moved.
        self._versions = (first._version, self._packed_v._version)

    def _push(self) -> None:
        """Write ``w(v)`` into the model."""
        self._refresh(write=True)

    def _pull(self) -> None:
        """Coordinate gradients from the model's weight gradients (a missing one counts as 0; with none
        at all the coordinates get none either, so the wrapped optimizer skips them)."""
        coords = self.coordinates
        grads = [t.grad for t in self._targets]
        if grads[0] is None and all(g is None for g in grads):
            for c in coords:
                c.grad = None
            return
        if self._versions != (coords[0]._version, self._packed_v._version):  # moved outside step()
            self._refresh(write=False)
        kernel = self.gspace._kernel()
        with torch.no_grad():
            # The weight gradients into the persistent tensors, in one dispatch (W_1's scaled first if
            # its factor is not 1).
            sources = [grads[k] for k in self._read_index]
            if not kernel.unit_first:
                kernel.scale_first(
                    kernel.zeros(kernel.first_shape) if grads[0] is None else grads[0], out=self._first_g
                )
            if sources:
                try:
                    torch._foreach_copy_(self._read_buffers, sources)
                except TypeError:  # some are None: zeros
                    torch._foreach_copy_(self._read_buffers, self._zero_filled(sources))
            kernel.backward(self._packed_gw, self._ws, self._first_g, self._packed_g)
        # The coordinates' gradients are these persistent tensors, attached once and overwritten here.
        if coords[0].grad is not self._first_g:
            coords[0].grad = self._first_g
        for c, view in zip(self._packed_coords, self._grad_views):
            if c.grad is not view:
                c.grad = view

    def _zero_filled(self, tensors: list[Tensor | None]) -> list[Tensor]:
        return [torch.zeros_like(b) if t is None else t for t, b in zip(tensors, self._read_buffers)]

    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        """One update of the wrapped optimizer in G-space, then the model gets the new weights ``w(v)``.

        Args:
            closure: re-evaluates the model and returns the loss after calling ``backward()`` on it
                (optional for most optimizers, required by LBFGS); it sees the model at the
                coordinates the wrapped optimizer is trying.

        Returns:
            The closure's loss, or None.
        """
        if _wrapped(self):  # the base class's wrapper: the step hooks and a profiling scope
            return self._hooked_step(closure)
        return self._step(closure)

    # Optimizer.__init__ would wrap step() in the scope above for every call; in the middle of a training
    # step that scope costs about as much as the whole G-space update of a small network, so step() enters
    # it only when a profiler records or a hook is registered (hooked = True: "do not wrap").
    step.hooked = True  # type: ignore[attr-defined]

    def _step(self, closure: Callable[[], Tensor] | None) -> Tensor | None:
        if closure is None:
            self._pull()
            loss = self._inner_step()
        else:

            def g_closure():
                self._push()
                with torch.enable_grad():
                    value = closure()
                self._pull()
                return value

            loss = self._inner_step(g_closure)
        try:
            self._push()
        except GSpaceSingularityError as err:
            self.resync()
            raise GSpaceSingularityError(
                f"{err}. The update was not applied: the model keeps its weights and the coordinates were "
                "reset to them (the wrapped optimizer's state, e.g. momentum, already includes this step)"
            ) from err
        return loss

    _hooked_step = torch.optim.Optimizer.profile_hook_step(_step)

    def _inner_step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        """The wrapped optimizer's step, outside the base class's wrapper (see `step`) unless the
        wrapped optimizer has hooks of its own or a profiler records."""
        opt = self.optimizer
        step = type(opt).step
        bare = getattr(step, "__wrapped__", None)
        if bare is None or not getattr(step, "hooked", False) or "step" in opt.__dict__ or _wrapped(opt):
            return opt.step() if closure is None else opt.step(closure)
        return bare(opt) if closure is None else bare(opt, closure)

    def resync(self) -> None:
        """Re-read the coordinates from the model's current weights (after changing them from outside).

        The next `step` writes ``w(v)`` back, with the designated weights at their fixed values,
        a function-preserving rescaling of what the model holds.
        """
        with torch.no_grad():
            coords = self.gspace.coordinate_tensors(dict(zip(self.gspace.names, self._targets)))
            for c, new in zip(self.coordinates, coords.values()):
                c.copy_(new)
        self._refresh(write=False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the model's weights (the coordinates' gradients are recomputed from
        them by every [`step`][manifolds.GOptimizer.step])."""
        for t in self._targets:
            if t.grad is None:
                continue
            if set_to_none:
                t.grad = None
            else:
                t.grad.detach_()
                t.grad.zero_()
        # The coordinates' gradients are persistent tensors that every step overwrites (or drops, when
        # the model has no gradient at all): leave them attached rather than detach and reattach them.
        if not set_to_none:
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
