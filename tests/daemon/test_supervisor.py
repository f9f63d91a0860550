"""The stage supervisor and the daemon's recovery, in-process with fake stages: restarts and their
bounds, requests parked while stages restart and resumed on the fresh ones, the poison guard."""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from fake_stage_backend import FakeBackend, FakeFactory, RecordingConnection

from pipeline.errors import StageFailed
from pipeline.protocol import Abort, Aborted, Accepted, Error, Generate
from pipeline.serve.config import DaemonConfig
from pipeline.serve.server import BackendState, DaemonServer
from pipeline.serve.socket_connection import handle_message
from pipeline.serve.supervisor import RestartBudget, RestartPolicy, StageSupervisor
from stages.contracts.config import EngineConfig
from shm.naming import new_instance_id, unlink_instance
from shm.ring import RingWriter
from shm.ring_reader import RingReader
from shm.segment import RingSegment
from stages.contracts.outputs import OutputEvent


def test_restart_budget_counts_restarts_over_a_sliding_window() -> None:
    budget = RestartBudget(RestartPolicy(max_restarts=2, window_s=60.0))
    assert budget.take(0.0) is None and budget.take(10.0) is None
    refusal = budget.take(20.0)
    assert refusal is not None and "2 restarts within 60 s" in refusal
    assert budget.take(60.5) is None  # the restart at 0.0 has left the window
    assert budget.take(61.0) is not None  # those at 10.0 and 60.5 have not
    assert RestartBudget(RestartPolicy(max_restarts=0)).take(0.0) is not None
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=-1).check()


async def _until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the supervisor did not get there in time"
        await asyncio.sleep(0.01)


def _run_supervised(scenario: Callable[[DaemonServer, FakeFactory, StageSupervisor], object],
                    max_restarts: int) -> None:
    """Runs `scenario(server, factory, supervisor)` (a coroutine) with a supervisor over fake stages."""
    config = EngineConfig(model="unused")

    async def main() -> None:
        factory = FakeFactory()
        first = factory(config, "1_a")
        server = DaemonServer(first, max_num_seqs=2, config=DaemonConfig(max_restarts=max_restarts))
        loop = asyncio.get_running_loop()
        supervisor = StageSupervisor(first, factory, config, server.config.restart_policy(), server, loop)
        supervisor.start()
        try:
            await scenario(server, factory, supervisor)  # type: ignore[misc]
        finally:
            await loop.run_in_executor(None, supervisor.stop, 5.0)
        assert all(backend.closed for backend in factory.made)

    asyncio.run(main())


def _generate(server: DaemonServer) -> RecordingConnection:
    connection = RecordingConnection()
    handle_message(server, connection, Generate(prompt="hello"))  # type: ignore[arg-type]
    return connection


@pytest.mark.timeout(30)
def test_supervisor_parks_requests_restarts_resumes_them_and_reports_degraded_meanwhile() -> None:
    async def scenario(server: DaemonServer, factory: FakeFactory, supervisor: StageSupervisor) -> None:
        first = factory.made[0]
        running = _generate(server)
        factory.allow_start.clear()  # hold the restart, to look at the daemon while it runs
        first.fail("stage 'runner' was killed by signal 9", "runner")
        await _until(lambda: server.state is BackendState.RESTARTING)
        assert [type(m) for m in running.sent] == [Accepted]  # parked, not failed
        health = server.health()
        assert health.status == "degraded" and "restarting after: stage 'runner'" in str(health.reason)
        queued = _generate(server)  # comes during the restart: it waits, as the parked one does
        assert [type(m) for m in queued.sent] == [Accepted]

        factory.allow_start.set()
        await _until(lambda: server.state is BackendState.SERVING)
        second = factory.made[1]
        assert first.closed and server.backend is second and second.instance != first.instance
        assert second.submitted == [0, 1]  # the parked request and the queued one, in order, on the fresh stages
        health = server.health()
        assert health.status == "ok" and health.num_restarts == 1 and health.instance == second.instance
        assert health.last_failure == "stage 'runner' was killed by signal 9"
        _generate(server)
        assert second.submitted == [0, 1, 2]
        stats = server.stats()
        assert (stats.num_resumed_requests, stats.num_guard_failed_requests) == (2, 0)

        # A restart that fails is tried again after a backoff; the requests wait on.
        factory.failures.append(RuntimeError("the forkserver died"))
        second.fail("stage 'scheduler' exited with code 1", "scheduler")
        await _until(lambda: server.state is BackendState.SERVING and len(factory.made) == 3)
        third = factory.made[2]
        assert second.closed and server.backend is third and third.submitted == [0, 1, 2]
        assert [type(m) for m in running.sent] == [Accepted]

        # One that fails every time spends the budget: the daemon stays degraded and says why,
        # and the parked requests end.
        factory.failures.extend(RuntimeError("model.safetensors is corrupt") for _ in range(10))
        third.fail("stage 'detokenizer' exited with code 1", "detokenizer")  # another stage: no guard
        await _until(lambda: server.state is BackendState.DOWN)
        health = server.health()
        assert health.status == "degraded" and "the last restart failed: RuntimeError: model.safetensors is corrupt" \
            in str(health.reason) and "(the limit is 5)" in str(health.reason)
        ended = running.sent[-1]
        assert isinstance(ended, Error) and ended.code == "stage_failed" and "not restarted" in ended.message
        assert server.num_in_flight == 0
        refused = _generate(server).sent[-1]
        assert isinstance(refused, Error) and refused.code == "stage_failed" and "not restarted" in refused.message
        assert third.closed and len(factory.made) == 3

    _run_supervised(scenario, max_restarts=5)


@pytest.mark.timeout(30)
def test_poison_guard_fails_a_request_in_flight_through_two_crashes_in_a_row_of_one_stage() -> None:
    async def scenario(server: DaemonServer, factory: FakeFactory, supervisor: StageSupervisor) -> None:
        suspect = _generate(server)  # in flight through every crash below
        factory.made[0].fail("stage 'runner' was killed by signal 9", "runner")
        await _until(lambda: server.num_restarts == 1 and server.state is BackendState.SERVING)
        late = _generate(server)  # in flight through the second crash only
        factory.made[1].fail("stage 'detokenizer' was killed by signal 9", "detokenizer")
        await _until(lambda: server.num_restarts == 2 and server.state is BackendState.SERVING)
        assert factory.made[2].submitted == [0, 1]  # a crash of another stage breaks the run

        factory.made[2].fail("stage 'detokenizer' was killed by signal 9", "detokenizer")
        await _until(lambda: server.num_restarts == 3 and server.state is BackendState.SERVING)
        for connection in (suspect, late):
            failed = connection.sent[-1]
            assert isinstance(failed, Error) and failed.code == "stage_failed", connection.sent
            assert "stage 'detokenizer' was killed by signal 9" in failed.message
            assert "in flight during this crash and the one before it" in failed.message
        assert factory.made[3].submitted == [] and server.num_in_flight == 0

        # A tokenizer holds a request only until the stages answer it: a tokenizer crash spares
        # the requests they have answered since they were last submitted.
        unanswered, answered = _generate(server), _generate(server)
        server.on_events([OutputEvent(3, "x", np.array([5], np.int32), prompt_token_ids=np.array([1], np.int32))])
        factory.made[3].fail("stage 'tokenizer0' was killed by signal 9", "tokenizer0")
        await _until(lambda: server.num_restarts == 4 and server.state is BackendState.SERVING)
        assert factory.made[4].submitted == [2, 3]
        factory.made[4].fail("stage 'tokenizer0' was killed by signal 9", "tokenizer0")
        await _until(lambda: server.num_restarts == 5 and server.state is BackendState.SERVING)
        failed = unanswered.sent[-1]
        assert isinstance(failed, Error) and "'tokenizer0'" in failed.message
        assert isinstance(answered.sent[-1], Accepted) and factory.made[5].submitted == [3]  # resumed
        stats = server.stats()
        assert (stats.num_resumed_requests, stats.num_guard_failed_requests) == (6, 3)

    _run_supervised(scenario, max_restarts=5)


@pytest.mark.timeout(30)
def test_poison_guard_spares_a_request_the_fresh_stages_served_between_two_crashes() -> None:
    async def scenario(server: DaemonServer, factory: FakeFactory, supervisor: StageSupervisor) -> None:
        served, stuck = _generate(server), _generate(server)  # both in flight through both crashes
        factory.made[0].fail("stage 'runner' was killed by signal 9", "runner")
        await _until(lambda: server.num_restarts == 1 and server.state is BackendState.SERVING)
        server.on_events([OutputEvent(0, "x", np.array([5], np.int32), prompt_token_ids=np.array([1], np.int32))])
        factory.made[1].fail("stage 'runner' was killed by signal 9", "runner")
        await _until(lambda: server.num_restarts == 2 and server.state is BackendState.SERVING)
        assert factory.made[2].submitted == [0]  # a token delivered after the first crash: not suspected
        failed = stuck.sent[-1]
        assert isinstance(failed, Error) and "with no output delivered between them" in failed.message
        assert server.stats().num_guard_failed_requests == 1 and not isinstance(served.sent[-1], Error)

    _run_supervised(scenario, max_restarts=5)


@pytest.mark.timeout(30)
def test_supervisor_stops_restarting_stages_that_die_again_and_again() -> None:
    async def scenario(server: DaemonServer, factory: FakeFactory, supervisor: StageSupervisor) -> None:
        for restarts in (1, 2):
            factory.made[-1].fail("stage 'runner' exited with code 1: CUDA error")
            await _until(lambda: server.num_restarts == restarts and server.state is BackendState.SERVING)
        factory.made[-1].fail("stage 'runner' exited with code 1: CUDA error")
        await _until(lambda: server.state is BackendState.DOWN)
        assert len(factory.made) == 3
        reason = str(server.health().reason)
        assert "not restarting after 2 restarts within 600 s already (the limit is 2)" in reason

    _run_supervised(scenario, max_restarts=2)


@pytest.mark.timeout(30)
def test_a_shutdown_during_a_restart_ends_the_parked_requests_at_once() -> None:
    async def scenario(server: DaemonServer, factory: FakeFactory, supervisor: StageSupervisor) -> None:
        running = _generate(server)
        factory.allow_start.clear()  # the restart is under way when the daemon begins to stop
        factory.made[0].fail("stage 'runner' was killed by signal 9", "runner")
        await _until(lambda: server.state is BackendState.RESTARTING)
        server.begin_shutdown()
        supervisor.stop_restarting()
        factory.allow_start.set()
        await asyncio.wait_for(server.wait_idle(), 5)  # the grace period need not run out
        ended = running.sent[-1]
        assert isinstance(ended, Error) and ended.code == "stage_failed"
        assert "not restarted: the daemon is shutting down" in ended.message
        assert server.state is BackendState.DOWN and factory.made[1].closed and factory.made[1].submitted == []

    _run_supervised(scenario, max_restarts=5)


def test_aborts_in_the_restart_gap_and_resubmissions_that_find_the_ring_full() -> None:
    config = EngineConfig(model="unused")
    first, second = FakeBackend(config, "1_a"), FakeBackend(config, "1_b")
    server = DaemonServer(first, max_num_seqs=4)
    connections = [_generate(server) for _ in range(4)]
    server.on_backend_failed("stage 'runner' was killed by signal 9", "runner")
    request_id = connections[1].sent[0].request_id
    handle_message(server, connections[1], Abort(request_id))  # in the gap: ends at once, is not resumed
    assert [type(m) for m in connections[1].sent] == [Accepted, Error, Aborted]
    second.room = 1
    server.on_backend_restarted(second)
    assert second.submitted == [0] and server.num_in_flight == 3
    second.room = 2
    server.on_events([])  # the stages made progress: one more fits
    assert second.submitted == [0, 2]
    server.drop_connection(connections[3])  # gone while it waited: not resumed
    second.room = None
    server.on_events([])
    assert second.submitted == [0, 2] and server.num_in_flight == 2
    assert server.stats().num_resumed_requests == 2


@pytest.fixture
def instance() -> Iterator[str]:
    instance_id = new_instance_id()
    yield instance_id
    unlink_instance(instance_id)


class LoopReadBackend(FakeBackend):
    """A fake backend whose events come through a real ring with a named-pipe doorbell, read on
    the event loop as StageBackend's are (events_fd, arm_events, poll_outputs, check_stages).
    A record's payload is the request id of an event with one token."""

    def __init__(self, config: EngineConfig, instance: str) -> None:
        super().__init__(config, instance)
        segment = RingSegment.create(instance, f"events{id(self)}", 4096, fifo_readers=[0])
        self.reader = RingReader(segment)
        self.writer = RingWriter(RingSegment.open(segment.name))
        self.polled_on: set[int] = set()  # the threads poll_outputs ran on

    def emit(self, req_id: int) -> None:
        self.writer.write(0, req_id.to_bytes(8, "little"), timeout=1.0)

    def events_fd(self) -> int:
        return self.reader.fileno()

    def arm_events(self) -> bool:
        return self.reader.arm()

    def poll_outputs(self) -> list[OutputEvent]:
        self.polled_on.add(threading.get_ident())
        self.reader.woken()
        events = []
        while (record := self.reader.try_read()) is not None:
            events.append(OutputEvent(int.from_bytes(record.payload, "little"), "x", np.array([7], np.int32)))
        return events

    def check_stages(self) -> None:
        if self._failed.is_set():
            raise StageFailed(str(self._failure), stage=self._failed_stage)

    def close(self, timeout_s: float = 5.0) -> None:
        if not self.closed:
            self.reader.close()
            self.writer.close()
        super().close(timeout_s)


class LoopReadFactory(FakeFactory):
    def __call__(self, config: EngineConfig, instance: str) -> FakeBackend:
        backend = LoopReadBackend(config, instance)
        self.made.append(backend)
        return backend


@pytest.mark.timeout(30)
def test_a_backend_with_an_events_descriptor_is_read_on_the_loop_and_let_go_of_when_it_fails(instance: str) -> None:
    config = EngineConfig(model="unused")
    routed: list[tuple[int, int]] = []  # (req_id, thread)

    async def main() -> None:
        factory = LoopReadFactory()
        first = factory(config, instance)
        server = DaemonServer(first, max_num_seqs=4, config=DaemonConfig(max_restarts=2))
        server.on_events = lambda events: routed.extend((e.req_id, threading.get_ident()) for e in events)
        loop = asyncio.get_running_loop()
        supervisor = StageSupervisor(first, factory, config, server.config.restart_policy(), server, loop)
        supervisor.start()
        try:
            for req_id in range(50):
                first.emit(req_id)
                if req_id % 7 == 0:
                    await asyncio.sleep(0.001)  # let the loop arm and sleep between some records
            await _until(lambda: len(routed) == 50)
            assert [r for r, _ in routed] == list(range(50))
            assert {thread for _, thread in routed} == first.polled_on == {threading.get_ident()}  # the loop's
            first.fail("stage 'detokenizer' was killed by signal 9", "detokenizer")
            await _until(lambda: len(factory.made) == 2 and server.state is BackendState.SERVING)
            assert first.closed  # after the loop let go of its descriptor: the fresh ring may reuse its number
            second = factory.made[1]
            second.emit(100)
            await _until(lambda: routed[-1][0] == 100)
            await asyncio.sleep(0.05)
            assert [r for r, _ in routed[50:]] == [100]
        finally:
            await loop.run_in_executor(None, supervisor.stop, 5.0)
        assert all(backend.closed for backend in factory.made)

    asyncio.run(main())
