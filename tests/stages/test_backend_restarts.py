"""A StageBackend's own recovery, without a daemon: a dead frontend stage restarts alone on fresh
links and the backend serves on with the same output; a stage of the engine does not restart
alone; a killed forkserver leaves the stages running and is replaced."""
from __future__ import annotations

import os
import signal
import time

import pytest
from backend_helpers import MakeBackend, generate, wait_for

from pipeline.engine.supervision import FORKSERVER_LOST
from pipeline.errors import StageFailed
from stages.contracts.params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def stage_pid(backend: object, name: str) -> int:
    return next(h.pid for h in backend.health() if h.name == name)  # type: ignore[attr-defined]


def wait_failure(backend: object, timeout_s: float = 10.0) -> StageFailed:
    """The StageFailed check_stages raises once the backend sees the stage dead."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            backend.check_stages()  # type: ignore[attr-defined]
        except StageFailed as failure:
            return failure
        time.sleep(0.05)
    raise AssertionError(f"no stage failure seen within {timeout_s} s")


@pytest.mark.timeout(120)
def test_a_dead_frontend_stage_restarts_alone_and_the_backend_serves_on(make_backend: MakeBackend) -> None:
    backend = make_backend()
    before = generate(backend, 0, ["the quick brown fox"], [GREEDY])[0]
    engine_pids = {name: stage_pid(backend, name) for name in ("runner", "scheduler")}
    os.kill(stage_pid(backend, "detokenizer"), signal.SIGKILL)
    failure = wait_failure(backend)
    assert failure.stage == "detokenizer" and "was killed by signal 9" in failure.message
    assert backend.restart_stage("detokenizer")
    assert {name: stage_pid(backend, name) for name in engine_pids} == engine_pids  # they ran on
    assert all(h.alive for h in backend.health())
    after = generate(backend, 1, ["the quick brown fox"], [GREEDY])[0]
    assert (after.token_ids, after.text) == (before.token_ids, before.text)


@pytest.mark.timeout(120)
def test_a_dead_engine_stage_does_not_restart_alone(make_backend: MakeBackend) -> None:
    backend = make_backend()
    os.kill(stage_pid(backend, "scheduler"), signal.SIGKILL)
    failure = wait_failure(backend)
    assert failure.stage == "scheduler" and "was killed by signal 9" in failure.message
    assert not backend.restart_stage("scheduler")


@pytest.mark.timeout(120)
def test_a_killed_forkserver_leaves_the_stages_running_and_is_replaced(make_backend: MakeBackend) -> None:
    backend = make_backend()
    import multiprocessing.forkserver as forkserver

    server_pid = forkserver._forkserver._forkserver_pid
    if server_pid is None:
        pytest.skip("the stages were not forked from a forkserver")
    os.kill(server_pid, signal.SIGKILL)
    # The runner is forked from it (the other stages are spawned, the daemon's own children).
    forked = [process for name, process in backend.processes.procs if name == "runner"]
    wait_for(lambda: all(process.exitcode == FORKSERVER_LOST for process in forked), 10.0)
    wait_for(lambda: (backend.check_stages(), forkserver._forkserver._forkserver_pid not in (None, server_pid))[1],
             60.0)
    assert all(h.alive for h in backend.health())
    assert generate(backend, 0, ["the quick brown fox"], [GREEDY])[0].finish_reason == "length"
