"""Smoke tests of the runnable examples in their ``--quick`` form (in-process, or as a script in a subprocess)."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from guards import HANG_GUARD_S

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str):
    """Import ``examples/<name>.py`` as a module (the folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def flatness_quick(tmp_path_factory):
    """One ``--quick`` run of the flatness-tables example: the module, its payload, the JSON it wrote and its output."""
    example = load_example("reproduce_flatness_tables")
    out = tmp_path_factory.mktemp("flatness") / "tables.json"
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        payload = example.main(["--quick", "--no-progress", "--json", str(out)])
    return example, payload, json.loads(out.read_text()), printed.getvalue()


def test_reproduce_flatness_tables_quick(flatness_quick):
    example, payload, written, printed = flatness_quick
    assert "relative difference" in printed and "PASS" in printed and "FAIL" not in printed
    assert written["checks"] == json.loads(json.dumps(payload["checks"])) and written["passed"] is True
    assert [m["name"] for m in payload["models"]] == ["F1", "C1"]
    for model in payload["models"]:
        assert model["training"]["grad_norm"] < 1e-12  # an exact critical point of the measured loss
        assert model["training"]["label_grad_norm"] > 1e-4  # ... unlike the training loss's trained point
        rescaled = model["points"][1:]
        assert [p["kind"] for p in rescaled].count("layer") == 2 and any(p["kind"] == "node" for p in rescaled)
        for point in model["points"]:
            if point["kind"] != "node":  # at a critical point our measure is the paper's G^-1 H
                assert point["gap"] < 1e-13
        for point in rescaled:
            diff = point["relative_difference"]
            # Invariant measures agree to rounding in float64; the Euclidean one moves by far more.
            assert diff["node f64"] < 1e-13
            if point["kind"] == "layer":
                assert diff["layer f64"] < 1e-13 and diff["gh f64"] < 1e-13
                assert diff["layer f32"] <= example.FLOAT32_FACTOR * model["float32_noise_floor"]
            else:  # the layer-wise measure is not invariant under node-wise rescaling
                assert diff["layer f64"] > 1e-2
            assert diff["euclidean f64"] > 1e-2
    kinds = {c["check"].split(": ", 1)[-1].split(",")[0] for c in payload["checks"]}
    assert {"layer f64 relative difference", "layer f32 relative difference", "node f64 relative difference",
            "gap |ours - G^-1 H| / ours (f64)"} <= kinds  # fmt: skip
    assert all(check["passed"] for check in payload["checks"])


def _failed(example, model, grad_tol=1e-8):
    return [c["check"] for c in example.checks(example.derive(model), grad_tol) if not c["passed"]]


def _scaled(model, point, column, factor):
    """A copy of ``model`` with one measured eigenvalue multiplied by ``factor``."""
    import copy

    model = copy.deepcopy(model)
    model["points"][point]["measures"][column]["value"] *= factor
    return model


@pytest.mark.parametrize("name", ["F1", "C1"])
def test_flatness_checks_fail_when_a_measurement_is_off_by_the_claimed_tolerance(flatness_quick, name):
    """Each check fails when its measured number moves by twice its tolerance, and holds at half of it."""
    example, payload, _, _ = flatness_quick
    (model,) = [m for m in payload["models"] if m["name"] == name]
    assert _failed(example, model) == []
    layer_point = 1  # the first layer-wise rescaling
    # float64: relative difference of our layer-wise measure, tolerance FLOAT64_TOL
    for factor, fails in ((1 + 2 * example.FLOAT64_TOL, True), (1 + example.FLOAT64_TOL / 4, False)):
        failed = _failed(example, _scaled(model, layer_point, "layer f64", factor))
        assert any("layer f64 relative difference" in c for c in failed) is fails
    # float32: within FLOAT32_FACTOR times the noise floor
    bound = example.FLOAT32_FACTOR * model["float32_noise_floor"]
    base = model["points"][0]["measures"]["layer f32"]["value"]
    measured = model["points"][layer_point]["measures"]["layer f32"]["value"]
    for target, fails in ((2 * bound, True), (bound / 2, False)):
        factor = base * (1 + target) / measured
        failed = _failed(example, _scaled(model, layer_point, "layer f32", factor))
        assert any("layer f32 relative difference" in c for c in failed) is fails
    # the gap between our measure and G^-1 H at the critical point, tolerance GAP_TOL
    for factor, fails in ((1 + 2 * example.GAP_TOL, True), (1 + example.GAP_TOL / 4, False)):
        failed = _failed(example, _scaled(model, 0, "layer f64", factor))
        assert any("W: gap" in c for c in failed) is fails
    # the critical point itself
    import copy

    moved = copy.deepcopy(model)
    moved["training"]["grad_norm"] = 2e-8
    assert _failed(example, moved) == [f"gradient norm at W below {1e-8:g}"]


def test_gspace_training_help_lists_quick_and_out(capsys):
    example = load_example("gspace_training")
    with pytest.raises(SystemExit) as exit_info:
        example.main(["--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    assert "--quick" in usage and "--out" in usage and "--epochs" in usage


def test_gspace_training_quick_runs_as_a_script(tmp_path):
    """The script itself (``__main__``, argparse, training, table, figure, JSON) in its quick form."""
    root = EXAMPLES.parent
    env = os.environ | {
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    out = tmp_path / "gs"
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "gspace_training.py"), "--quick", "--no-progress", "--out", str(out)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "best validation loss over 2 epochs, mean over 2 seeds" in done.stdout
    assert (out / "gspace_training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "gspace_training.pdf").read_bytes()[:5] == b"%PDF-"

    record = json.loads((out / "gspace_training.json").read_text())
    settings = record["settings"]
    assert settings["quick"] and (settings["epochs"], settings["seeds"], settings["grid_epochs"]) == (2, 2, 2)
    assert settings["learning_rates"] == [0.1, 0.01] and settings["extended"] == {}
    labels = ["SGD", "G-SGD", "Adam", "G-Adam", "G-Adam (moments kept)"]
    results = record["results"]
    assert list(results) == labels and "quick" not in record  # only a full run records the quick values
    chance = math.log(10)  # cross-entropy of uniform predictions over the 10 digits
    for label in labels:
        assert list(results[label]) == ["0.1", "0.01"]
        for s in results[label].values():
            assert len(s["mean"]) == 3 and s["diverged"] == [None, None] and len(s["at_best"]) == 2
            assert all(math.isfinite(v) and v > 0 for v in s["mean"])
            assert s["best"] == min(s["mean"]) == s["mean"][s["best_epoch"]]  # the score is the best epoch
            assert s["best"] == pytest.approx(sum(s["at_best"]) / 2)
        if label != "SGD":  # SGD from PyTorch's initialization of this deep narrow network barely moves at first
            assert results[label]["0.01"]["best"] < 0.6 * chance

    # Training in G-space is a different trajectory, not a relabelled SGD/Adam; G-Adam as the thesis code builds
    # it (no moments) is not G-Adam with its moments kept.
    for a, b in (("SGD", "G-SGD"), ("Adam", "G-Adam"), ("G-Adam", "G-Adam (moments kept)")):
        gaps = [abs(results[a][lr]["best"] - results[b][lr]["best"]) / results[b][lr]["best"] for lr in ("0.1", "0.01")]
        assert max(gaps) > 1e-3, (a, b, gaps)
    assert [c["verdict"] for c in record["claims"]][-1] == "cannot be tested here" and len(record["claims"]) == 8
    assert record["passed"] and len(record["checks"]) == 4


def test_reproduction_table_is_generated_from_the_json_records(tmp_path):
    """docs/reproductions.md is exactly what the committed JSON records give, and a changed record changes it."""
    import shutil

    table = load_example("reproduction_table")
    assert table.main(["--check", "--page-only"]) == 0
    data = tmp_path / "data"
    shutil.copytree(table.DATA, data)
    record = json.loads((data / "flatness_tables.json").read_text())
    point = next(p for p in record["models"][0]["points"] if p["kind"] == "layer")
    point["relative_difference"]["layer f64"] = 9.87e-13
    (data / "flatness_tables.json").write_text(json.dumps(record))
    page = table.render(data)
    assert page != table.OUT.read_text() and "| 9.9e-13 |" in page
    assert table.main(["--check", "--page-only", "--data", str(data)]) == 1


def test_gauge_checks_fail_when_a_measurement_is_off_by_the_claimed_tolerance():
    """The gauge example's checks, on the committed paper-size record: all pass; each fails when its number
    moves past its tolerance and holds at half of it."""
    import copy

    example = load_example("min_norm_gauge")
    runs = json.loads((EXAMPLES.parent / "docs" / "reproductions" / "min_norm_gauge.json").read_text())["runs"]
    assert len(runs) == 6 and all(c["passed"] for c in example.checks(runs))
    names = {"largest_increase": "largest objective increase / start",
             "output_change": "largest relative output change"}
    for key, tol in (("largest_increase", example.INCREASE_TOL), ("output_change", example.OUTPUT_TOL)):
        for value, fails in ((2 * tol, True), (tol / 2, False)):
            moved = copy.deepcopy(runs)
            moved[3][key] = value
            failed = [c["check"] for c in example.checks(moved) if not c["passed"]]
            assert failed == ([f"200-2000-1000-500-250-10, p=1: {names[key]}"] if fails else [])
    moved = copy.deepcopy(runs)
    moved[0]["converged"] = False
    assert [c["check"] for c in example.checks(moved) if not c["passed"]] == [
        "200-2500-1250-10, p=2: reached the tolerance (1 = yes)"
    ]
