"""Epsilon-sharpness: second-order estimate against projected ascent, ball constraints, invariance."""

import json
import math

import pytest
import torch
from cases import make_case

from manifolds import random_rescale
from sharpness import MEASURES, Objective, Solver, dense_hessian, epsilon_sharpness

METRIC_NAMES = ("euclidean", "layer", "node")


@pytest.fixture(scope="module")
def critical_point():
    """mlp_mse_sum on its first 6 samples, trained by full-batch L-BFGS and Newton steps to a smooth local minimum.

    (On all 17 samples L-BFGS stops on a ReLU kink, where the loss is not twice differentiable.)
    """
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        case = make_case("mlp_mse_sum")
        X, y = case.X[:6], case.y[:6]
        params = list(case.model.parameters())
        opt = torch.optim.LBFGS(params, lr=1, max_iter=300, tolerance_grad=1e-12, tolerance_change=0,
                                history_size=50, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = case.loss_fn(case.model(X), y)
            loss.backward()
            return loss

        opt.step(closure)
        for p in params:
            p.grad = None
        # L-BFGS ends within ~1e-7 of the critical point, where it stops depends on the machine's BLAS;
        # Newton steps converge quadratically from there (pseudo-inverse: the rescaling symmetries make
        # the Hessian singular along the orbit).
        for _ in range(10):
            obj = Objective(case.model, case.loss_fn, (X, y))
            step = torch.linalg.pinv(dense_hessian(obj), rtol=1e-10, hermitian=True) @ obj.gradient()
            with torch.no_grad():
                for p, s in zip(params, obj.layout.unflatten(step).values()):
                    p.sub_(s)
        grad_norm = float(torch.linalg.vector_norm(Objective(case.model, case.loss_fn, (X, y)).gradient()))
        assert grad_norm < 1e-9, f"L-BFGS did not reach a critical point (gradient norm {grad_norm:.1e})"
        with torch.no_grad():  # a smooth minimum: no pre-activation sits on the ReLU kink
            assert float(case.model[0](X).abs().min()) > 1e-3
        yield case.model, case.loss_fn, (X, y)
    finally:
        torch.set_default_dtype(old)


@pytest.mark.parametrize("metric", METRIC_NAMES)
def test_measured_matches_second_order_for_small_eps(critical_point, metric):
    model, loss_fn, data = critical_point
    eigen = None
    gaps = []
    for eps in (1e-1, 1e-2, 1e-3):
        res = epsilon_sharpness(model, loss_fn, data, eps, metric=metric, eigen=eigen,
                                solver=Solver(tol=1e-10), progress=False)
        eigen = res.lambda_max
        assert res.second_order == pytest.approx(eigen.value * eps**2 / (2 * (1 + res.loss)), rel=1e-14)
        gaps.append(abs(res.ratio - 1))
    assert gaps[-1] < 2e-3
    assert gaps[-2] < 2e-2
    assert gaps[2] < gaps[1] < gaps[0]  # the third-order term fades linearly in eps


@pytest.mark.parametrize("metric", METRIC_NAMES)
def test_large_eps_is_reported(critical_point, metric, tmp_path):
    model, loss_fn, data = critical_point
    res = epsilon_sharpness(model, loss_fn, data, 1.0, metric=metric, steps=10, progress=False)
    assert math.isfinite(res.measured) and res.measured > 0 and res.second_order > 0
    assert res.start_sign in (1, -1)
    assert len(res.history) == 2 * 11
    best = max(h["sharpness"] for h in res.history)
    assert res.measured == best
    assert all(h["radius"] <= 1.0 * (1 + 1e-12) for h in res.history)
    path = tmp_path / "eps.json"
    res.save_json(path, with_vectors=True)
    d = json.loads(path.read_text())
    assert d["metric"] == metric and d["measured"] == res.measured and d["lambda_max"] == res.lambda_max.value
    assert len(d["maximizer"]) == res.maximizer.numel()
    assert "maximizer" not in res.to_dict()


@pytest.mark.parametrize("metric", METRIC_NAMES)
def test_maximizer_is_horizontal_and_inside_the_ball(metric):
    case = make_case("mlp_bias")  # not a critical point: the ascent has work to do
    eps = 0.3
    res = epsilon_sharpness(case.model, case.loss_fn, case.data, eps, metric=metric, progress=False)
    obj = Objective(case.model, case.loss_fn, case.data)
    xi = res.maximizer
    if metric == "euclidean":
        norm, projected = torch.linalg.vector_norm(xi), xi
        moved = obj.layout.flatten(obj.params) + xi
    else:
        quotient = MEASURES[metric].quotient(obj)
        norm, projected = quotient.norm(xi), quotient.proj_horizontal(xi)
        moved = quotient.expmap(xi)
    assert float(norm) <= eps * (1 + 1e-12)
    assert float(norm) > 0.9 * eps  # off a critical point the maximum lies on the boundary
    torch.testing.assert_close(projected, xi, rtol=0, atol=1e-12 * float(xi.abs().max()))
    torch.testing.assert_close(res.perturbed, moved, rtol=1e-13, atol=1e-13)
    value = float(obj.value(res.perturbed))
    assert res.measured == pytest.approx((value - res.loss) / (1 + res.loss), rel=1e-12)
    assert res.measured >= max(h["sharpness"] for h in res.history if h["step"] == 0)  # ascent never loses
    assert set(res.perturbed_parameters()) == {k for k, _ in case.model.named_parameters()}


def test_node_epsilon_sharpness_invariant_under_node_rescaling():
    case = make_case("cnn")
    twin = random_rescale(case.model, "node", 1.0, torch.Generator().manual_seed(3))
    a = epsilon_sharpness(case.model, case.loss_fn, case.data, 0.2, metric="node", steps=10, solver=Solver(tol=1e-10),
                          progress=False)
    b = epsilon_sharpness(twin, case.loss_fn, case.data, 0.2, metric="node", steps=10,
                          solver=Solver(tol=1e-10), progress=False)
    assert a.second_order == pytest.approx(b.second_order, rel=1e-6)
    assert a.measured == pytest.approx(b.measured, rel=1e-6)
    assert a.measured > 0
    # the Euclidean one is not invariant
    ea = epsilon_sharpness(case.model, case.loss_fn, case.data, 0.2, metric="euclidean", steps=2, progress=False)
    eb = epsilon_sharpness(twin, case.loss_fn, case.data, 0.2, metric="euclidean", steps=2, progress=False)
    assert abs(ea.second_order / eb.second_order - 1) > 1e-2


def test_model_is_not_modified():
    case = make_case("mlp_bias")
    before = {k: v.clone() for k, v in case.model.state_dict().items()}
    epsilon_sharpness(case.model, case.loss_fn, case.data, 0.5, metric="layer", steps=3, progress=False)
    for k, v in case.model.state_dict().items():
        assert torch.equal(v, before[k])


def test_precomputed_eigenpair_gives_the_same_result():
    case = make_case("mlp_nobias")
    obj = Objective(case.model, case.loss_fn, case.data)
    first = epsilon_sharpness(case.model, case.loss_fn, case.data, 0.1, objective=obj, steps=3, progress=False)
    again = epsilon_sharpness(case.model, case.loss_fn, case.data, 0.1, objective=obj, steps=3, progress=False,
                              eigen=first.lambda_max)
    assert again.measured == first.measured and again.second_order == first.second_order
    assert again.lambda_max is first.lambda_max


def test_bad_arguments_are_named(monkeypatch):
    case = make_case("mlp_bias")
    args = (case.model, case.loss_fn, case.data)
    with pytest.raises(ValueError, match="epsilon must be a positive radius"):
        epsilon_sharpness(*args, 0.0, progress=False)
    with pytest.raises(ValueError, match="steps must be a non-negative integer"):
        epsilon_sharpness(*args, 0.1, steps=-1, progress=False)
    with pytest.raises(ValueError, match="unknown sharpness metric 'fisher'"):
        epsilon_sharpness(*args, 0.1, metric="fisher", progress=False)
    eigen = epsilon_sharpness(*args, 0.1, metric="euclidean", steps=0, progress=False).lambda_max
    with pytest.raises(ValueError, match="eigen was computed for metric 'euclidean', not 'node'"):
        epsilon_sharpness(*args, 0.1, metric="node", eigen=eigen, progress=False)
    # a measure without a ball geometry is named, with the measures that have one
    for name in ("minnorm", "fixed", "gspace"):
        assert not MEASURES[name].has_ball
        with pytest.raises(ValueError, match=f"the '{name}' measure has no metric ball .* use 'euclidean', 'layer'"):
            epsilon_sharpness(*args, 0.1, metric=name, progress=False)
    assert [name for name, m in MEASURES.items() if m.has_ball] == ["euclidean", "layer", "node"]


def test_structure_is_analyzed_once_per_objective():
    case = make_case("cnn")
    objective = Objective(case.model, case.loss_fn, case.data)
    twin = objective.with_params(objective.params)
    assert twin.structure is objective.structure  # copies at other points share the analysis
    a = epsilon_sharpness(None, None, None, 0.1, metric="node", steps=2, objective=objective, progress=False)
    b = epsilon_sharpness(case.model, case.loss_fn, case.data, 0.1, metric="node", steps=2, progress=False)
    assert a.measured == b.measured
