"""Progress of long loops: tqdm bars on a terminal, plain phase lines without one (logs, ``nohup``), silenceable.

Without a terminal a bar is replaced by `PhaseLines`: nothing for a phase shorter than
`FIRST_LINE_S`, then a line on standard error at least every `LINE_EVERY_S` seconds naming every open
phase and bar, e.g. ``[sharpness] measuring original model (node) > lanczos 40/300, residual=1.2e-03: 62 s
elapsed``, and a closing line with the total time. A bar made with ``estimate=True`` (grids) also says, after its
first update, how long the whole loop will take, when that is longer than `FIRST_LINE_S`. Lines come with
updates, and from a background thread (every `TICK_S` s) where an update is late. The clock is `clock`
(tests put a fake monotonic clock there, and no ticker).
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch.distributed as dist
from tqdm.auto import tqdm

# The monotonic clock of the phase lines, in seconds (replaceable: tests use a fake one, never real sleeps).
clock: Callable[[], float] = time.monotonic
# A phase shorter than this prints no line: short runs stay quiet in logs.
FIRST_LINE_S = 5.0
# Then a line at least this often (twice a minute, so a log shows life at least once a minute).
LINE_EVERY_S = 30.0
# Real seconds between the looks of a background thread that writes the line when no update comes in time (a setup
# step with no loop, one very long iteration); None: no thread (tests driving a fake clock).
TICK_S: float | None = 5.0

_open: list[PhaseLines] = []  # phases and line-mode bars open now, outermost first
_phases: list[str] = []  # labels of the open phases (progress_phase), for the terminal bars' descriptions
_last_line = [-math.inf]  # clock time of the last phase line written
_lock = threading.RLock()  # the open phases are read by the ticker thread too


def _tick() -> None:
    """Write the elapsed line if one is due (what the ticker thread does every `TICK_S` seconds)."""
    with _lock:
        if _open:
            _open[-1].due(clock())


def _ticker(stop: threading.Event) -> None:
    while not stop.wait(TICK_S):
        _tick()


def _enabled(progress: bool | None) -> bool:
    if progress is False:
        return False
    return not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0)


def _lines_wanted(progress: bool | None) -> bool:
    """Plain lines instead of a bar: progress left to the default (``None``) and standard error no terminal."""
    return progress is None and not sys.stderr.isatty()


def _program() -> str:
    """The line prefix: ``landscape`` under ``python -m landscape``, else ``sharpness``."""
    main = sys.argv[0] if sys.argv else ""
    ran_landscape = os.path.basename(main) == "__main__.py" and os.path.basename(os.path.dirname(main)) == "landscape"
    return "landscape" if ran_landscape else "sharpness"


def _count(n: float) -> str:
    return f"{n:.0f}" if float(n).is_integer() else f"{n:.1f}"


class PhaseLines:
    """A tqdm-compatible bar (``update``, ``set_postfix``, ``set_description``, ``close``, context manager) that
    writes plain phase lines to standard error instead of drawing (see the module docstring).

    Args:
        total: iterations expected (``None``: unknown).
        desc: what is being done (``"lanczos"``, ``"grid points"``).
        unit: the unit of ``total`` (``"it"``, ``"pt"``).
        estimate: after the first update, print the count and an estimate of the whole loop's time.
    """

    def __init__(self, total: float | None, desc: str, unit: str = "it", estimate: bool = False) -> None:
        self.total, self.desc, self.unit, self.estimate = total, desc, unit, estimate
        self.n: float = 0
        self.postfix = ""
        self.start = clock()
        self.lines = 0
        self._stop: threading.Event | None = None
        with _lock:
            if not _open:  # the outermost phase: its own cadence, and a ticker for the silences between updates
                _last_line[0] = -math.inf
                if TICK_S is not None:
                    self._stop = threading.Event()
                    threading.Thread(target=_ticker, args=(self._stop,), daemon=True, name="progress-lines").start()
            _open.append(self)

    def __enter__(self) -> PhaseLines:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True, **kwargs) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in {**(ordered_dict or {}), **kwargs}.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = str(s)

    def set_description(self, desc: str, refresh: bool = True) -> None:
        self.desc = desc

    def status(self) -> str:
        """This bar's part of a line: ``desc n/total unit, postfix``."""
        if self.total is None and self.n == 0:
            return self.desc
        done = _count(self.n) + (f"/{_count(self.total)}" if self.total is not None else "")
        unit = "" if self.unit == "it" else f" {self.unit}"
        return f"{self.desc} {done}{unit}" + (f", {self.postfix}" if self.postfix else "")

    def update(self, n: float = 1) -> None:
        with _lock:
            first = self.n == 0
            self.n += n
            now = clock()
            if first and self.estimate and self.total and 0 < self.n < self.total:
                whole = (now - self.start) * self.total / self.n
                if whole >= FIRST_LINE_S:
                    self._write(f"{self.desc}: {_count(self.total)} {self.unit} in all; the first {_count(self.n)} "
                                f"took {now - self.start:.1f} s, so about {whole:.0f} s in all", now)  # fmt: skip
                    return
            self.due(now)

    def due(self, now: float) -> None:
        """Write the line naming every open phase if the outermost has run `FIRST_LINE_S` and the last line
        is `LINE_EVERY_S` old."""
        root = _open[0].start if _open else self.start
        if now - root >= FIRST_LINE_S and now - _last_line[0] >= LINE_EVERY_S:
            self._write(f"{' > '.join(bar.status() for bar in _open)}: {now - root:.0f} s elapsed", now)

    def _write(self, text: str, now: float) -> None:
        try:
            print(f"[{_program()}] {text}", file=sys.stderr, flush=True)
        except (OSError, ValueError):  # standard error closed or gone: a progress line is not worth failing for
            pass
        _last_line[0] = now
        for bar in _open:
            bar.lines += 1

    def close(self) -> None:
        with _lock:
            if self._stop is not None:
                self._stop.set()
            if self not in _open:
                return
            if self is _open[0] and self.lines:  # the outermost, after lines were written: say it ended
                now = clock()
                self._write(f"{self.status()}: done in {now - self.start:.0f} s", now)
            _open.remove(self)


def progress_bar(total: int | None, desc: str, progress: bool | None = None, *, estimate: bool = False,
                 **kwargs) -> tqdm | PhaseLines:  # fmt: skip
    """A progress bar: a tqdm bar on a terminal, plain phase lines (`PhaseLines`) without one.

    Args:
        total: iterations expected (``None``: unknown).
        desc: what is being done.
        progress: ``None`` (default): a bar on a terminal, phase lines otherwise; ``True``: a tqdm bar wherever
            standard error goes; ``False``: nothing. In a ``torch.distributed`` group only process 0 reports (the
            others would repeat it).
        estimate: with phase lines, say after the first update how long the whole loop will take (grids).
        **kwargs: passed to tqdm (``unit`` is used by the phase lines too).

    Returns:
        An object with tqdm's ``update``, ``set_postfix``, ``set_postfix_str``, ``set_description`` and ``close``,
            usable in ``with``.
    """
    enabled = _enabled(progress)
    if enabled and _lines_wanted(progress):
        return PhaseLines(total, desc, kwargs.get("unit", "it"), estimate)
    if _phases:
        desc = f"{_phases[-1]}: {desc}"
    return tqdm(total=total, desc=desc, disable=not enabled, leave=False, dynamic_ncols=True, **kwargs)


@contextmanager
def progress_phase(label: str, progress: bool | None = None) -> Iterator[None]:
    """Name a phase around inner loops: their bars (on a terminal) or phase lines (without one) say ``label``.

    ``progress`` is as for `progress_bar` (``False``: nothing).
    """
    lines = PhaseLines(None, label) if _enabled(progress) and _lines_wanted(progress) else None
    _phases.append(label)
    try:
        yield
    finally:
        _phases.pop()
        if lines is not None:
            lines.close()
