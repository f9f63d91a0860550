"""The live daemon the fault tests inject their faults into, and what they share: the load a kill
comes under, the offline engine's outputs for it, and the checks that the daemon recovered.

The daemon runs the stage processes with one change, whose tokenizer workers die on a marked
prompt (poisoned_tokenizer.py), so that one daemon serves every fault test of the session (the
daemon's conftest.py holds it; a test that stops it leaves the next module to start it afresh).
The fault tests import the fixtures and helpers from here by this module's name.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from device_choice import engine_device, engine_dtype
from live_daemon import REAL_BACKEND, LiveDaemon, parent_pids, short_dir, start_daemon, wait_for_health

from pipeline import LLM, RequestOutput, SamplingParams
from pipeline.bench.workload import mixed_params
from pipeline.client import AsyncClient, AsyncStream, Client, Completion, StreamDelta
from pipeline.errors import PipelineError
from pipeline.models.tiny_model import make_tiny_model
from pipeline.protocol import HealthReply
from shm.naming import ring_name

GRACE_S = 3.0
SERVING_TIMEOUT_S = 30.0  # for a module's shared daemon, left by the last, to serve again
# A long context, so that a long request outlasts the grace period and the faults on any CPU: a
# single sequence of the tiny model decodes ~1,000 tokens a second when it runs alone.
MAX_MODEL_LEN = 16384
DAEMON_OPTIONS = ["--stall-seconds", "1", "--grace-seconds", str(GRACE_S), "--max-restarts", "64",
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


def fault_daemon(tmp_path_factory: pytest.TempPathFactory, extra: tuple[str, ...] = ()) -> Iterator[DaemonSlot]:
    """The fault daemon (DAEMON_OPTIONS, then `extra`) for a module's tests; stopped and removed after."""
    if not REAL_BACKEND:
        pytest.skip("faults are injected into real stage processes")
    model = make_tiny_model(tmp_path_factory.mktemp("long-context-llama"), "llama", seed=3,
                            max_position_embeddings=MAX_MODEL_LEN)
    directory = short_dir()
    slot = DaemonSlot(start_daemon(model, directory, DAEMON_OPTIONS + list(extra), BACKEND), directory, model)
    try:
        yield slot
    finally:
        slot.daemon.stop()
        shutil.rmtree(directory.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def fault_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonSlot]:
    """The fault daemon every fault test module shares (see `slot`)."""
    yield from fault_daemon(tmp_path_factory)


@pytest.fixture(scope="module")
def slot(fault_slot: DaemonSlot) -> DaemonSlot:
    """The shared fault daemon, started afresh on the same socket if an earlier module stopped it
    or left it not serving."""
    if fault_slot.daemon.process.poll() is None:
        try:
            wait_for_health(fault_slot.daemon.socket_path, lambda h: h.status == "ok", SERVING_TIMEOUT_S)
            return fault_slot
        except pytest.fail.Exception:
            fault_slot.daemon.stop()
    fault_slot.daemon = start_daemon(fault_slot.model, fault_slot.directory, DAEMON_OPTIONS, BACKEND)
    return fault_slot


@pytest.fixture(scope="session")
def fault_reference(fault_slot: DaemonSlot) -> str:
    """PROMPT's greedy output from the healthy daemon: the same after every restart."""
    with Client(fault_slot.daemon.socket_path) as client:
        return client.generate(PROMPT, SHORT).text


@pytest.fixture(scope="module")
def reference(slot: DaemonSlot, fault_reference: str) -> str:
    return fault_reference


def health_of(socket_path: Path) -> HealthReply:
    with Client(socket_path, timeout_s=5) as client:
        return client.health()


async def started_stream(stream: AsyncStream) -> AsyncIterator[StreamDelta]:
    """The stream's iterator once its first delta has come: the request is running."""
    iterator = stream.__aiter__()
    await iterator.__anext__()
    return iterator


async def finish_stream(deltas: AsyncIterator[StreamDelta]) -> tuple[BaseException | None, float]:
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


def make_load(model: Path) -> Load:
    """16 streams long enough to be mid-stream at the kill: greedy, seeded sampling, seeded with
    penalties, greedy with a stop string from late in its text; the offline engine's outputs."""
    llm = LLM(model, device=engine_device(), dtype=engine_dtype(engine_device()),
              max_model_len=MAX_MODEL_LEN, num_kv_blocks=4 * MAX_MODEL_LEN // 16,
              block_size=16)
    prompts = [f"{i}: {PROMPT}" for i in range(16)]
    params = mixed_params(llm, prompts, LOAD_TOKENS)
    return Load(prompts, params, llm.generate(prompts, params))


@pytest.fixture(scope="session")
def fault_load(fault_slot: DaemonSlot) -> Load:
    """make_load for the shared fault daemon's model, made once."""
    return make_load(fault_slot.model)


@pytest.fixture(scope="module")
def load(slot: DaemonSlot, fault_load: Load) -> Load:
    return fault_load


async def kill_under_load(socket_path: Path, load: Load, stage: str, then_kill: str | None = None,
                          timeout_s: float = 60) -> tuple[list[Completion | BaseException], float]:
    """SIGKILLs `stage` once every stream of `load` is running and (with `then_kill`) that stage as
    soon as the fresh stages run. Each stream's completion (or error), and the time from the kill
    to the first token from the fresh stages. `timeout_s` bounds the start and the rest of the
    streams (a busy machine needs more)."""
    client = AsyncClient(socket_path)
    streams = [client.stream(prompt, params) for prompt, params in zip(load.prompts, load.params)]
    arrivals: list[float] = []

    async def finish(deltas: AsyncIterator[StreamDelta]) -> None:
        async for _ in deltas:
            arrivals.append(time.monotonic())

    try:
        running = await asyncio.wait_for(asyncio.gather(*(started_stream(stream) for stream in streams)), timeout_s)
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
        ended = await asyncio.wait_for(finishing, timeout_s)
    finally:
        await client.close()
    results = [stream.completion if error is None else error for stream, error in zip(streams, ended)]
    return results, min(t for t in arrivals if t > restarting_at) - killed_at


def forkserver_pid(daemon_pid: int, timeout_s: float = 60.0, other_than: int = 0) -> int:
    """The pid of the daemon's forkserver (the process its runner forks from), once there is one."""
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


def assert_as_offline(results: list[Completion | BaseException], load: Load, stage: str) -> None:
    for index, (got, want) in enumerate(zip(results, load.expected)):
        assert isinstance(got, Completion), f"request {index} after killing {stage}: {got!r}"
        assert (got.token_ids, got.text) == (want.token_ids, want.text), f"request {index} after killing {stage}"
        assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason)
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(want.prompt_token_ids),
                                                                          len(want.token_ids))


def only_live_names(daemon: LiveDaemon, health: HealthReply) -> bool:
    """The daemon's /dev/shm holds the status board and the mailbox of its running instance (a
    restarted frontend stage opens them by name), and nothing else."""
    return daemon.shm_entries() == sorted(ring_name(str(health.instance), name).lstrip("/")
                                          for name in ("mailbox", "status"))
