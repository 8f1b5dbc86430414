"""A study's manifest: one row per checkpoint (CSV with a header row, or JSON), read and checked before any work.

Required columns: ``id`` (unique, usable as a file name), ``model`` (a model SPEC as ``compute --model`` takes),
``checkpoint`` (a state_dict file), ``train`` and ``test`` (data SPECs as ``--data`` takes). Every other column is
a hyperparameter: numbers or text, not both. Relative file paths (checkpoints, data files, ``file.py:factory``
models) are relative to the manifest's folder. Rows are numbered from 1 in messages (CSV: header excluded).
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from dataclasses import dataclass

from sharpness._specs import SpecError

REQUIRED = ("id", "model", "checkpoint", "train", "test")
# Columns the table adds after the hyperparameters: a hyperparameter of the same name would be lost in it.
MEASURED = ("train_loss", "train_error", "test_loss", "test_error", "gap", "gap_loss")
# An id names its row's file (rows/<id>.json): letters, digits and . _ - + = only, not starting with a dot.
_ID = re.compile(r"[A-Za-z0-9_+=-][A-Za-z0-9._+=-]{0,199}")
# Data SPECs that are not files.
_BUILTIN_DATA = re.compile(r"digits|synthetic(:.*)?")

Value = int | float | str


class ManifestError(SpecError):
    """A manifest that cannot be used: the message names the row (or column) and the fix."""


@dataclass(frozen=True)
class Row:
    """One checkpoint of a study.

    Attributes:
        number: the row's number in the manifest, from 1 (CSV: data rows, header excluded).
        id: its unique name.
        model: model SPEC.
        checkpoint: checkpoint path as written in the manifest.
        train, test: data SPECs as written in the manifest.
        hyper: hyperparameter column -> value (numbers as ``int``/``float``, text as ``str``), manifest order.
        folder: the manifest's folder, against which relative paths resolve.
    """

    number: int
    id: str
    model: str
    checkpoint: str
    train: str
    test: str
    hyper: dict[str, Value]
    folder: str

    @property
    def checkpoint_path(self) -> str:
        """The checkpoint file, resolved against the manifest's folder."""
        return os.path.join(self.folder, self.checkpoint)

    @property
    def model_spec(self) -> str:
        """The model SPEC with a ``file.py:factory`` path resolved against the manifest's folder."""
        where, sep, factory = self.model.rpartition(":")
        return os.path.join(self.folder, where) + sep + factory if sep and where.endswith(".py") else self.model

    def data_spec(self, which: str) -> str:
        """The ``train`` or ``test`` data SPEC, a file path resolved against the manifest's folder."""
        spec = getattr(self, which)
        return spec if _BUILTIN_DATA.fullmatch(spec) else os.path.join(self.folder, spec)

    def content(self) -> dict:
        """What the row says, as written (the part of its store key that comes from the manifest)."""
        return {"id": self.id, "model": self.model, "checkpoint": self.checkpoint, "train": self.train,
                "test": self.test, "hyper": self.hyper}  # fmt: skip

    def where(self) -> str:
        """The row in a message: ``row 3 (id b2)``."""
        return f"row {self.number} (id {self.id})"


@dataclass(frozen=True)
class Manifest:
    """A checked manifest: its rows and hyperparameter columns (manifest order)."""

    path: str
    rows: tuple[Row, ...]
    hyper_columns: tuple[str, ...]


def read_manifest(path: str | os.PathLike, reserved: tuple[str, ...] = ()) -> Manifest:
    """Read and check a manifest's text (not its files: see `sharpness.study._runner.check_rows`).

    Args:
        path: a ``.csv`` (header row first) or ``.json`` file (a list of objects, or ``{"rows": [...]}``).
        reserved: further column names a hyperparameter may not take (the measures' names: table columns).

    Returns:
        The `Manifest`.

    Raises:
        ManifestError: one sentence naming the row or column: an unreadable file, a missing required column,
            an empty or repeated id, a column mixing numbers and text, an empty cell.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ManifestError(f"the manifest {path} does not exist or is not a file")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".csv":
        columns, records = _read_csv(path)
    elif ext == ".json":
        columns, records = _read_json(path)
    else:
        raise ManifestError(f"the manifest {path} must be a .csv or .json file")
    if not records:
        raise ManifestError(f"the manifest {path} has no rows; give one row per checkpoint")
    missing = [c for c in REQUIRED if c not in columns]
    if missing:
        raise ManifestError(f"the manifest {path} has no column {', '.join(missing)}; the required columns are "
                            f"{', '.join(REQUIRED)}")  # fmt: skip
    hyper_columns = tuple(c for c in columns if c not in REQUIRED)
    taken = [c for c in hyper_columns if c in MEASURED or c in reserved]
    if taken:
        raise ManifestError(f"the manifest's column {taken[0]!r} has the name of a column of the results table; "
                            "rename it")  # fmt: skip
    folder = os.path.dirname(os.path.abspath(path))
    rows = tuple(_row(number, record, hyper_columns, folder) for number, record in enumerate(records, start=1))
    _check_ids(rows)
    _check_column_kinds(rows, hyper_columns)
    return Manifest(path=path, rows=rows, hyper_columns=hyper_columns)


def _read_csv(path: str) -> tuple[list[str], list[dict[str, Value]]]:
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            lines = list(csv.reader(fh))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ManifestError(f"the manifest {path} is not a readable UTF-8 CSV file ({exc})") from None
    lines = [line for line in lines if any(cell.strip() for cell in line)]
    if not lines:
        raise ManifestError(f"the manifest {path} is empty; its first line names the columns")
    header = [cell.strip() for cell in lines[0]]
    if "" in header:
        raise ManifestError(f"the manifest {path} has a column without a name (column {header.index('') + 1})")
    repeated = [c for i, c in enumerate(header) if c in header[:i]]
    if repeated:
        raise ManifestError(f"the manifest {path} names the column {repeated[0]!r} twice")
    records = []
    for number, line in enumerate(lines[1:], start=1):
        if len(line) != len(header):
            raise ManifestError(f"manifest row {number} has {len(line)} cells but the header names {len(header)} "
                                "columns")  # fmt: skip
        # required columns are specs and names, read as text (an id 7 stays "7"); the others may be numbers
        records.append({c: text.strip() if c in REQUIRED else _cell(text.strip()) for c, text in zip(header, line)})
    return header, records


def _cell(text: str) -> Value:
    """A CSV cell as a number where it reads as one (an integer where it is one), else as text."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        return text
    return value if math.isfinite(value) else text


def _read_json(path: str) -> tuple[list[str], list[dict[str, Value]]]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"the manifest {path} is not a readable JSON file ({exc})") from None
    if isinstance(data, dict) and set(data) == {"rows"}:
        data = data["rows"]
    if not isinstance(data, list):
        raise ManifestError(f"the manifest {path} must hold a list of rows (objects), or {{\"rows\": [...]}}")
    columns: list[str] = []
    for number, record in enumerate(data, start=1):
        if not isinstance(record, dict):
            raise ManifestError(f"manifest row {number} is a {type(record).__name__}, not an object of columns")
        for column, value in record.items():
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ManifestError(f"manifest row {number}: column {column!r} holds {json.dumps(value)}; a cell "
                                    "holds a number or a string")  # fmt: skip
            if isinstance(value, float) and not math.isfinite(value):
                raise ManifestError(f"manifest row {number}: column {column!r} is not a finite number")
            if column not in columns:
                columns.append(column)
    for number, record in enumerate(data, start=1):
        absent = [c for c in columns if c not in record]
        if absent:
            raise ManifestError(f"manifest row {number} has no column {absent[0]!r}, which other rows have; give "
                                "every row the same columns")  # fmt: skip
    return columns, data


def _row(number: int, record: dict[str, Value], hyper_columns: tuple[str, ...], folder: str) -> Row:
    for column in REQUIRED:
        value = record[column]
        if not isinstance(value, str) or not value.strip():
            shown = "empty" if value == "" else f"{value!r}, not text"
            raise ManifestError(f"manifest row {number}: column {column!r} is {shown}; give a {column}")
    ident = str(record["id"]).strip()
    if not _ID.fullmatch(ident):
        raise ManifestError(f"manifest row {number}: id {ident!r} cannot name a file; use letters, digits and "
                            ". _ - + = (not starting with a dot, at most 200 characters)")  # fmt: skip
    for column in hyper_columns:
        if record[column] == "":
            raise ManifestError(f"manifest row {number} (id {ident}): column {column!r} is empty; give every row "
                                "a value")  # fmt: skip
    return Row(
        number=number, id=ident, model=record["model"].strip(), checkpoint=record["checkpoint"].strip(),
        train=record["train"].strip(), test=record["test"].strip(), hyper={c: record[c] for c in hyper_columns},
        folder=folder,
    )  # fmt: skip


def _check_ids(rows: tuple[Row, ...]) -> None:
    """Refuse two rows with one id (or ids differing only in case: one file on case-insensitive file systems)."""
    seen: dict[str, Row] = {}
    for row in rows:
        other = seen.get(row.id.lower())
        if other is not None:
            same = "the same id" if other.id == row.id else f"ids that differ only in case ({other.id}, {row.id})"
            raise ManifestError(f"manifest rows {other.number} and {row.number} have {same}; give every row its "
                                "own id")  # fmt: skip
        seen[row.id.lower()] = row


def _check_column_kinds(rows: tuple[Row, ...], hyper_columns: tuple[str, ...]) -> None:
    """Refuse a hyperparameter column holding numbers in some rows and text in others."""
    for column in hyper_columns:
        first = rows[0]
        numeric = not isinstance(first.hyper[column], str)
        for row in rows[1:]:
            if (not isinstance(row.hyper[column], str)) != numeric:
                kind = "text" if numeric else "a number"
                raise ManifestError(
                    f"manifest {row.where()}: column {column!r} holds {kind} ({row.hyper[column]!r}) where row "
                    f"{first.number} holds {'a number' if numeric else 'text'}; a column holds numbers or text, "
                    "not both"
                )
