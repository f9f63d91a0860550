"""Who died is known by pid, how by the exit status whenever it can come: a stage killed while its
exit status cannot be reported is still named before the stage that ended because it died, and its
status is waited for, however late, once its parent can report it."""
from __future__ import annotations

import multiprocessing.forkserver as forkserver
import os
import signal
import time
from types import SimpleNamespace

import pytest

from pipeline.engine.supervision import RUNNER_MODULE, StageProcesses, _process_context
from shm.naming import pid_alive
from stages.process import EXIT_PEER_DIED


class _Stages:
    """The status board's stage slots: every stage ready, the errors given."""

    def __init__(self, errors: dict[int, str]) -> None:
        self.errors = errors

    def error(self, index: int) -> str:
        return self.errors.get(index, "")

    def is_ready(self, index: int) -> bool:
        return True


@pytest.mark.timeout(120)
def test_a_killed_stage_whose_status_comes_late_is_named_by_its_pid_before_the_stage_that_followed_it() -> None:
    context = _process_context(SimpleNamespace(module=RUNNER_MODULE))  # forked from the forkserver
    runner = context.Process(target=time.sleep, args=(600,), name="pipeline-runner")
    follower = context.Process(target=os._exit, args=(EXIT_PEER_DIED,), name="pipeline-scheduler")
    runner.start()
    follower.start()
    follower.join(60)
    assert follower.exitcode == EXIT_PEER_DIED
    server = forkserver._forkserver._forkserver_pid
    if server is None:
        pytest.skip("the stages were not forked from a forkserver")
    processes = StageProcesses(SimpleNamespace(start_timeout_s=60.0))
    processes.procs = [("runner", runner), ("scheduler", follower)]
    processes._board = SimpleNamespace(stages=_Stages({1: f"scheduler: ring 'x': the runner (pid {runner.pid}) died"}))
    try:
        # The forkserver reaps its children and reports their exit: stopped, it reports nothing,
        # as a killed stage's status is late while the kernel tears its many threads down.
        os.kill(server, signal.SIGSTOP)
        try:
            os.kill(runner.pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while pid_alive(runner.pid):
                assert time.monotonic() < deadline, "the killed runner is not dead by its pid after 30 s"
                time.sleep(0.01)
            time.sleep(1.5)  # longer than any fixed wait for the status would be
            unreported = processes.failed_stage()
            assert runner.exitcode is None  # its status has not come
        finally:
            os.kill(server, signal.SIGCONT)
        assert unreported is not None and unreported.stage == "runner", unreported
        assert "seen by its pid" in unreported.message
        # The parent runs again: the status it reports is waited for, and says how the runner died.
        reported = processes.failed_stage()
        assert reported is not None and reported.stage == "runner"
        assert reported.message == "stage 'runner' was killed by signal 9"
    finally:
        if runner.exitcode is None:
            os.kill(runner.pid, signal.SIGKILL)
        runner.join(30)
