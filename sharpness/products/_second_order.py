"""Second derivatives by autograd (double backward) over leaves a loss may not use.

A parameter the forward never reads (a layer defined but never called) has no gradient path: autograd reports it
as ``None``, and a gradient independent of every leaf carries no graph to differentiate again. Both mean a zero
gradient and zero Hessian rows, which is what these helpers give instead of torch's RuntimeError.
"""

from __future__ import annotations

import torch
from torch import Tensor


def gradient_with_graph(loss: Tensor, leaves: list[Tensor]) -> list[Tensor]:
    """``d loss / d leaf`` for each leaf, with the graph kept for a second derivative; zeros (without a graph)
    for a leaf the loss does not use."""
    grads = torch.autograd.grad(loss, leaves, create_graph=True, allow_unused=True)
    return [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves, grads)]


def gradient_products(
    gradient: list[Tensor], leaves: list[Tensor], vs: list[Tensor], batched: bool = False, retain_graph: bool = False
) -> list[Tensor]:
    """``H v``: ``sum_i <gradient_i, v_i>`` differentiated in ``leaves`` (``gradient`` from
    `gradient_with_graph`), one tensor per leaf shaped like its ``v`` (``batched``: each ``v`` has a leading
    dimension of products). Entries of ``gradient`` without a graph contribute nothing; a leaf nothing depends on
    gets zeros."""
    keep = [i for i, g in enumerate(gradient) if g.requires_grad]
    products: list[Tensor | None] = [None] * len(leaves)
    if keep:
        products = list(torch.autograd.grad(
            [gradient[i] for i in keep], leaves, grad_outputs=[vs[i] for i in keep], retain_graph=retain_graph,
            allow_unused=True, is_grads_batched=batched,
        ))  # fmt: skip
    return [torch.zeros_like(v) if h is None else h for v, h in zip(vs, products)]
