"""Statistics, report and built-in population of sharpness studies (sharpness.study)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy.stats import kendalltau

from sharpness.study._stats import granulated_tau, kendall_tau, summarize


def scipy_tau(x, y) -> float:
    """Independent reference: scipy's tau-b on the rows where both values are present."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    keep = ~(np.isnan(x) | np.isnan(y))
    if keep.sum() < 2:
        return math.nan
    return float(kendalltau(x[keep], y[keep]).statistic)


def reference_granulated(table: pd.DataFrame, measure: str, columns: list[str], gap: str = "gap") -> dict:
    """Jiang et al.'s granulated tau written out with pandas groupby and scipy (no shared code)."""
    per_column = {}
    for c in columns:
        others = [o for o in columns if o != c]
        groups = table.groupby(others, dropna=False) if others else [(None, table)]
        taus = [scipy_tau(g[measure], g[gap]) for _, g in groups]
        taus = [t for t in taus if not math.isnan(t)]
        per_column[c] = float(np.mean(taus)) if taus else math.nan
    defined = [v for v in per_column.values() if not math.isnan(v)]
    return {"per_column": per_column, "average": float(np.mean(defined)) if defined else math.nan}


def same(a: float, b: float, tol: float = 1e-12) -> bool:
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol


def grid_table(seed: int = 0, nan_rows: int = 0) -> pd.DataFrame:
    """A 3x2x2 hyperparameter grid with two seeds, a measure loosely ranked with the gap, ties in both."""
    rng = np.random.default_rng(seed)
    rows = [{"width": w, "lr": lr, "opt": opt, "seed": s} for w in (16, 32, 64) for lr in (0.01, 0.1)
            for opt in ("sgd", "adam") for s in (0, 1)]  # fmt: skip
    table = pd.DataFrame(rows)
    table["gap"] = np.round(rng.normal(size=len(table)), 1)  # rounded: ties
    table["m"] = np.round(table["gap"] + rng.normal(size=len(table)), 1)
    table.loc[rng.choice(len(table), nan_rows, replace=False), "m"] = np.nan
    return table


def test_kendall_tau_equals_scipy_on_known_rankings_ties_and_nans():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert same(kendall_tau([1, 2, 3, 4], [1, 2, 4, 3]), 4 / 6)
    rng = np.random.default_rng(1)
    for trial in range(20):
        n = int(rng.integers(2, 40))
        x, y = rng.integers(0, 5, n).astype(float), rng.normal(size=n).round(trial % 3)
        x[rng.random(n) < 0.1] = np.nan
        assert same(kendall_tau(x, y), scipy_tau(x, y)), trial
    # infinities are ordered, not NaN
    assert same(kendall_tau([1, np.inf, 2, -np.inf], [2, 4, 3, 1]), 1.0)


def test_kendall_tau_is_nan_without_two_rows_or_without_variation():
    assert math.isnan(kendall_tau([1.0], [2.0]))
    assert math.isnan(kendall_tau([1, 1, 1], [1, 2, 3]))
    assert math.isnan(kendall_tau([1, 2, np.nan], [1, np.nan, 3]))
    with pytest.raises(ValueError, match="one value per model"):
        kendall_tau([1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="one-dimensional"):
        kendall_tau([[1, 2]], [[1, 2]])


def test_granulated_tau_by_hand():
    """psi_a: groups b=0 (tau +1), b=1 (tau -1) -> 0; psi_b: groups a=0, a=1 (both +1) -> 1; psi = 1/2. The
    fifth row shares no other column's values with anyone (its groups have one row): it changes only tau."""
    table = pd.DataFrame({"a": [0, 1, 0, 1, 2], "b": [0, 0, 1, 1, 5], "m": [1, 2, 3, 4, 0.5],
                          "gap": [1, 2, 4, 3, 9]})  # fmt: skip
    result = granulated_tau(table, "m", ["a", "b"])
    assert result == {"per_column": {"a": 0.0, "b": 1.0}, "average": 0.5}
    assert same(kendall_tau(table["m"][:4], table["gap"][:4]), 2 / 3)
    # a group whose gap does not vary contributes nothing: psi_b now rests on the a=1 group alone
    tied = table.assign(gap=[1, 2, 1, 3, 9])
    assert granulated_tau(tied, "m", ["a", "b"])["per_column"]["b"] == 1.0
    # a column whose groups all hold one row has no psi_i and is left out of the average
    unique = granulated_tau(table.assign(c=range(5)), "m", ["a", "c"])
    assert math.isnan(unique["per_column"]["a"]) and unique["per_column"]["c"] == 1.0 and unique["average"] == 1.0


def test_granulated_tau_equals_groupby_and_scipy_on_a_grid():
    for seed, nan_rows in ((0, 0), (1, 3), (2, 7)):
        table = grid_table(seed, nan_rows)
        columns = ["width", "lr", "opt", "seed"]
        ours, ref = granulated_tau(table, "m", columns), reference_granulated(table, "m", columns)
        assert same(ours["average"], ref["average"]), seed
        for c in columns:
            assert same(ours["per_column"][c], ref["per_column"][c]), (seed, c)


def test_summarize_matches_a_loop_over_the_same_resamples():
    table = grid_table(3, nan_rows=2)
    columns = ["width", "lr", "opt", "seed"]
    table["m2"] = -(table["gap"] ** 3)  # perfectly anti-ranked: tau -1 in every resample that has variation
    summary = summarize(table, ["m", "m2"], columns, n_boot=25, seed=5, confidence=0.9)
    assert list(summary.columns) == ["measure", "tau", "tau_low", "tau_high", "psi", "psi_low", "psi_high",
                                     "tau_width", "tau_lr", "tau_opt", "tau_seed"]  # fmt: skip
    resamples = np.random.default_rng(5).integers(0, len(table), size=(25, len(table)))
    for _, row in summary.iterrows():
        m = row["measure"]
        ref = reference_granulated(table, m, columns)
        assert same(row["tau"], scipy_tau(table[m], table["gap"]))
        assert same(row["psi"], ref["average"])
        assert all(same(row[f"tau_{c}"], ref["per_column"][c]) for c in columns)
        boot = [table.iloc[r].reset_index(drop=True) for r in resamples]
        taus = np.array([scipy_tau(b[m], b["gap"]) for b in boot])
        psis = np.array([reference_granulated(b, m, columns)["average"] for b in boot])
        for name, values in (("tau", taus), ("psi", psis)):
            low, high = np.percentile(values[~np.isnan(values)], [5, 95])
            assert same(row[f"{name}_low"], low) and same(row[f"{name}_high"], high), (m, name)
    assert summary.loc[1, "tau_low"] == summary.loc[1, "tau_high"] == -1.0


def test_bootstrap_interval_covers_the_true_tau_of_a_monotone_relation():
    """(u, v) bivariate normal with correlation rho has tau = 2/pi asin(rho); exp(u) keeps the ranks. The 90%
    intervals of 20 independent samples cover it at least 15 times (a 90% interval misses 6 or more of 20
    with probability about 1%), and are not vacuous."""
    rho = 0.6
    truth = 2 / math.pi * math.asin(rho)
    covered, widths = 0, []
    for trial in range(20):
        rng = np.random.default_rng(100 + trial)
        u = rng.normal(size=60)
        v = rho * u + math.sqrt(1 - rho**2) * rng.normal(size=60)
        table = pd.DataFrame({"m": np.exp(u), "gap": v, "h": 0})
        row = summarize(table, ["m"], ["h"], n_boot=400, seed=trial, confidence=0.9).iloc[0]
        covered += row["tau_low"] <= truth <= row["tau_high"]
        widths.append(row["tau_high"] - row["tau_low"])
    assert covered >= 15
    assert max(widths) < 0.5


def test_summarize_refuses_bad_arguments():
    table = grid_table()
    with pytest.raises(ValueError, match="no column 'missing'"):
        summarize(table, ["missing"], ["width"])
    with pytest.raises(ValueError, match="n_boot"):
        summarize(table, ["m"], ["width"], n_boot=0)
    with pytest.raises(ValueError, match="confidence"):
        summarize(table, ["m"], ["width"], confidence=1.0)


# ---- report ---------------------------------------------------------------------------------------------------


def test_report_page_and_figures(tmp_path):
    from sharpness.study._report import write_report

    table = grid_table(4)
    table["wide"] = np.exp(3 * table["m"])  # positive over decades: a log axis
    table["missing"] = np.nan  # a measure that applied to no model
    measures, columns = ["m", "wide", "missing"], ["width", "lr", "opt", "seed"]
    summary = summarize(table, measures, columns, n_boot=50, seed=1)
    written = write_report(table, summary, tmp_path / "out", measures, columns)
    assert [p.name for p in written] == ["report.md", "scatter.png", "summary.png"]
    page = written[0].read_text()
    m = summary.iloc[0]
    assert f"| `m` | 24/24 | {m['tau']:+.2f} [{m['tau_low']:+.2f}, {m['tau_high']:+.2f}] |" in page
    assert "| `missing` | 0/24 | n/a | n/a |" in page and "95% bootstrap percentile intervals over 50" in page
    from PIL import Image

    for path in written[1:]:
        with Image.open(path) as image:
            assert image.format == "PNG" and image.info["Title"].startswith("sharpness study")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["report.md", "scatter.png", "summary.png"]
    from sharpness.study._report import scatter_figure

    fig = scatter_figure(table, summary, measures, "gap", "width")
    assert [ax.get_xscale() for ax in fig.axes[:3]] == ["linear", "log", "linear"]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["16", "32", "64"]
    with pytest.raises(ValueError, match="no row for absent"):
        write_report(table, summary, tmp_path / "out", ["absent"], columns)


# ---- built-in population --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quick_population(tmp_path_factory):
    from sharpness.study._builtin import train_builtin_population

    out = tmp_path_factory.mktemp("population")
    return out, train_builtin_population(out, rescaled=True, quick=True, progress=False)


def test_builtin_population_writes_a_manifest_the_loaders_accept(quick_population):
    import torch

    from sharpness._specs import build_model, load_checkpoint, load_data

    out, manifest = quick_population
    rows = pd.read_csv(manifest)
    assert list(rows.columns) == ["id", "model", "checkpoint", "train", "test", "width", "batch_size", "lr",
                                  "weight_decay", "seed"]  # fmt: skip
    assert len(rows) == 6 and rows["id"].is_unique and set(rows["width"]) == {8, 16, 32}
    X_train, y_train = load_data(str(out / "train.pt"))
    X_test, _ = load_data(str(out / "test.pt"))
    assert X_train.shape == (300, 64) and X_test.shape == (1497, 64)
    twins = pd.read_csv(out / "manifest_rescaled.csv")
    assert (twins["id"] == rows["id"]).all() and twins["rescaled"].sum() == 3
    with torch.no_grad():
        for row, twin in zip(rows.itertuples(), twins.itertuples()):
            model = load_checkpoint(build_model(row.model).double(), str(out / row.checkpoint))
            assert float(torch.nn.functional.cross_entropy(model(X_train.double()), y_train)) <= 0.15
            if twin.rescaled:
                assert twin.checkpoint.endswith("-rescaled.safetensors")
                copy = load_checkpoint(build_model(row.model).double(), str(out / twin.checkpoint))
                torch.testing.assert_close(copy(X_test.double()), model(X_test.double()), rtol=1e-9, atol=1e-9)
                ratio = copy[0].weight.norm(dim=1) / model[0].weight.norm(dim=1)
                assert float(ratio.max() / ratio.min()) > 3  # large scales
            else:
                assert twin.checkpoint == row.checkpoint


def test_builtin_population_resumes_and_is_deterministic(quick_population, tmp_path):
    from sharpness.study._builtin import train_builtin_population

    out, manifest = quick_population
    files = sorted(p for p in out.rglob("*") if p.is_file())
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in files}
    (out / "checkpoints" / "w8-b64-lr0.1-wd0-s0.safetensors").unlink()  # as if killed before this one
    assert train_builtin_population(out, rescaled=True, quick=True, progress=False) == manifest
    for p in files:
        assert p.read_bytes() == before[p][1], p.name
        if p.name != "w8-b64-lr0.1-wd0-s0.safetensors" and not p.name.startswith("manifest"):
            assert p.stat().st_mtime_ns == before[p][0], p.name  # kept, not rewritten
    fresh = tmp_path / "fresh"
    train_builtin_population(fresh, rescaled=True, quick=True, progress=False)
    for p in files:
        assert (fresh / p.relative_to(out)).read_bytes() == before[p][1], p.name
    with pytest.raises(ValueError, match="other settings"):
        train_builtin_population(out, quick=True, seed=1, progress=False)
