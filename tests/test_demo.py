"""The built-in demo end to end, on a loose loss threshold so it runs in seconds."""

import json

from sharpness._demo import run_demo
from sharpness._invariant import METRICS


def test_demo_writes_report_checkpoints_and_figure(tmp_path):
    summary = run_demo(str(tmp_path), seed=0, threshold=0.3, progress=False)
    for name in ("report.md", "report.json", "sharpness.png", "small_batch.safetensors", "full_batch.safetensors"):
        assert (tmp_path / name).stat().st_size > 0, name
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["invariance"]["passed"] is True
    for key in ("small_batch", "full_batch"):
        run = report["minima"][key]["training"]
        assert run["loss"] <= 0.3  # both stopped at the same threshold
        assert set(report["minima"][key]["measures"]) == set(METRICS)
    gamed = summary["gamed_euclidean"]
    assert gamed["reversed"] and gamed["euclidean"] > gamed["target"]
    md = (tmp_path / "report.md").read_text()
    assert "Gaming the Euclidean measure" in md and "invariant" in md
    assert not list(tmp_path.glob(".tmp*"))
