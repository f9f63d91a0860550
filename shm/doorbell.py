"""A doorbell: a named POSIX semaphore that wakes one sleeping ring end.

A ring end rings the bell only after its peer has announced, through a flag in the ring header,
that it is about to sleep, so a busy ring makes no system call. A ring may arrive for a record
the sleeper already took (a spurious wake-up), so a sleeper re-checks the ring after every
wake-up, and never sleeps without a timeout.

`FifoDoorbell` is the same bell as a named pipe beside the segment: ringing it writes a byte,
so its file descriptor becomes readable, and a sleeper can wait for it in an event loop
(`loop.add_reader`) along with everything else the loop waits for, instead of in a thread.
"""
from __future__ import annotations

import math
import os
import select

import posix_ipc

from shm.naming import SHM_DIR


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


class FifoDoorbell:
    """One named pipe in /dev/shm (mode 0600), made or opened by name; both ends open it for
    reading and writing, which never blocks and never fails for want of a peer."""

    __slots__ = ("name", "path", "_fd", "_poll")

    def __init__(self, name: str, *, create: bool) -> None:
        self.name = name
        self.path = os.path.join(SHM_DIR, name.lstrip("/"))
        if create:
            os.mkfifo(self.path, 0o600)
        self._fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self._poll = select.poll()  # not select(): a daemon with many connections has descriptors past 1024
        self._poll.register(self._fd, select.POLLIN)

    def fileno(self) -> int:
        """Readable from a ring until `drain`."""
        return self._fd

    def ring(self) -> None:
        try:
            os.write(self._fd, b"\x01")
        except BlockingIOError:
            pass  # the pipe is full of rings nobody took yet: it is rung already

    def wait(self, timeout_s: float) -> bool:
        """Sleep until rung or `timeout_s` passes; True if rung."""
        if not self._poll.poll(max(0, math.ceil(timeout_s * 1000))):
            return False
        self.drain()
        return True

    def drain(self) -> None:
        """Take every ring so far: the descriptor is not readable until the next."""
        try:
            while os.read(self._fd, 4096):
                pass
        except BlockingIOError:
            pass

    def unlink(self) -> None:
        """Remove the name; this handle and the peer's keep working."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass  # the peer unlinked it first

    def close(self) -> None:
        os.close(self._fd)
