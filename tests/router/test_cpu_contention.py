"""The contention helper the router's busy-machine tests run under (tests/contention.py): twice as
many busy processes as cores, at normal priority, each ending by itself, all ended with the block."""
from __future__ import annotations

import os
import time

import pytest
from contention import PROCESSES_PER_CORE, cpu_contention

from shm.naming import pid_alive

pytestmark = [pytest.mark.contention, pytest.mark.timeout(30)]


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (alive := [pid for pid in pids if pid_alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def test_busy_processes_twice_the_cores_at_normal_priority_ended_with_the_block() -> None:
    with cpu_contention() as pids:
        assert len(pids) == PROCESSES_PER_CORE * os.cpu_count()
        assert all(pid_alive(pid) for pid in pids)
        assert {os.getpriority(os.PRIO_PROCESS, pid) for pid in pids} == {os.getpriority(os.PRIO_PROCESS, 0)}
    assert _wait_gone(pids, 0) == []  # killed and reaped on the way out


def test_a_busy_process_ends_by_itself_after_its_time() -> None:
    with cpu_contention(seconds=0.5) as pids:
        assert _wait_gone(pids, 10) == []  # before the block ends: each bounded its own time
    with pytest.raises(ValueError, match="at most 600 s"):
        with cpu_contention(seconds=3600):
            pass
