"""Structured output under speculative decoding: a grammar row's drafts are checked against its
grammar, each verified position is masked with the grammar after the drafts before it, and the
output is that of the engine without speculation."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from small_engine import small_llm
from structured_cases import CASES, MAX_TOKENS

from stages.contracts.params import SamplingParams
from stages.gpu_runner.sampling.constraints import RowConstraints

pytestmark = pytest.mark.timeout(300)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 3}
KINDS = ["json_schema", "regex", "choice", "grammar", "repeating"]  # json_object's case has a logit_bias: it never drafts
PROMPTS = ["the answer is", "a b a b a b", "request 7: the answer is", "x", "ab ab cd ab"]
# A grammar whose greedy text repeats itself: its drafts are accepted, so positions after the
# first of a verifying row are sampled, each under the mask of the drafts before it.
REPEATING = r"((ab|cd|ef) ){8,12}"


def grammar_params(kind: str, **values: object) -> SamplingParams:
    if kind == "repeating":
        return SamplingParams(max_tokens=MAX_TOKENS, regex=REPEATING, **values)
    return SamplingParams(max_tokens=MAX_TOKENS, **CASES[kind][0], **values)


def mask_of(constraints: RowConstraints, matcher) -> np.ndarray:
    return constraints.bitmask([matcher])[0]


def test_draft_masks_follow_the_grammar_and_leave_the_matcher_as_it_was(tiny_llama: Path):
    vocab_size, eos = 1024, [2]
    constraints = RowConstraints(4, vocab_size, eos, tiny_llama / "tokenizer.json", torch.device("cpu"))
    params = grammar_params("regex")
    constraints.apply(SimpleNamespace(freed_rows=np.zeros(0, np.int32), new_requests=[
        SimpleNamespace(row=2, params=params, token_ids=np.zeros(3, np.int32), num_prompt_tokens=3)]))
    matcher = constraints._matchers[2]
    before = mask_of(constraints, matcher)
    # Two tokens the grammar takes (the lowest it allows at each step), then one it refuses.
    valid = []
    for _ in range(2):
        allowed = np.flatnonzero(np.unpackbits(mask_of(constraints, matcher).view(np.uint8), bitorder="little"))
        valid.append(int(allowed[0]))
        assert matcher.consume_token(valid[-1])
    masks_after = [before, None, mask_of(constraints, matcher)]
    matcher.rollback(1)
    masks_after[1] = mask_of(constraints, matcher)
    matcher.rollback(1)
    refused = int(np.flatnonzero(np.unpackbits(~masks_after[2].view(np.uint8), bitorder="little"))[0])
    drafts = np.array([[5, 6, 7, 8], [*valid, refused, valid[0]]], np.int64)

    index, bitmask = constraints.draft_bitmask(np.array([0, 2], np.int32), drafts)
    assert index == [1]  # row 0 has no grammar
    assert bitmask.shape == (5, -(-vocab_size // 32))
    for j in range(3):
        np.testing.assert_array_equal(bitmask[j], masks_after[j])
    assert (bitmask[3:] == -1).all()  # after the refused draft: never reached, left open
    np.testing.assert_array_equal(mask_of(constraints, matcher), before)

    # The row accepted its first draft and drew a token: the matcher takes exactly those.
    constraints.sampled(np.array([0, 2], np.int32), torch.tensor([[5, -1, -1, -1, -1], [valid[0], valid[1], -1, -1, -1]],
                                                                  dtype=torch.int32))
    np.testing.assert_array_equal(mask_of(constraints, matcher), masks_after[2])


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> list[list[int]]:
    params = [grammar_params(kind, temperature=0.0) for kind in KINDS]
    return [list(o.token_ids) for o in small_llm(tiny_llama).generate(PROMPTS, params)]


@pytest.mark.parametrize("config, async_scheduling", [(NGRAM, True), (SUFFIX, True), (SUFFIX, False)],
                         ids=["ngram-async", "suffix-async", "suffix-sync"])
def test_greedy_structured_output_with_drafts_equals_the_engine_without(tiny_llama, reference, config,
                                                                       async_scheduling):
    llm = small_llm(tiny_llama, async_scheduling=async_scheduling, speculative_config=config)
    params = [grammar_params(kind, temperature=0.0) for kind in KINDS]
    outputs = llm.generate(PROMPTS, params)
    assert [list(o.token_ids) for o in outputs] == reference
    for output, kind in zip(outputs[:-1], KINDS):
        assert output.finish_reason == "stop"
        CASES[kind][1](output.text)
    assert re.fullmatch(REPEATING, outputs[-1].text), outputs[-1].text
    spec = llm.scheduler.stats().speculative
    assert spec.num_draft_tokens > 0  # the grammar rows verified drafts
    assert spec.num_accepted_tokens > 0
