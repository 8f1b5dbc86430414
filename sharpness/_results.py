"""Result objects that say how they were obtained, and their JSON form."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import Tensor

from manifolds import ParamLayout


def figure_bytes(fig, fmt: str, dpi: int, title: str, description: str = "", software: str = "relu-geometry") -> bytes:
    """A matplotlib figure rendered as ``fmt`` (``"png"``, ``"pdf"``, ``"svg"``) at ``dpi``, with ``title`` and
    ``description`` (provenance: model, data, measure, the paper's figure) under the metadata keys the format
    knows: PDF ``Title`` and ``Subject``, PNG and SVG ``Title`` and ``Description``, PNG also ``Software``."""
    import io

    meta = {"Title": title}
    if description:
        meta["Subject" if fmt == "pdf" else "Description"] = description
    if fmt == "png":
        meta["Software"] = software
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, dpi=dpi, metadata=meta)
    return buffer.getvalue()


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` (text or bytes) to ``path`` through a temporary file in the same folder, then rename
    it, so no half-written file is ever left.

    A symbolic link is followed: its target is written (atomically) and the link stays a link. A path that
    exists and is not a regular file (a folder, a device, a pipe, a socket) is refused with ``ValueError``:
    the rename would replace it.
    """
    path = os.path.realpath(os.fspath(path))
    if os.path.lexists(path) and not os.path.isfile(path):
        raise ValueError(f"{path} exists and is not a regular file; it is not replaced")
    directory = os.path.dirname(path)
    # A short temporary name: the final name may already be as long as the file system allows.
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a plain open() would honour the umask
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_tensors_atomic(path: str | os.PathLike, tensors: dict) -> None:
    """Write ``{name: tensor}`` to ``path`` as a ``.safetensors`` checkpoint, atomically (see
    [`write_atomic`][sharpness.io.write_atomic]); tensors are detached and made contiguous first."""
    from safetensors.torch import save

    write_atomic(path, save({k: v.detach().contiguous() for k, v in tensors.items()}))


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically (see [`write_atomic`][sharpness.io.write_atomic])."""
    write_atomic(path, text)


def jsonable(x: Any) -> Any:
    """``x`` with tensors and numpy arrays/scalars as Python lists/numbers, non-finite floats as strings."""
    if isinstance(x, Tensor):
        return jsonable(x.detach().cpu().tolist())
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, np.generic):
        return jsonable(x.item())
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


@dataclass(frozen=True)
class EigenResult:
    """Eigenpairs of a symmetric operator and how they were found.

    Attributes:
        eigenvalues: ``(k,)`` float64 tensor, largest algebraic first.
        eigenvectors: ``(k, n)`` tensor, row ``i`` belongs to ``eigenvalues[i]``, unit Euclidean
            norm in the operator's coordinates (whitened coordinates for Riemannian operators are
            mapped back by the measure that built them; see ``coordinates``).
        residuals: ``(k,)`` relative residuals ``||A v - theta v|| / max(|theta|, tiny)``.
        n_matvec: operator applications spent (Hessian-vector products for curvature operators).
        iterations: solver iterations.
        converged: whether every requested pair met ``tol``. A solver that stops on ``max_iter``
            says ``False`` and the values are the best estimates so far, never silently.
        history: per-iteration records (``{"iteration", "eigenvalues", "residual"}``).
        method: solver name (``"lanczos"``, ``"power"``, ...).
        tol: relative tolerance asked for.
        seconds: wall time of the solve.
        layout: when set, maps flat vectors back to named parameter tensors.
        coordinates: what the eigenvectors are (``"euclidean"``, ``"tangent"`` ...).
        info: free-form extra facts (metric, shift used, loss value ...), JSON-serialisable.
    """

    eigenvalues: Tensor
    eigenvectors: Tensor
    residuals: Tensor
    n_matvec: int
    iterations: int
    converged: bool
    history: list[dict] = field(default_factory=list)
    method: str = ""
    tol: float = 0.0
    seconds: float = 0.0
    layout: ParamLayout | None = field(default=None, repr=False)
    coordinates: str = "euclidean"
    info: dict = field(default_factory=dict)

    @property
    def value(self) -> float:
        """The largest eigenvalue as a Python float."""
        return float(self.eigenvalues[0])

    @property
    def k(self) -> int:
        return int(self.eigenvalues.shape[0])

    @property
    def invariant_under(self) -> tuple[str, ...] | None:
        """The rescaling kinds the value is invariant under on this network (``info["invariant_under"]``: the
        measure's claim cut to the rescalings the network has; ``()`` for none), or ``None`` where not recorded."""
        kinds = self.info.get("invariant_under")
        return None if kinds is None else tuple(kinds)

    def parameter_vectors(self) -> list[dict[str, Tensor]]:
        """Eigenvectors as dictionaries shaped like the model's parameters."""
        if self.layout is None:
            raise ValueError("this result has no parameter layout; use .eigenvectors (flat)")
        return [self.layout.unflatten(v) for v in self.eigenvectors]

    def replace(self, **changes: Any) -> EigenResult:
        return dataclasses.replace(self, **changes)

    def to_dict(self, with_vectors: bool = False) -> dict:
        """JSON-serialisable summary (eigenvectors only on request: they are large)."""
        out = {
            "value": self.value,
            "eigenvalues": self.eigenvalues.tolist(),
            "residuals": self.residuals.tolist(),
            "n_hvp": self.n_matvec,
            "iterations": self.iterations,
            "converged": self.converged,
            "method": self.method,
            "tol": self.tol,
            "seconds": self.seconds,
            "coordinates": self.coordinates,
            "history": self.history,
            **self.info,
        }
        if with_vectors:
            out["eigenvectors"] = self.eigenvectors.tolist()
        return jsonable(out)

    def save_json(self, path: str | os.PathLike, with_vectors: bool = False) -> None:
        write_text_atomic(path, json.dumps(self.to_dict(with_vectors), indent=2))


@dataclass(frozen=True)
class TraceResult:
    """Hutchinson trace estimate: ``estimate`` +- ``stderr`` from ``n_probes`` Rademacher probes."""

    estimate: float
    stderr: float
    n_probes: int
    n_matvec: int
    samples: Tensor
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return jsonable(
            {
                "estimate": self.estimate,
                "stderr": self.stderr,
                "n_probes": self.n_probes,
                "n_hvp": self.n_matvec,
                "seconds": self.seconds,
            }
        )

