"""Dense references for small problems: the full Hessian and gradient by ``torch.func``.

Quadratic in the number of parameters: meant for tests and for checking the operators on models
with at most a few thousand parameters.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.func import hessian

from manifolds import RescalingGroup
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


def _horizontal_basis(vertical: Tensor, kept: Tensor) -> Tensor:
    """``(n, m)`` orthonormal basis of the kept coordinates orthogonal to the columns of ``vertical`` ``(n, d)``."""
    n = kept.numel()
    index = kept.nonzero().flatten()
    sub = vertical[index]
    eye = torch.eye(n, dtype=vertical.dtype, device=vertical.device)[:, index]
    if sub.shape[1] == 0:
        return eye
    u, s, _ = torch.linalg.svd(sub, full_matrices=True)
    rank = int((s > 1e-10 * s.max()).sum()) if s.numel() else 0
    return eye @ u[:, rank:]


def dense_riemannian_hessian(objective: Objective, metric: str, group: RescalingGroup | None = None) -> Tensor:
    """The Riemannian Hessian of the layer-wise or node-wise quotient metric as an ``(m, m)`` symmetric matrix.

    Built independently of the quotient classes, from `dense_hessian`, the gradient and the metrics'
    closed forms (docs/math.md): in whitened coordinates ``zeta = G^{1/2} xi``,

    - ``"node"`` (``g = sum xi^2 / w^2``): ``diag(|w|) H diag(|w|) + diag(w g)``; exactly-zero weights are
      left out (the metric is undefined there);
    - ``"layer"`` (``g = sum_B <xi_B, xi_B> / ||w_B||^2``): ``N H N + C`` with ``N = diag(||w_B||)`` and, per
      block, the Levi-Civita (connection) terms ``C_B = g_B w_B^T + w_B g_B^T - <w_B, g_B> I``;

    restricted to an orthonormal basis of the horizontal space, the whitened complement of the rescaling
    orbit's tangent ``w * (J c)``, which is read off the group's own action by forward differentiation
    (exact). Its eigenvalues are those of the measure of the same name. Quadratic in the number of
    parameters: for tiny instances (a few hundred parameters).

    Args:
        objective: the loss over the data set, float64 for a reference.
        metric: ``"layer"`` or ``"node"``.
        group: the rescaling group whose orbit is quotiented out (default: the model's, ``structure.layer_group``
            for ``"layer"``, ``structure.group`` for ``"node"``; e.g. a restricted one where tensors are frozen).

    Returns:
        ``(m, m)`` tensor, ``m`` the dimension of the horizontal space.

    Raises:
        ValueError: ``metric`` is neither, a tensor has zero norm under the layer-wise metric, or the
            rescaling group of the model is unknown.
    """
    if metric not in ("layer", "node"):
        raise ValueError(f"dense_riemannian_hessian takes metric 'layer' or 'node', got {metric!r}")
    structure = objective.structure
    if group is None:
        group = structure.layer_group if metric == "layer" else structure.group
    if group is None:
        raise ValueError(
            f"the rescaling group of this model is unknown ({structure.group_failure}), so the horizontal space "
            "has no reference; use a model that manifolds.analyze understands"
        )
    layout, params = objective.layout, objective.params
    w, g, H = layout.flatten(params), objective.gradient(), dense_hessian(objective)
    if metric == "node":
        scale = w.abs()  # G^{-1/2}
        M = scale[:, None] * H * scale[None, :] + torch.diag(w * g)
    else:
        scale = torch.cat([w[layout.slice(n)].norm().expand(layout.slice(n).stop - layout.slice(n).start)
                           for n in layout.names])  # fmt: skip
        zero = [n for n in layout.names if float(w[layout.slice(n)].norm()) == 0.0]
        if zero:
            raise ValueError(f"tensor {', '.join(zero)} has zero norm: the layer-wise metric is undefined there")
        M = scale[:, None] * H * scale[None, :]
        for name in layout.names:
            b = layout.slice(name)
            wb, gb = w[b], g[b]
            M[b, b] += torch.outer(gb, wb) + torch.outer(wb, gb) - torch.dot(wb, gb) * torch.eye(len(wb), dtype=w.dtype)
    kept = scale > 0

    def acted(log_scales: Tensor) -> Tensor:
        return layout.flatten({k: v for k, v in group.act(params, log_scales).items() if k in params})

    zeros = torch.zeros(group.dim, dtype=w.dtype, device=w.device)
    tangent = torch.func.jacfwd(acted)(zeros) if group.dim else w.new_zeros(w.numel(), 0)  # (n, dim): w * (J c)
    vertical = tangent / torch.where(kept, scale, 1.0)[:, None]  # whitened: G^{1/2} (w * J)
    Q = _horizontal_basis(vertical, kept)
    B = Q.T @ M @ Q
    return (B + B.T) / 2


def dense_gspace_hessian(objective: Objective, gspace=None) -> tuple[Tensor, Tensor]:
    """The Hessian and gradient of ``F(v) = L(w(v))`` in G-space coordinates, without the inverse map ``w(v)``.

    On the weights ``u`` that G-space leaves free (every weight entry but the designated ones, every bias),
    the coordinates ``v = phi(u)`` (path values, `manifolds.GSpace.coordinates`) are a bijection, and
    ``L = F o phi``. Differentiating twice: ``grad F = J^-T grad_u L`` and
    ``Hess F = J^-T (H_u - sum_k (grad F)_k Hess phi_k) J^-1`` with ``J = d phi / du``, all by ``torch.func`` in
    the objective's dtype: only the forward map ``phi`` is used, never the library's inverse ``w(v)``, so a
    sign or factor wrong in either shows as a mismatch with `sharpness.GSpaceMeasure`.

    Args:
        objective: the loss over the data set, float64 for a reference.
        gspace: the parametrization (default: the G-SGD skeleton at ``objective.params``, as the measure uses).

    Returns:
        ``(hessian (dim, dim), gradient (dim,))`` in the order of ``gspace.layout``.
    """
    from manifolds import GSpace

    if gspace is None:
        gspace = GSpace(objective.structure, params=objective.params)
    layout, params = objective.layout, objective.params
    masks = gspace.skeleton_masks()
    free = torch.zeros(layout.size, dtype=torch.bool, device=objective.device)
    for name in gspace.names:
        sl = layout.slice(name)
        free[sl] = ~masks[name].reshape(-1).to(free.device) if name in masks else True
    index = free.nonzero().flatten()
    if index.numel() != gspace.dim:
        raise ValueError(f"{index.numel()} free weights for {gspace.dim} G-space coordinates: not a bijection")
    flat = layout.flatten(params)

    def phi(u: Tensor) -> Tensor:
        return gspace.coordinates(layout.unflatten(flat.index_put((index,), u)))

    u = flat[index]
    J = torch.func.jacfwd(phi)(u)
    H = dense_hessian(objective)[index][:, index]
    grad = torch.linalg.solve(J.T, objective.gradient()[index])
    curvature = torch.func.hessian(lambda x: torch.dot(grad, phi(x)))(u)
    J_inv = torch.linalg.inv(J)
    F = J_inv.T @ (H - curvature) @ J_inv
    return (F + F.T) / 2, grad


def dense_spectrum(objective: Objective, measure: str) -> Tensor:
    """All eigenvalues, largest first, of the dense reference for one measure at ``objective.params``.

    ``"euclidean"``: `dense_hessian`; ``"layer"``, ``"node"``: `dense_riemannian_hessian`;
    ``"gspace"``: `dense_gspace_hessian`. The top ``k`` are what the measure of that name returns with
    ``k`` eigenvalues (``"node"`` adds a zero eigenvalue per left-out zero weight, which only matters where the
    top ``k`` are not positive).

    Raises:
        ValueError: another measure name.
    """
    if measure == "euclidean":
        M = dense_hessian(objective)
    elif measure in ("layer", "node"):
        M = dense_riemannian_hessian(objective, measure)
    elif measure == "gspace":
        M = dense_gspace_hessian(objective)[0]
    else:
        raise ValueError(f"no dense reference for the measure {measure!r}; choose euclidean, layer, node or gspace")
    return torch.linalg.eigvalsh(M).flip(0)
