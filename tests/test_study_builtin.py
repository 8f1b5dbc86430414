"""The built-in studies end to end on the quick population: the rescaled copy leaves the invariant measures'
statistics unchanged and moves the Euclidean one, and the written summary equals scipy on the written table."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image
from scipy.stats import kendalltau

from sharpness.study import run_study
from sharpness.study._builtin import GRID, builtin_studies

# Two measures keep the test cheap: `node` stands for the invariant ones (the docs' full run shows the others).
MEASURES = ["euclidean", "node"]
# The solver stops at a relative residual of 1e-6 (the default `tol`), so the top eigenvalue of a rescaled
# network agrees with the original's to about that; the float64 twins compute the same function to rounding.
RTOL = 1e-5


@pytest.fixture(scope="module")
def studies(tmp_path_factory):
    """Both built-in studies of the quick population, with the options the command line gives them. Seed 1:
    with seed 0 the six Euclidean values happen to keep their Kendall tau (not their granulated tau) after the
    rescaling, and this test wants to see tau itself move."""
    out = tmp_path_factory.mktemp("builtin")
    return [run_study(manifest, folder, MEASURES, progress=False, **options)
            for manifest, folder, options in builtin_studies(out, quick=True, seed=1, progress=False)]  # fmt: skip


def test_rescaling_keeps_the_invariant_measures_and_moves_the_euclidean_one(studies):
    original, rescaled = studies
    a, b = original.table, rescaled.table
    assert list(a["id"]) == list(b["id"]) and b["rescaled"].sum() == 3
    for column in ("train_error", "test_error", "gap"):  # same functions, so the same misses
        np.testing.assert_array_equal(a[column], b[column])
    np.testing.assert_allclose(b["node"], a["node"], rtol=RTOL)
    moved = b["rescaled"] == 1
    assert (np.abs(np.log(b["euclidean"][moved] / a["euclidean"][moved])) > 0.1).all()
    np.testing.assert_allclose(b["euclidean"][~moved], a["euclidean"][~moved], rtol=RTOL)
    sa, sb = original.summary.set_index("measure"), rescaled.summary.set_index("measure")
    # the same rows grouped the same way (rescaled is no hyperparameter), so the same ranks give the same numbers
    assert list(sa.columns) == list(sb.columns)
    stats = ["tau", "psi", *(f"tau_{c}" for c in GRID)]
    np.testing.assert_array_equal(sb.loc["node", stats], sa.loc["node", stats])  # exactly (NaN where undefined)
    assert sb.loc["euclidean", "tau"] != sa.loc["euclidean", "tau"]


def test_rescaled_study_is_coloured_by_the_rescaled_column_not_grouped_by_it(studies):
    original, rescaled = studies
    assert original.hyper_columns == rescaled.hyper_columns == list(GRID)
    assert "rescaled" in rescaled.table.columns and "tau_rescaled" not in rescaled.summary.columns
    folder = rescaled.out_dir
    assert "`rescaled`" not in Path(folder, "report.md").read_text().split("\n")[2]  # the hyperparameters line
    with Image.open(f"{folder}/scatter.png") as image:
        assert image.text["Description"].endswith("coloured by rescaled")
    with Image.open(f"{original.out_dir}/scatter.png") as image:
        assert image.text["Description"].endswith("coloured by width")


def _scipy_tau(frame: pd.DataFrame, measure: str) -> float:
    usable = frame[[measure, "gap"]].dropna()
    if len(usable) < 2:
        return math.nan
    return float(kendalltau(usable[measure], usable["gap"]).statistic)


def test_written_summary_equals_scipy_on_the_written_table(studies):
    for result in studies:
        table = pd.read_csv(f"{result.out_dir}/table.csv")
        summary = pd.read_csv(f"{result.out_dir}/summary.csv").set_index("measure")
        hyper = result.hyper_columns
        checked = 0
        for measure in MEASURES:
            assert summary.loc[measure, "tau"] == pytest.approx(_scipy_tau(table, measure), rel=1e-12, abs=1e-15)
            per_column = []
            for column in hyper:
                others = [c for c in hyper if c != column]
                taus = [_scipy_tau(group, measure) for _, group in table.groupby(others, dropna=False)]
                defined = [t for t in taus if not math.isnan(t)]
                psi_column = float(np.mean(defined)) if defined else math.nan
                written = summary.loc[measure, f"tau_{column}"]
                if math.isnan(psi_column):
                    assert math.isnan(written), (measure, column)
                else:
                    assert written == pytest.approx(psi_column, rel=1e-12, abs=1e-15), (measure, column)
                    checked += 1
                per_column.append(psi_column)
            defined = [p for p in per_column if not math.isnan(p)]
            assert summary.loc[measure, "psi"] == pytest.approx(np.mean(defined), rel=1e-12, abs=1e-15)
        assert checked >= 2 * len(MEASURES)  # width and lr vary in the quick population


def test_unknown_hyperparameter_or_colour_column_is_refused_before_any_work(studies, tmp_path):
    from sharpness._cli import main
    from sharpness.study import ManifestError

    manifest = Path(studies[0].out_dir).parent / "population" / "manifest.csv"
    for options, name in (({"hyper_columns": ["width", "nope"]}, "hyperparameter column 'nope'"),
                          ({"color_by": "rescaled"}, "colour column 'rescaled'")):  # fmt: skip
        with pytest.raises(ManifestError, match=name):
            run_study(manifest, tmp_path / "out", MEASURES, progress=False, **options)
        assert not (tmp_path / "out").exists()
    assert main(["study", "--builtin", "--out", str(tmp_path / "cli"), "--color-by", "width"]) == 2
    assert not (tmp_path / "cli").exists()


def test_command_line_takes_the_hyperparameters_and_colour_column(studies, tmp_path, capsys):
    import shutil

    from sharpness._cli import main

    rescaled = studies[1]
    out = tmp_path / "again"
    shutil.copytree(rescaled.out_dir, out)  # the stored rows: only the statistics and the report are redone
    manifest = Path(rescaled.out_dir).parent / "population" / "manifest_rescaled.csv"
    argv = ["study", str(manifest), "--out", str(out), "--quiet", "--hyper", "width", "--hyper", "lr",
            "--color-by", "seed", *(f"--metric={m}" for m in MEASURES)]  # fmt: skip
    assert main(argv) == 0
    assert "0 measured now, 6 read" in capsys.readouterr().out
    summary = pd.read_csv(out / "summary.csv")
    assert list(summary.columns)[7:] == ["tau_width", "tau_lr"]  # after measure, tau, psi and their intervals
    assert "rescaled" in pd.read_csv(out / "table.csv").columns
    with Image.open(out / "scatter.png") as image:
        assert image.text["Description"].endswith("coloured by seed")
