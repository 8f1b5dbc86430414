"""Progress bars for long loops: shown on a terminal, silenceable everywhere."""

from __future__ import annotations

import sys

import torch.distributed as dist
from tqdm.auto import tqdm


def progress_bar(total: int | None, desc: str, progress: bool | None = None, **kwargs) -> tqdm:
    """A tqdm bar. ``progress=None`` shows it only when stderr is a terminal; ``False`` hides it. In a
    ``torch.distributed`` group only process 0 shows bars (the others would repeat them)."""
    enabled = sys.stderr.isatty() if progress is None else bool(progress)
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        enabled = False
    return tqdm(total=total, desc=desc, disable=not enabled, leave=False, dynamic_ncols=True, **kwargs)
