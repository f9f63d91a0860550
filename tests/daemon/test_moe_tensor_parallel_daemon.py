"""A live daemon serving a mixture of experts over two ranks (gloo on CPU): SIGKILL of rank 1 under
live streams restarts both ranks and every stream completes as one rank generates it, with each
expert split across the ranks (Qwen2-MoE, its shared expert and a dense layer too) and with whole
experts per rank under --enable-expert-parallel (gpt-oss, its sinks and sliding layers too)."""
from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from device_choice import engine_device
from live_daemon import REAL_BACKEND, short_dir, start_daemon, wait_for_health, wait_idle
from test_tensor_parallel_daemon import OPTIONS, SCHEDULING, _assert_equal, _streams

from pipeline import LLM
from pipeline.bench.workload import mixed_params
from pipeline.models.tiny_model import make_tiny_model
from shm.naming import pid_alive

pytestmark = [pytest.mark.timeout(150),
              pytest.mark.skipif(not REAL_BACKEND, reason="tensor parallelism needs the real stage processes")]
MAX_TOKENS = 16


@pytest.mark.parametrize("arch, extra", [("qwen2_moe", []), ("gpt_oss", ["--enable-expert-parallel"])],
                         ids=["tensor-parallel", "expert-parallel"])
def test_a_killed_rank_of_a_mixture_restarts_and_every_stream_completes_exactly(
        tmp_path_factory: pytest.TempPathFactory, arch: str, extra: list[str]) -> None:
    model: Path = make_tiny_model(tmp_path_factory.mktemp(f"moe-tp-daemon-{arch}"), arch, seed=9)
    prompts = [f"{i}: the experts are shared by the ranks" for i in range(4)]
    # The small pool preempts and the step budget chunks every prompt, as in the dense test.
    with LLM(model, device=engine_device(), **SCHEDULING) as llm:
        params = mixed_params(llm, prompts, MAX_TOKENS)
        expected = llm.generate(prompts, params)
    directory = short_dir()
    daemon = start_daemon(model, directory, OPTIONS + extra)
    try:
        socket_path = daemon.socket_path
        before = wait_for_health(socket_path, lambda h: h.status == "ok", 10)
        _assert_equal(asyncio.run(_streams(socket_path, prompts, params, kill_stage="runner1")), expected)
        after = wait_for_health(socket_path, lambda h: h.status == "ok" and h.num_restarts == before.num_restarts + 1,
                                30)
        assert after.last_failure == "stage 'runner1' was killed by signal 9"
        assert not any(pid_alive(pid) for pid in before.stage_pids.values())  # rank 0 went with rank 1
        assert wait_idle(socket_path, timeout_s=5.0).kv_blocks_used == 0
    finally:
        daemon.stop()
        assert daemon.shm_entries() == []
        shutil.rmtree(directory.parent, ignore_errors=True)
