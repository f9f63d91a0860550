"""Faults, injected into a live daemon with real stage processes: a stalled stage, each stage
SIGKILLed under load (every client gets StageFailed at once, then the stages restart), the
daemon SIGKILLed (its stages follow it, the next start sweeps what it left), SIGTERM with a grace
period. The supervisor's restart bounds are tested in-process with fake stages."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import posix_ipc
import pytest
from fake_stage_backend import FakeFactory, RecordingConnection
from live_daemon import REAL_BACKEND, AsyncRawConnection, LiveDaemon, short_dir, start_daemon, wait_for_health

from stages.contracts.config import EngineConfig
from pipeline.client import AsyncClient, AsyncStream, Client, Completion, StreamDelta
from pipeline.serve.daemon import pid_file_for
from pipeline.serve.config import DaemonConfig
from pipeline.serve.server import BackendState, DaemonServer
from pipeline.errors import DaemonNotRunning, PipelineError, RequestAborted, StageFailed
from pipeline.protocol import Error, Generate, Health, HealthReply, ServerMessage
from pipeline.serve.supervisor import RestartBudget, RestartPolicy, StageSupervisor
from pipeline.models.tiny_model import make_tiny_model
from shm.naming import list_entries, pid_alive, ring_name

GRACE_S = 3.0
# A long context, so that a long request outlasts the grace period and the faults on any CPU: a
# single sequence of the tiny model decodes ~1,000 tokens a second when it runs alone.
MAX_MODEL_LEN = 16384
DAEMON_OPTIONS = ["--stall-seconds", "1", "--grace-seconds", str(GRACE_S), "--max-restarts", "5",
                  "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", str(4 * MAX_MODEL_LEN // 16)]
LONG = dict(max_tokens=MAX_MODEL_LEN - 64, ignore_eos=True, temperature=0.0)  # runs until the fault
SHORT = dict(max_tokens=12, ignore_eos=True, temperature=0.0)
QUICK = dict(max_tokens=6, ignore_eos=True, temperature=0.0)  # finishes well within the grace period
PROMPT = "After the fault the daemon"
STAGES = ["runner", "scheduler", "detokenizer", "tokenizer0"]
FAILED_WITHIN_S = 2.0

live = pytest.mark.skipif(not REAL_BACKEND, reason="faults are injected into real stage processes")


# ---- the supervisor, in-process with fake stages


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


def _run_supervised(scenario: Callable[[DaemonServer, FakeFactory], object], max_restarts: int) -> None:
    """Runs `scenario(server, factory)` (a coroutine) with a supervisor over fake stages."""
    config = EngineConfig(model="unused")

    async def main() -> None:
        factory = FakeFactory()
        first = factory(config, "1_a")
        server = DaemonServer(first, max_num_seqs=2, config=DaemonConfig(max_restarts=max_restarts))
        loop = asyncio.get_running_loop()
        supervisor = StageSupervisor(first, factory, config, server.config.restart_policy(), server, loop)
        supervisor.start()
        try:
            await scenario(server, factory)  # type: ignore[misc]
        finally:
            await loop.run_in_executor(None, supervisor.stop, 5.0)
        assert all(backend.closed for backend in factory.made)

    asyncio.run(main())


def _generate(server: DaemonServer) -> RecordingConnection:
    connection = RecordingConnection()
    server.handle(connection, Generate(prompt="hello"))  # type: ignore[arg-type]
    return connection


@pytest.mark.timeout(30)
def test_supervisor_fails_requests_restarts_and_reports_degraded_meanwhile() -> None:
    async def scenario(server: DaemonServer, factory: FakeFactory) -> None:
        first = factory.made[0]
        running = _generate(server)
        factory.allow_start.clear()  # hold the restart, to look at the daemon while it runs
        first.fail("stage 'runner' was killed by signal 9")
        await _until(lambda: server.state is BackendState.RESTARTING)
        failed = running.sent[-1]
        assert isinstance(failed, Error) and failed.code == "stage_failed" and "killed by signal 9" in failed.message
        health = server.health()
        assert health.status == "degraded" and "restarting after: stage 'runner'" in str(health.reason)
        refused = _generate(server).sent[-1]
        assert isinstance(refused, Error) and refused.code == "stage_failed"
        assert refused.message == "stages are restarting after: stage 'runner' was killed by signal 9; retry"

        factory.allow_start.set()
        await _until(lambda: server.state is BackendState.SERVING)
        second = factory.made[1]
        assert first.closed and server.backend is second and second.instance != first.instance
        health = server.health()
        assert health.status == "ok" and health.num_restarts == 1 and health.instance == second.instance
        assert health.last_failure == "stage 'runner' was killed by signal 9"
        _generate(server)
        assert second.submitted == [1]

        # A restart that fails is not retried: the daemon stays degraded and says why.
        factory.failures.append(RuntimeError("model.safetensors is corrupt"))
        second.fail("stage 'scheduler' exited with code 1")
        await _until(lambda: server.state is BackendState.DOWN)
        health = server.health()
        assert health.status == "degraded" and "the restart failed: RuntimeError: model.safetensors is corrupt" in str(
            health.reason)
        refused = _generate(server).sent[-1]
        assert isinstance(refused, Error) and refused.code == "stage_failed" and "not restarted" in refused.message
        assert second.closed and len(factory.made) == 2

    _run_supervised(scenario, max_restarts=5)


@pytest.mark.timeout(30)
def test_supervisor_stops_restarting_stages_that_die_again_and_again() -> None:
    async def scenario(server: DaemonServer, factory: FakeFactory) -> None:
        for restarts in (1, 2):
            factory.made[-1].fail("stage 'runner' exited with code 1: CUDA error")
            await _until(lambda: server.num_restarts == restarts and server.state is BackendState.SERVING)
        factory.made[-1].fail("stage 'runner' exited with code 1: CUDA error")
        await _until(lambda: server.state is BackendState.DOWN)
        assert len(factory.made) == 3
        reason = str(server.health().reason)
        assert "not restarting after 2 restarts within 600 s already (the limit is 2)" in reason

    _run_supervised(scenario, max_restarts=2)


# ---- a live daemon


@dataclass
class DaemonSlot:
    """The module's daemon; a test that kills it starts the next one on the same socket."""

    daemon: LiveDaemon
    directory: Path
    model: Path


@pytest.fixture(scope="module")
def slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonSlot]:
    if not REAL_BACKEND:
        pytest.skip("faults are injected into real stage processes")
    model = make_tiny_model(tmp_path_factory.mktemp("long-context-llama"), "llama", seed=3,
                            max_position_embeddings=MAX_MODEL_LEN)
    directory = short_dir()
    slot = DaemonSlot(start_daemon(model, directory, DAEMON_OPTIONS), directory, model)
    try:
        yield slot
    finally:
        slot.daemon.stop()
        shutil.rmtree(directory.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(slot: DaemonSlot) -> str:
    """PROMPT's greedy output from the healthy daemon: the same after every restart."""
    with Client(slot.daemon.socket_path) as client:
        return client.generate(PROMPT, SHORT).text


def _health(socket_path: Path) -> HealthReply:
    with Client(socket_path, timeout_s=5) as client:
        return client.health()


async def _running(stream: AsyncStream) -> AsyncIterator[StreamDelta]:
    """The stream's iterator once its first delta has come: the request is running."""
    iterator = stream.__aiter__()
    await iterator.__anext__()
    return iterator


async def _finish(deltas: AsyncIterator[StreamDelta]) -> tuple[BaseException | None, float]:
    """Reads a stream to its end: the error it ended with (None if it completed), and when."""
    try:
        async for _ in deltas:
            pass
    except PipelineError as exc:
        return exc, time.monotonic()
    return None, time.monotonic()


async def _kill_under_load(socket_path: Path, pid: int, num_streams: int = 3) -> list[tuple[BaseException | None, float]]:
    """SIGKILLs `pid` while streams run; each stream's error and its delay after the kill."""
    client = AsyncClient(socket_path)
    streams = [client.stream(f"load {i}: {PROMPT}", LONG) for i in range(num_streams)]
    try:
        running = await asyncio.wait_for(asyncio.gather(*(_running(stream) for stream in streams)), 20)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        ended = await asyncio.wait_for(asyncio.gather(*(_finish(deltas) for deltas in running)), 10)
    finally:
        await client.close()
    return [(error, ended_at - killed_at) for error, ended_at in ended]


@live
@pytest.mark.timeout(30)
def test_a_stalled_stage_reports_degraded_until_it_runs_again(slot: DaemonSlot, reference: str) -> None:
    socket_path = slot.daemon.socket_path
    pid = wait_for_health(socket_path, lambda h: h.status == "ok", 10).stage_pids["scheduler"]
    os.kill(pid, signal.SIGSTOP)
    try:
        stalled = wait_for_health(socket_path, lambda h: h.status == "degraded", 5)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert "stage 'scheduler' has not gone round its loop for" in str(stalled.reason)
    assert "(stall limit 1 s)" in str(stalled.reason)
    wait_for_health(socket_path, lambda h: h.status == "ok", 5)
    with Client(socket_path) as client:
        assert client.generate(PROMPT, SHORT).text == reference


@live
@pytest.mark.timeout(120)
def test_each_killed_stage_fails_its_requests_at_once_and_the_stages_restart(slot: DaemonSlot, reference: str) -> None:
    daemon = slot.daemon
    socket_path = daemon.socket_path
    for stage in STAGES:
        before = wait_for_health(socket_path, lambda h: h.status == "ok", 10)
        failures = asyncio.run(_kill_under_load(socket_path, before.stage_pids[stage]))
        for error, delay_s in failures:
            assert isinstance(error, StageFailed), (stage, error)
            assert f"stage {stage!r} was killed by signal 9" in error.message
            assert delay_s < FAILED_WITHIN_S, f"a client waited {delay_s:.2f} s for the failure of {stage}"
        print(f"{stage} killed: clients failed within {max(d for _, d in failures) * 1000:.0f} ms")

        with Client(socket_path, timeout_s=5) as client:  # while the stages restart: refused at once
            asked_at = time.monotonic()
            with pytest.raises(StageFailed, match=f"stages are restarting after: stage {stage!r} was killed"):
                client.generate(PROMPT, SHORT)
            assert time.monotonic() - asked_at < 1.0
            restarting = client.health()
        assert restarting.status == "degraded" and "restarting" in str(restarting.reason)

        after = wait_for_health(socket_path, lambda h: h.status == "ok" and h.num_restarts == before.num_restarts + 1,
                                30)
        assert after.instance != before.instance
        assert f"stage {stage!r} was killed by signal 9" in str(after.last_failure)
        assert not any(pid_alive(pid) for pid in before.stage_pids.values())
        assert [e for e in daemon.shm_entries() if str(before.instance) in e] == []
        with Client(socket_path) as client:
            assert client.generate(PROMPT, SHORT).text == reference
    with Client(socket_path) as client:
        assert client.stats().num_restarts >= len(STAGES)
    status = subprocess.run([sys.executable, "-m", "pipeline.cli", "status", "--socket", str(socket_path)],
                            capture_output=True, text=True, timeout=30)
    assert status.returncode == 0, status.stderr
    assert "daemon: ok" in status.stdout and "last failure: stage 'tokenizer0' was killed by signal 9" in status.stdout
    assert daemon.shm_entries() == []


@live
@pytest.mark.timeout(60)
def test_a_killed_daemon_takes_its_stages_along_and_the_next_start_sweeps(slot: DaemonSlot, reference: str) -> None:
    daemon = slot.daemon
    stage_pids = wait_for_health(daemon.socket_path, lambda h: h.status == "ok", 10).stage_pids.values()
    # What a daemon killed while its stages start leaves: a segment named after its instance.
    leftover = ring_name(f"{daemon.process.pid}_dead01", "leftover")
    posix_ipc.SharedMemory(leftover, posix_ipc.O_CREX, mode=0o600, size=4096).close_fd()
    killed_at = time.monotonic()
    daemon.process.kill()
    daemon.process.wait()
    while any(pid_alive(pid) for pid in stage_pids):
        assert time.monotonic() - killed_at < 2.0, "stages outlived their daemon by 2 s"
        time.sleep(0.01)
    print(f"stages exited {(time.monotonic() - killed_at) * 1000:.0f} ms after the daemon was killed")
    assert daemon.socket_path.exists() and pid_file_for(daemon.socket_path).exists()  # left behind
    with pytest.raises(DaemonNotRunning):
        _health(daemon.socket_path)

    slot.daemon = start_daemon(slot.model, slot.directory, DAEMON_OPTIONS)
    assert slot.daemon.socket_path == daemon.socket_path
    assert leftover.lstrip("/") not in list_entries()
    assert int(pid_file_for(daemon.socket_path).read_text()) == slot.daemon.process.pid
    with Client(daemon.socket_path) as client:
        assert client.health().status == "ok"
        assert client.generate(PROMPT, SHORT).text == reference


@live
@pytest.mark.timeout(60)
def test_sigterm_finishes_requests_within_the_grace_period_and_aborts_the_rest(slot: DaemonSlot) -> None:
    daemon = slot.daemon
    socket_path = daemon.socket_path
    stage_pids = _health(socket_path).stage_pids.values()
    client = AsyncClient(socket_path)

    async def start_load() -> tuple[list[AsyncStream], AsyncIterator[StreamDelta]]:
        """A long request running, then quick ones accepted."""
        long = await _running(client.stream(PROMPT, LONG))
        quick = [client.stream(f"{PROMPT} {i}", QUICK) for i in range(2)]
        for stream in quick:
            await stream.start()
        return quick, long

    async def expected_outputs() -> list[Completion | None]:
        # The same load without a signal: the outputs to expect, and a first pass over batch
        # shapes the runner has not seen (which runs slowly enough to outlast a short grace period).
        quick, _ = await start_load()
        await asyncio.gather(*(_finish(stream.__aiter__()) for stream in quick))
        await client.close()
        return [stream.completion for stream in quick]

    async def scenario() -> tuple[list[Completion | None], BaseException | None, float, ServerMessage, float]:
        quick, long = await start_load()
        raw = await AsyncRawConnection.open(socket_path)
        signalled_at = time.monotonic()
        daemon.process.send_signal(signal.SIGTERM)
        finishing = [asyncio.ensure_future(_finish(deltas)) for deltas in (*(s.__aiter__() for s in quick), long)]
        while "shutting down" not in str((health := await raw.ask(Health())).reason):  # type: ignore[union-attr]
            assert time.monotonic() - signalled_at < 2.0, health
        refused = await raw.ask(Generate(prompt="too late"))
        with pytest.raises(DaemonNotRunning):
            await client.health()  # no new connections either
        results = await asyncio.wait_for(asyncio.gather(*finishing), GRACE_S + 5)
        raw.close()
        assert [error for error, _ in results[:-1]] == [None] * len(quick)
        exit_code = await asyncio.get_running_loop().run_in_executor(None, daemon.process.wait, GRACE_S + 5)
        exited_after_s = time.monotonic() - signalled_at
        assert exit_code == 0
        long_error, long_ended_at = results[-1]
        return [stream.completion for stream in quick], long_error, long_ended_at - signalled_at, refused, \
            exited_after_s

    expected = asyncio.run(expected_outputs())
    completions, long_error, long_ended_after_s, refused, exited_after_s = asyncio.run(scenario())
    assert None not in expected
    for completion, want in zip(completions, expected):
        assert completion is not None and want is not None
        assert completion.text == want.text and completion.token_ids == want.token_ids
    assert isinstance(refused, Error) and refused.code == "aborted" and "shutting down" in refused.message
    assert isinstance(long_error, RequestAborted)
    assert f"grace period {GRACE_S:g} s" in long_error.message
    assert GRACE_S - 0.5 < long_ended_after_s < GRACE_S + 2.0
    assert exited_after_s < GRACE_S + 3.0, f"the daemon exited {exited_after_s:.1f} s after SIGTERM"
    print(f"SIGTERM with a {GRACE_S:g} s grace period: the long request ended after {long_ended_after_s:.2f} s, "
          f"the daemon exited after {exited_after_s:.2f} s")
    assert not any(pid_alive(pid) for pid in stage_pids)
    assert daemon.shm_entries() == []
    assert not socket_path.exists() and not pid_file_for(socket_path).exists()

