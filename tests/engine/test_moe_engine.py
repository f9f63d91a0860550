"""Mixtures of experts through the whole offline engine: greedy tokens equal transformers' with chunked
prefill, a prefix-cache hit and preemption, under async and sync scheduling, for each family (gpt-oss
with its sinks and sliding window too); and with speculative decoding."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hf_reference import greedy_with_top2, skip_where_transformers_ignores_the_swiglu_limit
from small_engine import small_llm

from pipeline import SamplingParams
from pipeline.models.tiny_model import MOE, make_tiny_model

pytestmark = pytest.mark.timeout(180)
NUM_NEW = 16


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory):
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = make_tiny_model(tmp_path_factory.mktemp(f"engine-{arch}"), arch, seed=31)
        return built[arch]

    return get


@pytest.fixture(scope="module")
def expected(moe_model):
    """transformers' greedy tokens per family, once: its forward with its own KV cache, argmax each step."""
    from transformers import AutoModelForCausalLM

    built: dict[str, list[list[int]]] = {}

    def get(arch: str) -> list[list[int]]:
        if arch in built:
            return built[arch]
        model = AutoModelForCausalLM.from_pretrained(moe_model(arch), dtype=torch.float32).eval()
        skip_where_transformers_ignores_the_swiglu_limit(model)
        built[arch] = [greedy_with_top2(model, prompt, NUM_NEW)[0] for prompt in prompts()]
        return built[arch]

    return get


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(6)
    long = rng.integers(2, 1000, 80).tolist()
    # The second shares 64 tokens with the first, which is cached by then: a prefix hit.
    return [long, long[:64] + rng.integers(2, 1000, 30).tolist(), rng.integers(2, 1000, 50).tolist()]


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("arch", [*sorted(MOE), "gpt_oss"])
def test_moe_engine_equals_transformers_with_chunks_prefix_hits_and_preemption(moe_model, expected, arch,
                                                                             async_scheduling):
    model = moe_model(arch)
    # A 24-token step budget chunks every prompt; 40 blocks of 4 cannot hold the last two requests at once.
    llm = small_llm(model, max_num_batched_tokens=24, max_num_seqs=2, num_kv_blocks=40, max_model_len=160,
                    async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)
    first = llm.generate(prompts()[:1], params)  # its blocks stay cached for the second prompt's hit
    outputs = first + llm.generate(prompts()[1:], params)
    assert [o.token_ids for o in outputs] == expected(arch)
    assert all(len(set(tokens)) > 4 for tokens in expected(arch))  # not a degenerate model
    stats = llm.scheduler.stats()
    assert stats.prefix.num_hit_tokens >= 64 and stats.num_preemptions > 0
    assert llm.scheduler.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("arch", sorted(MOE))
def test_moe_with_speculative_decoding_equals_transformers(moe_model, expected, arch):
    """The mixture drafts for itself (every draft accepted) and verifies several tokens per row a step."""
    model = moe_model(arch)
    llm = small_llm(model, max_num_seqs=3, max_model_len=160,
                    speculative_config={"method": "draft_model", "model": str(model), "num_speculative_tokens": 3})
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts(), params)] == expected(arch)
    spec = llm.scheduler.stats().speculative
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == spec.num_draft_tokens


def test_gpt_oss_verifying_a_dense_drafts_tokens_equals_transformers(moe_model, expected, tmp_path):
    """gpt-oss cannot draft (its sliding layers); as the target it verifies a tiny Llama's drafts,
    several queries per row through its sink attention."""
    draft = make_tiny_model(tmp_path / "draft", "llama", seed=32)
    llm = small_llm(moe_model("gpt_oss"), max_num_seqs=3, max_model_len=160,
                    speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts(), params)] == expected("gpt_oss")
    assert llm.scheduler.stats().speculative.num_draft_tokens > 0
