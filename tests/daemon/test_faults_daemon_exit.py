"""The daemon's own end under faults, with real stage processes: the daemon SIGKILLed under streams
(its stages follow it and remove its /dev/shm names; the next start sweeps what other dead
daemons left, and nothing of a live one); SIGTERM with a grace period (the last test: it stops
the daemon).

The daemon (fault_daemon.py) serves every test here.
"""
from __future__ import annotations

import asyncio
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import posix_ipc
import pytest
from fault_daemon import (BACKEND, DAEMON_OPTIONS, GRACE_S, LONG, PROMPT, QUICK, SHORT, DaemonSlot, finish_stream,
                          health_of, live, started_stream)
from fault_daemon import reference, slot  # noqa: F401 - the fault daemon's fixtures
from live_daemon import AsyncRawConnection, LiveDaemon, process_tree, start_daemon, wait_for_health, wait_nothing_left

from pipeline.client import AsyncClient, AsyncStream, Client, Completion, StreamDelta
from pipeline.errors import ConnectionLost, DaemonNotRunning, RequestAborted
from pipeline.protocol import Error, Generate, Health, ServerMessage
from pipeline.serve.daemon import pid_file_for
from shm.naming import list_entries, new_instance_id, pid_alive, ring_name
from shm.segment import unlink_segment

def _dead_pid() -> int:
    """The pid of a process that ran and was reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


async def _kill_under_streams(daemon: LiveDaemon, num_streams: int) -> tuple[list[BaseException | None], float]:
    """SIGKILLs the daemon once `num_streams` long streams run; how each stream ended, and when
    the daemon was killed (time.monotonic())."""
    client = AsyncClient(daemon.socket_path)
    try:
        streams = [client.stream(f"{i}: {PROMPT}", LONG) for i in range(num_streams)]
        running = await asyncio.wait_for(asyncio.gather(*(started_stream(stream) for stream in streams)), 30)
        daemon.process.kill()
        killed_at = time.monotonic()
        ended = await asyncio.wait_for(asyncio.gather(*(finish_stream(deltas) for deltas in running)), 10)
    finally:
        await client.close()
    return [error for error, _ in ended], killed_at


@live
@pytest.mark.timeout(60)
def test_a_daemon_killed_under_streams_leaves_nothing_and_the_next_start_sweeps_only_the_dead(
        slot: DaemonSlot, reference: str) -> None:
    daemon = slot.daemon
    stage_pids = wait_for_health(daemon.socket_path, lambda h: h.status == "ok", 10).stage_pids.values()
    alive = ring_name(new_instance_id(), "mailbox")  # a live daemon's name (this process's)
    dead = ring_name(f"{_dead_pid()}_dead01", "mailbox")  # what a daemon killed with its stages left
    posix_ipc.SharedMemory(alive, posix_ipc.O_CREX, mode=0o600, size=4096).close_fd()
    try:
        tree = process_tree(daemon.process.pid)
        assert set(stage_pids) < tree  # with the daemon, its forkserver and its resource tracker
        errors, killed_at = asyncio.run(_kill_under_streams(daemon, 4))
        assert all(isinstance(error, ConnectionLost) for error in errors), errors
        daemon.process.wait(5)
        gone_after_s = wait_nothing_left(daemon, tree, killed_at, within_s=5.0)
        print(f"the killed daemon's processes and /dev/shm names were gone {gone_after_s * 1000:.0f} ms after the kill")
        assert alive.lstrip("/") in list_entries()
        assert daemon.socket_path.exists() and pid_file_for(daemon.socket_path).exists()  # left behind
        with pytest.raises(DaemonNotRunning):
            health_of(daemon.socket_path)

        posix_ipc.SharedMemory(dead, posix_ipc.O_CREX, mode=0o600, size=4096).close_fd()
        slot.daemon = start_daemon(slot.model, slot.directory, DAEMON_OPTIONS, BACKEND)
        assert slot.daemon.socket_path == daemon.socket_path
        entries = list_entries()
        assert dead.lstrip("/") not in entries and alive.lstrip("/") in entries
        # It says what it removed. Under parallel test workers another test's daemon, starting in the
        # same moment, may have swept the name first: then that daemon's log names it.
        logs = [slot.daemon.log_path, *Path(tempfile.gettempdir()).glob("pld-*/daemon.log")]
        assert any(dead.lstrip("/") in log.read_text(errors="replace") for log in logs if log.exists())
        assert int(pid_file_for(daemon.socket_path).read_text()) == slot.daemon.process.pid
        with Client(daemon.socket_path) as client:
            assert client.health().status == "ok"
            assert client.generate(PROMPT, SHORT).text == reference
    finally:
        for name in (dead, alive):
            unlink_segment(name)


@live
@pytest.mark.timeout(60)
def test_sigterm_finishes_requests_within_the_grace_period_and_aborts_the_rest(slot: DaemonSlot) -> None:
    daemon = slot.daemon
    socket_path = daemon.socket_path
    stage_pids = health_of(socket_path).stage_pids.values()
    client = AsyncClient(socket_path)

    async def start_load() -> tuple[list[AsyncStream], AsyncIterator[StreamDelta]]:
        """A long request running, then quick ones accepted."""
        long = await started_stream(client.stream(PROMPT, LONG))
        quick = [client.stream(f"{PROMPT} {i}", QUICK) for i in range(2)]
        for stream in quick:
            await stream.start()
        return quick, long

    async def expected_outputs() -> list[Completion | None]:
        # The same load without a signal: the outputs to expect, and a first pass over batch
        # shapes the runner has not seen (which runs slowly enough to outlast a short grace period).
        quick, _ = await start_load()
        await asyncio.gather(*(finish_stream(stream.__aiter__()) for stream in quick))
        await client.close()
        return [stream.completion for stream in quick]

    async def scenario() -> tuple[list[Completion | None], BaseException | None, float, ServerMessage, float]:
        quick, long = await start_load()
        raw = await AsyncRawConnection.open(socket_path)
        signalled_at = time.monotonic()
        daemon.process.send_signal(signal.SIGTERM)
        finishing = [asyncio.ensure_future(finish_stream(deltas)) for deltas in (*(s.__aiter__() for s in quick), long)]
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
