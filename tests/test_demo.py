"""The built-in demo end to end, on a loose loss threshold so it runs in seconds, and its loss-surface
planes on a small network under a generic (non-dyadic) node-wise rescaling."""

import json

import numpy as np
import pytest
import torch
from cases import make_case
from safetensors.torch import load_file
from torch import nn

import manifolds
from landscape._demo import digits_data, run_demo
from landscape._demo_surfaces import SURFACE_METRICS, plane_directions, surface_panels
from sharpness import MEASURES, Objective, Solver, measure_sharpness
from sharpness._specs import mlp

ROWS = ("small_batch", "full_batch", "rescaled")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    summary = run_demo(str(out), seed=0, threshold=0.3, progress=False, grid_steps=9)
    return out, summary


def test_demo_writes_report_checkpoints_and_figures(demo):
    tmp_path, summary = demo
    names = ("report.md", "report.json", "sharpness.png", "surfaces.png", "surfaces.npz")
    for name in (*names, "small_batch.safetensors", "full_batch.safetensors"):
        assert (tmp_path / name).stat().st_size > 0, name
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["invariance"]["passed"] is True
    for key in ("small_batch", "full_batch"):
        run = report["minima"][key]["training"]
        assert run["loss"] <= 0.3  # both stopped at the same threshold
        assert set(report["minima"][key]["measures"]) == set(MEASURES)
        for metric in SURFACE_METRICS:  # one k=2 solve serves the table and the figure
            measure = report["minima"][key]["measures"][metric]
            assert len(measure["eigenvalues"]) == 2 and measure["value"] == measure["eigenvalues"][0]
    gamed = summary["gamed_euclidean"]
    assert gamed["reversed"] and gamed["euclidean"] > gamed["target"]
    md = (tmp_path / "report.md").read_text()
    assert "Gaming the Euclidean measure" in md and "invariant" in md
    assert "![loss surfaces](surfaces.png)" in md
    assert not list(tmp_path.glob(".tmp*")) and not list(tmp_path.glob("*.tmp*"))


def test_demo_surfaces_npz_matches_report(demo):
    tmp_path, summary = demo
    grids = np.load(tmp_path / "surfaces.npz")
    surfaces = json.loads((tmp_path / "report.json").read_text())["surfaces"]
    assert surfaces["rescaled_twin_of"] == summary["gamed_euclidean"]["rescaled"]
    for metric in SURFACE_METRICS:
        axis = grids[f"axis_{metric}"]
        assert axis.shape == (9,) and axis[4] == 0.0
        assert axis[-1] == pytest.approx(surfaces["half_width"][metric]) and axis[0] == -axis[-1]
        for row in ROWS:
            loss = grids[f"loss_{row}_{metric}"]
            panel = surfaces["panels"][row][metric]
            assert loss.shape == (9, 9) and np.all(np.isfinite(loss))
            assert panel["max_loss"] == pytest.approx(loss.max(), rel=1e-12)
            assert panel["center_loss"] == pytest.approx(loss[4, 4], rel=1e-12)
            assert list(grids[f"eigenvalues_{row}_{metric}"]) == [panel["lambda_1"], panel["lambda_2"]]
            assert panel["lambda_1"] >= panel["lambda_2"]
    # the ranges follow the stated rule: RANGE_SCALE / sqrt(largest lambda_1 of the column)
    ratio = [
        surfaces["half_width"][m] * np.sqrt(max(surfaces["panels"][r][m]["lambda_1"] for r in ROWS))
        for m in SURFACE_METRICS
    ]
    assert ratio[0] == pytest.approx(ratio[1])


def test_demo_surface_centres_are_the_training_losses(demo):
    tmp_path, summary = demo
    grids = np.load(tmp_path / "surfaces.npz")
    X, y = digits_data(torch.float64)
    flat = summary["gamed_euclidean"]["rescaled"]
    for row in ROWS:
        key = flat if row == "rescaled" else row
        model = mlp([64, 128, 128, 10]).double().eval()
        model.load_state_dict({k: v.double() for k, v in load_file(str(tmp_path / f"{key}.safetensors")).items()})
        loss64 = float(Objective(model, nn.CrossEntropyLoss(), (X, y), dtype=torch.float64).value())
        for metric in SURFACE_METRICS:
            centre = grids[f"loss_{row}_{metric}"][4, 4]
            assert centre == pytest.approx(loss64, rel=1e-12), (row, metric)
            # the float32 loss at which training stopped
            assert centre == pytest.approx(summary["minima"][key]["training"]["loss"], rel=1e-5), (row, metric)


def test_demo_invariant_panels_of_the_rescaled_twin_agree_euclidean_ones_do_not(demo):
    tmp_path, summary = demo
    grids = np.load(tmp_path / "surfaces.npz")
    flat = summary["gamed_euclidean"]["rescaled"]
    twin, original = grids["loss_rescaled_node"], grids[f"loss_{flat}_node"]
    np.testing.assert_allclose(twin, original, rtol=1e-8, atol=0)
    difference = (
        np.abs(grids["loss_rescaled_euclidean"] - grids[f"loss_{flat}_euclidean"]) / grids[f"loss_{flat}_euclidean"]
    )
    assert difference.max() > 0.1
    lam_twin, lam = grids["eigenvalues_rescaled_euclidean"], grids[f"eigenvalues_{flat}_euclidean"]
    assert lam_twin[0] > lam[0] * 1.05  # the gamed twin is Euclidean-sharper
    np.testing.assert_allclose(grids["eigenvalues_rescaled_node"], grids[f"eigenvalues_{flat}_node"], rtol=1e-8)


def _flat_factors(model: nn.Module, factors: list[torch.Tensor]) -> torch.Tensor:
    """The diagonal ``D`` of the node rescaling ``w -> D w`` as a flat vector (rescale an all-ones point)."""
    structure = manifolds.analyze(model)
    ones = {k: torch.ones_like(v) for k, v in model.state_dict().items()}
    return manifolds.ParamLayout.from_tensors(ones).flatten(manifolds.rescale_parameters(ones, structure, factors))


@pytest.mark.parametrize("name", ["mlp_bias", "cnn"])
def test_node_planes_map_onto_the_rescaled_twin_under_a_generic_node_rescaling(name):
    case = make_case(name)
    structure = manifolds.analyze(case.model)
    g = torch.Generator().manual_seed(3)
    factors = [torch.exp(torch.randn(h, generator=g, dtype=torch.float64)) for h in structure.hidden_units]
    twin = manifolds.rescale_model(case.model, factors)
    D = _flat_factors(case.model, factors)
    networks, directions = {}, {}
    for row, model in (("original", case.model), ("twin", twin)):
        results = {
            m: measure_sharpness(model, case.loss_fn, case.data, m, k=2, solver=Solver(tol=1e-12), progress=False)
            for m in SURFACE_METRICS
        }
        networks[row] = (model, results)
        objective = Objective(model, case.loss_fn, case.data, dtype=torch.float64)
        directions[row] = {m: plane_directions(results[m], objective, m) for m in SURFACE_METRICS}
        quotient = manifolds.NodeScaleQuotient(objective.params, structure, objective.layout)
        for v in directions[row]["node"]:
            assert float(quotient.norm(v)) == pytest.approx(1.0, rel=1e-12)
            assert float(quotient.norm(quotient.proj_horizontal(v) - v)) < 1e-10
        assert torch.allclose(directions[row]["euclidean"].norm(dim=1), torch.ones(2, dtype=torch.float64))
    # the twin's invariant directions are the original's pushed through the rescaling, signs included
    torch.testing.assert_close(directions["twin"]["node"], D * directions["original"]["node"], rtol=0, atol=1e-8)
    assert not torch.allclose(directions["twin"]["euclidean"], D * directions["original"]["euclidean"], atol=1e-3)
    panels, _ = surface_panels(networks, case.data, steps=7, progress=False)
    np.testing.assert_allclose(panels["twin"]["node"].loss, panels["original"]["node"].loss, rtol=1e-8, atol=0)
    euclid = np.abs(panels["twin"]["euclidean"].loss - panels["original"]["euclidean"].loss)
    assert euclid.max() > 1e-2 * panels["original"]["euclidean"].loss.max()
    centre = float(Objective(case.model, case.loss_fn, case.data).value())
    for row in networks:
        for metric in SURFACE_METRICS:
            assert panels[row][metric].loss[3, 3] == pytest.approx(centre, rel=1e-12)


def _exit_code(main, argv) -> int:
    """``main(argv)``'s exit code, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def test_demo_command_line_refuses_bad_input_before_training(tmp_path, capsys):
    from landscape._cli import main

    assert _exit_code(main, ["demo", "--help"]) == 0 and "report.md" in capsys.readouterr().out
    a_file = tmp_path / "file.txt"
    a_file.write_text("")
    for argv, message in ((["demo", "--out", str(a_file)], "is not a folder"),
                          (["demo", "--out", str(tmp_path / "o"), "--threshold", "0"], "--threshold")):  # fmt: skip
        code = _exit_code(main, argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "o").exists()


def test_an_interrupted_demo_leaves_no_partial_output(tmp_path, monkeypatch, capsys):
    """Ctrl-C after the first checkpoint is written: exit 130, "interrupted", and nothing left behind."""
    import types

    import landscape._demo as demo
    from landscape._cli import main as cli_main

    calls = []

    def train(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return types.SimpleNamespace()

    monkeypatch.setattr(demo, "train_to_loss", train)
    out = tmp_path / "demo-out"
    code = cli_main(["demo", "--out", str(out), "--quiet"])
    assert code == 130 and capsys.readouterr().err.strip() == "interrupted"
    assert len(calls) == 2  # the first checkpoint was written to the staging folder before the interrupt
    assert not out.exists() and list(tmp_path.iterdir()) == []
