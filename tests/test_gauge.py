"""Minimum-norm gauge (gauge paper, Algorithm 1) and the gauge-fixed "minnorm" sharpness."""

import numpy as np
import pytest
import torch
from cases import make_case, mlp
from torch import nn

from manifolds import (
    UnsupportedModelError,
    analyze,
    min_norm_gauge,
    min_norm_gauge_parameters,
    random_factors,
    random_rescale,
    rescale_parameters,
)
from sharpness import Objective, Solver, dense_hessian, invariant_sharpness

P_VALUES = (1.0, 2.0, 3.5)
TIGHT = 1e-13  # gauge tolerance where weights are compared to 1e-8 (error ~ tol / (1 - rate))


def unit_norms(model, p):
    """Per hidden layer: (incoming, outgoing) ``sum |W|^p`` of every unit, from the weights directly."""
    structure = analyze(model)
    params = dict(model.named_parameters())
    out = []
    for layer, nxt in zip(structure.layers[:-1], structure.layers[1:]):
        w_in = params[layer.weight].detach().abs() ** p
        w_out = params[nxt.weight].detach().abs() ** p
        incoming = w_in.reshape(layer.out_units, -1).sum(1)
        # conv: the [:, i] slice; Linear after Flatten: the in_group columns of channel i
        outgoing = w_out.reshape(w_out.shape[0], layer.out_units, -1).sum((0, 2))
        out.append((incoming, outgoing))
    return out


def weight_objective(model, p):
    structure = analyze(model)
    params = dict(model.named_parameters())
    return float(sum((params[layer.weight].detach().abs() ** p).sum() for layer in structure.layers))


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("p", P_VALUES)
def test_gauge_balances_units_decreases_norm_and_keeps_function(rescalable_case, p):
    model = rescalable_case.model
    before = snapshot(model)
    gauged, history = min_norm_gauge(model, p=p, tol=1e-10)
    assert history.converged and history.p == p
    assert len(history.objective) == len(history.max_imbalance) == history.iterations + 1
    # Lemma 2.3: every Jacobi update leaves sum |W|^p no larger (up to rounding).
    objective = np.array(history.objective)
    assert np.all(np.diff(objective) <= 1e-13 * objective[0])
    assert objective[-1] < objective[0]
    assert weight_objective(model, p) == pytest.approx(objective[0], rel=1e-12)
    assert weight_objective(gauged, p) == pytest.approx(objective[-1], rel=1e-12)
    # Lemma 2.2 / eq. (9): incoming and outgoing weight p-norms (biases excluded) are equal per unit.
    gamma = 0.0
    for incoming, outgoing in unit_norms(gauged, p):
        torch.testing.assert_close(incoming, outgoing, rtol=1e-6, atol=0)
        gamma = max(gamma, float(((incoming - outgoing).abs() / (incoming + outgoing)).max()))
    assert history.gamma == pytest.approx(gamma, rel=1e-6, abs=1e-15)  # eq. (20)
    assert history.max_imbalance[-1] == history.gamma
    # same function, user's model untouched
    with torch.no_grad():
        ref, out = model(rescalable_case.X), gauged(rescalable_case.X)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10 * float(ref.abs().max()))
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert gauged is not model


@pytest.mark.parametrize("p", P_VALUES)
def test_balanced_point_is_the_minimum_over_rescalings(rescalable_case, p):
    gauged, history = min_norm_gauge(rescalable_case.model, p=p, tol=1e-12)
    structure = analyze(gauged)
    params = {k: v.detach() for k, v in gauged.named_parameters()}
    g = torch.Generator().manual_seed(1)
    for scale in (1e-3, 0.1, 1.0):
        moved = rescale_parameters(params, structure, random_factors(structure, "node", scale, g))
        norm = float(sum((moved[layer.weight].abs() ** p).sum() for layer in structure.layers))
        assert norm >= history.objective[-1] * (1 - 1e-12)


@pytest.mark.parametrize("p", P_VALUES)
def test_gauge_is_canonical_under_node_rescaling(rescalable_case, p):
    g = torch.Generator().manual_seed(3)
    twin = random_rescale(rescalable_case.model, kind="node", scale=1.0, generator=g)
    a, _ = min_norm_gauge(rescalable_case.model, p=p, tol=TIGHT)
    b, _ = min_norm_gauge(twin, p=p, tol=TIGHT)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(y, x, rtol=1e-8, atol=1e-8 * float(x.abs().max()), msg=name)


@pytest.mark.parametrize("p", P_VALUES)
def test_one_update_is_the_jacobi_step_of_algorithm_1(rescalable_case, p):
    """After one update every unit's factor is computed from the initial weights (all at once)."""
    model = rescalable_case.model
    _, history = min_norm_gauge(model, p=p, max_iter=1)
    assert history.iterations == 1 and not history.converged
    # On a chain the group's free scales are the hidden units in forward order.
    expected = torch.cat([(outgoing / incoming) ** (1 / (4 * p)) for incoming, outgoing in unit_norms(model, p)])
    torch.testing.assert_close(torch.exp(history.log_scales), expected, rtol=1e-12, atol=0)


def test_functional_form_matches_the_model_form():
    case = make_case("cnn")
    params = {k: v.detach() for k, v in case.model.named_parameters()}
    gauged_params, history = min_norm_gauge_parameters(params, analyze(case.model), p=2.0)
    gauged, _ = min_norm_gauge(case.model, p=2.0)
    for name, value in gauged.named_parameters():
        assert torch.equal(gauged_params[name], value.detach()), name
    assert history.log_scales.dtype == torch.float64 and history.log_scales.shape == (analyze(case.model).group.dim,)


class _Untraceable(nn.Module):
    """Python control flow on a tensor (fx cannot trace it), each sample apart: the branch reads the weights, not the
    batch (a branch on ``h.sum()`` would mix the samples, which the objective refuses first)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.relu(h) if self.a.weight.sum() > 0 else torch.relu(-h))


def test_refuses_a_model_without_a_group():
    with pytest.raises(UnsupportedModelError, match="rescaling group is unknown, because torch.fx cannot trace"):
        min_norm_gauge(_Untraceable(), example_input=torch.randn(3, 5))


def test_pinned_units_are_left_alone():
    model = mlp([3, 4, 2], activation=nn.GELU).double()
    gauged, history = min_norm_gauge(model)
    assert history.iterations == 0 and history.log_scales.shape == (0,)
    for (name, a), (_, b) in zip(model.named_parameters(), gauged.named_parameters()):
        assert torch.equal(a, b), name


def test_dead_unit_is_named():
    model = make_case("mlp_bias").model
    with torch.no_grad():
        model[2].weight[3].zero_()  # unit 3 of layer '2' has no incoming weight
    with pytest.raises(ValueError, match=r"channel\(s\) output of module '2' \(Linear\)\[3\] have all incoming"):
        min_norm_gauge(model)


@pytest.mark.parametrize("bad", [{"p": 0.0}, {"p": -1.0}, {"tol": 0.0}, {"max_iter": -1}])
def test_bad_arguments(bad):
    with pytest.raises(ValueError):
        min_norm_gauge(make_case("mlp_bias").model, **bad)


def test_not_converging_says_so():
    _, history = min_norm_gauge(make_case("mlp_nobias").model, max_iter=2)
    assert history.iterations == 2 and not history.converged


def minnorm(model, case):
    return invariant_sharpness(model, case.loss_fn, case.data, metric="minnorm",
                               solver=Solver(tol=1e-10), progress=False)


def test_minnorm_sharpness_is_euclidean_top_eigenvalue_at_the_gauge(rescalable_case):
    case = rescalable_case
    result = minnorm(case.model, case)
    gauged, history = min_norm_gauge(case.model, p=2.0, tol=1e-12)
    dense = dense_hessian(Objective(gauged, case.loss_fn, case.data))
    top = float(torch.linalg.eigvalsh(dense)[-1])
    assert result.value == pytest.approx(top, rel=1e-8)
    assert result.info["metric"] == "minnorm" and result.info["gauge_converged"]
    assert result.info["gauge_iterations"] == history.iterations and result.info["gauge_gamma"] < 1e-10
    assert result.coordinates == "gauged" and result.info["hvp_strategy"]


@pytest.mark.parametrize("kind", ["node", "layer"])
def test_minnorm_sharpness_is_invariant(rescalable_case, kind):
    case = rescalable_case
    g = torch.Generator().manual_seed(5)
    twin = random_rescale(case.model, kind=kind, scale=1.0, generator=g)
    assert minnorm(twin, case).value == pytest.approx(minnorm(case.model, case).value, rel=1e-8)


def test_minnorm_refuses_a_model_without_a_group():
    case = make_case("mlp_bias")
    with pytest.raises(UnsupportedModelError, match="rescaling group is unknown"):
        minnorm(_Untraceable().double().eval(), case)
