"""Sharpness in G-space: the top eigenvalues of the Hessian of ``L(w(v))`` in basis-path coordinates.

The G-space coordinates ``v`` (values of basis paths, [`manifolds.GSpace`][manifolds.GSpace]) are unchanged by
every positive rescaling of hidden units, and ``L(w(v))`` is the same function of ``v`` for every
representative of a network, so its Hessian, and its spectrum, are invariant under node-wise (and
layer-wise) rescaling exactly, at any point.

Unlike the metric measures (``"node"``, ``"layer"``), which are spectra of a Riemannian Hessian and do
not depend on how the quotient is parametrized, this is the Euclidean Hessian in one particular chart:
it depends on the choice of basis paths (the skeleton), changes when the coordinates are reparametrized
(e.g. the paths are measured in other units or another skeleton is designated), and has the units of
loss per squared path value. Compare G-space sharpness only between networks of the same architecture
with the same skeleton.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor
from torch.func import jvp

from manifolds import GSpace
from sharpness.measures._measure import CurvatureOperator, Measure, require_trainable_layers
from sharpness.products._objective import Objective, eval_mode, hvp_by_jvp
from sharpness.products._operator import CallableOperator


class GSpaceLoss:
    """The whole-data-set loss as a function of the G-space coordinates, ``v -> f(w(v))``.

    Args:
        objective: the loss over the data set (its ``params`` are the point).
        gspace: the parametrization (default: the G-SGD skeleton of ``objective.model`` at
            ``objective.params``).

    Attributes:
        gspace: the parametrization.
        point: ``(dim,)`` coordinates of ``objective.params``.
    """

    def __init__(self, objective: Objective, gspace: GSpace | None = None):
        self.objective = objective
        if gspace is None:
            gspace = GSpace(objective.structure, params=objective.params)
        self.gspace = gspace
        self._others = {k: t for k, t in objective.params.items() if k not in gspace.names}
        self.point = gspace.coordinates(objective.params).detach()
        gspace.check(self.point)  # the transforms below run without the check
        self._graph: tuple[Tensor, Tensor] | None = None

    def chunk_loss(self, v: Tensor, x: Tensor, y: Tensor) -> Tensor:
        """Loss of one chunk at coordinates ``v`` (``(dim,)``), differentiable by autograd and torch.func."""
        return self.objective._chunk_loss({**self._others, **self.gspace.weights(v, check=False)}, x, y)

    def value_and_gradient(self) -> tuple[Tensor, Tensor]:
        """``(f, grad_v f)`` at ``point``: the loss and the G-space gradient (inverse chain rule)."""
        value = torch.zeros((), dtype=self.point.dtype, device=self.point.device)
        total = torch.zeros_like(self.point)
        fn = torch.func.grad_and_value(self.chunk_loss)
        with eval_mode(self.objective.model):
            for x, y, w in self.objective.chunks():
                g, v = fn(self.point, x, y)
                total += w * g
                value += w * v.detach()
        both = self.objective.comm.sum_(torch.cat([value.reshape(1), total]))  # every process's share
        return both[0], both[1:]

    def _graph_gradient(self) -> tuple[Tensor, Tensor]:
        if self._graph is None:
            with torch.enable_grad(), eval_mode(self.objective.model):
                leaf = self.point.clone().requires_grad_(True)
                total = torch.zeros_like(self.point)
                for x, y, w in self.objective.chunks():
                    total = total + torch.autograd.grad(w * self.chunk_loss(leaf, x, y), leaf, create_graph=True)[0]
            self._graph = (leaf, total)  # this process's share: products through it are summed in hvp
        return self._graph

    def hvp(self, t: Tensor, strategy: str) -> Tensor:
        """Hessian-vector product in G-space, ``(dim,)`` in and out.

        ``strategy``: ``"jvp"`` (``torch.func.jvp`` of ``torch.func.grad`` per chunk, through the
        parametrization), ``"double_backward"`` (autograd per chunk) or ``"graph"`` (the whole-data-set
        gradient graph kept and differentiated again for every product).
        """
        if strategy == "graph":
            leaf, g = self._graph_gradient()
            with torch.enable_grad():
                product = torch.autograd.grad(g, leaf, grad_outputs=t, retain_graph=True)[0].detach()
            return self.objective.comm.sum_(product)
        total = torch.zeros_like(self.point)
        with eval_mode(self.objective.model):
            for x, y, w in self.objective.chunks():
                if strategy == "jvp":
                    hv = hvp_by_jvp(self.chunk_loss, self.point, t, x, y)
                else:
                    with torch.enable_grad():
                        leaf = self.point.clone().requires_grad_(True)
                        g = torch.autograd.grad(self.chunk_loss(leaf, x, y), leaf, create_graph=True)[0]
                        hv = torch.autograd.grad(g, leaf, grad_outputs=t)[0]
                total += w * hv.detach()
        return self.objective.comm.sum_(total)

    def pushforward(self, t: Tensor) -> Tensor:
        """The weight-space tangent ``J t`` (``J = dw/dv``), flat in ``objective.layout`` order."""

        def flat_weights(v: Tensor) -> Tensor:
            return self.objective.layout.flatten({**self._others, **self.gspace.weights(v, check=False)})

        return jvp(flat_weights, (self.point,), (t,))[1]


def gspace_hessian_operator(
    objective: Objective, gspace: GSpace | None = None, hvp: str = "auto"
) -> tuple[CallableOperator, GSpaceLoss]:
    """The Hessian of ``L(w(v))`` w.r.t. the G-space coordinates at ``objective.params``, as an operator.

    Args:
        objective: the loss over the data set.
        gspace: the parametrization (default: the G-SGD skeleton).
        hvp: ``"auto"`` (chosen as for the Euclidean Hessian), ``"graph"``, ``"double_backward"`` or
            ``"jvp"``; see [`GSpaceLoss.hvp`][sharpness.GSpaceLoss.hvp].

    Returns:
        ``(operator, loss)``: the symmetric operator on ``(dim,)`` vectors and the G-space loss it uses.
    """
    loss = GSpaceLoss(objective, gspace)
    strategy = objective.hvp_strategy(hvp, autograd=True)  # products through w(v): no R-operator

    def apply(t: Tensor) -> Tensor:
        return loss.hvp(t, strategy)

    op = CallableOperator(apply, loss.gspace.dim, objective.dtype, objective.device, comm=objective.comm,
                          start_hint=cache(lambda: loss.value_and_gradient()[1]))  # the G-space gradient, once
    op.strategy = strategy
    return op, loss


@dataclass(frozen=True)
class GSpaceMeasure(Measure):
    """The top eigenvalue of the Hessian of ``L(w(v))`` in G-space (basis-path values, default skeleton).

    The eigenvectors are found in G-space (unit norm there) and returned pushed forward to weight space,
    ``J xi`` with ``J = dw/dv`` (``coordinates="tangent"``, zero on the fixed skeleton weights), so
    ``result.parameter_vectors()`` works as for the other measures; ``xi`` itself is
    ``torch.func.jvp(gspace.coordinates, (params,), (J xi,))``. ``info`` holds ``gspace_dim`` and
    ``gspace_grad_norm``. Coordinate-dependent: see the module docstring.
    """

    name = "gspace"
    description = (
        "Hessian of L(w(v)) in G-space (basis-path values): invariant under node- and layer-wise rescaling, "
        "but coordinate-dependent (it changes with the skeleton), unlike the metric measures"
    )
    invariant_under = ("node", "layer")

    def operator(self, objective: Objective, hvp: str = "auto") -> CurvatureOperator:
        require_trainable_layers(objective, "the G-space measure")
        gspace = GSpace(objective.structure, params=objective.params)
        op, loss = gspace_hessian_operator(objective, gspace, hvp)
        gradient = op.start_hint()  # the G-space gradient, computed once for the info and the solver's start

        def to_parameters(vectors: Tensor) -> Tensor:
            return torch.stack([loss.pushforward(xi) for xi in vectors])

        info = {"gspace_dim": gspace.dim, "gspace_grad_norm": float(gradient.norm()), "hvp_strategy": op.strategy}
        return CurvatureOperator(op, to_parameters=to_parameters, coordinates="tangent", info=info)
