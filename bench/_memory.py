"""Peak memory of one operation, measured in a fresh process (shared by the benchmark scripts).

A script re-runs itself as ``python SCRIPT --memory-probe JSON`` (:func:`run_probe`); the child builds its model
and data, warms up, and calls :func:`measure` on the operation, which prints what it found as one JSON line.

* **RSS**: the kernel's high-water mark, reset just before the operation (``/proc/self/clear_refs``, Linux 4.0
  and later), minus the resident size at that moment; elsewhere ``ru_maxrss``, which only counts what exceeds
  the process's earlier high-water mark (``rss_precise`` says which).
* **torch allocator** (optional: its trace holds every allocation, too large for long operations): the peak of
  the bytes torch's CPU allocator holds during the operation, from the profiler's memory events.

On a GPU (``measure(..., device=cuda)``) the resident set says nothing about the operation: every figure is instead
``torch.cuda.max_memory_allocated`` during it (the peak reset just before) minus what was allocated then, stored under
the same keys, with ``"memory": "cuda_max_memory_allocated"`` in the result.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any


def _status_kb() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, val = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(val.split()[0])
    return out


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _maxrss_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def torch_peak_bytes(fn: Callable[[], Any]) -> int | None:
    """Peak of bytes allocated by torch's CPU allocator during ``fn`` (profiler memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = json.load(fh)["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]" and "args" in e]
    return max(totals) if totals else None


def module_gradient(model, loss_fn, X, y) -> Callable[[], None]:
    """The reference operation: one ``loss.backward()`` of the module over all of ``X`` at once."""

    def op() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(model(X), y).backward()

    return op


def cuda_peak_bytes(op: Callable[[], Any], device) -> int:
    """Peak bytes the CUDA caching allocator hands out during ``op`` above what it held before (peak reset first)."""
    import torch

    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = op()
    del result
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def budget_of(spec: dict[str, Any]) -> dict[str, int]:
    """``{"memory_budget": ...}`` where the probe's spec sets one, for ``Objective(**...)``."""
    return {"memory_budget": spec["memory_budget"]} if "memory_budget" in spec else {}


def measure(
    op: Callable[[], Any],
    clean: Callable[[], None],
    rounds: Sequence[str] = ("first", "repeat"),
    torch_peak=True,
    device=None,
) -> dict[str, Any]:
    """``rss_<round>_bytes`` for each of ``rounds`` (``op`` run again in the same process: one-time
    initialisations drop out of the later rounds), ``rss_precise``, and ``torch_peak_bytes`` (``None`` unless
    ``torch_peak``). ``clean`` runs before each round. On a CUDA ``device`` every figure is the GPU's peak
    allocation instead (see the module docstring; ``torch_peak_bytes`` is the first round's)."""
    out: dict[str, Any] = {}
    if device is not None and str(device).startswith("cuda"):
        for key in rounds:
            clean()
            gc.collect()
            out[f"rss_{key}_bytes"] = cuda_peak_bytes(op, device)
        out.update(rss_precise=True, memory="cuda_max_memory_allocated")
        out["torch_peak_bytes"] = out[f"rss_{rounds[0]}_bytes"] if torch_peak else None
        return out
    for key in rounds:
        clean()
        gc.collect()
        base = _status_kb()["VmRSS"]
        precise = _reset_peak()
        maxrss0 = _maxrss_kb()
        result = op()
        del result
        if precise:
            out[f"rss_{key}_bytes"] = (_status_kb()["VmHWM"] - base) * 1024
        else:  # coarse: counts only what exceeds the earlier high-water mark
            out[f"rss_{key}_bytes"] = (_maxrss_kb() - maxrss0) * 1024
        out["rss_precise"] = precise
    out["torch_peak_bytes"] = None
    if torch_peak:
        clean()
        gc.collect()
        out["torch_peak_bytes"] = torch_peak_bytes(op)
    return out


def run_probe(script: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Run ``script --memory-probe spec`` in a fresh Python process; the last JSON line it prints."""
    cmd = [sys.executable, os.path.abspath(script), "--memory-probe", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"memory probe failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(lines[-1])
