"""Minimum-norm gauge fixing: the function-preserving rescaling with the smallest entry-wise p-norm.

Algorithm 1 of the minimum-norm gauge paper, on the network's exact rescaling group (residual
connections, BatchNorm and concatenation included; see [`manifolds.analyze`][manifolds.analyze]). Every free scale
``k`` of the group gets the factor

    a_k = (sum_out |w|^p / sum_in |w|^p) ** (1 / (4 p)),

where "in" are the weight entries that scale with ``e^{s_k}`` (a unit's incoming weights, a BatchNorm's
``weight``) and "out" those that scale with ``e^{-s_k}`` (its outgoing weights). Every entry has at most
one in-scale and one out-scale, so the objective ``sum |w|^p`` is a sum of ``A e^{p (s_i - s_j)}`` terms;
each update is the paper's Jacobi step (all scales from the same iterate), which by
``e^{p(a-b)} <= (e^{2pa} + e^{-2pb}) / 2`` never increases the objective (Lemma 2.3), and converges to
the unique representative whose every free scale has equal in- and out-sums (Lemma 2.2, eq. (9)).
Biases are rescaled with their unit but not counted (as in the paper).

Implementation: ``|w|^p`` is summed once over the axes along which an entry's scales do not vary (a
kernel's spatial extent), so an iteration costs a few passes over per-(channel, channel) sums and the
weights are rescaled once at the end (no rounding drift from repeated rescaling).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from manifolds._group import Action, RescalingGroup
from manifolds._structure import DegeneratePointError, NetworkStructure, _acted_copy, analyze


@dataclass(frozen=True)
class GaugeHistory:
    """How a minimum-norm gauge was found.

    Attributes:
        p: exponent of the entry-wise norm.
        objective: ``sum |w|^p`` over all weight tensors (biases excluded), one value per iterate, starting
            with the initial network (``iterations + 1`` values).
        max_imbalance: eq. (20) of the paper per iterate (same length as ``objective``):
            ``max_k |in_k - out_k| / (in_k + out_k)`` over the group's free scales, with ``in_k`` / ``out_k``
            the sums of ``|w|^p`` over the weights that scale with ``e^{s_k}`` / ``e^{-s_k}``; in ``[0, 1]``,
            0 when balanced.
        gamma: ``max_imbalance`` of the returned network.
        iterations: number of updates applied.
        converged: whether the last update had ``max_k |a_k - 1| < tol``.
        log_scales: ``(dim,)`` float64 log-scales of the node-wise group (``structure.group``):
            ``structure.group.act(params, log_scales)`` is the gauged network.
    """

    p: float
    objective: list[float]
    max_imbalance: list[float]
    gamma: float
    iterations: int
    converged: bool
    log_scales: Tensor


@dataclass(frozen=True)
class _Term:
    """``|w|^p`` of one weight tensor summed over the axes along which its scale does not vary."""

    magnitude: Tensor  # (joint shape of plus and minus) float64
    plus: Tensor  # class indices, expanded to the joint shape
    minus: Tensor


def _terms(params: Mapping[str, Tensor], actions: Sequence[Action], dim: int, p: float) -> tuple[list[_Term], float]:
    terms, constant = [], 0.0
    for a in actions:
        if a.role != "weight":
            continue
        # On the CPU: the per-scale sums are small, and an accelerator would wait for each of them every update.
        w = params[a.name].detach().to("cpu", torch.float64)
        if not bool(torch.isfinite(w).all()):
            raise ValueError(f"{a.name} has non-finite entries; the minimum-norm gauge needs finite weights")
        plus = a.plus if a.plus is not None else torch.full((1,) * w.dim(), dim)
        minus = a.minus if a.minus is not None else torch.full((1,) * w.dim(), dim)
        joint = torch.broadcast_shapes(plus.shape, minus.shape)
        summed = tuple(i for i, size in enumerate(joint) if size == 1 and w.shape[i] != 1)
        magnitude = w.abs().pow(p)
        magnitude = magnitude.sum(dim=summed, keepdim=True) if summed else magnitude
        plus, minus = plus.expand(joint).to(w.device), minus.expand(joint).to(w.device)
        moving = plus != minus  # an entry whose two ends share a scale never changes
        constant += float(magnitude[~moving].sum())
        terms.append(_Term(magnitude[moving], plus[moving], minus[moving]))
    return terms, constant


def _in_out(terms: Sequence[_Term], constant: float, s: Tensor, p: float) -> tuple[Tensor, Tensor, float]:
    """In- and out-sums of ``|w|^p`` per free scale under log-scales ``s`` (with the trailing 0), and the objective."""
    incoming, outgoing = torch.zeros_like(s), torch.zeros_like(s)
    total = constant
    for t in terms:
        value = t.magnitude * torch.exp(p * (s[t.plus] - s[t.minus]))
        incoming.index_add_(0, t.plus, value)
        outgoing.index_add_(0, t.minus, value)
        total += float(value.sum())
    return incoming[:-1], outgoing[:-1], total


def _imbalance(incoming: Tensor, outgoing: Tensor) -> float:
    if not incoming.numel():
        return 0.0
    return float(((incoming - outgoing).abs() / (incoming + outgoing)).max())


def _check_scales(group: RescalingGroup, incoming: Tensor, outgoing: Tensor) -> None:
    """A scale with no incoming or no outgoing weight has no minimum-norm gauge (it runs off to 0 or inf)."""
    for norms, side in ((incoming, "incoming"), (outgoing, "outgoing")):
        dead = torch.nonzero(norms == 0).flatten()
        if dead.numel():
            members = group.classes[int(dead[0])]
            raise DegeneratePointError(
                f"the channel(s) {', '.join(members[:3])}{' ...' if len(members) > 3 else ''} have all {side} "
                f"weights zero ({dead.numel()} such scale(s)), so no rescaling minimizes the weight norm (the "
                "scale would run off to 0 or infinity); prune the unit (it does not depend on the input or does "
                "not reach the output) before gauge fixing",
                short="dead unit",
            )


def _solve(
    params: Mapping[str, Tensor], structure: NetworkStructure, p: float, tol: float, max_iter: int
) -> GaugeHistory:
    group = structure.require_group("the minimum-norm gauge").restricted(params)
    if not p > 0:
        raise ValueError(f"the norm exponent p must be positive, got {p}")
    if not tol > 0:
        raise ValueError(f"tol must be positive, got {tol}")
    if max_iter < 0:
        raise ValueError(f"max_iter must be non-negative, got {max_iter}")
    p = float(p)
    missing = [a.name for a in group.parameter_actions if a.name not in params]
    if missing:
        raise KeyError(f"params lack {', '.join(missing)}, which the rescaling group acts on")
    terms, constant = _terms(params, group.parameter_actions, group.dim, p)
    device = terms[0].magnitude.device if terms else torch.device("cpu")
    s = torch.zeros(group.dim + 1, dtype=torch.float64, device=device)
    incoming, outgoing, objective = _in_out(terms, constant, s, p)
    if not group.dim:  # nothing to balance
        return GaugeHistory(p, [objective], [0.0], 0.0, 0, True, s[:-1].cpu())
    _check_scales(group, incoming, outgoing)
    objectives, imbalances = [objective], [_imbalance(incoming, outgoing)]
    converged, iterations = False, 0
    while iterations < max_iter and not converged:
        # log a_k = (log out_k - log in_k) / (4p), every scale from the same iterate (Jacobi).
        step = (torch.log(outgoing) - torch.log(incoming)) / (4 * p)
        s[:-1] += step
        incoming, outgoing, objective = _in_out(terms, constant, s, p)
        objectives.append(objective)
        imbalances.append(_imbalance(incoming, outgoing))
        iterations += 1
        converged = float(torch.expm1(step).abs().max()) < tol
    return GaugeHistory(p, objectives, imbalances, imbalances[-1], iterations, converged, s[:-1].cpu())


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
        structure: from [`analyze`][manifolds.analyze] (its ``group`` is used).
        p: exponent of the entry-wise norm ``sum |W_ij|^p``, any ``p > 0``.
        tol: stop once an update has ``max_i |a_i - 1| < tol``. The distance to the exact gauge is
            about ``tol / (1 - rate)`` for the linear convergence rate of the updates, so ask for a
            smaller ``tol`` where the gauge must be reproduced to a given accuracy.
        max_iter: most updates; when reached, the history says ``converged=False``.

    Returns:
        ``(gauged, history)``: a new dictionary with the same keys (layer weights and biases rescaled
            by ``history.factors``, everything else passed through), and the [`GaugeHistory`][manifolds.GaugeHistory].

    Raises:
        UnsupportedModelError: the structure has no rescaling group (fx could not trace the model).
        ValueError: bad ``p``, ``tol`` or ``max_iter``, or non-finite weights.
        DegeneratePointError: a hidden unit whose incoming or outgoing weights are all zero (named in the
            message; a ``ValueError`` too).
    """
    history = _solve(params, structure, p, tol, max_iter)
    return structure.group.restricted(params).act(params, history.log_scales), history


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
        model: any network fx can trace (its group comes from [`analyze`][manifolds.analyze]).
        p: exponent of the entry-wise norm, any ``p > 0``.
        tol: stop once an update has ``max_i |a_i - 1| < tol`` (see `min_norm_gauge_parameters`).
        max_iter: most updates.
        example_input: passed to [`analyze`][manifolds.analyze] (needed only when fx cannot trace the model).

    Returns:
        ``(gauged_model, history)``, see [`GaugeHistory`][manifolds.GaugeHistory].

    Raises:
        UnsupportedModelError: fx cannot trace ``model``, so its rescaling group is unknown.
        ValueError: as for [`min_norm_gauge_parameters`][manifolds.min_norm_gauge_parameters].

    Example:
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> gauged, history = min_norm_gauge(net, p=2.0)
        >>> history.converged and history.objective[-1] <= history.objective[0]
        True
    """
    structure = analyze(model, example_input)
    history = _solve(dict(model.named_parameters(remove_duplicate=False)), structure, p, tol, max_iter)
    group = structure.group.restricted(dict(model.named_parameters(remove_duplicate=False)))
    return _acted_copy(model, group, history.log_scales), history
