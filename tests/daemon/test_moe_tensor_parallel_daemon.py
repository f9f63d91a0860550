"""A live daemon serving a mixture of experts over two ranks (gloo on CPU): SIGKILL of rank 1 under
live streams restarts both ranks and every stream completes as one rank generates it, with each
expert split across the ranks (Qwen2-MoE, its shared expert and a dense layer too) and with whole
experts per rank under --enable-expert-parallel (gpt-oss, its sinks and sliding layers too)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from device_choice import engine_device, engine_dtype
from live_daemon import REAL_BACKEND, short_dir, start_daemon
from test_tensor_parallel_daemon import OPTIONS, SCHEDULING, kill_rank_under_streams

from pipeline import LLM
from pipeline.bench.workload import mixed_params
from pipeline.models.tiny_model import make_tiny_model

pytestmark = [pytest.mark.timeout(150),
              pytest.mark.skipif(not REAL_BACKEND, reason="tensor parallelism needs the real stage processes")]
MAX_TOKENS = 16


@pytest.mark.parametrize("arch, extra", [("qwen2_moe", []), ("gpt_oss", ["--enable-expert-parallel"])],
                         ids=["tensor-parallel", "expert-parallel"])
def test_a_killed_rank_of_a_mixture_restarts_and_every_stream_completes_exactly(
        tmp_path_factory: pytest.TempPathFactory, arch: str, extra: list[str]) -> None:
    engine_device(num_devices=2)
    model: Path = make_tiny_model(tmp_path_factory.mktemp(f"moe-tp-daemon-{arch}"), arch, seed=9)
    prompts = [f"{i}: the experts are shared by the ranks" for i in range(4)]
    # The small pool preempts and the step budget chunks every prompt, as in the dense test.
    with LLM(model, device=engine_device(), dtype=engine_dtype(engine_device()), **SCHEDULING) as llm:
        params = mixed_params(llm, prompts, MAX_TOKENS)
        expected = llm.generate(prompts, params)
    directory = short_dir()
    daemon = start_daemon(model, directory, OPTIONS + extra)
    try:
        kill_rank_under_streams(daemon.socket_path, prompts, params, expected)
    finally:
        daemon.stop()
        assert daemon.shm_entries() == []
        shutil.rmtree(directory.parent, ignore_errors=True)
