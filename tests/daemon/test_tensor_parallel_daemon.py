"""A live daemon whose runner is two tensor-parallel ranks (gloo on CPU): its outputs equal one rank's,
async and sync, with chunked prefill, prefix hits and preemption; SIGKILL of rank 1 under 8 live
streams restarts both ranks and every stream completes exactly; bad sizes are refused at start."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from device_choice import engine_device, engine_dtype
from live_daemon import REAL_BACKEND, LiveDaemon, daemon_command, short_dir, start_daemon, wait_for_health, wait_idle

from pipeline import LLM, RequestOutput, SamplingParams
from pipeline.bench.workload import mixed_params
from pipeline.client import AsyncClient, Completion
from pipeline.models.tiny_model import make_tiny_model
from shm.naming import pid_alive

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not REAL_BACKEND, reason="tensor parallelism needs the real stage processes")]

# A pool of 40 blocks of 4 tokens for 8 requests of ~40 tokens each: requests are preempted; a
# budget of 16 tokens a step chunks every prompt.
SCHEDULING = dict(max_model_len=128, num_kv_blocks=40, block_size=4, max_num_batched_tokens=16)
OPTIONS = ["--tensor-parallel-size", "2", "--max-model-len", "128", "--num-kv-blocks", "40", "--block-size", "4",
           "--max-num-batched-tokens", "16", "--stall-seconds", "5", "--max-restarts", "5"]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    engine_device(num_devices=2)
    # One KV head for two ranks: each rank holds a copy of it.
    return make_tiny_model(tmp_path_factory.mktemp("tp-daemon-llama"), "llama", seed=4, num_kv_heads=1)


@pytest.fixture(scope="module")
def workload(model: Path) -> tuple[list[str], list[SamplingParams], list[RequestOutput]]:
    """8 prompts with greedy, seeded and stop-string params, and one rank's outputs for them (in
    which the small pool preempts)."""
    llm = LLM(model, device=engine_device(), dtype=engine_dtype(engine_device()), **SCHEDULING)
    prompts = [f"{i}: the tensor parallel ranks share one plan" for i in range(8)]
    params = mixed_params(llm, prompts, MAX_TOKENS)
    expected = llm.generate(prompts, params)
    assert llm.scheduler.stats().num_preemptions > 0
    return prompts, params, expected


def _daemon(model: Path, extra: list[str]) -> Iterator[LiveDaemon]:
    directory = short_dir()
    daemon = start_daemon(model, directory, OPTIONS + extra)
    try:
        yield daemon
    finally:
        daemon.stop()
        assert daemon.shm_entries() == []
        shutil.rmtree(directory.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def async_daemon(model: Path) -> Iterator[LiveDaemon]:
    yield from _daemon(model, [])


async def _streams(socket_path: Path, prompts: list[str], params: list[SamplingParams],
                   kill_stage: str | None = None, kill_pid: int | None = None) -> list[Completion]:
    """Every prompt streamed at once; with `kill_stage` (or `kill_pid`) that stage (or process) is
    SIGKILLed once all run."""
    client = AsyncClient(socket_path)
    try:
        streams = [client.stream(prompt, p) for prompt, p in zip(prompts, params)]
        iterators = [stream.__aiter__() for stream in streams]
        if kill_stage is not None or kill_pid is not None:
            await asyncio.wait_for(asyncio.gather(*(it.__anext__() for it in iterators)), 30)
            os.kill(kill_pid or (await client.health()).stage_pids[kill_stage], signal.SIGKILL)

        async def drain(iterator: object) -> None:
            async for _ in iterator:
                pass

        await asyncio.wait_for(asyncio.gather(*(drain(it) for it in iterators)), 60)
    finally:
        await client.close()
    return [stream.completion for stream in streams]


def _assert_equal(got: list[Completion], expected: list[RequestOutput]) -> None:
    for index, (completion, want) in enumerate(zip(got, expected)):
        assert (completion.token_ids, completion.text) == (want.token_ids, want.text), f"request {index}"
        assert completion.finish_reason == want.finish_reason, f"request {index}"


def test_two_ranks_serve_what_one_rank_generates(async_daemon: LiveDaemon, workload: tuple) -> None:
    prompts, params, expected = workload
    health = wait_for_health(async_daemon.socket_path, lambda h: h.status == "ok", 10)
    assert {"runner", "runner1"} <= set(health.stage_pids)
    for _ in range(2):  # the second time the prompts' blocks may be in the prefix cache
        _assert_equal(asyncio.run(_streams(async_daemon.socket_path, prompts, params)), expected)
    stats = wait_idle(async_daemon.socket_path, timeout_s=5.0)
    assert stats.prefix_cache_hit_rate > 0


def kill_rank_under_streams(socket_path: Path, prompts: list[str], params: list[SamplingParams],
                            expected: list[RequestOutput]) -> tuple:
    """Rank 1 SIGKILLed under the prompts' streams: every stream equals `expected`, both ranks restart
    once (rank 0 goes with rank 1) and the engine ends idle. The health before and after."""
    before = wait_for_health(socket_path, lambda h: h.status == "ok", 10)
    _assert_equal(asyncio.run(_streams(socket_path, prompts, params, kill_stage="runner1")), expected)
    after = wait_for_health(socket_path, lambda h: h.status == "ok" and h.num_restarts == before.num_restarts + 1,
                            30)
    assert after.last_failure == "stage 'runner1' was killed by signal 9"
    assert not any(pid_alive(pid) for pid in before.stage_pids.values())  # rank 0 went with rank 1
    assert wait_idle(socket_path, timeout_s=5.0).kv_blocks_used == 0
    return before, after


def test_a_killed_rank_restarts_every_rank_and_every_stream_completes_exactly(async_daemon: LiveDaemon,
                                                                               workload: tuple) -> None:
    before, after = kill_rank_under_streams(async_daemon.socket_path, *workload)
    assert after.instance != before.instance
    assert [e for e in async_daemon.shm_entries() if str(before.instance) in e] == []


def test_sync_scheduling_two_ranks_equal_one(model: Path, workload: tuple) -> None:
    prompts, params, expected = workload
    for daemon in _daemon(model, ["--no-async-scheduling"]):
        _assert_equal(asyncio.run(_streams(daemon.socket_path, prompts, params)), expected)


def test_a_size_that_does_not_divide_the_heads_is_refused_at_start(model: Path) -> None:
    directory = short_dir()
    try:
        command = daemon_command(model, directory / "pipeline.sock", ["--tensor-parallel-size", "3"])
        result = subprocess.run(command, capture_output=True, text=True, timeout=90)
    finally:
        shutil.rmtree(directory.parent, ignore_errors=True)
    assert result.returncode != 0
    assert "tensor_parallel_size 3 does not divide the model's 4 attention heads" in result.stderr + result.stdout


def test_ranks_that_do_not_spread_evenly_over_the_nodes_are_refused_by_the_cli(model: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "pipeline.cli", "start", "--model", str(model),
                             "--tensor-parallel-size", "3",
                             "--nnodes", "2", "--master-port", "29999", "--socket", "/nonexistent/x.sock"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "tensor_parallel_size 3 must be a multiple of nnodes 2" in result.stderr


def test_a_rank_that_never_joins_fails_start_naming_the_rank_and_the_address(model: Path) -> None:
    from pipeline.errors import StageFailed
    from pipeline.engine.multiprocess import StageBackend
    from shm.naming import list_entries, new_instance_id
    from stages.contracts.config import EngineConfig

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # Rank 1 belongs to a second machine whose worker never comes.
    config = EngineConfig(model=str(model), device="cpu", tensor_parallel_size=2, nnodes=2, master_port=port,
                          start_timeout_s=6.0, num_kv_blocks=16, max_model_len=64)
    instance = new_instance_id()
    with pytest.raises(StageFailed, match=f"tensor-parallel rank 1 did not join the group at 127.0.0.1:{port} "
                                          f"within 3 s"):
        StageBackend(config, instance)
    assert [e for e in list_entries() if instance in e] == []
