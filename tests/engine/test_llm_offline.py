"""The offline engine on a tiny fp32 model: outputs do not depend on how steps are planned."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from small_engine import small_llm as llm

from pipeline import RequestOutput, SamplingParams

pytestmark = pytest.mark.timeout(60)


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    shared = rng.integers(2, 1000, 22).tolist()
    return [shared + rng.integers(2, 1000, n).tolist() for n in (1, 5, 9)] + \
        [rng.integers(2, 1000, n).tolist() for n in (3, 17, 30)]


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.token_ids for o in outputs]


CONFIGS = {
    "async": dict(async_scheduling=True),
    "sync-chunked": dict(async_scheduling=False, max_num_batched_tokens=16),
    "async-chunked": dict(async_scheduling=True, max_num_batched_tokens=16),
    "async-no-prefix-cache": dict(async_scheduling=True, enable_prefix_caching=False),
    "async-preempt": dict(async_scheduling=True, num_kv_blocks=24, max_model_len=96),
    "sync-preempt-chunked": dict(async_scheduling=False, num_kv_blocks=24, max_model_len=96,
                                 max_num_batched_tokens=8),
}


def test_greedy_outputs_identical_across_scheduling_modes(tiny_llama: Path) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0)
    reference = llm(tiny_llama, async_scheduling=False, enable_prefix_caching=False)
    expected = tokens(reference.generate(prompts(), greedy))
    assert all(len(t) == 12 for t in expected)
    for name, options in CONFIGS.items():
        engine = llm(tiny_llama, **options)
        # Twice: the second call hits the prefix cache (or recomputes after eviction).
        for _ in range(2):
            assert tokens(engine.generate(prompts(), greedy)) == expected, name
        stats = engine.scheduler.stats()
        assert stats.kv_blocks_free == engine.runner.num_kv_blocks, name
        if "preempt" in name:
            assert stats.num_preemptions > 0, name


def test_seeded_sampling_invariant_to_async_and_chunking(tiny_llama: Path) -> None:
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=100 + i) for i in range(6)]
    results = []
    for options in (dict(async_scheduling=True), dict(async_scheduling=False),
                    dict(async_scheduling=True, max_num_batched_tokens=8)):
        results.append(tokens(llm(tiny_llama, **options).generate(prompts(), params)))
    assert results[0] == results[1] == results[2]
    greedy = tokens(llm(tiny_llama).generate(prompts(), SamplingParams(max_tokens=10, temperature=0)))
    assert results[0] != greedy  # the sampler really sampled


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_stop_string_and_stop_token_finish_with_stop(tiny_llama: Path, async_scheduling: bool) -> None:
    engine = llm(tiny_llama, async_scheduling=async_scheduling)
    prompt = "the quick brown fox"
    full = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0))[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 16 and full.stop_reason is None
    stop = full.text[len(full.text) // 2:][:3]
    cut = full.text.index(stop)
    stopped = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0, stop=[stop]))[0]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop)
    assert stopped.text == full.text[:cut]
    assert stopped.token_ids == full.token_ids[:len(stopped.token_ids)] and len(stopped.token_ids) < 16
    stop_id = full.token_ids[5]
    by_token = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[stop_id]))[0]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", stop_id)
    assert by_token.token_ids == full.token_ids[:full.token_ids.index(stop_id) + 1]
    assert engine.scheduler.stats().kv_blocks_free == engine.runner.num_kv_blocks


def test_logprobs_returned_when_asked(tiny_llama: Path) -> None:
    engine = llm(tiny_llama)
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, logprobs=2))[0]
    assert out.prompt_token_ids == [5, 6, 7]
    assert len(out.logprobs) == 4
    for token_id, entry in zip(out.token_ids, out.logprobs):
        assert token_id in entry and len(entry) in (2, 3)
        assert max(entry.values()) == entry[token_id]  # greedy: the sampled token is the most likely
    assert engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0].logprobs is None


def test_prompt_errors_name_the_problem(tiny_llama: Path) -> None:
    engine = llm(tiny_llama, max_model_len=32)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 2], []])
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 1024\): \[5000\]"):
        engine.generate([[1, 5000]])
    with pytest.raises(ValueError, match="prompt 0 has 40 tokens; max_model_len 32"):
        engine.generate([list(range(2, 42))])
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        engine.generate(["hi"], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="kv_connector"):
        llm(tiny_llama, kv_connector="disk")
    # A rejected batch leaves nothing behind: the next call works.
    assert len(engine.generate([[1, 2]], SamplingParams(max_tokens=2))[0].token_ids) == 2


OFFLOAD_CASES = [("cpu", True), ("cpu", False),
                 pytest.param("cuda", True, marks=[pytest.mark.cuda, pytest.mark.skipif(
                     not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.mark.parametrize(("device", "async_scheduling"), OFFLOAD_CASES)
def test_offload_connector_hits_give_outputs_computed_from_scratch(
        tiny_llama: Path, device: str, async_scheduling: bool) -> None:
    greedy = SamplingParams(max_tokens=10, temperature=0)
    rng = np.random.default_rng(8)
    target = rng.integers(2, 1000, 40).tolist()
    fillers = [rng.integers(2, 1000, 44).tolist() for _ in range(3)]
    expected = tokens(llm(tiny_llama, device=device, enable_prefix_caching=False).generate([target], greedy))
    engine = llm(tiny_llama, device=device, async_scheduling=async_scheduling, kv_connector="offload",
                 num_kv_blocks=20, max_model_len=64, kv_offload_num_blocks=64)
    assert tokens(engine.generate([target], greedy)) == expected
    for filler in fillers:  # evicts the target's blocks from the device prefix cache
        engine.generate([filler], greedy)
    connector = engine.scheduler.connector
    assert connector.num_loaded_blocks == 0
    assert tokens(engine.generate([target], greedy)) == expected
    assert connector.num_loaded_blocks == 9  # (40 - 1) // 4 full prompt blocks from host memory
    extended = target + expected[0][:8]  # blocks holding generated tokens come back too
    expected_ext = tokens(llm(tiny_llama, device=device, enable_prefix_caching=False).generate([extended], greedy))
    for filler in fillers:
        engine.generate([filler], greedy)
    loaded_before = connector.num_loaded_blocks
    assert tokens(engine.generate([extended], greedy)) == expected_ext
    assert connector.num_loaded_blocks - loaded_before == 11  # (48 - 1) // 4
    assert engine.scheduler.stats().kv_blocks_free == 20
