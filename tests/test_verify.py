"""Invariance verification and the metric-name entry point: which measures survive random rescalings."""

import json
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from cases import make_case, mlp
from torch import nn

from manifolds import UnsupportedModelError
from sharpness import (
    MEASURES,
    Euclidean,
    Layer,
    Node,
    Rescalings,
    Solver,
    euclidean_sharpness,
    invariant_sharpness,
    measure_sharpness,
    verify_invariance,
)
from sharpness.measures._verify import InvarianceReport, relative_difference

BASE_METRICS = ("euclidean", "layer", "node")


@pytest.fixture(scope="module", params=["mlp_bias", "cnn"])
def report(request):
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    case = make_case(request.param)
    try:
        yield verify_invariance(case.model, case.loss_fn, case.data, BASE_METRICS, rescalings=Rescalings(trials=2),
                                progress=False)  # fmt: skip
    finally:
        torch.set_default_dtype(old)


def test_node_metric_invariant_under_node_and_layer_rescaling(report):
    for kind in ("node", "layer"):
        assert report.max_relative_difference("node", kind) <= 1e-8
        assert report.verdict("node", kind) == "invariant"
        assert report.claims_invariance("node", kind)


def test_layer_metric_invariant_under_layer_rescaling_only(report):
    assert report.max_relative_difference("layer", "layer") <= 1e-8
    assert report.verdict("layer", "layer") == "invariant"
    # The flatness paper's measure is not invariant under the full (node-wise) symmetry group.
    assert report.max_relative_difference("layer", "node") > 1e-2
    assert not report.claims_invariance("layer", "node")
    assert report.verdict("layer", "node") == "changes"


def test_euclidean_sharpness_changes(report):
    for kind in ("node", "layer"):
        assert report.verdict("euclidean", kind) == "changes"
        assert report.max_relative_difference("euclidean", kind) > 1e-1
    assert report.max_relative_difference("euclidean", "node") > 1.0


def test_report_passes_and_copies_are_function_identical(report):
    assert report.passed
    assert report.metrics == BASE_METRICS and report.kinds == ("node", "layer")
    assert all(report.converged.values())
    for kind in report.kinds:
        assert len(report.output_differences[kind]) == 2
        assert max(report.output_differences[kind]) < 1e-12
        for m in report.metrics:
            assert len(report.rescaled[m][kind]) == 2 and len(report.rescaled[m][kind][0]) == 1
            expected = [relative_difference(report.original[m], v) for v in report.rescaled[m][kind]]
            assert list(report.relative_differences[m][kind]) == expected


def test_table_names_metrics_and_verdicts(report):
    table = report.table()
    for m in BASE_METRICS:
        assert m in table
    assert "invariant" in table and "changes" in table and "FAILED" not in table
    assert f"{report.original['node'][0]:.4g}" in table
    assert f"{report.max_relative_difference('euclidean', 'node'):.2e}" in table
    assert str(report) == table


def test_json_round_trip(report, tmp_path):
    path = tmp_path / "report.json"
    report.save_json(path)
    loaded = json.loads(path.read_text())
    assert loaded == json.loads(json.dumps(report.to_dict()))
    assert loaded["passed"] is True
    assert loaded["verdicts"]["layer"]["node"] == "changes"
    assert loaded["max_relative_differences"]["node"]["layer"] <= 1e-8
    assert InvarianceReport.from_dict(loaded) == report
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no temporary file left


@dataclass(frozen=True)
class _Boastful(Euclidean):
    """The Euclidean measure claiming invariances it does not have."""

    name = "boastful"
    invariant_under = ("node", "layer")


def test_wrong_claim_is_reported_as_failed():
    case = make_case("mlp_bias")
    rep = verify_invariance(case.model, case.loss_fn, case.data, [_Boastful()], rescalings=Rescalings(trials=1),
                            progress=False)  # fmt: skip
    assert rep.metrics == ("boastful",) and rep.claims == {"boastful": ("node", "layer")}
    assert rep.verdict("boastful", "node") == "FAILED" and rep.verdict("boastful", "layer") == "FAILED"
    assert not rep.passed
    assert str(rep) == rep.table()
    assert "FAILED: changed by more than rtol" in rep.table()


def test_verdict_draws_the_line_at_rtol():
    case = make_case("mlp_bias")
    small = Rescalings(kinds="layer", trials=1, scale=1e-4)
    rep = verify_invariance(case.model, case.loss_fn, case.data, [_Boastful()], rescalings=small, progress=False)
    change = rep.max_relative_difference("boastful", "layer")
    assert 1e-8 < change < 1e-2
    for rtol, verdict in ((change * 1.01, "invariant"), (change * 0.99, "FAILED")):
        again = verify_invariance(case.model, case.loss_fn, case.data, [_Boastful()], rescalings=small, rtol=rtol,
                                  progress=False)  # fmt: skip
        assert again.verdict("boastful", "layer") == verdict


def test_pinned_units_leave_nothing_to_rescale():
    """GELU pins every hidden unit: the group is trivial, so no copy is made and no claim is said to hold (see
    test_claims.py for the report's details)."""
    model = mlp([5, 4, 3], activation=nn.GELU).eval()
    data = (torch.randn(7, 5), torch.randn(7, 3))
    rep = verify_invariance(model, nn.MSELoss(), data, rescalings=Rescalings(trials=1), progress=False)
    assert not rep.passed and rep.outcome == "nothing to verify" and rep.kinds == ()


def test_an_untraceable_model_is_refused_saying_why():
    model = _HiddenGelu().double().eval()
    data = (torch.randn(7, 5), torch.randn(7, 3))
    with pytest.raises(UnsupportedModelError, match="rescaling group is unknown, because torch.fx cannot trace"):
        verify_invariance(model, nn.MSELoss(), data, ["euclidean"], rescalings=Rescalings(trials=1), progress=False)


class _HiddenGelu(nn.Module):
    """A GELU the structure analysis cannot see: fx fails on the branch, hooks miss functional calls."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x):
        if x.sum() > -1e30:  # data-dependent control flow: torch.fx cannot trace this
            x = F.gelu(self.a(x))
        return self.b(x)


def test_rescaled_copy_that_changes_the_function_raises(monkeypatch):
    """A wrong rule would show as changed outputs: verification checks every copy before measuring it."""
    from manifolds import RescalingGroup

    act = RescalingGroup.act

    def wrong(self, tensors, log_scales):
        out = act(self, tensors, log_scales)
        out["0.weight"] = 2 * out["0.weight"]
        return out

    monkeypatch.setattr(RescalingGroup, "act", wrong)
    case = make_case("mlp_bias")
    with pytest.raises(UnsupportedModelError, match="changes the model's outputs"):
        verify_invariance(case.model, case.loss_fn, case.data, ["euclidean"], rescalings=Rescalings(trials=1),
                          progress=False)  # fmt: skip


def test_float32_model_is_checked_in_float64():
    case = make_case("mlp_bias", dtype=torch.float32)
    rep = verify_invariance(case.model, case.loss_fn, case.data, ["node"], rescalings=Rescalings("node", 1),
                            progress=False)  # fmt: skip
    assert rep.dtype == "float64" and rep.kinds == ("node",)
    assert rep.max_relative_difference("node", "node") <= 1e-8
    assert next(case.model.parameters()).dtype == torch.float32  # the model is left alone


def test_model_is_not_modified():
    case = make_case("mlp_bias")
    before = {k: v.clone() for k, v in case.model.state_dict().items()}
    verify_invariance(case.model, case.loss_fn, case.data, ["layer"], rescalings=Rescalings(["layer"], 1),
                      progress=False)  # fmt: skip
    for k, v in case.model.state_dict().items():
        assert torch.equal(v, before[k])


@pytest.fixture
def registry():
    """The measure registry, restored afterwards with its entries in their order (the registry's order is
    the order in which measures are verified and offered)."""
    saved = dict(MEASURES)
    yield MEASURES
    MEASURES.clear()
    MEASURES.update(saved)


def _only_metrics(registry, keep):
    for name in list(registry):
        if name not in keep:
            del registry[name]


@dataclass(frozen=True)
class _NodeAgain(Node):
    """The node-wise measure under another name."""

    name = "node_again"


def test_metrics_registered_later_are_picked_up(registry):
    registry["node_again"] = _NodeAgain()
    _only_metrics(registry, ("euclidean", "node", "node_again"))
    case = make_case("mlp_nobias")
    direct = measure_sharpness(case.model, case.loss_fn, case.data, "node_again", solver=Solver(tol=1e-10),
                               progress=False)  # fmt: skip
    assert direct.info["metric"] == "node_again"
    rep = verify_invariance(case.model, case.loss_fn, case.data, rescalings=Rescalings(trials=1), progress=False)
    assert rep.metrics == ("euclidean", "node", "node_again")
    assert rep.original["node_again"] == rep.original["node"] == (direct.value,)
    assert rep.verdict("node_again", "node") == "invariant" and rep.passed


@dataclass(frozen=True)
class _Picky(Node):
    """A measure that applies to no model."""

    name = "picky"
    invariant_under = ("node",)

    def solve(self, *_args, **_kwargs):
        raise UnsupportedModelError("Cannot compute the picky measure for this model.")


def test_metric_that_does_not_apply_is_skipped_unless_asked_for(registry):
    registry["picky"] = _Picky()
    _only_metrics(registry, ("node", "picky"))
    case = make_case("mlp_bias")
    rep = verify_invariance(case.model, case.loss_fn, case.data, rescalings=Rescalings("layer", 1), progress=False)
    assert rep.metrics == ("node",)
    assert rep.skipped == {"picky": "Cannot compute the picky measure for this model."}
    assert rep.skip_reasons == {"picky": "not supported for this model"}
    assert "picky: skipped: Cannot compute the picky measure" in rep.table()
    with pytest.raises(UnsupportedModelError, match="picky"):
        verify_invariance(case.model, case.loss_fn, case.data, ["picky"], rescalings=Rescalings("layer", 1),
                          progress=False)  # fmt: skip


def test_measure_sharpness_dispatches_by_name_and_object():
    case = make_case("cnn")
    solver = Solver(tol=1e-10)
    eu = measure_sharpness(case.model, case.loss_fn, case.data, "euclidean", solver=solver, progress=False)
    assert eu.value == euclidean_sharpness(case.model, case.loss_fn, case.data, solver=solver, progress=False).value
    for metric in ("layer", "node"):
        res = measure_sharpness(case.model, case.loss_fn, case.data, metric, solver=solver, progress=False)
        ref = invariant_sharpness(case.model, case.loss_fn, case.data, metric, solver=solver, progress=False)
        by_object = measure_sharpness(case.model, case.loss_fn, case.data, MEASURES[metric], solver=solver,
                                      progress=False)  # fmt: skip
        assert res.info["metric"] == metric and res.value == ref.value == by_object.value


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"metrics": ["hessian"]}, "unknown sharpness metric 'hessian'"),
        ({"metrics": []}, "metrics is empty"),
        ({"metrics": ["node", Node()]}, "metrics names a measure twice"),
        ({"rtol": 0.0}, "rtol must be a positive number"),
        ({"rtol": float("nan")}, "rtol must be a positive number"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    case = make_case("mlp_bias")
    with pytest.raises(ValueError, match=message):
        verify_invariance(case.model, case.loss_fn, case.data, progress=False, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kinds": ["channel"]}, "kinds must be distinct rescaling kinds"),
        ({"kinds": []}, "kinds must be distinct rescaling kinds"),
        ({"kinds": ["node", "node"]}, "kinds must be distinct rescaling kinds"),
        ({"trials": 0}, "trials must be a positive integer"),
        ({"scale": -1.0}, "scale must be a non-negative"),
        ({"scale": float("inf")}, "scale must be a non-negative finite"),
    ],
)
def test_bad_rescalings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Rescalings(**kwargs)


def test_relative_difference_compares_on_the_scale_of_the_top_eigenvalue():
    assert relative_difference([2.0], [3.0]) == 0.5
    assert relative_difference([4.0, 0.0], [4.0, 2.0]) == 0.5
    assert relative_difference([0.0], [0.0]) == 0.0
    assert relative_difference([0.0], [1.0]) == float("inf")


def test_layer_metric_is_skipped_where_it_does_not_exist_unless_asked_for():
    case = make_case("mlp_bias")
    with torch.no_grad():
        case.model[2].bias.zero_()  # the layer-wise metric 1/||b||^2 does not exist at this point
    rep = verify_invariance(case.model, case.loss_fn, case.data, rescalings=Rescalings(trials=1), progress=False)
    assert "layer" not in rep.metrics and "2.bias" in rep.skipped["layer"] and rep.passed
    with pytest.raises(UnsupportedModelError, match=r"2\.bias"):
        verify_invariance(case.model, case.loss_fn, case.data, ["layer"], rescalings=Rescalings(trials=1),
                          progress=False)  # fmt: skip
    excluded = verify_invariance(case.model, case.loss_fn, case.data, [Layer(zero_blocks="exclude")],
                                 rescalings=Rescalings(trials=1), progress=False)  # fmt: skip
    assert excluded.metrics == ("layer",) and excluded.passed
