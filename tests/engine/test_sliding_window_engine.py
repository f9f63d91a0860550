"""Gemma 3's local layers through the whole engine: their KV blocks are released behind the window
and reused by others, and greedy tokens still equal transformers' with chunked prefill that
crosses the window, a prefix-cache hit past it, preemption, and async scheduling."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from small_engine import small_llm

from pipeline import SamplingParams
from pipeline.models.tiny_model import GEMMA3_WINDOW, make_tiny_model

pytestmark = pytest.mark.timeout(120)
NUM_NEW = 20


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("engine-tiny-gemma3"), "gemma3", seed=15)


def hf_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            for _ in range(NUM_NEW):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            outputs.append(ids[0, len(prompt):].tolist())
    return outputs


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    long = rng.integers(2, 1000, 90).tolist()
    # The second shares 64 tokens (four times the window) with the first: its hit reaches past the window.
    return [long, long[:64] + rng.integers(2, 1000, 30).tolist(), rng.integers(2, 1000, 50).tolist()]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_gemma3_engine_equals_transformers_with_window_blocks_released(tiny_gemma3, async_scheduling):
    llm = small_llm(tiny_gemma3, max_num_batched_tokens=24, max_num_seqs=2, num_kv_blocks=40, max_model_len=160,
                    async_scheduling=async_scheduling, dtype="float32")
    runner, scheduler = llm.runner, llm.scheduler
    assert runner.kv_group_windows == (None, GEMMA3_WINDOW)
    # Fewer local blocks than the longest request has tokens' blocks: it runs only if they are released.
    assert 0 < runner.num_window_blocks < -(-(len(prompts()[1]) + NUM_NEW) // 4)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)
    first = llm.generate(prompts()[:1], params)  # its blocks stay cached for the second prompt's hit
    outputs = first + llm.generate(prompts()[1:], params)
    assert [o.token_ids for o in outputs] == hf_greedy(tiny_gemma3, prompts())
    stats = scheduler.stats()
    assert stats.prefix.num_hit_tokens >= 64 and stats.num_preemptions > 0
    assert scheduler.kv.groups[1].manager.num_used_blocks == scheduler.block_manager.num_used_blocks == 0
