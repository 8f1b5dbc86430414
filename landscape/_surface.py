"""A computed loss curve or surface, and its ``.npz`` + ``.json`` files.

A [`Surface`][landscape.Surface] holds everything needed to redraw a plot without recomputing it: the grid
axes, the loss (and accuracy) at every grid point, axis labels, a title and free-form metadata
(directions' seeds, normalization, center loss, timing). ``save`` writes ``STEM.npz`` (arrays) and
``STEM.json`` (everything else), each atomically, so an interrupted run never leaves a
half-written file.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sharpness.io import jsonable, write_atomic, write_text_atomic


@dataclass(frozen=True)
class Surface:
    """Loss over a 1-D line or a 2-D grid of parameter-space coordinates.

    Attributes:
        x: ``(nx,)`` coordinates along the first axis.
        y: ``(ny,)`` coordinates along the second axis, or ``None`` for a line.
        loss: ``(ny, nx)`` with ``loss[i, j]`` at ``(x[j], y[i])``; ``(nx,)`` for a line.
        accuracy: same shape as ``loss`` (fraction of correct argmax predictions), or ``None``.
        x_label: axis label of ``x`` (matplotlib mathtext allowed).
        y_label: axis label of ``y`` (``""`` for a line).
        title: what the surface shows, including which reading of "fixed weight" where it applies.
        z_label: what ``loss`` is (e.g. ``"loss"``, ``r"$\\sin(y)$"``).
        extras: further arrays saved in the ``.npz`` (e.g. ``fixed``: the fixed-weight value).
        metadata: JSON-serialisable facts about how the surface was computed.
    """

    x: np.ndarray
    y: np.ndarray | None
    loss: np.ndarray
    accuracy: np.ndarray | None = None
    x_label: str = "x"
    y_label: str = ""
    title: str = ""
    z_label: str = "loss"
    extras: dict[str, np.ndarray] = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)

    def __post_init__(self):
        expected = (len(self.x),) if self.y is None else (len(self.y), len(self.x))
        if tuple(self.loss.shape) != expected:
            raise ValueError(f"loss has shape {tuple(self.loss.shape)}, expected {expected} from the axes")
        if self.accuracy is not None and tuple(self.accuracy.shape) != expected:
            raise ValueError(f"accuracy has shape {tuple(self.accuracy.shape)}, expected {expected}")

    @property
    def is_line(self) -> bool:
        return self.y is None

    def replace(self, **changes: Any) -> Surface:
        return dataclasses.replace(self, **changes)

    def center_index(self) -> tuple[int, ...]:
        """Index of the grid point at coordinates 0 (``(j,)`` for a line, ``(i, j)`` for a plane)."""
        j = int(np.flatnonzero(self.x == 0)[0])
        return (j,) if self.y is None else (int(np.flatnonzero(self.y == 0)[0]), j)

    def save(self, stem: str | os.PathLike) -> tuple[Path, Path]:
        """Write ``STEM.npz`` (``x``, ``y``, ``loss``, ``accuracy``, extras) and ``STEM.json``.

        A line stores ``y`` as an empty array. Returns the two paths.
        """
        stem = Path(stem)
        arrays = {"x": np.asarray(self.x), "y": np.asarray([] if self.y is None else self.y), "loss": self.loss}
        if self.accuracy is not None:
            arrays["accuracy"] = self.accuracy
        arrays.update({k: np.asarray(v) for k, v in self.extras.items()})
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        npz, meta = stem.with_name(stem.name + ".npz"), stem.with_name(stem.name + ".json")
        record = {
            "kind": "line" if self.is_line else "plane",
            "x_label": self.x_label,
            "y_label": self.y_label,
            "z_label": self.z_label,
            "title": self.title,
            "extras": sorted(self.extras),
            "metadata": self.metadata,
        }
        text = json.dumps(jsonable(record), indent=2)
        write_atomic(npz, buffer.getvalue())
        write_text_atomic(meta, text + "\n")
        return npz, meta

    @classmethod
    def load(cls, stem: str | os.PathLike) -> Surface:
        """Read a surface written by [`save`][landscape.Surface.save] (``STEM``, ``STEM.npz`` or ``STEM.json``)."""
        stem = Path(stem)
        if stem.suffix in (".npz", ".json"):
            stem = stem.with_suffix("")
        with open(stem.with_name(stem.name + ".json")) as fh:
            record = json.load(fh)
        with np.load(stem.with_name(stem.name + ".npz"), allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
        return cls(
            x=arrays["x"],
            y=None if record["kind"] == "line" else arrays["y"],
            loss=arrays["loss"],
            accuracy=arrays.get("accuracy"),
            x_label=record["x_label"],
            y_label=record["y_label"],
            title=record["title"],
            z_label=record.get("z_label", "loss"),
            extras={k: arrays[k] for k in record.get("extras", [])},
            metadata=record["metadata"],
        )


def spans_decades(surfaces: Sequence[Surface], decades: float = 2.0) -> bool:
    """Whether the finite losses are all positive and span more than ``decades`` decades: then a linear
    scale would draw the low ones (the minimum and its neighbourhood) as one flat blob."""
    finite = np.concatenate([s.loss[np.isfinite(s.loss)].ravel() for s in surfaces])
    return finite.size > 0 and decades_apart(float(finite.min()), float(finite.max()), decades)


def decades_apart(low: float, high: float, decades: float = 2.0) -> bool:
    """Whether positive values from ``low`` to ``high`` span more than ``decades`` decades (a case for a log scale)."""
    return low > 0 and high > 10**decades * low


def resolve_log(log: bool | str, surfaces: Sequence[Surface]) -> bool:
    """``log`` as a bool: ``"auto"`` is logarithmic where the losses span more than two decades."""
    if log == "auto":
        return spans_decades(surfaces)
    if not isinstance(log, (bool, np.bool_)):
        raise ValueError(f"log must be True, False or 'auto', got {log!r}")
    return bool(log)
