"""Store-load ordering for the sleep handshake, kept off the per-record hot path.

x86-64 keeps aligned loads and stores in program order except one case: a store followed by a
load of another address may complete in the other order (the store waits in the store
buffer). The handshake "sleeper: set my flag, then read the cursor; publisher: store the
cursor, then read the flag" is exactly that case on both sides, and without a barrier both can
miss each other: a lost wake-up, paid for by a full doorbell timeout.

By default both sides issue a real barrier: a free lock's acquire and release are locked
instructions, which order everything before them against everything after (about 0.1 µs).
With PIPELINE_SHM_MEMBARRIER=1, where Linux offers membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED),
the barrier is asymmetric instead: the side about to sleep forces a full barrier on every CPU
running a registered ring process, so publishing a record needs no barrier at all. That pays
where records are many and sleeps rare (tools/micro/bench_ipc.py, 64-byte records back to back:
1.7 M records/s with it, 1.4 M without). Here it is the other way round: every stage sleeps
once or more a device step and publishes about as often, and each membarrier interrupts every
other CPU (the daemon streaming 256 requests on the simulated device spent 1.76 µs of CPU per
token with it, 1.56 µs without).
"""
from __future__ import annotations

import ctypes
import os
import threading

_SYS_MEMBARRIER_X86_64 = 324
_CMD_QUERY = 0
_CMD_GLOBAL_EXPEDITED = 1 << 1
_CMD_REGISTER_GLOBAL_EXPEDITED = 1 << 2

_lock = threading.Lock()
_acquire = _lock.acquire
_release = _lock.release


def full_fence() -> None:
    """A full barrier in this process: both sides of a symmetric handshake call it."""
    _acquire()
    _release()


def _load_membarrier() -> object | None:
    if not os.environ.get("PIPELINE_SHM_MEMBARRIER"):
        return None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    supported = syscall(_SYS_MEMBARRIER_X86_64, _CMD_QUERY, 0, 0)
    needed = _CMD_GLOBAL_EXPEDITED | _CMD_REGISTER_GLOBAL_EXPEDITED
    if supported < 0 or supported & needed != needed:
        return None
    return syscall


_membarrier = _load_membarrier()
# True without membarrier (the default): then the hot side must call full_fence() itself.
PUBLISH_NEEDS_FENCE = _membarrier is None


def register_process() -> None:
    """Make this process a target of heavy_fence(); every ring end calls it when attaching
    (registering again is harmless, and a spawned child must register itself)."""
    if _membarrier is not None and _membarrier(_SYS_MEMBARRIER_X86_64, _CMD_REGISTER_GLOBAL_EXPEDITED, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "membarrier(REGISTER_GLOBAL_EXPEDITED) failed")


def heavy_fence() -> None:
    """The sleeper's barrier: after it, every registered process has made its earlier stores
    visible, and sees ours."""
    if _membarrier is None:
        full_fence()
    elif _membarrier(_SYS_MEMBARRIER_X86_64, _CMD_GLOBAL_EXPEDITED, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "membarrier(GLOBAL_EXPEDITED) failed")
