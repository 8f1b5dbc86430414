"""Smoke tests of the runnable examples in their ``--quick`` form (in-process, or as a script in a subprocess)."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str):
    """Import ``examples/<name>.py`` as a module (the folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_reproduce_flatness_tables_quick(tmp_path, capsys):
    example = load_example("reproduce_flatness_tables")
    out = tmp_path / "tables.json"
    payload = example.main(["--quick", "--no-progress", "--json", str(out)])

    printed = capsys.readouterr().out
    assert "relative difference" in printed and "PASS" in printed and "FAIL" not in printed
    assert json.loads(out.read_text())["checks"] == json.loads(json.dumps(payload["checks"]))

    assert [m["name"] for m in payload["models"]] == ["F1", "C1"]
    for model in payload["models"]:
        rescaled = model["points"][1:]
        assert [p["kind"] for p in rescaled].count("layer") == 2 and any(p["kind"] == "node" for p in rescaled)
        for point in rescaled:
            diff = point["relative_difference"]
            # Invariant measures agree to rounding in float64; the Euclidean one moves by far more.
            assert diff["node f64"] < 1e-8
            if point["kind"] == "layer":
                assert diff["layer f64"] < 1e-8
            else:  # the layer-wise measure is not invariant under node-wise rescaling
                assert diff["layer f64"] > 1e-2
            assert diff["euclidean f64"] > 1e-2
    assert all(check["passed"] for check in payload["checks"])


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
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "best validation loss over 2 epochs, mean over 1 seeds" in done.stdout
    assert (out / "gspace_training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "gspace_training.pdf").read_bytes()[:5] == b"%PDF-"

    record = json.loads((out / "gspace_training.json").read_text())
    settings = record["settings"]
    assert settings["quick"] and (settings["epochs"], settings["seeds"]) == (2, 1)
    assert settings["learning_rates"] == [0.1, 0.01]
    labels = ["SGD", "G-SGD", "Adam", "G-Adam"]
    summary = record["best_val_loss_mean"]
    assert list(summary) == labels and list(record["runs"]) == labels
    chance = math.log(10)  # cross-entropy of uniform predictions over the 10 digits
    for label in labels:
        assert list(record["runs"][label]) == ["0.1", "0.01"]
        for lr, value in zip(["0.1", "0.01"], summary[label]):
            (run,) = record["runs"][label][lr]  # one seed
            assert run["diverged"] is None and len(run["val_loss"]) == 2
            assert all(math.isfinite(v) and 0 < v < chance + 1e-3 for v in run["val_loss"])
            assert value == min(run["val_loss"])  # the score is the best epoch
        assert summary[label][1] < 0.6 * chance  # lr 1e-2 learns something in two epochs, every optimizer

    # Same start, same batches: training in G-space is a different trajectory, not a relabelled SGD/Adam.
    for plain, gspace in (("SGD", "G-SGD"), ("Adam", "G-Adam")):
        gaps = [abs(a - b) / b for a, b in zip(summary[plain], summary[gspace])]
        assert max(gaps) > 1e-3, (plain, summary[plain], gspace, summary[gspace])
