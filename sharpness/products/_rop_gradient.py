"""The Euclidean gradient read off the R-operator products' kept state, without a forward or backward pass.

The products of a graph (`sharpness.products._rop_graph`) keep, per data chunk, every layer's input and the
first-order error ``delta = dL/dz`` at the output of each layer whose input moves (and of each fused layer with a
BatchNorm weight, whose weight adjoint ``Hz = A_W^T(h, delta)`` and error sums are kept with it). A layer's
gradient is then one weight adjoint at most (`_Layer` in `sharpness.products._rop_ops` for the notation)::

    affine     g_W = A_W^T(h, delta),            g_b = sum delta
    BatchNorm  g_gamma = sum(xhat delta),        g_beta = sum delta
    fused      g_W = gain Hz,   g_b = gain sum delta,   g_beta = sum delta,
               g_gamma = a (<W, Hz> + (b - mu) sum delta)        (per output channel, gain = gamma a)

A chain (`sharpness.products._rop`) keeps the errors of its affine layers but the first; that one's error is carried
back from the second's through the maps between them (one input adjoint, a mask or pooling), then read the same way.

Where a parameter's layer has no kept error (a graph's layer of the data alone, LayerNorm, ``nn.MultiheadAttention``,
parameters used outside a module, a chain of one affine layer), or no state is kept (streamed chunks, the autograd
strategies), the gradient is the objective's own pass (`Objective.gradient`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from sharpness.products._objective import Objective
from sharpness.products._rop import ChunkState, RopChain, _Affine
from sharpness.products._rop_graph import RopGraph
from sharpness.products._rop_ops import _channel_dot, _Layer


def shared_gradient(objective: Objective, strategy: str) -> Tensor:
    """``objective.gradient()`` (flat ``(n,)``), read off what the products keep where they keep it: the R-operator
    state (``strategy == "rop"``, the state fits in the memory budget, every parameter's layer has its error there),
    or the whole-data-set autograd graph (``strategy == "graph"``, which holds the gradient itself); else the
    objective's own forward and backward pass. Builds what the products keep if they have not yet (the first
    product would)."""
    if strategy == "graph":
        _, gradients = objective._build_graph()
        flat = objective.layout.flatten({name: g.detach() for name, g in zip(objective.params, gradients)})
        return objective.comm.sum_(flat)
    if strategy == "rop":
        kept = objective.rop_states()
        add = None if kept is None else _reader(kept[0], objective.params)
        if add is not None:
            reader, states = kept
            total, views = objective._accumulator(torch.empty(objective.layout.size, dtype=objective.dtype,
                                                              device=objective.device))  # fmt: skip
            into = dict(zip(objective.params, views))
            with torch.no_grad():
                for state in states:
                    add(reader, objective.params, state, into)
            return objective.comm.sum_(total)
    return objective.gradient()


def _reader(reader: RopGraph | RopChain, params: Mapping[str, Tensor]):
    """The function adding one chunk's gradient from its kept state, or ``None`` where some parameter's error is not
    there."""
    if isinstance(reader, RopGraph):
        return _add_gradient if _readable(reader, params) else None
    affine = [op for op in reader.ops if isinstance(op, _Affine)]
    read = {n for op in affine for n in (op.weight, op.bias) if n}
    return _add_chain_gradient if len(affine) > 1 and set(params) <= read else None


def _add_chain_gradient(chain: RopChain, params: Mapping[str, Tensor], state: ChunkState,
                        into: Mapping[str, Tensor], first: bool = True) -> Tensor:  # fmt: skip
    """Add a chain's chunk gradient to ``into``: every affine layer's from its kept error, the first layer's (unless
    ``first`` is false) from the second's carried back through the maps between them. Returns that first error."""
    affine = [i for i, op in enumerate(chain.ops) if isinstance(op, _Affine)]
    g = state.deltas[affine[1]]
    for i in range(affine[1], affine[0], -1):  # the second affine layer down to the first's output
        op = chain.ops[i]
        g = op.input_adjoint(g, state.saved[i], params[op.weight]) if isinstance(op, _Affine) \
            else op.adjoint(g, state.saved[i])  # fmt: skip
    head = chain.ops[affine[0]]
    if head.bias:
        into[head.bias].add_(head.bias_adjoint(g))
    if first:
        head.add_weight_adjoint(into[head.weight], state.saved[affine[0]], g, params[head.weight])
    for i in affine[1:]:
        op, delta = chain.ops[i], state.deltas[i]
        op.add_weight_adjoint(into[op.weight], state.saved[i], delta, params[op.weight])
        if op.bias:
            into[op.bias].add_(op.bias_adjoint(delta))
    return g


def chain_gradient_but_first_weight(objective: Objective, chain: RopChain, states: list[ChunkState],
                                    into: Mapping[str, Tensor]) -> list[Tensor] | None:  # fmt: skip
    """Add the gradient of every parameter but the first layer's weight, read off a chain's kept ``states``, to
    ``into`` (``{name: tensor}``), and return each chunk's error at the first layer's output (``(chunk, h)``), from
    which that weight's gradient is ``E^T X`` (`sharpness.products._data_span` forms it in its own coordinates);
    ``None`` (nothing added) where the chain's state does not hold the errors."""
    if _reader(chain, objective.params) is None:
        return None
    with torch.no_grad():
        return [_add_chain_gradient(chain, objective.params, state, into, first=False) for state in states]


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


__all__ = ["chain_gradient_but_first_weight", "shared_gradient"]
