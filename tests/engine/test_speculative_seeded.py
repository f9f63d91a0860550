"""Seeded sampling through the offline engine gives the same tokens with speculation on and off.

A verified position draws from the target with the row's seeded noise, exactly as the plain
sampler does there, and accepts drafts while the draw equals them; so neither the drafts nor
when a row speculated change a seeded request's text. Each method proposing drafts is one entry
of METHODS.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from small_engine import small_llm

from stages.contracts.params import SamplingParams

REPEATED = [11, 12, 13, 14, 15, 16, 17] * 5
PROMPTS = [REPEATED, [300 + i for i in range(23)], [7, 7, 8, 9, 7, 7, 8, 9, 7, 7], [42] * 3]
MAX_TOKENS = 24
K = 3
LOGIT_SCALE = 10.0


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, seed=seed, repetition_penalty=1.1, presence_penalty=0.2,
                          frequency_penalty=0.1, max_tokens=MAX_TOKENS, ignore_eos=True)


PARAMS = [seeded(100 + i) for i in range(len(PROMPTS))]
# name -> (the speculative_config for a target checkpoint, whether some of its drafts get accepted
# here). The random model's seeded text does not repeat itself within MAX_TOKENS, so n-gram drafts
# are all rejected; the target as its own draft proposes its argmax, often (not always) the draw.
METHODS = {
    "ngram": (lambda target: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
                              "prompt_lookup_max": 3}, False),
    "draft_model": (lambda target: {"method": "draft_model", "model": str(target), "num_speculative_tokens": K},
                    True),
    # suffix tries trusting any match (a 1-token match drafts up to 4 tokens), so that rows draft here
    "suffix": (lambda target: {"method": "suffix", "num_speculative_tokens": K, "suffix_decoding_min_token_prob": 0.0,
                               "suffix_decoding_max_spec_factor": 4.0}, False),
}


@pytest.fixture(scope="module")
def peaked_llama(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with its output head scaled up: a random model's next-token distribution is
    nearly flat, this one's is peaked enough at temperature 0.8 for drafts to be accepted."""
    model = tmp_path_factory.mktemp("peaked-llama")
    shutil.copytree(tiny_llama, model, dirs_exist_ok=True)
    tensors = load_file(model / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * LOGIT_SCALE
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    return model


def generate(model: Path, speculative_config: dict | None, async_scheduling: bool):
    llm = small_llm(model, speculative_config=speculative_config, async_scheduling=async_scheduling)
    return [list(o.token_ids) for o in llm.generate(PROMPTS, PARAMS)], llm


@pytest.fixture(scope="module")
def reference(peaked_llama: Path) -> list[list[int]]:
    outputs, _ = generate(peaked_llama, None, async_scheduling=True)
    assert [len(o) for o in outputs] == [MAX_TOKENS] * len(PROMPTS)
    assert len({tuple(o) for o in outputs}) == len(PROMPTS)
    return outputs


def test_seeded_output_is_the_same_sync_and_async_without_speculation(peaked_llama, reference):
    assert generate(peaked_llama, None, async_scheduling=False)[0] == reference


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("method", list(METHODS))
def test_seeded_output_is_the_same_with_speculation(peaked_llama, reference, method, async_scheduling):
    config, accepts = METHODS[method]
    outputs, llm = generate(peaked_llama, config(peaked_llama), async_scheduling)
    assert outputs == reference
    spec = llm.scheduler.stats().speculative
    assert spec.num_verifications > 0 and spec.num_accepted_tokens < spec.num_draft_tokens  # drafts rejected
    if accepts:
        assert spec.num_accepted_tokens > 0  # and accepted: a run of accepted drafts, then the draw
