"""Run a study: every manifest row checked, then measured (resumably, in parallel), then tabulated and reported.

Each row is loaded the way ``python -m sharpness compute`` loads a checkpoint (`sharpness._cli.load_model`,
`sharpness._cli.prepare_data`) and measured by the same code (`sharpness._cli.measure_entry`), over
the whole training set; its loss and error are evaluated over the whole training and held-out sets. Each row's
result is stored as it is finished (`sharpness.study._store`), so a rerun measures only rows that are new,
changed, or were not finished. Rows are shared between ``jobs`` worker processes, and between the processes of
a ``torchrun`` launch by index (process ``r`` of ``W`` takes rows ``r, r + W, ...``).
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import multiprocessing
import os
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from sharpness._cli import (
    _measures,
    _versions,
    check_model_dtype,
    check_outputs,
    load_model,
    measure_entry,
    memory_budget,
    parse_device,
    prepare_data,
)
from sharpness._launch import DEFAULT_TIMEOUT_S, confirm_inputs, join_processes, launch_rank, launched_processes
from sharpness._progress import progress_bar
from sharpness._results import jsonable, write_text_atomic
from sharpness._specs import SpecError, load_data
from sharpness.measures._claims import first_line
from sharpness.measures._registry import MEASURES
from sharpness.products._objective import Objective
from sharpness.solvers._solve import SOLVERS, Solver
from sharpness.study._manifest import MEASURED, Manifest, ManifestError, Row, read_manifest
from sharpness.study._store import RowStore, file_digest, row_key

# A study's losses are mean cross-entropy (errors are argmax misses), as in the table's definition.
LOSS = "ce"


@dataclass(frozen=True)
class StudyOptions:
    """How every row is measured.

    Attributes:
        measures: registered measure names, in table order.
        k: eigenvalues per measure (the table holds the largest).
        tol: the eigen-solver's relative residual tolerance.
        method: the eigen-solver (a name in `sharpness.SOLVERS`).
        dtype: ``"float64"`` or ``"float32"``.
        device: where to evaluate (``"cpu"``, ``"cuda"`` ...).
        memory_mib: memory budget for activations in MiB (``None``: the objective's default); changes how the data
            are streamed, not the results, so it is not part of a row's store key (nor is the device).
    """

    measures: tuple[str, ...]
    k: int = 1
    tol: float = 1e-6
    method: str = "lanczos"
    dtype: str = "float64"
    device: str = "cpu"
    memory_mib: float | None = None

    def key(self) -> dict:
        """What the results depend on (part of every row's store key)."""
        return {"measures": list(self.measures), "k": self.k, "tol": self.tol, "method": self.method,
                "dtype": self.dtype, "loss": LOSS}  # fmt: skip


@dataclass
class StudyResult:
    """A study's results.

    Attributes:
        table: ``pandas.DataFrame``, one row per manifest row: ``id``, the hyperparameter columns, ``train_loss``,
            ``train_error``, ``test_loss``, ``test_error``, ``gap`` (test error minus train error, fractions),
            ``gap_loss`` (test loss minus train loss, mean cross-entropy), then one column per measure (its top
            eigenvalue; NaN where it does not apply).
        skipped: ``{id: {measure: reason}}`` for the measures that did not apply.
        measures: the measure columns of the table.
        hyper_columns: the hyperparameter columns of the statistics (the table also holds the manifest's other
            columns, as labels).
        summary: the statistics per measure (``sharpness.study._stats.summarize``), where available.
        out_dir: the folder the outputs were written to.
        computed: ids measured by this run (the others were read from the store).
        files: the files written (the table, the skipped measures, the summary and the report).
    """

    table: object
    skipped: dict[str, dict[str, str]]
    measures: list[str]
    hyper_columns: list[str]
    summary: object | None = None
    out_dir: str = ""
    computed: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        """The results as JSON text: the table's rows (records), the skipped measures and the summary."""
        summary = None if self.summary is None else self.summary.to_dict(orient="records")
        return json.dumps(jsonable({
            "table": self.table.to_dict(orient="records"), "skipped": self.skipped, "measures": self.measures,
            "hyper_columns": self.hyper_columns, "summary": summary,
        }), indent=2)  # fmt: skip


def run_study(
    manifest: str | os.PathLike,
    out_dir: str | os.PathLike,
    measures: list[str] | None = None,
    jobs: int = 1,
    progress: bool | None = None,
    *,
    k: int = 1,
    tol: float = 1e-6,
    method: str = "lanczos",
    dtype: str = "float64",
    device: str = "cpu",
    memory_mib: float | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    report: bool = True,
    hyper_columns: list[str] | None = None,
    color_by: str | None = None,
) -> StudyResult:
    """Measure every row of a manifest, store each row as it is finished, and write the table.

    Every row is checked before any is measured. Rows already stored under the same key (same row, options and
    file contents) are read back instead of measured. Under ``torchrun`` the processes share the rows by index;
    every process returns the whole table and process 0 writes the outputs.

    Args:
        manifest: the manifest file (``.csv`` or ``.json``; see `sharpness.study._manifest`).
        out_dir: folder for ``rows/<id>.json``, ``table.csv``, ``skipped.json`` (and the statistics and report,
            where available); created if missing.
        measures: registered measure names, or ``["all"]``; ``None``: every registered measure (those that do not
            apply to a row are recorded as skipped).
        jobs: worker processes measuring rows at once (1: in this process).
        progress: a bar over the rows with the time left; ``None``: on a terminal only.
        k: eigenvalues per eigenvalue measure, as for ``compute``.
        tol: the eigen-solver's relative tolerance.
        method: the eigen-solver (``"lanczos"``, ``"power"``, ...; see `sharpness.SOLVERS`).
        dtype: ``"float64"`` (default) or ``"float32"``.
        device: where to evaluate.
        memory_mib: memory budget for activations per process, in MiB (``None``: the default of the device).
        timeout: under ``torchrun``, seconds a process waits for the others (their rows included) at the end.
        report: also compute the statistics and write the report (where that part is installed).
        hyper_columns: the manifest columns that are hyperparameters of the granulated tau; ``None``: every column
            besides the required ones. The others are labels: kept in the table, not grouped by (say a
            ``rescaled`` flag, which changes no trained model and so is no hyperparameter).
        color_by: the manifest column colouring the report's scatter plots (``None``: the first hyperparameter
            with 2 to 10 distinct values).

    Returns:
        The `StudyResult`.

    Raises:
        SpecError: a bad option, or a bad manifest
            (`sharpness.study._manifest.ManifestError`, naming the row): missing files, a model spec that
            does not build or does not fit its checkpoint, data the model cannot take, repeated ids, a column
            mixing numbers and text; a ``hyper_columns`` or ``color_by`` entry that is not a column of the manifest.
    """
    options = _options(measures, k, tol, method, dtype, device, memory_mib)
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise SpecError(f"jobs must be a positive whole number, got {jobs!r}")
    world = launched_processes()
    if world > 1 and jobs > 1:
        raise SpecError("under torchrun each process measures its own rows; leave --jobs at 1")
    if world > 1:
        if not (math.isfinite(timeout) and timeout > 0):
            raise SpecError(f"--timeout must be a positive number of seconds, got {timeout:g}")
        # joined before the checks, so that one process's bad input stops every process (confirm_inputs)
        comm = join_processes(parse_device(device), timeout)
    out_dir = os.fspath(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise SpecError(f"the output folder {out_dir} exists and is not a folder")
    parsed = read_manifest(manifest, reserved=tuple(MEASURES))
    hyper = _hyper_columns(parsed, hyper_columns, color_by)
    inputs = (os.fspath(manifest), *(row.checkpoint_path for row in parsed.rows))
    outputs = [("the table", os.path.join(out_dir, "table.csv")),
               ("the skipped measures", os.path.join(out_dir, "skipped.json"))]  # fmt: skip
    check_outputs(outputs, inputs, new_folder=True)
    keys = check_rows(parsed, options)
    confirm_inputs()
    os.makedirs(out_dir, exist_ok=True)
    store = RowStore(out_dir)
    mine = parsed.rows[launch_rank() :: world]
    todo = [row for row in mine if store.load(row.id, keys[row.id]) is None]
    error = None
    try:
        _measure_rows(todo, options, keys, out_dir, jobs, progress)
    except SpecError as exc:
        error = exc
    computed = {row.id for row in todo}
    if world > 1:
        comm.check_together(error)  # every process waits for the others' rows; one's failure stops all
        computed = {ident for text in comm.gather_text(" ".join(sorted(computed))) for ident in text.split()}
    elif error is not None:
        raise error
    records = {row.id: store.load(row.id, keys[row.id]) for row in parsed.rows}
    lost = [row for row in parsed.rows if records[row.id] is None]
    if lost:  # replaced after it was stored: another study with other options writes to the same folder
        raise SpecError(f"the stored result of manifest {lost[0].where()} was replaced while this study ran; "
                        f"give each study its own output folder ({out_dir} is shared)")  # fmt: skip
    result = _tabulate(parsed, records, options, hyper)
    result.out_dir, result.computed = out_dir, [row.id for row in parsed.rows if row.id in computed]
    if world == 1 or launch_rank() == 0:
        _write_outputs(result, report, color_by)
    return result


def _hyper_columns(manifest: Manifest, hyper_columns: list[str] | None, color_by: str | None) -> list[str]:
    """The hyperparameter columns of the statistics, checked against the manifest's columns (as is ``color_by``)."""
    columns = list(manifest.hyper_columns)
    if hyper_columns is None:
        chosen = columns
    else:
        chosen = [hyper_columns] if isinstance(hyper_columns, str) else list(hyper_columns)
        if len(set(chosen)) != len(chosen):
            raise SpecError(f"hyperparameter columns repeat: {', '.join(chosen)}; name each once")
    for name, what in [*((c, "hyperparameter") for c in chosen), *([(color_by, "colour")] if color_by else [])]:
        if name not in columns:
            have = ", ".join(columns) or "none"
            raise ManifestError(f"the {what} column {name!r} is not a column of the manifest {manifest.path} (its "
                                f"columns besides the required ones: {have})")  # fmt: skip
    return chosen


def _options(measures, k, tol, method, dtype, device, memory_mib) -> StudyOptions:
    """The options, checked (the same sentences as ``compute``'s)."""
    measures = [measures] if isinstance(measures, str) else measures
    names = _measures(list(measures)) if measures else list(MEASURES)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise SpecError(f"--k must be at least 1, got {k}")
    if not (math.isfinite(tol) and tol > 0):
        raise SpecError(f"--tol must be a positive number, got {tol}")
    if method not in SOLVERS:
        raise SpecError(f"unknown solver {method!r}; choose one of {', '.join(SOLVERS)}")
    if dtype not in ("float32", "float64"):
        raise SpecError(f"--dtype must be float32 or float64, got {dtype!r}")
    memory_budget(memory_mib)
    parse_device(device)
    return StudyOptions(tuple(names), k, tol, method, dtype, device, memory_mib)


def check_rows(manifest: Manifest, options: StudyOptions) -> dict[str, str]:
    """Check every row's files before any work: the checkpoint exists and fits its model spec, the training and
    held-out data load and the model takes them (the checks of ``compute``). Returns each row's store key.

    Raises:
        ManifestError: one sentence naming the row.
    """
    data_cache: dict[str, tuple] = {}
    digests: dict[str, str] = {}
    keys = {}
    for row in manifest.rows:
        try:
            model = load_model(row.model_spec, row.checkpoint_path, options.dtype)
            check_model_dtype(model, options.dtype)
            files = {"checkpoint": file_digest(row.checkpoint_path, digests)}
            for which in ("train", "test"):
                spec = row.data_spec(which)
                if spec not in data_cache:
                    data_cache[spec] = load_data(spec)
                prepare_data(model, data_cache[spec], spec, options.dtype, LOSS, pairing=f"its model and {which} data")
                if os.path.isfile(spec):
                    files[which] = file_digest(spec, digests)
        except SpecError as exc:
            raise ManifestError(f"manifest {row.where()}: {first_line(exc)}") from None
        keys[row.id] = row_key(row.content(), options.key(), files)
    return keys


def measure_row(row: Row, options: StudyOptions, progress: bool | None = False) -> dict:
    """One row's record: loss and error over the training and held-out data, and every measure's entry (as
    ``compute --json`` writes it; a measure that does not apply holds its reason).

    Raises:
        SpecError: the row cannot be measured (naming it).
    """
    start = time.perf_counter()
    try:
        device = parse_device(options.device)
        model = load_model(row.model_spec, row.checkpoint_path, options.dtype).to(device)
        check_model_dtype(model, options.dtype)
        budget = memory_budget(options.memory_mib)
        loss_fn = nn.CrossEntropyLoss()
        sets = {}
        for which in ("train", "test"):
            spec = row.data_spec(which)
            data = load_data(spec)
            data = prepare_data(model, data, spec, options.dtype, LOSS, pairing=f"its model and {which} data")
            sets[which] = Objective(model, loss_fn, data, memory_budget=budget)
        evaluated = {which: objective.evaluate() for which, objective in sets.items()}
        if "accuracy" not in evaluated["train"]:
            raise SpecError("the model's outputs are not class scores of shape (samples, classes), so a study's "
                            "error (argmax misses) is undefined for it")  # fmt: skip
        solver = Solver(method=options.method, tol=options.tol)
        measures = {
            name: measure_entry(sets["train"], name, options.k, solver, progress, skip_unsupported=True)[0]
            for name in options.measures
        }
    except (ValueError, OSError, FloatingPointError) as exc:  # bad input found only now, e.g. by the objective
        raise SpecError(f"manifest {row.where()}: {first_line(exc)}") from None
    return {
        "id": row.id,
        "row": row.content(),
        "options": options.key(),
        **{which: {"loss": e["loss"], "error": _error(e["accuracy"], sets[which].n_samples),
                   "n_samples": sets[which].n_samples} for which, e in evaluated.items()},  # fmt: skip
        "measures": measures,
        "seconds": time.perf_counter() - start,
        "versions": _versions(),
    }


def _error(accuracy: float, n: int) -> float:
    """The fraction of misses, ``misses / n`` exactly (``1 - accuracy`` can differ from it in the last bit)."""
    return (n - round(accuracy * n)) / n


def _measure_and_store(row: Row, options: StudyOptions, key: str, out_dir: str) -> str:
    """Measure ``row`` and store its record under ``key`` (in a worker process, or in this one). Returns its id."""
    RowStore(out_dir).save({"key": key, **measure_row(row, options)})
    return row.id


def _worker_threads(threads: int) -> None:
    """A worker's share of the CPU threads (``jobs`` workers at once would otherwise oversubscribe the cores)."""
    torch.set_num_threads(threads)


def _measure_rows(todo: list[Row], options: StudyOptions, keys: dict[str, str], out_dir: str, jobs: int,
                  progress: bool | None) -> None:  # fmt: skip
    """Measure and store ``todo``, ``jobs`` at once, with a bar over the rows."""
    bar = progress_bar(len(todo), "study", progress, unit="row")
    try:
        if jobs == 1 or len(todo) <= 1:
            for row in todo:
                bar.set_postfix_str(row.id)
                _measure_and_store(row, options, keys[row.id], out_dir)
                bar.update()
            return
        threads = max(1, torch.get_num_threads() // jobs)
        # spawned, not forked: a forked copy of a process that has started torch's threads can deadlock
        context = multiprocessing.get_context("spawn")
        workers = min(jobs, len(todo))
        with concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=context, initializer=_worker_threads, initargs=(threads,)
        ) as pool:
            futures = [pool.submit(_measure_and_store, row, options, keys[row.id], out_dir) for row in todo]
            try:
                for future in concurrent.futures.as_completed(futures):
                    bar.set_postfix_str(future.result())
                    bar.update()
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)  # rows already running finish and are stored
                raise
    finally:
        bar.close()


def _tabulate(
    manifest: Manifest, records: dict[str, dict], options: StudyOptions, hyper_columns: list[str]
) -> StudyResult:
    """The tidy table and the skipped measures from the stored records; ``hyper_columns`` are the statistics'."""
    import pandas as pd

    lines, skipped = [], {}
    for row in manifest.rows:
        record = records[row.id]
        train, test = record["train"], record["test"]
        line = {"id": row.id, **row.hyper, "train_loss": train["loss"], "train_error": train["error"],
                "test_loss": test["loss"], "test_error": test["error"], "gap": test["error"] - train["error"],
                "gap_loss": test["loss"] - train["loss"]}  # fmt: skip
        for name in options.measures:
            entry = record["measures"][name]
            if "skipped" in entry:
                skipped.setdefault(row.id, {})[name] = entry["skipped"]
                line[name] = math.nan
            else:
                line[name] = float(entry["value"])  # float("inf") where the store wrote a non-finite value as text
        lines.append(line)
    columns = ["id", *manifest.hyper_columns, *MEASURED, *options.measures]
    table = pd.DataFrame(lines, columns=columns)
    return StudyResult(table=table, skipped=skipped, measures=list(options.measures),
                       hyper_columns=list(hyper_columns))  # fmt: skip


def _write_outputs(result: StudyResult, report: bool, color_by: str | None = None) -> None:
    """``table.csv`` and ``skipped.json``, then the statistics and the report where that part is installed."""
    out = result.out_dir
    table_path, skipped_path = os.path.join(out, "table.csv"), os.path.join(out, "skipped.json")
    write_text_atomic(table_path, result.table.to_csv(index=False))
    write_text_atomic(skipped_path, json.dumps(result.skipped, indent=2) + "\n")
    result.files = [table_path, skipped_path]
    if report:
        _statistics_and_report(result, color_by)


def _statistics_and_report(result: StudyResult, color_by: str | None = None) -> None:
    """``summary.csv`` and the report, from `sharpness.study._stats` and `sharpness.study._report`;
    without those modules (an installation without them) the table alone is the result."""
    try:
        from sharpness.study._report import write_report
        from sharpness.study._stats import summarize
    except ModuleNotFoundError as exc:
        if exc.name not in ("sharpness.study._stats", "sharpness.study._report"):
            raise
        return  # result.summary stays None
    measured = [m for m in result.measures if result.table[m].notna().any()]
    result.summary = summarize(result.table, measured, result.hyper_columns)
    summary_path = os.path.join(result.out_dir, "summary.csv")
    write_text_atomic(summary_path, result.summary.to_csv(index=False))
    written = write_report(result.table, result.summary, result.out_dir, measured, result.hyper_columns,
                           color_by=color_by)  # fmt: skip
    result.files += [summary_path, *map(os.fspath, written)]
