"""Grid points' forward passes compiled with ``torch.compile`` (opt-in: ``compile=True``).

A grid point's forward pass on the CPU is mostly convolutions; what a compiler removes is the rest: the
element-wise work between them (fused into one pass each) and the Python cost of calling a module with new
parameters (measured on ResNet-20, 1000 samples, 2 threads: about 5% of a point). Compiling costs seconds to
tens of seconds on the first point, so it pays on large grids only, and is never the default.
"""

from __future__ import annotations

import importlib.util
import itertools
import types
from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from manifolds import tensor_aliases, untied

_serial = itertools.count()


def _code_generator(device: torch.device) -> str | None:
    """What ``torch.compile`` lacks on ``device`` to generate code, or ``None`` when nothing is missing."""
    if device.type == "cuda":
        return None if importlib.util.find_spec("triton") is not None else "the package triton"
    if device.type != "cpu":
        return f"support for {device.type} devices"
    try:  # inductor's own search (the compiler named by CXX, then g++): private, so any failure counts as none
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception:
        return "a C++ compiler (g++, or the one named by the environment variable CXX)"
    return None


def require_compiler(device: torch.device) -> None:
    """Refuse ``compile=True``, before anything is computed, where ``torch.compile`` cannot generate code.

    Raises:
        ValueError: naming what is missing (a C++ compiler on the CPU, Triton on a GPU).
    """
    missing = _code_generator(device)
    if missing is not None:
        raise ValueError(
            f"compile=True needs {missing} for torch.compile on this machine; install it or leave compile off"
        )


def compiled_forward(
    module: nn.Module, buffers: Mapping[str, Tensor], head: Callable[..., Tensor] | None = None
) -> Callable[..., Tensor]:
    """``(params, *inputs) -> module(head(*inputs))`` with ``params`` (names as in ``module``) and ``buffers``, compiled
    on first call; without ``head``, ``(params, x) -> module(x)``.

    The parameters are inputs of the compiled graph, so new points reuse it; ``head`` is compiled into the same
    graph (its work fused with the first layers'). It is compiled again once, with a symbolic batch size, when a
    data piece of another size comes (``torch.compile``'s default). ``module`` must not write into its input
    (give it the graph without in-place operations).
    """

    aliases = tensor_aliases(module)  # read once, outside the compiled graph

    def forward(params: dict[str, Tensor], *inputs) -> Tensor:
        x = inputs[0] if head is None else head(*inputs)
        tensors = untied({**params, **buffers}, aliases)
        return torch.func.functional_call(module, tensors, (x,), tie_weights=False)

    # torch.compile keeps its graphs per code object, and this closure's code is shared by every model: a grid
    # after the eighth would exceed its recompilation limit and run uncompiled. Each gets its own code object.
    code = forward.__code__.replace(co_name=f"grid_forward_{next(_serial)}")
    fresh = types.FunctionType(code, forward.__globals__, code.co_name, None, forward.__closure__)
    return torch.compile(fresh)
