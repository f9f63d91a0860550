"""A CPU oversubscribed on purpose, for tests of what must hold on a busy machine: twice as many busy
processes as there are cores, at normal priority (a co-located job, not a polite background one),
each ending by itself after a bounded time, and all ended when the `with` block or the test ends.

    with cpu_contention():
        ...  # every core has two busy processes to share with the code under test

Tests that use it carry the `contention` marker; `make test-contention` runs them, the default run
leaves them out. PIPELINE_CONTENTION_RUNS=N runs each of them N times in one session (a pass count
out of N, without starting their fixtures N times). Run alone, `python tests/contention.py SECONDS
[PER_CORE]` loads the machine for that long.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

PROCESSES_PER_CORE = 2
MAX_SECONDS = 600.0  # a busy process ends by itself after this long, whatever became of its parent

RUNS_ENV = "PIPELINE_CONTENTION_RUNS"

_SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


@contextmanager
def cpu_contention(seconds: float = MAX_SECONDS, per_core: int = PROCESSES_PER_CORE) -> Iterator[list[int]]:
    """`per_core` x os.cpu_count() busy processes for the block (each for `seconds` at most); yields their pids."""
    if not 0 < seconds <= MAX_SECONDS:
        raise ValueError(f"a contention lasts more than 0 and at most {MAX_SECONDS:g} s, got {seconds!r}")
    busy: list[subprocess.Popen] = []
    try:
        for _ in range(per_core * (os.cpu_count() or 1)):
            busy.append(subprocess.Popen([sys.executable, "-c", _SPIN.format(seconds=seconds)],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL))
        yield [process.pid for process in busy]
    finally:
        for process in busy:
            process.kill()
        for process in busy:
            process.wait()


def runs() -> list[int]:
    """Each contention test's runs, to parametrize it with: PIPELINE_CONTENTION_RUNS of them (1 unset)."""
    return list(range(int(os.environ.get(RUNS_ENV, "1"))))


@pytest.fixture
def contention() -> Iterator[list[int]]:
    """The CPU oversubscribed for the test (see cpu_contention); the busy processes' pids."""
    with cpu_contention() as pids:
        yield pids


if __name__ == "__main__":
    duration_s = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
    per_core = int(sys.argv[2]) if len(sys.argv) > 2 else PROCESSES_PER_CORE
    with cpu_contention(duration_s, per_core) as pids:
        print(f"{len(pids)} busy processes on {os.cpu_count()} cores: {pids}", flush=True)
        time.sleep(duration_s)
