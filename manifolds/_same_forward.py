"""Whether a subclass of a torch normalization layer computes that layer's own forward.

The readers of a traced graph read a module call by what it computes (torch's ``nn.LayerNorm``, say). A subclass may
override ``forward`` with another computation (Gemma's ``(1 + weight)`` scale) and is then an unknown operation; many
override it only to choose among kernels: timm's ``LayerNorm`` calls ``F.layer_norm`` exactly as ``nn.LayerNorm``
does unless its fast-norm option is on. Such a forward is recognised by its fx graph: traced on the module itself, it
must be, node for node (operations, targets, constants, wiring), the graph of the base class's forward on a twin
with the same settings. Nothing numerical is compared, so nothing is accepted within a tolerance.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from manifolds._modules import eval_mode, hooked, kept_buffers

# The bases recognised: a twin of a module's settings built on the meta device (only traced, never run), the
# stock computation on a module's own tensors, and the shape of an input to compare them on.
_TWINS: dict[type[nn.Module], tuple[Callable[[nn.Module], nn.Module], Callable[[nn.Module, Tensor], Tensor],
                                    Callable[[nn.Module], tuple[int, ...]]]] = {  # fmt: skip
    nn.LayerNorm: (
        lambda m: nn.LayerNorm(
            m.normalized_shape, m.eps, m.elementwise_affine, bias=getattr(m, "bias", None) is not None, device="meta"
        ),  # fmt: skip
        lambda m, x: F.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps),
        lambda m: (2, *m.normalized_shape),
    ),
    # timm's Linear (MobileNetV3's classifier): F.linear as nn.Linear calls it, unless TorchScript compiles it
    nn.Linear: (
        lambda m: nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta"),
        lambda m, x: F.linear(x, m.weight, m.bias),
        lambda m: (2, m.in_features),
    ),
}


def read_as(module: nn.Module) -> type[nn.Module]:
    """The class ``module`` is read as: a base of `_TWINS` where ``module`` is a subclass that inherits its forward or
    overrides it with the same graph (see the module docstring) and computes the stock layer's values and derivatives
    (`_same_derivatives`), else its own class."""
    kind = type(module)
    for base, (twin, stock, shape) in _TWINS.items():
        if isinstance(module, base) and kind is not base:
            try:
                same = kind.forward is base.forward or _same(_signature(module), _signature(twin(module)))
            except Exception:  # tracing runs the subclass's own code: what cannot be traced is not recognised
                same = False
            return base if same and _same_derivatives(module, stock, shape(module)) else kind
    return kind


def norm_then_activation(module: nn.Module, shape: tuple[int, ...] | None = None) -> nn.Module | None:
    """The activation module of timm's ``BatchNormAct2d`` (a ``BatchNorm2d`` whose forward is the normalization, then
    its ``drop`` and ``act`` submodules: RegNet's, DenseNet's, EfficientNet's), where ``module`` computes exactly that
    in eval mode with its running statistics (values and derivatives on a random input of ``shape``, the input it is
    called with in the model, and values under ``torch.no_grad()`` too: `_same_derivatives`), ``drop`` is a dropout or
    the identity, and neither has a forward of its own set on the instance (the check would call it on both sides);
    else ``None``."""
    if not isinstance(module, nn.BatchNorm2d) or type(module).__name__ != "BatchNormAct2d" or hooked(module):
        return None
    act, drop = getattr(module, "act", None), getattr(module, "drop", None)
    if not isinstance(act, nn.Module) or type(drop) not in (nn.Identity, nn.Dropout) or hooked(act) or hooked(drop) \
            or any("forward" in vars(m) for m in act.modules()) or "forward" in vars(drop):  # fmt: skip
        return None
    if module.running_mean is None or module.running_var is None:  # batch statistics even in eval mode
        return None

    def stock(m: nn.Module, x: Tensor) -> Tensor:
        return act(F.batch_norm(x, m.running_mean, m.running_var, m.weight, m.bias, False, 0.0, m.eps))

    # the same kernels on the same tensors: equal to the last bit, or it computes something else
    return act if _same_derivatives(module, stock, shape or (2, module.num_features, 3, 3), exact=True) else None


def channel_layer_norm(module: nn.Module, shape: tuple[int, ...] | None = None) -> bool:
    """Whether ``module`` is a LayerNorm over the channels of an ``(N, C, H, W)`` input (timm's ``LayerNorm2d``, as
    ConvNeXt uses it): an ``nn.LayerNorm`` subclass of shape ``(C,)`` whose forward is ``F.layer_norm`` of the input
    moved to channels-last and back, exactly (values and derivatives on a random input of ``shape``, the 4-D input it
    is called with in the model, to the last bit)."""
    if not isinstance(module, nn.LayerNorm) or len(module.normalized_shape) != 1 or hooked(module):
        return False
    if shape is not None and (len(shape) != 4 or shape[1] != module.normalized_shape[0]):
        return False

    def stock(m: nn.Module, x: Tensor) -> Tensor:
        moved = F.layer_norm(x.permute(0, 2, 3, 1), m.normalized_shape, m.weight, m.bias, m.eps)
        return moved.permute(0, 3, 1, 2)

    return _same_derivatives(module, stock, shape or (2, module.normalized_shape[0], 3, 3), exact=True)


def _same_derivatives(module: nn.Module, stock: Callable[[nn.Module, Tensor], Tensor], shape: tuple[int, ...],
                      exact: bool = False) -> bool:  # fmt: skip
    """Whether calling ``module`` gives the values and the gradients (with respect to the input and the trainable
    parameters, for a random combination of the outputs) of the ``stock`` computation on its tensors, on a random
    input of two rows: fx does not record grad mode, so a forward under ``torch.no_grad()`` (or a ``__call__`` that
    adds one) has the stock graph and other derivatives; the values under ``torch.no_grad()`` are compared too (a
    forward may branch on grad mode, as torch's Transformer fast path does). Eval mode; the buffers are put back.
    ``shape``: the input's; ``exact``: equal to the last bit, not within float32's tolerance."""
    param = next(module.parameters(), None)
    dtype, device = (param.dtype, param.device) if param is not None else (torch.float32, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator, dtype=torch.float64)
    x = x.to(device=device, dtype=dtype).requires_grad_()
    leaves = [x, *(p for p in module.parameters() if p.requires_grad)]
    try:
        with torch.enable_grad(), eval_mode(module), kept_buffers(module):
            out, ref = module(x), stock(module, x)
            weights = torch.randn(ref.shape, generator=generator, dtype=torch.float64).to(device=device, dtype=dtype)
            mine = torch.autograd.grad((out * weights).sum(), leaves)
            theirs = torch.autograd.grad((ref * weights).sum(), leaves)
        with torch.no_grad(), eval_mode(module), kept_buffers(module):
            quiet, quiet_ref = module(x.detach()), stock(module, x.detach())
    except Exception:  # no gradient (a forward without one), or another failure: not the stock layer
        return False
    same = torch.equal if exact else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    return all(same(a, b) for a, b in zip((out, quiet, *mine), (ref, quiet_ref, *theirs)))


def _signature(module: nn.Module) -> list[tuple]:
    """``module``'s forward as fx traces it on the module: per node its operation, target (placeholders unnamed) and
    arguments, other nodes given by their position."""
    graph = fx.Tracer().trace(module)
    position: dict[fx.Node, int] = {}
    out = []
    for i, node in enumerate(graph.nodes):
        position[node] = i
        arguments = fx.node.map_arg((node.args, node.kwargs), lambda n: _Position(position[n]))
        out.append((node.op, None if node.op == "placeholder" else node.target, arguments))
    return out


class _Position(int):
    """A node's position among the arguments of a signature (distinct from a constant of the same value)."""


def _same(a: object, b: object) -> bool:
    """Exact equality of two signatures or of parts of them: the same types throughout, containers item by item; a
    tensor constant is never taken as equal (its values would have to be compared)."""
    if type(a) is not type(b) or isinstance(a, Tensor):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


__all__ = ["channel_layer_norm", "norm_then_activation", "read_as"]
