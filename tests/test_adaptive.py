"""Adaptive sharpness (sharpness.measures._adaptive): invariance under the rescaling group, the second-order
limit at a critical point, the ball constraints, the per-batch variant and argument checks."""

import math

import pytest
import torch
from test_group_zoo import build
from torch import nn

from manifolds import analyze
from sharpness import Ascent, Objective, adaptive_sharpness, dense_hessian

NO_EIGEN = Ascent(steps=6, restarts=1, eigen_start=False, samples=8)


@pytest.mark.parametrize("name", ["resnet", "residual_mlp"])
@pytest.mark.parametrize("kind", ["l2", "linf", "average"])
def test_invariant_under_the_rescaling_group(name, kind):
    model, x, y, *_ = build(name)
    loss = nn.CrossEntropyLoss()
    obj = Objective(model, loss, (x, y))
    group = analyze(model, example_input=x).group
    twin = obj.with_params(group.act(obj.params, group.random_log_scales(1.0, torch.Generator().manual_seed(5))))
    moved = float((obj.layout.flatten(twin.params) - obj.layout.flatten(obj.params)).abs().max())
    assert moved > 0.1
    a = adaptive_sharpness(None, None, None, 0.05, kind, ascent=NO_EIGEN, objective=obj, progress=False)
    b = adaptive_sharpness(None, None, None, 0.05, kind, ascent=NO_EIGEN, objective=twin, progress=False)
    assert a.value > 0
    assert b.value == pytest.approx(a.value, rel=1e-8)
    for h, g in zip(a.history, b.history, strict=True):
        assert g["increase"] == pytest.approx(h["increase"], rel=1e-7, abs=1e-12)


def test_l2_worst_case_is_half_rho_squared_times_the_node_measure_at_a_critical_point(critical):
    model, loss, x, y, obj = critical
    w = obj.layout.flatten(obj.params)
    lam = float(torch.linalg.eigvalsh(w.abs()[:, None] * dense_hessian(obj) * w.abs()[None, :])[-1])
    assert lam > 0
    for rho in (1e-2, 1e-3):
        res = adaptive_sharpness(model, loss, (x, y), rho, "l2", ascent=Ascent(steps=10, restarts=0), progress=False)
        assert res.value == pytest.approx(rho**2 / 2 * lam, rel=5 * rho)
        assert {h["start"] for h in res.history} == {"centre", "eigen+", "eigen-"}


def test_average_case_at_a_critical_point_is_half_rho_squared_times_the_trace(critical):
    model, loss, x, y, obj = critical
    w = obj.layout.flatten(obj.params)
    trace = float(torch.trace(w.abs()[:, None] * dense_hessian(obj) * w.abs()[None, :]))
    rho = 1e-3
    res = adaptive_sharpness(model, loss, (x, y), rho, "average", ascent=Ascent(samples=400), progress=False)
    # E[z^T A z] / 2 = rho^2 tr(A) / 2; Monte Carlo error about sqrt(2/400) of it for a few dominant directions
    assert res.value == pytest.approx(rho**2 / 2 * trace, rel=0.3)
    assert res.standard_error < 0.2 * res.value


@pytest.mark.parametrize("kind", ["l2", "linf"])
def test_the_best_point_lies_in_the_scaled_ball(kind):
    model, x, y, *_ = build("vgg_bn")
    rho = 0.1
    res = adaptive_sharpness(model, nn.CrossEntropyLoss(), (x, y), rho, kind, ascent=Ascent(steps=5, restarts=1),
                             progress=False)  # fmt: skip
    obj = Objective(model, nn.CrossEntropyLoss(), (x, y))
    w = obj.layout.flatten(obj.params)
    z = res.perturbation / w.abs()
    size = float(z.abs().max()) if kind == "linf" else float(z.norm())
    assert size <= rho * (1 + 1e-12)
    assert size > 0.5 * rho
    assert float(obj.value(w + res.perturbation)) - float(obj.value()) == pytest.approx(res.value, rel=1e-10)
    assert max(h["increase"] for h in res.history) == pytest.approx(res.value, rel=1e-12)
    assert res.to_dict()["kind"] == kind and "perturbation" in res.to_dict(with_vectors=True)


def test_per_batch_variant_averages_each_batch_on_its_own():
    model, x, y, *_ = build("residual_mlp")
    loss = nn.CrossEntropyLoss()
    res = adaptive_sharpness(model, loss, (x, y), 0.05, "l2", ascent=NO_EIGEN, batch_size=4, progress=False)
    assert len(res.batch_values) == 3  # 10 samples in batches of 4, 4 and 2
    alone = [
        adaptive_sharpness(model, loss, (x[i : i + 4], y[i : i + 4]), 0.05, "l2", ascent=NO_EIGEN, progress=False).value
        for i in (0, 4, 8)
    ]
    for got, want in zip(res.batch_values, alone, strict=True):
        assert got == pytest.approx(want, rel=1e-12)
    assert res.value == pytest.approx(sum(alone) / 3, rel=1e-12)
    assert res.perturbation is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rho": 0.0}, "rho must be a positive radius"),
        ({"rho": math.inf}, "rho must be a positive radius"),
        ({"kind": "l1"}, "unknown adaptive-sharpness kind 'l1'"),
        ({"batch_size": 0}, "batch_size must be a positive integer"),
    ],
)
def test_bad_arguments(kwargs, message):
    model, x, y, *_ = build("residual_mlp")
    args = {"rho": 0.1, "kind": "l2", **kwargs}
    with pytest.raises(ValueError, match=message):
        adaptive_sharpness(model, nn.CrossEntropyLoss(), (x, y), args["rho"], args["kind"],
                           batch_size=kwargs.get("batch_size"), progress=False)  # fmt: skip


@pytest.mark.parametrize("bad", [{"steps": -1}, {"samples": 0}, {"step_size": 0.0}, {"restarts": 1.5}])
def test_ascent_settings_are_checked(bad):
    with pytest.raises(ValueError):
        Ascent(**bad)
