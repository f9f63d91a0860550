"""`pipeline start --in-process`: the same engine in the daemon's own process serves the same tokens."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from device_choice import engine_device, engine_dtype
from live_daemon import REAL_BACKEND, short_dir, start_daemon, wait_idle

from pipeline import LLM, SamplingParams
from pipeline.client import Client

pytestmark = [pytest.mark.timeout(90),
              pytest.mark.skipif(not REAL_BACKEND, reason="starts `pipeline start` itself")]


def test_in_process_daemon_matches_the_offline_engine(daemon_model: Path) -> None:
    prompts = ["the quick brown fox", [5, 6, 7, 8, 9, 10], "a token mailbox ring"]
    params = [SamplingParams(max_tokens=16, temperature=0.0),
              SamplingParams(max_tokens=12, temperature=0.9, top_k=40, seed=11),
              SamplingParams(max_tokens=10, temperature=0.0, stop=[" "], logprobs=2)]
    offline = LLM(daemon_model, device=engine_device(), dtype=engine_dtype(engine_device()),
                  max_model_len=2048, num_kv_blocks=512, block_size=16)
    expected = offline.generate(prompts, params)
    directory = short_dir()
    daemon = start_daemon(daemon_model, directory, ["--in-process"])
    try:
        with Client(daemon.socket_path, timeout_s=30) as client:
            health = client.health()
            assert health.status == "ok" and list(health.stages) == ["engine"]
            for prompt, request_params, want in zip(prompts, params, expected):
                got = client.generate(prompt, request_params)
                assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
                assert got.stop_reason == want.stop_reason
        wait_idle(daemon.socket_path, timeout_s=5.0)
        assert daemon.shm_entries() == []  # no rings, no segments: one process
    finally:
        assert daemon.stop() == 0
        shutil.rmtree(directory.parent, ignore_errors=True)
