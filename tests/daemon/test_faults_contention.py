"""Stage recovery on a busy machine: with the CPU oversubscribed (tests/contention.py), every stage
killed under load still costs only a pause, and one long stream comes through a runner kill, the
forkserver's death and a second runner kill with every token of an uninterrupted run.

Slow is not dead: the stages beat late and step slowly under the load, and nothing may take that
for a death. `make test-contention` runs these; PIPELINE_CONTENTION_RUNS=N runs each N times.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest
from contention import cpu_contention, runs
from device_choice import engine_device, engine_dtype
from fault_daemon import (ENGINE_STAGES, FRONTEND_STAGES, MAX_MODEL_LEN, DaemonSlot, Load, assert_as_offline,
                          fault_daemon, forkserver_pid, health_of, kill_under_load, live, make_load)
from live_daemon import wait_for_health

from pipeline import LLM, SamplingParams
from pipeline.client import AsyncClient, Client, Completion
from pipeline.errors import PipelineError
from pipeline.protocol import HealthReply

pytestmark = [pytest.mark.contention, live]

# The long stream runs through three faults: the runner, the forkserver, the runner again, each once it
# has this many tokens. Under the load one stream decodes a few tokens a second on a 2-core machine.
LONG_TOKENS = 600
KILL_AFTER_TOKENS = (100, 250, 400)
STAGE_WAIT_S = 240  # for the stream's next stretch: a busy machine decodes slowly
LONG_PROMPT = "Through every fault the stream"


@pytest.fixture(scope="module")
def slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonSlot]:
    """The fault daemon, allowed a restart per kill of every run (each test kills up to 4 times per run)."""
    yield from fault_daemon(tmp_path_factory, ("--max-restarts", str(8 * len(runs()) + 8)))


@pytest.fixture(scope="module")
def load(slot: DaemonSlot) -> Load:
    return make_load(slot.model)


def _serving(socket_path: os.PathLike, timeout_s: float = 60) -> HealthReply:
    """The daemon's health once no restart is under way and every stage lives (a stage that beats
    late under the load is slow, not dead: that is what this waits through)."""
    return wait_for_health(socket_path, lambda h: h.num_restarts is not None and "restarting" not in str(h.reason)
                           and "dead" not in str(h.reason) and "shutting down" not in str(h.reason), timeout_s)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", runs())
@pytest.mark.parametrize("stage", ENGINE_STAGES + FRONTEND_STAGES)
def test_each_stage_killed_under_cpu_contention_resumes_every_request_exactly(slot: DaemonSlot, load: Load,
                                                                              stage: str, run: int) -> None:
    socket_path = slot.daemon.socket_path
    before = _serving(socket_path)
    with cpu_contention():
        results, resumed_after_s = asyncio.run(kill_under_load(socket_path, load, stage, timeout_s=400))
        after = _serving(socket_path)
    assert_as_offline(results, load, f"{stage} under CPU contention")
    print(f"{stage} killed under contention: first resumed token {resumed_after_s * 1000:.0f} ms after the kill")
    assert after.num_restarts == before.num_restarts + 1
    assert f"stage {stage!r} was killed by signal 9" in str(after.last_failure)
    with Client(socket_path) as client:
        assert client.stats().num_guard_failed_requests == 0


@pytest.fixture(scope="module")
def long_expected(slot: DaemonSlot) -> list[int]:
    """LONG_PROMPT's greedy LONG_TOKENS tokens from the offline engine."""
    llm = LLM(slot.model, device=engine_device(), dtype=engine_dtype(engine_device()),
              max_model_len=MAX_MODEL_LEN, num_kv_blocks=4 * MAX_MODEL_LEN // 16,
              block_size=16)
    return llm.generate([LONG_PROMPT], SamplingParams(max_tokens=LONG_TOKENS, ignore_eos=True, temperature=0.0))[0].token_ids


async def _long_stream_through_faults(slot: DaemonSlot) -> tuple[Completion | BaseException, list[str]]:
    """One long greedy stream; once it has KILL_AFTER_TOKENS[i] tokens: the runner SIGKILLed, then
    the forkserver (once the fresh stages run), then the runner again. Its completion (or error)
    and what happened when."""
    socket_path = slot.daemon.socket_path
    client = AsyncClient(socket_path)
    stream = client.stream(LONG_PROMPT, dict(max_tokens=LONG_TOKENS, ignore_eos=True, temperature=0.0))
    received = 0
    reached = [asyncio.Event() for _ in KILL_AFTER_TOKENS]
    timeline: list[str] = []
    started = time.monotonic()

    async def read() -> BaseException | None:
        nonlocal received
        try:
            async for delta in stream:
                received += len(delta.token_ids)
                for threshold, event in zip(KILL_AFTER_TOKENS, reached):
                    if received >= threshold:
                        event.set()
        except PipelineError as exc:
            return exc
        return None

    def note(what: str) -> None:
        timeline.append(f"{time.monotonic() - started:6.1f} s, {received} tokens: {what}")

    try:
        reading = asyncio.create_task(read())
        kills = [lambda h: os.kill(h.stage_pids["runner"], signal.SIGKILL),
                 lambda h: os.kill(forkserver_pid(slot.daemon.process.pid), signal.SIGKILL),
                 lambda h: os.kill(h.stage_pids["runner"], signal.SIGKILL)]
        names = ["runner killed", "forkserver killed", "runner killed again"]
        for event, kill, name in zip(reached, kills, names):
            waiting = asyncio.create_task(event.wait())
            await asyncio.wait({waiting, reading}, timeout=STAGE_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            if not event.is_set():
                note(f"stream ended or stuck before {name}: {reading.result() if reading.done() else 'stuck'!r}")
                break
            health = await asyncio.to_thread(_serving, socket_path)
            kill(health)
            note(name)
        error = await asyncio.wait_for(reading, STAGE_WAIT_S)
        note(f"ended: {error!r}")
    finally:
        await client.close()
    return (stream.completion if error is None else error), timeline


@pytest.mark.timeout(900)
@pytest.mark.parametrize("run", runs())
def test_a_long_stream_comes_whole_through_runner_forkserver_runner_kills_under_cpu_contention(
        slot: DaemonSlot, long_expected: list[int], run: int) -> None:
    before = _serving(slot.daemon.socket_path)
    with cpu_contention():
        result, timeline = asyncio.run(_long_stream_through_faults(slot))
    print("\n".join(timeline))
    print("".join(line for line in slot.daemon.log_path.read_text().splitlines(keepends=True)
                  if " WARNING " in line or " ERROR " in line))
    assert isinstance(result, Completion), f"{result!r}; {timeline}"
    assert result.token_ids == long_expected, f"{len(result.token_ids)} of {len(long_expected)} tokens; {timeline}"
    after = wait_for_health(slot.daemon.socket_path, lambda h: h.num_restarts == before.num_restarts + 2, 60)
    assert "exit status was lost with the forkserver" in str(after.last_failure)
    with Client(slot.daemon.socket_path) as client:
        assert client.stats().num_guard_failed_requests == 0
    assert health_of(slot.daemon.socket_path).status in ("ok", "degraded")
