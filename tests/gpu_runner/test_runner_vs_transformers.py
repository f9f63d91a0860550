"""Greedy tokens from the runner equal transformers' own implementation of the same checkpoint.

Each batch mixes prompt lengths 1 to 300, runs with chunked prefill under a small token budget,
reuses rows (max_num_seqs below the number of requests), and includes a request whose first
blocks are another request's cached prefix (it starts with num_computed_tokens > 0).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.models.tiny_model import ARCHITECTURES
from hf_reference import greedy_with_top2
from runner_plans import PlannedRequest, make_runner, run_requests

NUM_NEW_TOKENS = 33
PROMPT_LENGTHS = (1, 2, 15, 16, 17, 64, 129, 300)
SHARED_BLOCKS = 3  # of the 129-token prompt, reused by the last request
BLOCK_SIZE = 16

pytestmark = pytest.mark.timeout(60)


def make_prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, 1000, n).tolist() for n in PROMPT_LENGTHS]
    # Same first 3 blocks as the 129-token prompt, then its own 40 tokens.
    prompts.append(prompts[6][: SHARED_BLOCKS * BLOCK_SIZE] + rng.integers(2, 1000, 40).tolist())
    return prompts


def hf_greedy(model_dir, prompts: list[list[int]], num_new_tokens: int) -> list[list[int]]:
    """transformers' forward with its own KV cache, argmax each step (EOS does not stop it)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [greedy_with_top2(model, prompt, num_new_tokens)[0] for prompt in prompts]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    cache = {}

    def get(arch: str) -> tuple[list[list[int]], list[list[int]]]:
        if arch not in cache:
            prompts = make_prompts(seed=len(cache) + 100)
            cache[arch] = prompts, hf_greedy(tiny_checkpoint(arch), prompts, NUM_NEW_TOKENS)
        return cache[arch]

    return get


def planned(prompts: list[list[int]], block_size: int = BLOCK_SIZE) -> list[PlannedRequest]:
    requests = [PlannedRequest(p, NUM_NEW_TOKENS) for p in prompts]
    requests[-1].prefix_from = (6, SHARED_BLOCKS * BLOCK_SIZE // block_size)
    return requests


@pytest.mark.parametrize("arch", tuple(ARCHITECTURES))
def test_greedy_matches_transformers_with_chunked_prefill_and_prefix_reuse(arch, tiny_checkpoint, reference):
    prompts, expected = reference(arch)
    runner = make_runner(tiny_checkpoint(arch), max_num_seqs=4, num_kv_blocks=256, block_size=BLOCK_SIZE)
    assert runner.max_model_len == 2048
    got = run_requests(runner, planned(prompts), token_budget=48)
    for prompt, want, have in zip(prompts, expected, got):
        assert have == want, f"{arch}: prompt of {len(prompt)} tokens diverges"
    # The random model must not be degenerate, or equality would prove little.
    assert all(len(set(tokens)) > 10 for tokens in expected)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_async_planning_and_other_chunk_sizes_give_the_same_tokens(arch, tiny_checkpoint, reference):
    """Plans made a step ahead of their results (decode inputs come from the device table only),
    with a different budget and block size, all rows at once."""
    prompts, expected = reference(arch)
    runner = make_runner(tiny_checkpoint(arch), max_num_seqs=16, num_kv_blocks=512, block_size=8)
    got = run_requests(runner, planned(prompts, block_size=8), token_budget=100, async_mode=True)
    assert got == expected
