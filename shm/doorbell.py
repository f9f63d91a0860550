"""A doorbell: a named POSIX semaphore that wakes one sleeping ring end.

A ring end rings the bell only after its peer has announced, through a flag in the ring header,
that it is about to sleep, so a busy ring makes no system call. A ring may arrive for a record
the sleeper already took (a spurious wake-up), so a sleeper re-checks the ring after every
wake-up, and never sleeps without a timeout.
"""
from __future__ import annotations

import posix_ipc


class Doorbell:
    """One named semaphore, created (mode 0600) or opened by name."""

    __slots__ = ("name", "_sem")

    def __init__(self, name: str, *, create: bool) -> None:
        self.name = name
        if create:
            self._sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0)
        else:
            self._sem = posix_ipc.Semaphore(name)

    def ring(self) -> None:
        self._sem.release()

    def wait(self, timeout_s: float) -> bool:
        """Sleep until rung or `timeout_s` passes; True if rung."""
        try:
            self._sem.acquire(timeout_s)
        except posix_ipc.BusyError:
            return False
        return True

    def unlink(self) -> None:
        """Remove the name; this handle and the peer's keep working."""
        try:
            self._sem.unlink()
        except posix_ipc.ExistentialError:
            pass  # the peer unlinked it first

    def close(self) -> None:
        self._sem.close()
