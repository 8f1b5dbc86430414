"""The study's store: one JSON file per manifest row (``rows/<id>.json``), written atomically, keyed by a digest.

The key digests what the result depends on: the row as written, the measurement options, and the bytes of the
checkpoint and of data files. A stored row whose key matches is reused; any change recomputes that row only.
Since every file is written whole or not at all (`sharpness._results.write_atomic`), a study killed at any
moment leaves only complete rows behind.
"""

from __future__ import annotations

import hashlib
import json
import os

from sharpness._results import jsonable, write_text_atomic

# Bumped when what a row file holds changes meaning: older files are then recomputed, not misread.
STORE_VERSION = 1


def file_digest(path: str, cache: dict[str, str] | None = None) -> str:
    """SHA-256 of a file's bytes (hex), remembered in ``cache`` by path, size and modification time."""
    stat = os.stat(path)
    token = f"{os.path.realpath(path)}:{stat.st_size}:{stat.st_mtime_ns}"
    if cache is not None and token in cache:
        return cache[token]
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(2**20), b""):
            digest.update(block)
    if cache is not None:
        cache[token] = digest.hexdigest()
    return digest.hexdigest()


def row_key(content: dict, options: dict, files: dict[str, str]) -> str:
    """The store key of a row: SHA-256 (hex) of its content, the options and its files' digests (name -> hex)."""
    text = json.dumps(jsonable({"version": STORE_VERSION, "row": content, "options": options, "files": files}),
                      sort_keys=True)  # fmt: skip
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class RowStore:
    """The row files under ``folder/rows``."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = os.path.join(os.fspath(folder), "rows")

    def path(self, ident: str) -> str:
        """The file of the row ``ident``."""
        return os.path.join(self.folder, f"{ident}.json")

    def load(self, ident: str, key: str) -> dict | None:
        """The stored record of row ``ident`` if it was computed under ``key``, else ``None`` (absent, stale, or
        not a record this version wrote)."""
        try:
            with open(self.path(ident), encoding="utf-8") as fh:
                record = json.load(fh)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None
        return record if isinstance(record, dict) and record.get("key") == key else None

    def save(self, record: dict) -> None:
        """Store ``record`` (with its ``id`` and ``key``) atomically."""
        os.makedirs(self.folder, exist_ok=True)
        write_text_atomic(self.path(record["id"]), json.dumps(jsonable(record), indent=1))
