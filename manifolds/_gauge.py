"""Minimum-norm gauge fixing: the function-preserving rescaling with the smallest entry-wise p-norm.

Algorithm 1 of the minimum-norm gauge paper. Every hidden unit (conv channel) ``i`` gets the factor

    a_i = (sum_out |W_ji|^p / sum_in |W_ij|^p) ** (1 / (4 p)),

then ``W_ij <- W_ij a_i / a_j`` and ``b_i <- b_i a_i`` (a node-wise rescaling, so the function is
unchanged), repeated until ``max_i |a_i - 1| < tol``. The objective ``sum |W_ij|^p`` counts weights
only, biases are rescaled with their unit but not counted (as in the paper). All units are updated
at once from the same iterate (a Jacobi update, the paper's Algorithm 1 computes every ``a_i`` before
rescaling anything); Lemma 2.3 shows this update never increases the objective, and Theorem 2.1 that
it converges to the global minimizer, the unique representative whose every hidden unit has equal
incoming and outgoing weight p-norms (Lemma 2.2, eq. (9)).

Implementation: ``|W|^p`` summed over the entries that join one unit to one unit of the previous
layer (one kernel for a conv, ``in_group`` columns for a Linear after Flatten) gives a matrix ``A_l``
of shape ``(units_l, units_{l-1})``. Under cumulative node factors ``c`` it becomes
``A_l * c_l^p / c_{l-1}^p``, so every iteration costs two matrix-vector products per layer and the
weights are rescaled once at the end (no rounding drift from repeated rescaling).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from manifolds._structure import NetworkStructure, _rescaled_copy, analyze, rescale_parameters


@dataclass(frozen=True)
class GaugeHistory:
    """How a minimum-norm gauge was found.

    Attributes:
        p: exponent of the entry-wise norm.
        objective: ``||W||_{p,p}^p = sum |W_ij|^p`` over all layer weights (biases excluded), one value
            per iterate, starting with the initial network (``iterations + 1`` values).
        max_imbalance: eq. (20) of the paper per iterate (same length as ``objective``):
            ``max_i |in_i - out_i| / (in_i + out_i)`` over hidden units, with ``in_i`` / ``out_i`` the
            sums of ``|W|^p`` over the unit's incoming / outgoing weights; in ``[0, 1]``, 0 when balanced.
        gamma: ``max_imbalance`` of the returned network.
        iterations: number of updates applied.
        converged: whether the last update had ``max_i |a_i - 1| < tol``.
        factors: cumulative node factors, one ``(hidden_units[l],)`` float64 tensor per hidden layer:
            ``rescale_parameters(params, structure, factors)`` is the gauged network.
    """

    p: float
    objective: list[float]
    max_imbalance: list[float]
    gamma: float
    iterations: int
    converged: bool
    factors: tuple[Tensor, ...]


def _unit_norms(params: Mapping[str, Tensor], structure: NetworkStructure, p: float) -> list[Tensor]:
    """``A_l``: ``|W_l|^p`` summed per (unit, previous unit) pair, ``(out_units, previous units)`` float64."""
    mats = []
    for i, layer in enumerate(structure.layers):
        # Columns grouped by unit of the previous layer (input channels / features for the first).
        prev_units = structure.layers[i - 1].out_units if i > 0 else layer.in_units
        weight = params[layer.weight].detach().to(torch.float64)
        if not bool(torch.isfinite(weight).all()):
            raise ValueError(f"layer '{layer.name}' has non-finite weights; the minimum-norm gauge needs finite ones")
        # Same grouping as rescale_parameters: (out, prev_units, in_group * kernel size).
        mats.append(weight.abs().pow(p).reshape(weight.shape[0], prev_units, -1).sum(-1))
    return mats


def _in_out(mats: Sequence[Tensor], log_c: Sequence[Tensor], p: float) -> tuple[list[Tensor], list[Tensor], float]:
    """In- and out-norms (``sum |W|^p``) of every hidden unit under factors ``exp(log_c)``, and the objective."""
    ones_in = torch.ones(mats[0].shape[1], dtype=torch.float64, device=mats[0].device)
    ones_out = torch.ones(mats[-1].shape[0], dtype=torch.float64, device=mats[-1].device)
    up = [torch.exp(p * lc) for lc in log_c]  # c^p: rows of layer l scale by it
    down = [torch.exp(-p * lc) for lc in log_c]  # c^-p: columns of layer l + 1 scale by it
    rows = [up[i] if i < len(up) else ones_out for i in range(len(mats))]
    cols = [down[i - 1] if i > 0 else ones_in for i in range(len(mats))]
    row_sums = [r * (m @ c) for m, r, c in zip(mats, rows, cols)]
    incoming = row_sums[:-1]
    outgoing = [d * (m.T @ r) for m, r, d in zip(mats[1:], rows[1:], down)]
    objective = float(sum(s.sum() for s in row_sums))
    return incoming, outgoing, objective


def _imbalance(incoming: Sequence[Tensor], outgoing: Sequence[Tensor]) -> float:
    return max(float(((i - o).abs() / (i + o)).max()) for i, o in zip(incoming, outgoing))


def _check_units(structure: NetworkStructure, incoming: Sequence[Tensor], outgoing: Sequence[Tensor]) -> None:
    """A unit with no incoming or no outgoing weight has no minimum-norm gauge (its factor runs off to 0 or inf)."""
    for layer, norms_in, norms_out in zip(structure.layers[:-1], incoming, outgoing):
        for norms, side in ((norms_in, "incoming"), (norms_out, "outgoing")):
            dead = torch.nonzero(norms == 0).flatten()
            if dead.numel():
                raise ValueError(
                    f"hidden unit {int(dead[0])} of layer '{layer.name}' ({layer.module_type}) has all "
                    f"{side} weights zero ({dead.numel()} such unit(s) in that layer), so no rescaling "
                    "minimizes the weight norm (its factor would run off to 0 or infinity); prune the unit "
                    "(it does not depend on the input or does not reach the output) before gauge fixing"
                )


def _solve(
    params: Mapping[str, Tensor], structure: NetworkStructure, p: float, tol: float, max_iter: int
) -> GaugeHistory:
    structure.require_rescalable("the minimum-norm gauge")
    if not p > 0:
        raise ValueError(f"the norm exponent p must be positive, got {p}")
    if not tol > 0:
        raise ValueError(f"tol must be positive, got {tol}")
    if max_iter < 0:
        raise ValueError(f"max_iter must be non-negative, got {max_iter}")
    p = float(p)
    mats = _unit_norms(params, structure, p)
    log_c = [torch.zeros(h, dtype=torch.float64, device=mats[0].device) for h in structure.hidden_units]
    incoming, outgoing, objective = _in_out(mats, log_c, p)
    if not log_c:  # a single layer has no hidden unit and nothing to balance
        return GaugeHistory(p, [objective], [0.0], 0.0, 0, True, ())
    _check_units(structure, incoming, outgoing)
    objectives, imbalances = [objective], [_imbalance(incoming, outgoing)]
    converged, iterations = False, 0
    while iterations < max_iter and not converged:
        # log a_i = (log out_i - log in_i) / (4p), all units from the same iterate (Jacobi).
        steps = [(torch.log(o) - torch.log(i)) / (4 * p) for i, o in zip(incoming, outgoing)]
        log_c = [lc + s for lc, s in zip(log_c, steps)]
        incoming, outgoing, objective = _in_out(mats, log_c, p)
        objectives.append(objective)
        imbalances.append(_imbalance(incoming, outgoing))
        iterations += 1
        converged = max(float(torch.expm1(s).abs().max()) for s in steps) < tol
    factors = tuple(torch.exp(lc) for lc in log_c)
    return GaugeHistory(p, objectives, imbalances, imbalances[-1], iterations, converged, factors)


def min_norm_gauge_parameters(
    params: Mapping[str, Tensor],
    structure: NetworkStructure,
    p: float = 2.0,
    tol: float = 1e-8,
    max_iter: int = 10000,
) -> tuple[dict[str, Tensor], GaugeHistory]:
    """The minimum-``p``-norm representative of ``params`` under node-wise rescaling (functional).

    Jacobi multiplicative updates of the paper's Algorithm 1 (see the module docstring), computed in
    float64 whatever the parameters' dtype.

    Args:
        params: ``{name: tensor}`` containing at least every layer's weight and bias; not modified.
        structure: from :func:`analyze`; must be rescalable.
        p: exponent of the entry-wise norm ``sum |W_ij|^p``, any ``p > 0``.
        tol: stop once an update has ``max_i |a_i - 1| < tol``. The distance to the exact gauge is
            about ``tol / (1 - rate)`` for the linear convergence rate of the updates, so ask for a
            smaller ``tol`` where the gauge must be reproduced to a given accuracy.
        max_iter: most updates; when reached, the history says ``converged=False``.

    Returns:
        ``(gauged, history)``: a new dictionary with the same keys (layer weights and biases rescaled
        by ``history.factors``, everything else passed through), and the :class:`GaugeHistory`.

    Raises:
        UnsupportedModelError: positive rescaling is not a symmetry of the structure.
        ValueError: bad ``p``, ``tol`` or ``max_iter``, non-finite weights, or a hidden unit whose
            incoming or outgoing weights are all zero (named in the message).
    """
    history = _solve(params, structure, p, tol, max_iter)
    if not history.factors:
        return dict(params), history
    return rescale_parameters(params, structure, history.factors), history


def min_norm_gauge(
    model: nn.Module,
    p: float = 2.0,
    tol: float = 1e-8,
    max_iter: int = 10000,
    *,
    example_input: Tensor | None = None,
) -> tuple[nn.Module, GaugeHistory]:
    """A deep copy of ``model`` rescaled to its minimum-norm gauge (``model`` is untouched).

    The copy computes the same function and has the smallest entry-wise ``p``-norm of the layer
    weights among all node-wise (channel-wise) rescalings of ``model``; at convergence every hidden
    unit has equal incoming and outgoing ``sum |W|^p`` (biases excluded). The result is canonical:
    any rescaling of ``model`` gauges to the same weights.

    Args:
        model: a chain of Linear/Conv2d layers with positively homogeneous operations between them.
        p: exponent of the entry-wise norm, any ``p > 0``.
        tol: stop once an update has ``max_i |a_i - 1| < tol`` (see :func:`min_norm_gauge_parameters`).
        max_iter: most updates.
        example_input: passed to :func:`analyze` (needed only when fx cannot trace the model).

    Returns:
        ``(gauged_model, history)``, see :class:`GaugeHistory`.

    Raises:
        UnsupportedModelError: positive rescaling is not a symmetry of ``model`` (e.g. GELU, BatchNorm).
        ValueError: as for :func:`min_norm_gauge_parameters`.

    Example:
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> gauged, history = min_norm_gauge(net, p=2.0)
        >>> history.converged and history.objective[-1] <= history.objective[0]
        True
    """
    structure = analyze(model, example_input)
    history = _solve(dict(model.named_parameters()), structure, p, tol, max_iter)
    if not history.factors:
        return copy.deepcopy(model), history
    return _rescaled_copy(model, structure, history.factors), history
