"""Progress of long first-time work (a GGUF's metadata directory, the CPU kernels' build, loading
weights, warming up): a line rewritten in place while stderr is a terminal, log lines elsewhere.

    with Progress("loading weights", total=len(names)) as progress:
        for name in names:
            ...
            progress.advance()

On a terminal the line reads `loading weights: 12/30 (3.1 s)` and ends with `done in 4.0 s`; in a
log (stderr not a terminal, as a daemon's is) there is one line at the start and one at the end,
written to the stream itself: a stage process has no logging handlers of its own.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO

REDRAW_INTERVAL_S = 0.1
CLEAR_LINE = "\r\x1b[K"


class Progress:
    """One piece of work's progress; `total` None counts nothing and shows the time alone."""

    def __init__(self, what: str, total: int | None = None, stream: TextIO | None = None) -> None:
        self.what = what
        self.total = total
        self.done = 0
        self.note = ""
        self._stream = stream if stream is not None else sys.stderr
        self._live = _is_terminal(self._stream)
        self._started_s = time.monotonic()
        self._drawn_s = 0.0

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self._started_s

    def start(self) -> Progress:
        if self._live:
            self._draw()
        else:
            self._log(f"{self.what} ...")
        return self

    def advance(self, count: int = 1, note: str = "") -> None:
        """`count` more units done; `note` (what is under way) replaces the last one."""
        self.done += count
        self.update(note)

    def update(self, note: str = "") -> None:
        """Redraws the line (at most every REDRAW_INTERVAL_S) with `note`."""
        self.note = note
        if self._live and time.monotonic() - self._drawn_s >= REDRAW_INTERVAL_S:
            self._draw()

    def finish(self, failed: bool = False) -> None:
        outcome = f"{'failed after' if failed else 'done in'} {self.elapsed_s:.1f} s"
        if self._live:
            self._stream.write(f"{CLEAR_LINE}{self.what}: {outcome}\n")
            self._stream.flush()
        else:
            self._log(f"{self.what}: {outcome}")

    def _log(self, line: str) -> None:
        self._stream.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
        self._stream.flush()

    def _draw(self) -> None:
        self._drawn_s = time.monotonic()
        count = f"{self.done}/{self.total} " if self.total is not None else ""
        note = f" {self.note}" if self.note else ""
        self._stream.write(f"{CLEAR_LINE}{self.what}: {count}({self.elapsed_s:.1f} s){note}")
        self._stream.flush()

    def __enter__(self) -> Progress:
        return self.start()

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.finish(failed=exc_type is not None)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or file-less stream
        return False
