"""Bounded polling waits: spin briefly, then sleep in short polls, look at the peers now and then,
and give up at a deadline with an error naming what was awaited.

The token mailbox waits this way on both sides: the runner for a slot its consumers still hold,
a consumer for the device work that fills a slot. Neither ever blocks in a call that a dead peer
could leave hanging.
"""
from __future__ import annotations

import time
from collections.abc import Callable

SPIN_S = 50e-6  # the first this-long of a wait only spins: most waits end within it
POLL_S = 0.0002  # then the waiter sleeps this long between polls
CHECK_EVERY_S = 0.05  # and calls its `check` this often


def poll_until(done: Callable[[], bool], what: str, timeout_s: float, check: Callable[[], None] = lambda: None,
               *, clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
    """Return once `done()` is true. Calls `check` (which raises to abandon the wait, e.g. when the
    peer died) every CHECK_EVERY_S; raises TimeoutError "`what` within `timeout_s` s" once
    `timeout_s` has passed."""
    start = clock()
    next_check = start + CHECK_EVERY_S
    while not done():
        now = clock()
        if now - start > timeout_s:
            raise TimeoutError(f"{what} within {timeout_s} s")
        if now >= next_check:
            check()
            next_check = now + CHECK_EVERY_S
        if now - start > SPIN_S:
            sleep(POLL_S)
