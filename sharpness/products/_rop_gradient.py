"""The Euclidean gradient read off the R-operator products' kept state, without a forward or backward pass.

The products of a graph (`sharpness.products._rop_graph`) keep, per data chunk, every layer's input and the
first-order error ``delta = dL/dz`` at the output of each layer whose input moves (and of each fused layer with a
BatchNorm weight, whose weight adjoint ``Hz = A_W^T(h, delta)`` and error sums are kept with it). A layer's
gradient is then one weight adjoint at most (`_Layer` in `sharpness.products._rop_ops` for the notation)::

    affine     g_W = A_W^T(h, delta),            g_b = sum delta
    BatchNorm  g_gamma = sum(xhat delta),        g_beta = sum delta
    fused      g_W = gain Hz,   g_b = gain sum delta,   g_beta = sum delta,
               g_gamma = a (<W, Hz> + (b - mu) sum delta)        (per output channel, gain = gamma a)

Where a parameter's layer has no kept error (a layer of the data alone, chains, whose first layer's error is never
formed, LayerNorm, ``nn.MultiheadAttention``, parameters used outside a module), or no state is kept (streamed chunks,
the autograd strategies), the gradient is the objective's own pass (`Objective.gradient`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from sharpness.products._objective import Objective
from sharpness.products._rop import ChunkState
from sharpness.products._rop_graph import RopGraph
from sharpness.products._rop_ops import _channel_dot, _Layer


def shared_gradient(objective: Objective, strategy: str) -> Tensor:
    """``objective.gradient()`` (flat ``(n,)``), read off the kept R-operator state where the products keep one
    (``strategy == "rop"``, the state fits in the memory budget) and every parameter's layer has its error there;
    else the objective's own forward and backward pass. Builds the kept state if the products have not yet (the
    first product would)."""
    if strategy == "rop":
        kept = objective.rop_states()
        if kept is not None and isinstance(kept[0], RopGraph) and _readable(kept[0], objective.params):
            graph, states = kept
            total, views = objective._accumulator(torch.empty(objective.layout.size, dtype=objective.dtype,
                                                              device=objective.device))  # fmt: skip
            into = dict(zip(objective.params, views))
            with torch.no_grad():
                for state in states:
                    _add_gradient(graph, objective.params, state, into)
            return objective.comm.sum_(total)
    return objective.gradient()


def _readable(graph: RopGraph, params: Mapping[str, Tensor]) -> bool:
    """Whether every step with parameters is a `_Layer` whose first-order error the products keep (a parameter
    no step reads has gradient 0)."""
    kept = graph._kept_errors
    return all(not getattr(step.op, "names", ()) or (isinstance(step.op, _Layer) and i in kept)
               for i, step in enumerate(graph.steps))  # fmt: skip


def _add_gradient(graph: RopGraph, params: Mapping[str, Tensor], state: ChunkState, into: Mapping[str, Tensor]) -> None:
    """Add the chunk's gradient to ``into`` (``{name: tensor}``), layer by layer, from its kept errors."""
    for i, step in enumerate(graph.steps):
        op = step.op
        if not isinstance(op, _Layer) or not op.names:
            continue
        a, n, kept, saved = op.affine, op.norm, state.deltas[i], state.saved[i]
        if n is None:  # affine alone: kept is delta, saved the input
            a.add_weight_adjoint(into[a.weight], saved, kept, params[a.weight])
            if a.bias:
                into[a.bias].add_(a.bias_adjoint(kept))
            continue
        if a is None:  # BatchNorm alone: kept is delta, saved xhat (None without a weight)
            if n.weight is not None:
                into[n.weight].add_(n._sum(kept * saved))
            if n.bias is not None:
                into[n.bias].add_(n._sum(kept))
            continue
        delta, hz, delta_sum = kept if isinstance(kept, tuple) else (kept, None, None)
        weight, gain = params[a.weight], n.gain(params).reshape(-1)
        if hz is None:
            hz = a.weight_adjoint(saved[0], delta, weight)
        if delta_sum is None:
            delta_sum = a.bias_adjoint(delta)
        into[a.weight].addcmul_(hz, gain.reshape(-1, *([1] * (hz.dim() - 1))))
        if a.bias:
            into[a.bias].addcmul_(gain, delta_sum)
        if n.bias is not None:
            into[n.bias].add_(delta_sum)
        if n.weight is not None:
            inner = _channel_dot(weight, hz).add_(op._shift(params, delta_sum, None))
            into[n.weight].addcmul_(inner, n.scale.reshape(-1))


__all__ = ["shared_gradient"]
