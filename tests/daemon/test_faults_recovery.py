"""Recovery in a live daemon with real stage processes: the forkserver killed under load (nothing
restarts, and a stage killed later restarts from its replacement); a request that crashes a
stage every time it meets it (the poison guard fails it, the others resume); requests that come
while a restart is held wait for it and complete exactly.

The daemon (fault_daemon.py) serves every test here. The forkserver's test comes first: it has
the longest time limit, and the first test to use the load makes its offline outputs.
"""
from __future__ import annotations

import asyncio
import os
import signal

import pytest
from fault_daemon import (PROMPT, SHORT, DaemonSlot, Load, assert_as_offline, finish_stream, forkserver_pid,
                          kill_under_load, live, started_stream)
from fault_daemon import load, slot  # noqa: F401 - the fault daemon's fixtures
from live_daemon import wait_for_health, wait_idle
from poisoned_tokenizer import POISON_PROMPT

from pipeline.client import AsyncClient, Client, Completion
from pipeline.errors import StageFailed
from shm.naming import pid_alive


@live
@pytest.mark.timeout(240)
def test_a_killed_forkserver_costs_nothing_and_a_stage_killed_later_restarts_from_its_replacement(
        slot: DaemonSlot, load: Load) -> None:
    socket_path, daemon_pid = slot.daemon.socket_path, slot.daemon.process.pid
    before = wait_for_health(socket_path, lambda h: h.status == "ok", 30)
    forkserver = forkserver_pid(daemon_pid)

    async def kill_forkserver_under_load() -> list[Completion | BaseException]:
        client = AsyncClient(socket_path)
        streams = [client.stream(prompt, params) for prompt, params in zip(load.prompts, load.params)]
        try:
            running = await asyncio.wait_for(asyncio.gather(*(started_stream(stream) for stream in streams)), 30)
            os.kill(forkserver, signal.SIGKILL)
            ended = await asyncio.wait_for(asyncio.gather(*(finish_stream(deltas) for deltas in running)), 60)
        finally:
            await client.close()
        return [stream.completion if error is None else error for stream, (error, _) in zip(streams, ended)]

    assert_as_offline(asyncio.run(kill_forkserver_under_load()), load, "the forkserver")
    health = wait_for_health(socket_path, lambda h: h.status == "ok", 5)
    assert (health.instance, health.num_restarts, health.stage_pids) == (before.instance, before.num_restarts,
                                                                         before.stage_pids)  # nothing restarted
    forkserver_pid(daemon_pid, other_than=forkserver)  # a fresh one, ready for the next restart
    results, resumed_after_s = asyncio.run(kill_under_load(socket_path, load, "runner"))
    assert_as_offline(results, load, "runner, after the forkserver")
    print(f"runner killed after the forkserver: first resumed token {resumed_after_s * 1000:.0f} ms after the kill")
    after = wait_for_health(socket_path, lambda h: h.status == "ok" and h.num_restarts == before.num_restarts + 1, 30)
    # Its exit status went with the forkserver that forked it; its death did not.
    assert after.last_failure == "stage 'runner' died (its exit status was lost with the forkserver it was forked from)"
    assert not any(pid_alive(pid) for pid in before.stage_pids.values())
    assert [e for e in slot.daemon.shm_entries() if str(before.instance) in e] == []


@live
@pytest.mark.timeout(120)
def test_the_poison_guard_fails_the_request_that_crashes_a_stage_twice_and_resumes_the_others(
        slot: DaemonSlot, load: Load) -> None:
    socket_path = slot.daemon.socket_path
    before = wait_for_health(socket_path, lambda h: h.status == "ok", 30)

    async def scenario() -> tuple[list[Completion | BaseException], BaseException | None]:
        client = AsyncClient(socket_path)
        streams = [client.stream(prompt, params) for prompt, params in zip(load.prompts, load.params)]
        try:
            running = await asyncio.wait_for(asyncio.gather(*(started_stream(stream) for stream in streams)), 30)
            # Every stream has passed the tokenizer: the poisoned request alone crashes it, twice.
            poisoned = await asyncio.wait_for(finish_stream(client.stream(f"{POISON_PROMPT} {PROMPT}", SHORT).__aiter__()),
                                              60)
            ended = await asyncio.wait_for(asyncio.gather(*(finish_stream(deltas) for deltas in running)), 60)
        finally:
            await client.close()
        return [stream.completion if error is None else error for stream, (error, _) in zip(streams, ended)], \
            poisoned[0]

    results, poisoned = asyncio.run(scenario())
    assert isinstance(poisoned, StageFailed), poisoned
    assert "stage 'tokenizer0' exited with code 1" in poisoned.message and "RuntimeError: a poisoned prompt" in \
        poisoned.message
    assert "in flight during this crash and the one before it" in poisoned.message
    assert_as_offline(results, load, "tokenizer0 (poisoned)")
    after = wait_for_health(socket_path, lambda h: h.status == "ok" and h.num_restarts == before.num_restarts + 2, 30)
    with Client(socket_path) as client:
        stats = client.stats()
    # Each crash was a tokenizer's: the frontend restarted alone, under the same instance.
    assert stats.num_guard_failed_requests == 1 and after.instance == before.instance
    assert wait_idle(socket_path, timeout_s=5.0).kv_blocks_used == 0


@live
@pytest.mark.timeout(180)
def test_requests_that_come_during_a_restart_wait_for_it_and_complete_exactly(slot: DaemonSlot, load: Load) -> None:
    socket_path = slot.daemon.socket_path
    before = wait_for_health(socket_path, lambda h: h.status == "ok", 30)
    forkserver = forkserver_pid(slot.daemon.process.pid)

    async def scenario() -> list[Completion | BaseException]:
        client = AsyncClient(socket_path)
        try:
            # A stopped forkserver holds the restart: the fresh stages' forks wait for it.
            os.kill(forkserver, signal.SIGSTOP)
            try:
                os.kill(before.stage_pids["scheduler"], signal.SIGKILL)
                while "restarting" not in str((await client.health()).reason):
                    await asyncio.sleep(0.01)
                streams = [client.stream(prompt, params) for prompt, params in zip(load.prompts, load.params)]
                await asyncio.wait_for(asyncio.gather(*(stream.start() for stream in streams)), 30)  # accepted
                health = await client.health()
                assert health.status == "degraded" and "restarting" in str(health.reason)
            finally:
                os.kill(forkserver, signal.SIGCONT)
            ended = await asyncio.wait_for(asyncio.gather(*(finish_stream(stream.__aiter__()) for stream in streams)), 90)
        finally:
            await client.close()
        return [stream.completion if error is None else error for stream, (error, _) in zip(streams, ended)]

    assert_as_offline(asyncio.run(scenario()), load, "scheduler, with requests sent during the restart")
    wait_for_health(socket_path, lambda h: h.status == "ok" and h.num_restarts == before.num_restarts + 1, 30)
