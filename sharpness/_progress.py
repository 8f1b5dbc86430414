"""Progress bars for long loops: shown on a terminal, silenceable everywhere."""

from __future__ import annotations

import sys

from tqdm.auto import tqdm


def progress_bar(total: int | None, desc: str, progress: bool | None = None, **kwargs) -> tqdm:
    """A tqdm bar. ``progress=None`` shows it only when stderr is a terminal; ``False`` hides it."""
    enabled = sys.stderr.isatty() if progress is None else bool(progress)
    return tqdm(total=total, desc=desc, disable=not enabled, leave=False, dynamic_ncols=True, **kwargs)
