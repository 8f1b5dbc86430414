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
    """The ``(n, n)`` Hessian of the whole-data-set loss at ``objective.params``."""
    layout = objective.layout
    flat = layout.flatten(objective.params)
    total = torch.zeros(layout.size, layout.size, dtype=objective.dtype, device=objective.device)
    with eval_mode(objective.model):
        for x, y, w in objective.chunks():
            total += w * hessian(lambda v, x=x, y=y: objective._chunk_loss(layout.unflatten(v), x, y))(flat)
    return total
