"""The offline engine with the runner's static decode path (bucketed buffers) against the dynamic
path: the same tokens through the real scheduler, with preemption, prefix hits and penalties."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline import LLM, SamplingParams
from stages.contracts.config import EngineConfig
from stages.gpu_runner.runner import ModelRunner

pytestmark = pytest.mark.timeout(90)

OPTIONS = dict(device="cpu", max_model_len=96, num_kv_blocks=24, block_size=4, max_num_seqs=5,
               async_scheduling=True)


def engine(model: Path, static_decode: bool) -> LLM:
    runner = ModelRunner(EngineConfig(model=str(model), **OPTIONS), static_decode=static_decode)
    return LLM(model=model, runner=runner, **OPTIONS)


def test_static_decode_gives_the_dynamic_tokens_with_preemption_and_prefix_hits(tiny_llama: Path) -> None:
    rng = np.random.default_rng(5)
    shared = rng.integers(2, 1000, 12).tolist()
    prompts = [shared + rng.integers(2, 1000, n).tolist() for n in (1, 6, 11)] + \
        [rng.integers(2, 1000, n).tolist() for n in (2, 19, 27)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0),
              SamplingParams(max_tokens=10, ignore_eos=True, temperature=0, repetition_penalty=1.4, frequency_penalty=0.3),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, top_k=30, seed=9),
              SamplingParams(max_tokens=9, ignore_eos=True, temperature=0, presence_penalty=0.8),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0),
              SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=4, logprobs=1)]
    results = {}
    for static_decode in (False, True):
        llm = engine(tiny_llama, static_decode)
        static_steps = []
        if static_decode:
            original = llm.runner._execute_static_decode
            llm.runner._execute_static_decode = lambda plan: static_steps.append(plan.num_rows) or original(plan)
        # Twice: the second pass hits the prefix cache (or recomputes after eviction).
        results[static_decode] = [[o.token_ids for o in llm.generate(prompts, params)] for _ in range(2)]
        assert len(static_steps) > 10 if static_decode else not static_steps
        stats = llm.scheduler.stats()
        assert stats.num_preemptions > 0 and stats.kv_blocks_free == llm.runner.num_kv_blocks
    assert results[True] == results[False]
    assert [len(t) for t in results[True][0]] == [12, 10, 12, 9, 12, 8]
