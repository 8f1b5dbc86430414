"""The command lines' standard streams and arguments: text that every output can record, and output that outlives
its reader.

- Every argument must be UTF-8 text: file names are recorded in the outputs (JSON, figure metadata, HTML) and
  printed, and a name whose bytes are in another encoding (Latin-1 ``caf\\xe9``) can be none of these. It is
  refused before any work, so nothing is written.
- A reader that goes away (``| head -1``, a closed terminal) does not stop the command: what it prints from then
  on is discarded, every output file is still written, and the exit status is 141, the status of a program ended
  by SIGPIPE (what ``cat`` or ``grep`` give in the same pipe), unless the command itself failed. A closed stdout
  (``>&-``) prints nothing and changes nothing else. Text the terminal's encoding cannot show is printed with
  backslash escapes instead of failing.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
from collections.abc import Iterator, Sequence

from sharpness._specs import SpecError

# The exit status of a program ended by SIGPIPE, as the shell reports it.
READER_GONE_STATUS = 128 + signal.SIGPIPE


def require_text(args: Sequence[str]) -> None:
    """Refuse an argument that is not UTF-8 text (a file name in another encoding, decoded by Python with
    ``surrogateescape``), in one sentence naming its option and showing its bytes.

    Raises:
        SpecError: naming the argument and the fix.
    """
    for i, arg in enumerate(args):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            shown = ascii(os.fsencode(arg))[2:-1]
            what = f"{args[i - 1]} " if i and args[i - 1].startswith("-") else "the argument "
            raise SpecError(
                f"{what}'{shown}' is not UTF-8 text (a name in another encoding, such as Latin-1); file names are "
                "recorded in the outputs (JSON, figure metadata, HTML), so rename the file to a UTF-8 name"
            ) from None


class _Stream:
    """A text stream that discards what it is given once its reader has gone (EPIPE), and escapes what its
    encoding cannot show; everything else is the wrapped stream's."""

    def __init__(self, stream):
        self._stream = stream
        self.reader_gone = False

    def write(self, text: str) -> int:
        if not self.reader_gone:
            self._deliver(lambda: self._stream.write(text), text)
        return len(text)

    def flush(self) -> None:
        if not self.reader_gone:
            self._deliver(self._stream.flush, "")

    def _deliver(self, call, text: str) -> None:
        try:
            call()
        except UnicodeEncodeError:
            encoding = self._stream.encoding or "utf-8"
            self._deliver(lambda: self._stream.write(text.encode(encoding, "backslashreplace").decode(encoding)), "")
        except OSError as err:
            if err.errno not in (errno.EPIPE, errno.ECONNRESET):
                raise
            self.reader_gone = True
            # What is still buffered would fail again when the interpreter flushes at exit: send it nowhere.
            with contextlib.suppress(OSError, ValueError):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, self._stream.fileno())
                os.close(devnull)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def guarded_streams() -> Iterator[list[_Stream]]:
    """``sys.stdout`` and ``sys.stderr`` wrapped (see `_Stream`) while the block runs; yields the wrappers,
    whose ``reader_gone`` says whether a reader went away. A closed stream (``None``) is left as it is."""
    saved = sys.stdout, sys.stderr
    streams = [None if s is None else _Stream(s) for s in saved]
    sys.stdout, sys.stderr = streams
    try:
        yield [s for s in streams if s is not None]
    finally:
        for stream in streams:
            if stream is not None:
                stream.flush()  # a reader that left during the last lines is noticed here, not at exit
        sys.stdout, sys.stderr = saved
