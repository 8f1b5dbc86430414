"""Smoke tests of the runnable examples: each runs in-process in its ``--quick`` form."""

import importlib.util
import json
import sys
from pathlib import Path

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
