"""Faults, injected into a live daemon with real stage processes: a stalled stage; each stage
SIGKILLed under load (the stages restart and every request resumes where it was, with the output
of an uninterrupted run), once with a second kill during the recovery; a frontend stage killed
(it restarts alone: the engine's stages run on, and the resumed requests hit the prefix cache); a request that crashes a
stage every time it meets it (the poison guard fails it, the others resume); the daemon SIGKILLed
under streams (its stages follow it and remove its /dev/shm names; the next start sweeps what
other dead daemons left, and nothing of a live one); SIGTERM with a grace period.

The daemon runs the stage processes with one change, whose tokenizer workers die on a marked
prompt (poisoned_tokenizer.py), so that one daemon serves every test here. The supervisor's
restart bounds and the guard's rules are tested in-process with fake stages (test_supervisor.py).
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import posix_ipc
import pytest
from device_choice import engine_device
from live_daemon import (REAL_BACKEND, AsyncRawConnection, LiveDaemon, parent_pids, process_tree, short_dir,
                         start_daemon, wait_for_health, wait_idle, wait_nothing_left)
from poisoned_tokenizer import POISON_PROMPT

from pipeline import LLM, RequestOutput, SamplingParams
from pipeline.bench.workload import mixed_params
from pipeline.client import AsyncClient, AsyncStream, Client, Completion, StreamDelta
from pipeline.serve.daemon import pid_file_for
from pipeline.errors import ConnectionLost, DaemonNotRunning, PipelineError, RequestAborted, StageFailed
from pipeline.protocol import Error, Generate, Health, HealthReply, ServerMessage
from pipeline.models.tiny_model import make_tiny_model
from shm.naming import list_entries, new_instance_id, pid_alive, ring_name
from shm.segment import unlink_segment

GRACE_S = 3.0
# A long context, so that a long request outlasts the grace period and the faults on any CPU: a
# single sequence of the tiny model decodes ~1,000 tokens a second when it runs alone.
MAX_MODEL_LEN = 16384
DAEMON_OPTIONS = ["--stall-seconds", "1", "--grace-seconds", str(GRACE_S), "--max-restarts", "16",
                  "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", str(4 * MAX_MODEL_LEN // 16)]
BACKEND = "poisoned-tokenizer"  # the stage processes, but for a tokenizer that dies on POISON_PROMPT
LONG = dict(max_tokens=MAX_MODEL_LEN - 64, ignore_eos=True, temperature=0.0)  # runs until the fault
SHORT = dict(max_tokens=12, ignore_eos=True, temperature=0.0)
QUICK = dict(max_tokens=6, ignore_eos=True, temperature=0.0)  # finishes well within the grace period
LOAD_TOKENS = 200  # per stream of a kill under load: most of it comes after the kill
PROMPT = "After the fault the daemon"
ENGINE_STAGES = ["runner", "scheduler"]  # a crash of one restarts every stage
FRONTEND_STAGES = ["detokenizer", "tokenizer0"]  # a crash of one restarts these alone

live = pytest.mark.skipif(not REAL_BACKEND, reason="faults are injected into real stage processes")


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
    slot = DaemonSlot(start_daemon(model, directory, DAEMON_OPTIONS, BACKEND), directory, model)
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


@dataclass
class Load:
    """The requests of a kill under load, and what the offline engine makes of them."""

    prompts: list[str]
    params: list[SamplingParams]
    expected: list[RequestOutput]


@pytest.fixture(scope="module")
def load(slot: DaemonSlot) -> Load:
    """16 streams long enough to be mid-stream at the kill: greedy, seeded sampling, seeded with
    penalties, greedy with a stop string from late in its text; the offline engine's outputs."""
    llm = LLM(slot.model, device=engine_device(), max_model_len=MAX_MODEL_LEN, num_kv_blocks=4 * MAX_MODEL_LEN // 16,
              block_size=16)
    prompts = [f"{i}: {PROMPT}" for i in range(16)]
    params = mixed_params(llm, prompts, LOAD_TOKENS)
    return Load(prompts, params, llm.generate(prompts, params))


async def _kill_under_load(socket_path: Path, load: Load, stage: str,
                           then_kill: str | None = None) -> tuple[list[Completion | BaseException], float]:
    """SIGKILLs `stage` once every stream of `load` is running and (with `then_kill`) that stage as
    soon as the fresh stages run. Each stream's completion (or error), and the time from the kill
    to the first token from the fresh stages."""
    client = AsyncClient(socket_path)
    streams = [client.stream(prompt, params) for prompt, params in zip(load.prompts, load.params)]
    arrivals: list[float] = []

    async def finish(deltas: AsyncIterator[StreamDelta]) -> None:
        async for _ in deltas:
            arrivals.append(time.monotonic())

    try:
        running = await asyncio.wait_for(asyncio.gather(*(_running(stream) for stream in streams)), 30)
        before = await client.health()
        killed_at = time.monotonic()
        os.kill(before.stage_pids[stage], signal.SIGKILL)
        finishing = asyncio.gather(*(finish(deltas) for deltas in running), return_exceptions=True)
        # Once the daemon says it restarts the stages, or has, it has let go of the dead ones:
        # every later delta comes from the fresh stages. (The restart takes a fraction of a
        # second, too short to catch the refusal of new requests meanwhile reliably here; the
        # supervisor's tests hold a restart to see it.)
        while ((health := await client.health()).instance == before.instance and "restarting" not in str(health.reason)
               and health.num_restarts == before.num_restarts):
            await asyncio.sleep(0.01)
        restarting_at = time.monotonic()
        if then_kill is not None:
            while (health := await client.health()).status != "ok":
                await asyncio.sleep(0.01)
            os.kill(health.stage_pids[then_kill], signal.SIGKILL)
        ended = await asyncio.wait_for(finishing, 60)
    finally:
        await client.close()
    results = [stream.completion if error is None else error for stream, error in zip(streams, ended)]
    return results, min(t for t in arrivals if t > restarting_at) - killed_at


def _assert_as_offline(results: list[Completion | BaseException], load: Load, stage: str) -> None:
    for index, (got, want) in enumerate(zip(results, load.expected)):
        assert isinstance(got, Completion), f"request {index} after killing {stage}: {got!r}"
        assert (got.token_ids, got.text) == (want.token_ids, want.text), f"request {index} after killing {stage}"
        assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason)
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(want.prompt_token_ids),
                                                                          len(want.token_ids))


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
@pytest.mark.timeout(240)
def test_each_killed_stage_costs_a_pause_and_every_request_resumes_exactly(slot: DaemonSlot, reference: str,
                                                                           load: Load) -> None:
    daemon = slot.daemon
    socket_path = daemon.socket_path
    rounds = [(stage, None) for stage in ENGINE_STAGES] + [("runner", "detokenizer")]  # the last: killed again
    for stage, then_kill in rounds:
        before = wait_for_health(socket_path, lambda h: h.status == "ok", 30)
        results, resumed_after_s = asyncio.run(_kill_under_load(socket_path, load, stage, then_kill))
        _assert_as_offline(results, load, stage)
        again = f", then {then_kill} killed during the recovery" if then_kill else ""
        print(f"{stage} killed{again}: first resumed token {resumed_after_s * 1000:.0f} ms after the kill, "
              f"0 of {len(results)} requests lost")

        restarts = 2 if then_kill else 1
        after = wait_for_health(socket_path, lambda h: h.status == "ok" and h.num_restarts == before.num_restarts
                                + restarts, 30)
        assert after.instance != before.instance
        assert f"stage {then_kill or stage!r} was killed by signal 9" in str(after.last_failure)
        assert not any(pid_alive(pid) for pid in before.stage_pids.values())
        assert [e for e in daemon.shm_entries() if str(before.instance) in e] == []
        assert wait_idle(socket_path, timeout_s=5.0).kv_blocks_used == 0
        with Client(socket_path) as client:
            assert client.generate(PROMPT, SHORT).text == reference
    with Client(socket_path) as client:
        stats = client.stats()
    assert stats.num_restarts >= len(rounds) + 1
    assert stats.num_resumed_requests >= len(rounds) * len(load.prompts) and stats.num_guard_failed_requests == 0
    status = subprocess.run([sys.executable, "-m", "pipeline.cli", "status", "--socket", str(socket_path)],
                            capture_output=True, text=True, timeout=30)
    assert status.returncode == 0, status.stderr
    assert "daemon: ok" in status.stdout and "last failure: stage 'detokenizer' was killed by signal 9" in status.stdout
    assert f"recovery: {stats.num_resumed_requests} requests resumed after stage restarts, 0 failed" in status.stdout
    assert _only_live_names(daemon, _health(socket_path))


def _only_live_names(daemon: LiveDaemon, health: HealthReply) -> bool:
    """The daemon's /dev/shm holds the status board and the mailbox of its running instance (a
    restarted frontend stage opens them by name), and nothing else."""
    return daemon.shm_entries() == sorted(ring_name(str(health.instance), name).lstrip("/")
                                          for name in ("mailbox", "status"))


@dataclass
class FrontendKill:
    results: list[Completion | BaseException]  # each stream's completion (or error)
    at_kill: HealthReply  # just before the kill
    hit_tokens: int  # the prefix cache's hit tokens just before the kill
    num_running: int  # streams that had delivered min_tokens and not ended at the kill


async def _kill_frontend_under_load(socket_path: Path, load: Load, stage: str, min_tokens: int) -> FrontendKill:
    """SIGKILLs `stage` once every stream of `load` has delivered `min_tokens` or ended."""
    client = AsyncClient(socket_path)
    streams = [client.stream(prompt, params) for prompt, params in zip(load.prompts, load.params)]

    async def delivered(deltas: AsyncIterator[StreamDelta]) -> bool:
        num_tokens = 0
        while num_tokens < min_tokens:
            try:
                num_tokens += len((await deltas.__anext__()).token_ids)
            except StopAsyncIteration:
                return False  # a stop string ended it early
        return True

    try:
        iterators = [stream.__aiter__() for stream in streams]
        running = await asyncio.wait_for(asyncio.gather(*(delivered(deltas) for deltas in iterators)), 60)
        at_kill = await client.health()
        hit_tokens = (await client.stats()).prefix_cache_hit_tokens
        os.kill(at_kill.stage_pids[stage], signal.SIGKILL)
        ended = await asyncio.wait_for(asyncio.gather(*(_finish(deltas) for deltas in iterators)), 60)
    finally:
        await client.close()
    results = [stream.completion if error is None else error for stream, (error, _) in zip(streams, ended)]
    return FrontendKill(results, at_kill, hit_tokens, sum(running))


@live
@pytest.mark.timeout(120)
def test_a_killed_frontend_stage_restarts_alone_and_the_resumed_requests_hit_the_prefix_cache(
        slot: DaemonSlot, reference: str, load: Load) -> None:
    socket_path = slot.daemon.socket_path
    min_tokens = 40  # each stream's prompt and outputs then fill two blocks of 16 at least
    for stage in FRONTEND_STAGES:
        before = wait_for_health(socket_path, lambda h: h.status == "ok", 30)
        kill = asyncio.run(_kill_frontend_under_load(socket_path, load, stage, min_tokens))
        at_kill = kill.at_kill
        _assert_as_offline(kill.results, load, stage)
        after = wait_for_health(socket_path, lambda h: h.status == "ok" and h.num_restarts == before.num_restarts + 1,
                                30)
        assert after.instance == before.instance, stage
        assert {name: after.stage_pids[name] for name in ENGINE_STAGES} == \
            {name: at_kill.stage_pids[name] for name in ENGINE_STAGES}, f"the engine's stages ran on after {stage}"
        assert not pid_alive(at_kill.stage_pids[stage]) and after.stage_pids[stage] != at_kill.stage_pids[stage]
        assert f"stage {stage!r} was killed by signal 9" in str(after.last_failure)
        with Client(socket_path) as client:
            stats = client.stats()
            assert client.generate(PROMPT, SHORT).text == reference
        # Each resumed request's replay found its first two blocks (at least) in the cache the
        # scheduler kept: the hit count runs on from before the kill.
        print(f"{stage} killed: {kill.num_running} streams resumed, {stats.prefix_cache_hit_tokens - kill.hit_tokens} "
              "prefix cache hit tokens since")
        assert kill.num_running >= len(load.prompts) // 2, "the kill came after most streams ended"
        assert stats.prefix_cache_hit_tokens - kill.hit_tokens >= 2 * 16 * kill.num_running, stage
        assert wait_idle(socket_path, timeout_s=5.0).kv_blocks_used == 0
        assert _only_live_names(slot.daemon, after)


# Long constrained outputs, so a stream is mid-way at the kill: arrays of exactly LIST_ITEMS items.
LIST_ITEMS = 60
LONG_SCHEMA = {"type": "object", "properties": {
    "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": LIST_ITEMS,
               "maxItems": LIST_ITEMS},
    "codes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 8,
              "maxItems": 8}}, "required": ["colors", "codes"], "additionalProperties": False}
LONG_REGEX = r"([a-z]{3}-[0-9]{2} ){40}end"


@live
@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", ["runner", "scheduler"])
def test_a_stage_killed_mid_constrained_stream_resumes_and_the_output_still_validates(
        slot: DaemonSlot, stage: str) -> None:
    """The runner holds the grammar state: the fresh one rebuilds it from the delivered tokens."""
    import json
    import re

    import jsonschema

    llm = LLM(slot.model, device=engine_device(), max_model_len=MAX_MODEL_LEN, num_kv_blocks=4 * MAX_MODEL_LEN // 16,
              block_size=16)
    prompts = [f"{i}: {PROMPT}" for i in range(8)]
    params = [SamplingParams(max_tokens=600, temperature=1.0, seed=40 + i,
                             **({"json_schema": json.dumps(LONG_SCHEMA)} if i % 2 else {"regex": LONG_REGEX}))
              for i in range(len(prompts))]
    constrained = Load(prompts, params, llm.generate(prompts, params))
    before = wait_for_health(slot.daemon.socket_path, lambda h: h.status == "ok", 30)
    with Client(slot.daemon.socket_path) as client:
        resumed_before = client.stats().num_resumed_requests
    results, _ = asyncio.run(_kill_under_load(slot.daemon.socket_path, constrained, stage))
    with Client(slot.daemon.socket_path) as client:
        assert client.stats().num_resumed_requests - resumed_before == len(prompts)  # all were mid-stream
    _assert_as_offline(results, constrained, stage)
    for index, got in enumerate(results):
        assert got.finish_reason == "stop"
        if index % 2:
            jsonschema.validate(json.loads(got.text), LONG_SCHEMA)
        else:
            assert re.fullmatch(LONG_REGEX, got.text), got.text
    wait_for_health(slot.daemon.socket_path, lambda h: h.status == "ok" and h.num_restarts == before.num_restarts + 1,
                    30)


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
            running = await asyncio.wait_for(asyncio.gather(*(_running(stream) for stream in streams)), 30)
            # Every stream has passed the tokenizer: the poisoned request alone crashes it, twice.
            poisoned = await asyncio.wait_for(_finish(client.stream(f"{POISON_PROMPT} {PROMPT}", SHORT).__aiter__()),
                                              60)
            ended = await asyncio.wait_for(asyncio.gather(*(_finish(deltas) for deltas in running)), 60)
        finally:
            await client.close()
        return [stream.completion if error is None else error for stream, (error, _) in zip(streams, ended)], \
            poisoned[0]

    results, poisoned = asyncio.run(scenario())
    assert isinstance(poisoned, StageFailed), poisoned
    assert "stage 'tokenizer0' exited with code 1" in poisoned.message and "RuntimeError: a poisoned prompt" in \
        poisoned.message
    assert "in flight during this crash and the one before it" in poisoned.message
    _assert_as_offline(results, load, "tokenizer0 (poisoned)")
    after = wait_for_health(socket_path, lambda h: h.status == "ok" and h.num_restarts == before.num_restarts + 2, 30)
    with Client(socket_path) as client:
        stats = client.stats()
    # Each crash was a tokenizer's: the frontend restarted alone, under the same instance.
    assert stats.num_guard_failed_requests == 1 and after.instance == before.instance
    assert wait_idle(socket_path, timeout_s=5.0).kv_blocks_used == 0


def _forkserver_pid(daemon_pid: int, timeout_s: float = 60.0, other_than: int = 0) -> int:
    """The pid of the daemon's forkserver (the process its stages fork from), once there is one."""
    deadline = time.monotonic() + timeout_s
    while True:
        for pid, ppid in parent_pids().items():
            if ppid != daemon_pid or pid == other_than:
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                    command = cmdline.read()
            except OSError:
                continue
            if b"multiprocessing.forkserver" in command:
                return pid
        assert time.monotonic() < deadline, f"the daemon {daemon_pid} has no forkserver after {timeout_s} s"
        time.sleep(0.05)


@live
@pytest.mark.timeout(240)
def test_a_killed_forkserver_costs_nothing_and_a_stage_killed_later_restarts_from_its_replacement(
        slot: DaemonSlot, load: Load) -> None:
    socket_path, daemon_pid = slot.daemon.socket_path, slot.daemon.process.pid
    before = wait_for_health(socket_path, lambda h: h.status == "ok", 30)
    forkserver = _forkserver_pid(daemon_pid)

    async def kill_forkserver_under_load() -> list[Completion | BaseException]:
        client = AsyncClient(socket_path)
        streams = [client.stream(prompt, params) for prompt, params in zip(load.prompts, load.params)]
        try:
            running = await asyncio.wait_for(asyncio.gather(*(_running(stream) for stream in streams)), 30)
            os.kill(forkserver, signal.SIGKILL)
            ended = await asyncio.wait_for(asyncio.gather(*(_finish(deltas) for deltas in running)), 60)
        finally:
            await client.close()
        return [stream.completion if error is None else error for stream, (error, _) in zip(streams, ended)]

    _assert_as_offline(asyncio.run(kill_forkserver_under_load()), load, "the forkserver")
    health = wait_for_health(socket_path, lambda h: h.status == "ok", 5)
    assert (health.instance, health.num_restarts, health.stage_pids) == (before.instance, before.num_restarts,
                                                                         before.stage_pids)  # nothing restarted
    _forkserver_pid(daemon_pid, other_than=forkserver)  # a fresh one, ready for the next restart
    results, resumed_after_s = asyncio.run(_kill_under_load(socket_path, load, "runner"))
    _assert_as_offline(results, load, "runner, after the forkserver")
    print(f"runner killed after the forkserver: first resumed token {resumed_after_s * 1000:.0f} ms after the kill")
    after = wait_for_health(socket_path, lambda h: h.status == "ok" and h.num_restarts == before.num_restarts + 1, 30)
    # Its exit status went with the forkserver that forked it; its death did not.
    assert after.last_failure == "stage 'runner' died (its exit status was lost with the forkserver it was forked from)"
    assert not any(pid_alive(pid) for pid in before.stage_pids.values())
    assert [e for e in slot.daemon.shm_entries() if str(before.instance) in e] == []


@live
@pytest.mark.timeout(180)
def test_requests_that_come_during_a_restart_wait_for_it_and_complete_exactly(slot: DaemonSlot, load: Load) -> None:
    socket_path = slot.daemon.socket_path
    before = wait_for_health(socket_path, lambda h: h.status == "ok", 30)
    forkserver = _forkserver_pid(slot.daemon.process.pid)

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
            ended = await asyncio.wait_for(asyncio.gather(*(_finish(stream.__aiter__()) for stream in streams)), 90)
        finally:
            await client.close()
        return [stream.completion if error is None else error for stream, (error, _) in zip(streams, ended)]

    _assert_as_offline(asyncio.run(scenario()), load, "scheduler, with requests sent during the restart")
    wait_for_health(socket_path, lambda h: h.status == "ok" and h.num_restarts == before.num_restarts + 1, 30)


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
        running = await asyncio.wait_for(asyncio.gather(*(_running(stream) for stream in streams)), 30)
        daemon.process.kill()
        killed_at = time.monotonic()
        ended = await asyncio.wait_for(asyncio.gather(*(_finish(deltas) for deltas in running)), 10)
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
            _health(daemon.socket_path)

        posix_ipc.SharedMemory(dead, posix_ipc.O_CREX, mode=0o600, size=4096).close_fd()
        slot.daemon = start_daemon(slot.model, slot.directory, DAEMON_OPTIONS, BACKEND)
        assert slot.daemon.socket_path == daemon.socket_path
        entries = list_entries()
        assert dead.lstrip("/") not in entries and alive.lstrip("/") in entries
        assert dead.lstrip("/") in slot.daemon.log_path.read_text()  # it says what it removed
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

