"""The study engine (issue 35): manifests checked before any work, rows measured as ``compute`` measures them and
stored one file each, resumed after SIGKILL, shared between worker processes, tabulated."""

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from guards import HANG_GUARD_S
from safetensors.torch import save_file

import sharpness
from sharpness._specs import SpecError, build_model, load_checkpoint, load_data
from sharpness.study._store import RowStore

MEASURES = ["euclidean", "fixed"]  # fast; fixed does not apply to the residual network (skipped with a reason)
TRAIN = "train.pt"
TEST = "test.pt"
# The model file of the manifests: a residual network (no chain: `fixed` is skipped), and a chain whose second
# construction in a process waits for the file GATE (the first is the check before any work), so that a study can
# be stopped for certain while that row is being measured.
MODELS = """
import os
import time

from torch import nn


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x):
        return self.b(self.a(x).relu() + x)


def residual():
    return Residual()


def gated():
    counter = f"STUDY_TEST_GATED_CALLS_{os.getpid()}"  # this process's calls (the environment is inherited)
    calls = int(os.environ.get(counter, "0")) + 1
    os.environ[counter] = str(calls)
    while calls > 1 and not os.path.exists(os.path.join(os.path.dirname(__file__), "GATE")):
        time.sleep(0.01)
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
"""
HEADER = "id,model,checkpoint,train,test,lr,width,optimizer\n"
LINES = [
    "a,mlp:4-5-3,a.safetensors,train.pt,test.pt,0.1,5,sgd",
    "b,mlp:4-5-3,b.safetensors,train.pt,test.pt,0.01,5,adam",
    "c,models.py:residual,c.safetensors,train.pt,test.pt,0.1,4,sgd",
    "d,models.py:gated,d.safetensors,train.pt,test.pt,0.01,5,adam",
]
TABLE_COLUMNS = ["id", "lr", "width", "optimizer", "train_loss", "train_error", "test_loss", "test_error", "gap",
                 "gap_loss", *MEASURES]  # fmt: skip


def _population(folder: Path) -> Path:
    """Four tiny checkpoints, their data and manifest in ``folder``; returns the manifest. The same files whatever
    the default dtype (float64 in the tests, float32 in a module fixture, which is set up before it)."""
    (folder / "models.py").write_text(MODELS)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        _draw(folder)
    finally:
        torch.set_default_dtype(default)
    manifest = folder / "manifest.csv"
    manifest.write_text(HEADER + "\n".join(LINES) + "\n")
    return manifest


def _draw(folder: Path) -> None:
    """The population's data and weights, drawn in float32."""
    g = torch.Generator().manual_seed(0)
    for name, n in ((TRAIN, 40), (TEST, 30)):
        torch.save({"X": torch.randn(n, 4, generator=g), "y": torch.randint(0, 3, (n,), generator=g)}, folder / name)
    namespace: dict = {}
    exec(MODELS, namespace)
    builders = {"a": lambda: build_model("mlp:4-5-3"), "b": lambda: build_model("mlp:4-5-3"),
                "c": namespace["residual"], "d": lambda: build_model("mlp:4-5-3")}  # fmt: skip
    for seed, (ident, make) in enumerate(builders.items()):
        torch.manual_seed(seed)
        weights = make().state_dict()
        save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / f"{ident}.safetensors"))


@pytest.fixture(scope="module")
def population(tmp_path_factory):
    folder = tmp_path_factory.mktemp("population")
    manifest = _population(folder)
    (folder / "GATE").touch()
    return manifest


@pytest.fixture(scope="module")
def reference(population, tmp_path_factory):
    """An uninterrupted study of the population, in this process (the package called as a function)."""
    return sharpness.study(population, tmp_path_factory.mktemp("reference") / "out", MEASURES, progress=False)


def _study_cli(*args: str, cwd: Path, **kw) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "sharpness", "study", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)  # fmt: skip


def test_the_table_holds_the_documented_columns_and_the_values_compute_measures(population, reference):
    table = reference.table
    assert list(table.columns) == TABLE_COLUMNS
    assert list(table["id"]) == ["a", "b", "c", "d"] and reference.computed == ["a", "b", "c", "d"]
    assert table["lr"].dtype == float and table["width"].dtype == int
    assert list(table["optimizer"]) == ["sgd", "adam", "sgd", "adam"]
    folder = population.parent
    for row in table.itertuples():
        spec = LINES[row.Index].split(",")[1]
        model = build_model(str(folder / spec) if spec.startswith("models.py") else spec).double()
        load_checkpoint(model, str(folder / f"{row.id}.safetensors"))
        losses = {}
        for which in ("train", "test"):
            X, y = load_data(str(folder / f"{which}.pt"))
            with torch.no_grad():
                out = model(X.double())
            misses = int((out.argmax(1) != y).sum())
            losses[which] = (float(torch.nn.functional.cross_entropy(out, y)), misses / len(y))
        assert math.isclose(row.train_loss, losses["train"][0], rel_tol=1e-12)
        assert math.isclose(row.test_loss, losses["test"][0], rel_tol=1e-12)
        assert (row.train_error, row.test_error) == (losses["train"][1], losses["test"][1])
        assert row.gap == row.test_error - row.train_error and row.gap_loss == row.test_loss - row.train_loss
        objective = sharpness.Objective(model, torch.nn.CrossEntropyLoss(), load_data(str(folder / TRAIN)))
        expected = sharpness.euclidean_sharpness(None, None, None, objective=objective).value
        assert math.isclose(row.euclidean, expected, rel_tol=1e-9), (row.id, row.euclidean, expected)
    # the residual network has no chain: `fixed` is NaN in the table, its reason in skipped
    assert math.isnan(table.loc[2, "fixed"]) and table["fixed"].drop(index=2).gt(0).all()
    assert list(reference.skipped) == ["c"] and "defined for chains" in reference.skipped["c"]["fixed"]
    out = Path(reference.out_dir)
    assert json.loads((out / "skipped.json").read_text()) == reference.skipped
    pd.testing.assert_frame_equal(pd.read_csv(out / "table.csv"), table, check_exact=True)
    assert sorted(p.name for p in (out / "rows").iterdir()) == ["a.json", "b.json", "c.json", "d.json"]
    again = json.loads(reference.to_json())
    assert again["table"][0]["id"] == "a" and again["skipped"] == reference.skipped
    if importlib.util.find_spec("sharpness.study._stats") is None:  # the statistics: another module, optional here
        assert reference.summary is None and [Path(f).name for f in reference.files] == ["table.csv", "skipped.json"]
    else:
        assert list(reference.summary["measure"]) == ["euclidean", "fixed"]


def test_a_rerun_reads_stored_rows_and_recomputes_only_changed_ones(population, reference, tmp_path, capsys):
    folder = tmp_path / "pop"
    folder.mkdir()
    for f in population.parent.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    out = tmp_path / "out"
    first = sharpness.run_study(folder / "manifest.csv", out, MEASURES, progress=False)
    pd.testing.assert_frame_equal(first.table, reference.table, check_exact=True)
    stamps = {p.name: p.stat().st_mtime_ns for p in (out / "rows").iterdir()}
    again = sharpness.run_study(folder / "manifest.csv", out, MEASURES, progress=True)
    assert again.computed == []
    assert "0row" in capsys.readouterr().err  # the bar counts rows (none left to measure)
    # other weights in b's checkpoint (same name) and another hyperparameter value in a's row: those two only
    torch.manual_seed(7)
    weights = build_model("mlp:4-5-3").state_dict()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "b.safetensors"))
    (folder / "manifest.csv").write_text(HEADER + "\n".join([LINES[0].replace(",0.1,", ",0.2,"), *LINES[1:]]) + "\n")
    changed = sharpness.run_study(folder / "manifest.csv", out, MEASURES, progress=True)
    assert "0/2" in capsys.readouterr().err  # a bar over the two changed rows (later counts show as time passes)
    assert changed.computed == ["a", "b"]
    assert {p.name: p.stat().st_mtime_ns for p in (out / "rows").iterdir() if p.name in ("c.json", "d.json")} == {
        k: v for k, v in stamps.items() if k in ("c.json", "d.json")}  # fmt: skip
    assert changed.table.loc[0, "lr"] == 0.2
    assert changed.table.loc[0, "euclidean"] == reference.table.loc[0, "euclidean"]
    assert changed.table.loc[1, "euclidean"] != reference.table.loc[1, "euclidean"]
    # other options are another key: every row again
    assert sharpness.run_study(folder / "manifest.csv", out, ["euclidean"], progress=False).computed == list("abcd")


def test_a_study_killed_by_sigkill_resumes_without_recomputing_and_ends_as_an_uninterrupted_run(
    reference, tmp_path
):  # fmt: skip
    manifest = _population(tmp_path)  # no GATE yet: row d waits for it, so the study is stopped for certain
    args = [str(manifest), "--out", "out", *(a for m in MEASURES for a in ("--metric", m)), "--quiet"]
    first = _study_cli(*args, cwd=tmp_path)
    rows = tmp_path / "out" / "rows"
    start = time.monotonic()
    while not (rows / "a.json").exists() and first.poll() is None and time.monotonic() - start < HANG_GUARD_S:
        time.sleep(0.01)  # polling for the first row's file (the study itself never ends before GATE exists)
    assert first.poll() is None, first.communicate()
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=HANG_GUARD_S)
    assert first.returncode == -signal.SIGKILL
    stored = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in rows.iterdir()}
    assert "a.json" in stored and "d.json" not in stored
    assert not (tmp_path / "out" / "table.csv").exists()
    (tmp_path / "GATE").touch()
    second = _study_cli(*args, cwd=tmp_path)
    stdout, stderr = second.communicate(timeout=HANG_GUARD_S)
    assert second.returncode == 0, stderr
    assert f"{4 - len(stored)} measured now, {len(stored)} read from" in stdout
    assert {name: (p.stat().st_mtime_ns, p.read_bytes()) for name in stored for p in [rows / name]} == stored
    table = pd.read_csv(tmp_path / "out" / "table.csv")
    pd.testing.assert_frame_equal(table, pd.read_csv(Path(reference.out_dir) / "table.csv"), check_exact=True)


def test_jobs_share_the_rows_between_processes_with_the_same_results(population, reference, tmp_path):
    # progress=None with standard error captured (not a terminal): the bar is phase lines, as under nohup
    result = sharpness.study(population, tmp_path / "out", MEASURES, jobs=2, progress=None)
    assert sorted(result.computed) == ["a", "b", "c", "d"]
    pd.testing.assert_frame_equal(result.table, reference.table, check_exact=True)
    assert result.skipped == reference.skipped


def _manifest(folder: Path, lines: list[str], header: str = HEADER, name: str = "m.csv") -> Path:
    path = folder / name
    path.write_text(header + "\n".join(lines) + "\n")
    return path


BAD = {  # case: (manifest lines, what the message says, in order)
    "missing checkpoint": ([LINES[0], LINES[1].replace("b.safetensors", "gone.safetensors")],
                           ["manifest row 2 (id b): checkpoint ", "gone.safetensors does not exist"]),
    "spec does not build": ([LINES[0], LINES[1].replace("mlp:4-5-3", "mlp:4-x-3")],
                            ["manifest row 2 (id b): model spec 'mlp:4-x-3' is not of the form"]),
    "spec does not fit": ([LINES[0], LINES[1].replace("mlp:4-5-3", "mlp:4-6-3")],
                          ["manifest row 2 (id b): checkpoint ", "b.safetensors does not fit the model: 3 ",
                           "tensor(s) differ in shape (first '0.weight': (5, 4) in the checkpoint, (6, 4) in the "
                           "model)"]),
    "data the model cannot take": ([LINES[0], LINES[1].replace("train.pt", '"synthetic:n=5,dim=7,classes=3"')],
                                   ["manifest row 2 (id b): the model cannot take inputs of shape (7,)",
                                    "check that its model and train data match"]),
    "labels out of range": ([LINES[0], LINES[1].replace("test.pt", '"synthetic:n=5,dim=4,classes=9"')],
                            ["manifest row 2 (id b): labels range over [0, ", "but the model has 3 outputs"]),
    "duplicate id": ([LINES[0], LINES[1], LINES[2].replace("c,", "a,", 1)],
                     ["manifest rows 1 and 3 have the same id; give every row its own id"]),
    "ids differing in case": ([LINES[0], LINES[1].replace("b,", "A,", 1)],
                              ["manifest rows 1 and 2 have ids that differ only in case (a, A)"]),
    "mixed column": ([LINES[0], LINES[1].replace(",0.01,", ",fast,")],
                     ["manifest row 2 (id b): column 'lr' holds text ('fast') where row 1 holds a number"]),
    "missing column": ([",".join(line.split(",")[:4] + line.split(",")[5:]) for line in LINES[:2]],
                       ["has no column test; the required columns are id, model, checkpoint, train, test"]),
    "empty cell": ([LINES[0], LINES[1].replace(",adam", ",")], ["manifest row 2 (id b): column 'optimizer' is empty"]),
    "short row": ([LINES[0], LINES[1].replace(",adam", "")], ["manifest row 2 has 7 cells but the header names 8"]),
    "id not a file name": ([LINES[0], LINES[1].replace("b,", "../b,", 1)], ["manifest row 2: id '../b' cannot name"]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_manifests_are_refused_before_any_work_naming_the_row(population, tmp_path, case):
    lines, parts = BAD[case]
    header = HEADER.replace("test,", "") if case == "missing column" else HEADER
    manifest = _manifest(population.parent, lines, header, name=f"bad-{case.replace(' ', '-')}.csv")
    with pytest.raises(sharpness.study.ManifestError) as info:
        sharpness.study(manifest, tmp_path / "out", MEASURES)
    message = str(info.value)
    assert "\n" not in message, message
    position = 0
    for part in parts:
        assert message.find(part, position) >= position, (part, message)
        position = message.find(part, position) + len(part)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"id": 1, "model": "mlp:4-5-3", "checkpoint": "a.safetensors", "train": TRAIN, "test": TEST}],
         "manifest row 1: column 'id' is 1, not text"),
        ({"rows": [{"id": "a", "model": "mlp:4-5-3", "checkpoint": "a.safetensors", "train": TRAIN, "test": TEST,
                    "lr": [0.1]}]}, "manifest row 1: column 'lr' holds [0.1]"),
        ([{"id": "a", "model": "mlp:4-5-3", "checkpoint": "a.safetensors", "train": TRAIN, "test": TEST, "lr": 0.1},
          {"id": "b", "model": "mlp:4-5-3", "checkpoint": "b.safetensors", "train": TRAIN, "test": TEST}],
         "manifest row 2 has no column 'lr'"),
        ([{"id": "a", "model": "mlp:4-5-3", "checkpoint": "a.safetensors", "train": TRAIN, "test": TEST,
           "euclidean": 1}], "column 'euclidean' has the name of a column of the results table"),
        ({"id": "a"}, "must hold a list of rows"),
    ],
)  # fmt: skip
def test_bad_json_manifests_are_refused_naming_the_row(population, tmp_path, rows, message):
    manifest = population.parent / f"bad-{abs(hash(message))}.json"
    manifest.write_text(json.dumps(rows))
    with pytest.raises(SpecError) as info:
        sharpness.study(manifest, tmp_path / "out", MEASURES)
    assert message in str(info.value), str(info.value)


def test_a_study_without_a_terminal_reports_in_phase_lines(population, reference, tmp_path):
    result = sharpness.study(population, tmp_path / "out", MEASURES, progress=None)  # stderr is not a terminal here
    pd.testing.assert_frame_equal(result.table, reference.table, check_exact=True)


def test_a_json_manifest_gives_the_csv_manifests_table(population, reference, tmp_path):
    rows = []
    for line in LINES:
        ident, model, checkpoint, train, test, lr, width, optimizer = line.split(",")
        rows.append({"id": ident, "model": model, "checkpoint": checkpoint, "train": train, "test": test,
                     "lr": float(lr), "width": int(width), "optimizer": optimizer})  # fmt: skip
    manifest = population.parent / "manifest.json"
    manifest.write_text(json.dumps(rows))
    result = sharpness.study(manifest, tmp_path / "out", MEASURES, progress=False)
    pd.testing.assert_frame_equal(result.table, reference.table, check_exact=True)


def test_cli_bad_manifest_is_one_sentence_exit_2_and_no_output(population, tmp_path):
    manifest = _manifest(population.parent, [LINES[0], LINES[1].replace("mlp:4-5-3", "mlp:4-6-3")], name="cli.csv")
    run = _study_cli(str(manifest), "--out", str(tmp_path / "out"), cwd=tmp_path)
    stdout, stderr = run.communicate(timeout=HANG_GUARD_S)
    assert run.returncode == 2 and stdout == ""
    assert stderr.startswith("error: manifest row 2 (id b): checkpoint ") and stderr.count("\n") == 1, stderr
    assert not (tmp_path / "out").exists()


def test_row_files_are_keyed_and_a_foreign_file_is_recomputed(reference, tmp_path):
    store = RowStore(reference.out_dir)
    record = json.loads(Path(store.path("a")).read_text())
    assert store.load("a", record["key"]) == record and store.load("a", "0" * 64) is None
    assert record["train"]["n_samples"] == 40 and record["measures"]["euclidean"]["measure"]["name"] == "euclidean"
