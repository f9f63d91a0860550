"""Stage faults in a live daemon with real stage processes: a stalled stage; each stage SIGKILLed
under load (the stages restart and every request resumes where it was, with the output of an
uninterrupted run), once with a second kill during the recovery; a frontend stage killed (it
restarts alone: the engine's stages run on, and the resumed requests hit the prefix cache); a
stage killed mid-way through constrained streams (the output still validates).

The daemon (fault_daemon.py) serves every test here. The supervisor's restart bounds and the
guard's rules are tested in-process with fake stages (test_supervisor.py).
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from device_choice import engine_device, engine_dtype
from fault_daemon import (ENGINE_STAGES, FRONTEND_STAGES, MAX_MODEL_LEN, PROMPT, SHORT, DaemonSlot, Load,
                          assert_as_offline, finish_stream, health_of, kill_under_load, live, only_live_names)
from fault_daemon import load, reference, slot  # noqa: F401 - the fault daemon's fixtures
from live_daemon import wait_for_health, wait_idle

from pipeline import LLM, SamplingParams
from pipeline.client import AsyncClient, Client, Completion, StreamDelta
from pipeline.protocol import HealthReply
from shm.naming import pid_alive

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
    assert "(stall limit " in str(stalled.reason) and "at least --stall-seconds 1 s)" in str(stalled.reason)
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
    with Client(socket_path) as client:
        at_start = client.stats()  # the fault modules share one daemon: count from here
    for stage, then_kill in rounds:
        before = wait_for_health(socket_path, lambda h: h.status == "ok", 30)
        results, resumed_after_s = asyncio.run(kill_under_load(socket_path, load, stage, then_kill))
        assert_as_offline(results, load, stage)
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
    assert stats.num_restarts - at_start.num_restarts >= len(rounds) + 1
    assert stats.num_resumed_requests - at_start.num_resumed_requests >= len(rounds) * len(load.prompts)
    assert stats.num_guard_failed_requests == at_start.num_guard_failed_requests
    status = subprocess.run([sys.executable, "-m", "pipeline.cli", "status", "--socket", str(socket_path)],
                            capture_output=True, text=True, timeout=30)
    assert status.returncode == 0, status.stderr
    assert "daemon: ok" in status.stdout and "last failure: stage 'detokenizer' was killed by signal 9" in status.stdout
    assert (f"recovery: {stats.num_resumed_requests} requests resumed after stage restarts, "
            f"{stats.num_guard_failed_requests} failed") in status.stdout
    assert only_live_names(daemon, health_of(socket_path))


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
        ended = await asyncio.wait_for(asyncio.gather(*(finish_stream(deltas) for deltas in iterators)), 60)
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
        assert_as_offline(kill.results, load, stage)
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
        assert only_live_names(slot.daemon, after)


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

    llm = LLM(slot.model, device=engine_device(), dtype=engine_dtype(engine_device()),
              max_model_len=MAX_MODEL_LEN, num_kv_blocks=4 * MAX_MODEL_LEN // 16,
              block_size=16)
    prompts = [f"{i}: {PROMPT}" for i in range(8)]
    params = [SamplingParams(max_tokens=600, temperature=1.0, seed=40 + i,
                             **({"json_schema": json.dumps(LONG_SCHEMA)} if i % 2 else {"regex": LONG_REGEX}))
              for i in range(len(prompts))]
    constrained = Load(prompts, params, llm.generate(prompts, params))
    before = wait_for_health(slot.daemon.socket_path, lambda h: h.status == "ok", 30)
    with Client(slot.daemon.socket_path) as client:
        resumed_before = client.stats().num_resumed_requests
    results, _ = asyncio.run(kill_under_load(slot.daemon.socket_path, constrained, stage))
    with Client(slot.daemon.socket_path) as client:
        assert client.stats().num_resumed_requests - resumed_before == len(prompts)  # all were mid-stream
    assert_as_offline(results, constrained, stage)
    for index, got in enumerate(results):
        assert got.finish_reason == "stop"
        if index % 2:
            jsonschema.validate(json.loads(got.text), LONG_SCHEMA)
        else:
            assert re.fullmatch(LONG_REGEX, got.text), got.text
    wait_for_health(slot.daemon.socket_path, lambda h: h.status == "ok" and h.num_restarts == before.num_restarts + 1,
                    30)
