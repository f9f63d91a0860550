"""The one clock every process shares: CLOCK_MONOTONIC in nanoseconds, and sleeping until a time on it.

A time one process stores in shared memory (a mailbox slot's "ready at") means the same instant
in every other process on the machine, so a reader can sleep until it instead of polling.
"""
from __future__ import annotations

import time


def now_ns() -> int:
    """CLOCK_MONOTONIC now, in nanoseconds (`time.monotonic_ns` is that clock on Linux)."""
    return time.monotonic_ns()


def sleep_until_ns(deadline_ns: int) -> None:
    """Return once `now_ns() >= deadline_ns`, sleeping (not spinning) until then."""
    while (left_ns := deadline_ns - time.monotonic_ns()) > 0:
        time.sleep(left_ns / 1e9)
