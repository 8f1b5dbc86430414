"""Dense references for small problems: the full Hessian and gradient by ``torch.func``.

Quadratic in the number of parameters: meant for tests and for checking the operators on models
with at most a few thousand parameters.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.func import hessian

from sharpness.products._objective import Objective, eval_mode


def dense_hessian(objective: Objective) -> Tensor:
    """The ``(n, n)`` Hessian of the whole-data-set loss at ``objective.params``.

    Computed by ``torch.func.hessian`` per chunk. Where the result is not symmetric (torch.func's batched
    double backward is wrong for some models: a Linear -> LayerNorm -> ReLU -> Linear -> GELU chain gives a
    6% asymmetric Hessian in torch 2.13), the chunk is recomputed row by row with
    ``torch.autograd.functional.hessian``, which does not batch.
    """
    layout = objective.layout
    flat = layout.flatten(objective.params)
    total = torch.zeros(layout.size, layout.size, dtype=objective.dtype, device=objective.device)
    tol = 1e3 * torch.finfo(objective.dtype).eps
    with eval_mode(objective.model):
        for x, y, w in objective.chunks():

            def loss(v: Tensor, x=x, y=y) -> Tensor:
                return objective._chunk_loss(layout.unflatten(v), x, y)

            chunk = hessian(loss)(flat)
            if float((chunk - chunk.T).abs().max()) > tol * max(float(chunk.abs().max()), 1.0):
                chunk = torch.autograd.functional.hessian(loss, flat)
            total += w * chunk
    return objective.comm.sum_(total)
