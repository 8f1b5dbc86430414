"""Results say what they could not measure: the rescaling group a result used, invariance claimed only under
rescalings the network has, parameters left out at degenerate points, and measures skipped with their reason."""

import json

import pytest
import torch
from cases import make_case, mlp
from torch import nn

from landscape import random_directions
from manifolds import DegeneratePointError, UnsupportedModelError, analyze
from sharpness import MEASURES, Layer, Objective, Rescalings, Solver, verify_invariance
from sharpness.measures._verify import InvarianceReport

SOLVER = Solver(tol=1e-10)


def _objective(model, n=9, inputs=5, outputs=3):
    g = torch.Generator().manual_seed(3)
    X = torch.randn(n, inputs, generator=g)
    y = torch.randint(0, outputs, (n,), generator=g)
    return Objective(model.eval(), nn.CrossEntropyLoss(), (X, y))


def _zeroed(model, *names):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not names or name in names:
                p.zero_()
    return model


def test_invariant_results_record_the_group_they_used():
    case = make_case("mlp_bias")
    structure = analyze(case.model, case.X[:1])
    obj = Objective(case.model, case.loss_fn, case.data)
    for name in ("node", "layer", "minnorm"):
        res = MEASURES[name].sharpness(obj, 1, SOLVER, progress=False)
        group = res.to_dict()["group"]
        assert group["dim"] == structure.group.dim == 10 and group["layer_dim"] == structure.layer_group.dim == 2
        assert any("network's input" in pin and "5 channel(s)" in pin for pin in group["pinned"]), group["pinned"]
        assert res.invariant_under == MEASURES[name].invariant_under and "invariance_note" not in res.info
        assert json.loads(json.dumps(res.to_dict()))["invariant_under"] == list(MEASURES[name].invariant_under)
    euclidean = MEASURES["euclidean"].sharpness(obj, 1, SOLVER, progress=False)
    assert euclidean.invariant_under == () and "group" not in euclidean.info


def test_a_network_without_symmetry_makes_no_invariance_claim():
    """GELU pins every hidden unit: the node measure is invariant under nothing there, and says why."""
    torch.manual_seed(0)
    obj = _objective(mlp([5, 4, 3], activation=nn.GELU))
    res = MEASURES["node"].sharpness(obj, 1, SOLVER, progress=False)
    assert res.invariant_under == () and res.to_dict()["invariant_under"] == []
    assert res.info["invariance_note"].startswith("invariant under nothing here: ")
    assert "dimension 0" in res.info["invariance_note"]
    assert res.info["group"]["dim"] == 0 and res.info["group"]["layer_dim"] == 0
    assert any(pin.startswith("GELU is not positively homogeneous") for pin in res.info["group"]["pinned"])
    assert MEASURES["node"].to_dict()["invariant_under"] == ["node", "layer"]  # the general claim stays


def test_a_network_without_symmetry_has_nothing_to_verify():
    """Rescaling by the identity is a check that cannot fail: the report says there is nothing to verify."""
    torch.manual_seed(0)
    model = mlp([5, 4, 3], activation=nn.GELU).eval()
    data = (torch.randn(7, 5), torch.randn(7, 3))
    rep = verify_invariance(model, nn.MSELoss(), data, rescalings=Rescalings(trials=1), progress=False)
    assert rep.outcome == "nothing to verify" and rep.nothing_to_verify and not rep.passed
    assert rep.kinds == () and rep.checked == () and rep.metrics == ()
    assert set(rep.skipped_kinds) == {"node", "layer"} and "dimension 0" in rep.skipped_kinds["node"]
    assert rep.group["dim"] == 0
    table = rep.table()
    assert "nothing to verify" in table and "passed" not in table and "node-wise rescalings: skipped:" in table
    again = InvarianceReport.from_dict(json.loads(json.dumps(rep.to_dict())))
    assert again.outcome == "nothing to verify" and again.skipped_kinds == rep.skipped_kinds
    assert rep.to_dict()["outcome"] == "nothing to verify" and rep.to_dict()["passed"] is False


def test_a_zero_hidden_layer_is_counted_as_dropped():
    torch.manual_seed(0)
    obj = _objective(_zeroed(mlp([5, 4, 3]), "0.weight", "0.bias"))
    node = MEASURES["node"].sharpness(obj, 1, SOLVER, progress=False)
    assert (node.info["n_params"], node.info["n_measured"], node.info["n_dropped"]) == (39, 15, 24)
    assert node.info["dropped"].startswith("24 of 39 parameters left out (0.weight, 0.bias): they are exactly zero")
    layer = Layer(zero_blocks="exclude").sharpness(obj, 1, SOLVER, progress=False)
    assert (layer.info["n_measured"], layer.info["n_dropped"]) == (15, 24) and "zero norm" in layer.info["dropped"]
    euclidean = MEASURES["euclidean"].sharpness(obj, 1, SOLVER, progress=False)
    assert (euclidean.info["n_measured"], euclidean.info["n_dropped"]) == (39, 0) and "dropped" not in euclidean.info
    with pytest.raises(DegeneratePointError, match=r"tensors 0\.weight, 0\.bias have zero norm") as err:
        MEASURES["layer"].sharpness(obj, 1, SOLVER, progress=False)
    assert err.value.short == "zero-norm tensor"


def test_an_all_zero_point_keeps_what_exists_and_says_what_does_not():
    torch.manual_seed(0)
    model = _zeroed(mlp([5, 4, 3]))
    obj = _objective(model)
    assert MEASURES["euclidean"].sharpness(obj, 1, SOLVER, progress=False).value > 0
    with pytest.raises(DegeneratePointError, match="every parameter is exactly zero") as err:
        MEASURES["node"].sharpness(obj, 1, SOLVER, progress=False)
    assert isinstance(err.value, UnsupportedModelError) and err.value.short == "all parameters dropped"
    X, y = torch.randn(9, 5), torch.randint(0, 3, (9,))
    rep = verify_invariance(model, nn.CrossEntropyLoss(), (X, y), rescalings=Rescalings(trials=1), progress=False)
    assert rep.metrics == ("euclidean",) and rep.original["euclidean"][0] > 0
    assert set(rep.skipped) == {"layer", "node", "fixed", "minnorm", "gspace", "symmetry"}
    assert rep.skip_reasons["node"] == "all parameters dropped" and rep.skip_reasons["minnorm"] == "dead unit"
    assert rep.outcome == "nothing to verify"


def test_one_pruned_unit_skips_what_does_not_apply_and_verifies_the_rest():
    torch.manual_seed(0)
    model = mlp([5, 4, 3]).eval()
    with torch.no_grad():
        model[0].weight[1] = 0.0  # hidden unit 1 has all-zero incoming weights
    X, y = torch.randn(9, 5), torch.randint(0, 3, (9,))
    rep = verify_invariance(model, nn.CrossEntropyLoss(), (X, y), rescalings=Rescalings(trials=1), progress=False)
    assert rep.outcome == "passed" and {"node", "layer", "fixed"} <= set(rep.metrics)
    assert rep.skip_reasons["minnorm"] == "dead unit" and "all incoming weights zero" in rep.skipped["minnorm"]
    table = rep.table()
    assert "skipped: dead unit" in table and "minnorm: skipped: the channel(s)" in table
    with pytest.raises(DegeneratePointError, match="all incoming weights zero"):  # asked for by name: must apply
        verify_invariance(model, nn.CrossEntropyLoss(), (X, y), ["minnorm"], rescalings=Rescalings(trials=1),
                          progress=False)  # fmt: skip


def test_a_plane_around_an_all_zero_point_is_refused():
    params = {"0.weight": torch.zeros(4, 5), "0.bias": torch.zeros(4)}
    for norm in ("filter", "layer", "element"):
        with pytest.raises(ValueError, match="vanishes under .* normalization"):
            random_directions(params, 2, norm=norm)
    assert random_directions(params, 2, norm="none").vectors.abs().sum() > 0
