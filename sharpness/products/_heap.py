"""Keep memory the process frees for reuse, instead of handing it back to the system after every tensor.

Products, gradients and grids over a data set in pieces allocate and free the same large tensors (a few MiB
each) piece after piece. glibc's ``malloc`` returns freed memory at the top of its heap to the system once more
than ``M_TRIM_THRESHOLD`` of it is free, and serves allocations above ``M_MMAP_THRESHOLD`` from fresh mappings;
both thresholds start at 128 KiB and only grow as large blocks are freed. Every piece then touches its tensors'
pages afresh, and on a 2-core virtual machine those page faults cost a ResNet-20 Hessian-vector product a fifth
of its time (half a million faults a product, 2 GB of first touches). With the mapping threshold at glibc's
largest (32 MiB) and the trim threshold at 128 MiB, a product takes about ten thousand.

Process-wide and once: `sharpness.Objective` applies it when it runs on the CPU. The memory kept is at
most the trim threshold above what the process holds at its peak. ``SHARPNESS_RETAIN_FREED_MEMORY=0`` in the
environment leaves the allocator as it is. Nothing happens outside Linux with glibc.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest: its own dynamic threshold never grows past it
TRIM_THRESHOLD = 128 * 2**20
ENV = "SHARPNESS_RETAIN_FREED_MEMORY"

_lock = threading.Lock()
_state: list[bool] = []  # [applied], once decided


def retain_freed_memory() -> bool:
    """Set glibc's ``malloc`` to keep freed memory for reuse (see the module docstring), once per process.

    Returns:
        Whether the settings are in force: ``False`` outside Linux with glibc, where ``mallopt`` refused them, or
            where ``SHARPNESS_RETAIN_FREED_MEMORY`` is ``0``, ``false``, ``no`` or ``off``.
    """
    with _lock:
        if not _state:
            _state.append(_apply())
        return _state[0]


def _apply() -> bool:
    if os.environ.get(ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; the mapping threshold first (setting either one fixes both).
    return mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1


__all__ = ["retain_freed_memory"]
