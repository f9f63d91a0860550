"""Speculative decoding through the offline engine: output equal to the engine without it.

Greedy output must be identical token for token whatever the drafts (n-gram, a draft model equal
to the target, an unrelated draft model), async and sync, chunked, preempted and with prefix hits.
The engine without speculation is itself checked against transformers elsewhere.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from small_engine import small_llm

from structured_cases import CASES, MAX_TOKENS

from pipeline.models.tiny_model import make_tiny_model
from stages.contracts.params import SamplingParams

REPEATED = [11, 12, 13, 14, 15, 16, 17] * 5  # an n-gram lookup finds these again and again
PROMPTS = [REPEATED, [300 + i for i in range(23)], [7, 7, 8, 9, 7, 7, 8, 9, 7, 7], [42] * 3]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama with the target's tokenizer and other weights: its drafts are mostly rejected."""
    return make_tiny_model(tmp_path_factory.mktemp("spec-draft"), "llama", seed=5, num_layers=1)


def run(model: Path, params: SamplingParams | list[SamplingParams] = GREEDY, prompts=PROMPTS, **options):
    llm = small_llm(model, **options)
    outputs = llm.generate(prompts, params)
    return [list(o.token_ids) for o in outputs], llm


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> list[list[int]]:
    return run(tiny_llama)[0]


@pytest.mark.parametrize("async_scheduling, k", [(True, 1), (True, 3), (False, 3), (True, 5)])
def test_ngram_greedy_output_equals_the_engine_without_speculation(tiny_llama, reference, async_scheduling, k):
    outputs, llm = run(tiny_llama, async_scheduling=async_scheduling,
                       speculative_config={**NGRAM, "num_speculative_tokens": k})
    assert outputs == reference
    spec = llm.scheduler.stats().speculative
    # rows verify 1..k drafts each, as many as their acceptance pays for
    assert 0 < spec.num_verifications <= spec.num_draft_tokens <= k * spec.num_verifications
    assert spec.num_accepted_tokens > 0  # the repeated prompt's copies are accepted: drafting is on


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_suffix_greedy_output_equals_the_engine_without_speculation(tiny_llama, reference, async_scheduling):
    llm = small_llm(tiny_llama, async_scheduling=async_scheduling, speculative_config=SUFFIX)
    accepted = []
    for _ in range(2):  # the second round also finds the first round's outputs in the cache
        assert [list(o.token_ids) for o in llm.generate(PROMPTS, GREEDY)] == reference
        accepted.append(llm.scheduler.stats().speculative.num_accepted_tokens - sum(accepted))
    # The first round's drafts come from each request's own text, which this random model does not
    # repeat: they are verified (drafted) but may all be rejected, and the rows' rates then keep
    # further drafts off. The second round's come from the first round's outputs, and are accepted.
    assert accepted[1] > 0
    # a row's outputs join the cache when a later plan frees it: the first round's all have
    assert len(PROMPTS) <= llm.runner.speculator.proposer.cache.num_sequences < 2 * len(PROMPTS)


def test_the_runners_suffix_cache_holds_what_the_schedulers_holds(tiny_llama):
    """Both sides cache every leaving request's outputs, a request that never drafted too (here one
    that turned speculation off): the scheduler plans drafts from its cache, the runner proposes
    them from its own, and the two must agree."""
    llm = small_llm(tiny_llama, speculative_config=SUFFIX)
    params = [GREEDY, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, speculative=False)]
    llm.generate(PROMPTS[1:3], params)
    llm.generate(PROMPTS[2:4], params[::-1])
    cached = list(llm.scheduler.spec.suffix.cache._sequences.values())
    assert len(cached) == 4
    # the rows of the last requests are freed on the runner by the next plan, not made yet
    pending = len(llm.scheduler._rows_to_free)
    assert 0 < pending <= 2
    assert list(llm.runner.speculator.proposer.cache._sequences.values()) == cached[:len(cached) - pending]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_draft_model_equal_to_the_target_has_every_draft_accepted(tiny_llama, reference, async_scheduling):
    outputs, llm = run(tiny_llama, async_scheduling=async_scheduling,
                       speculative_config={"method": "draft_model", "model": str(tiny_llama),
                                           "num_speculative_tokens": 3})
    assert outputs == reference
    spec = llm.scheduler.stats().speculative
    assert spec.num_draft_tokens > 0
    assert spec.num_accepted_tokens == spec.num_draft_tokens


@pytest.mark.parametrize("async_scheduling, k", [(True, 3), (False, 5), (True, 1)])
def test_an_unrelated_draft_model_changes_nothing_but_speed(tiny_llama, reference, other_draft, async_scheduling, k):
    outputs, llm = run(tiny_llama, async_scheduling=async_scheduling,
                       speculative_config={"method": "draft_model", "model": str(other_draft),
                                           "num_speculative_tokens": k})
    assert outputs == reference
    spec = llm.scheduler.stats().speculative
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens < spec.num_draft_tokens


def test_chunked_prefill_preemption_and_prefix_hits_with_speculation(tiny_llama, reference):
    # 24 KV blocks of 4 tokens cannot hold four requests of 40-80 tokens: some are preempted and
    # recomputed; 12-token chunks split the longer prompts; the second round finds its prompts cached.
    llm = small_llm(tiny_llama, num_kv_blocks=24, max_model_len=96, max_num_batched_tokens=12,
                    speculative_config=NGRAM)
    for _ in range(2):
        outputs = [list(o.token_ids) for o in llm.generate(PROMPTS, GREEDY)]
        assert outputs == reference
    stats = llm.scheduler.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix.num_hit_tokens > 0
    assert stats.speculative.num_draft_tokens > 0


def test_penalties_logprobs_and_stops_see_exactly_the_accepted_tokens(tiny_llama):
    params = [
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, repetition_penalty=1.3,
                       frequency_penalty=0.4, presence_penalty=0.3),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[15], min_tokens=4),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
    ]
    plain = small_llm(tiny_llama).generate(PROMPTS, params)
    spec = small_llm(tiny_llama, speculative_config=NGRAM).generate(PROMPTS, params)
    for a, b in zip(plain, spec):
        assert list(a.token_ids) == list(b.token_ids)
        assert a.finish_reason == b.finish_reason
    assert [list(step) for step in spec[1].logprobs] == [list(step) for step in plain[1].logprobs]
    np.testing.assert_allclose([list(step.values()) for step in spec[1].logprobs],
                               [list(step.values()) for step in plain[1].logprobs], atol=1e-4)


def test_seeded_sampling_with_speculation_is_reproducible(tiny_llama):
    params = SamplingParams(max_tokens=30, temperature=0.8, top_k=50, seed=123, ignore_eos=True)
    first = run(tiny_llama, params, speculative_config=NGRAM)[0]
    again = run(tiny_llama, params, speculative_config=NGRAM, async_scheduling=False)[0]
    # the same seeded request alone in its batch draws the same tokens
    alone = run(tiny_llama, params, prompts=PROMPTS[:1], speculative_config=NGRAM)[0]
    assert first == again
    assert alone[0] == first[0]


def test_a_request_may_turn_speculation_off(tiny_llama, reference):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, speculative=False)
    outputs, llm = run(tiny_llama, params, speculative_config=NGRAM)
    assert outputs == reference
    assert llm.scheduler.stats().speculative.num_draft_tokens == 0


def test_speculation_turns_off_in_a_large_batch(tiny_llama, reference):
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (10, 40, 40, 40)]
    outputs, llm = run(tiny_llama, params, speculative_config={**NGRAM, "disable_by_batch_size": 3})
    assert outputs == [reference[0][:10], *reference[1:]]
    # Four rows decode at once, with no drafts, until the first one ends; then three may speculate.
    stats = llm.scheduler.stats()
    assert 0 < stats.speculative.num_verifications <= 3 * 30


def test_structured_output_with_speculation_validates(tiny_llama):
    fields, check = CASES["choice"]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, **fields) for i in range(3)]
    params.append(GREEDY)
    outputs = small_llm(tiny_llama, speculative_config=NGRAM).generate(PROMPTS, params)
    plain = small_llm(tiny_llama).generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    for output in outputs[:3]:
        assert output.finish_reason == "stop"
        check(output.text)


def test_offloaded_blocks_come_back_under_speculation(tiny_llama):
    config = NGRAM
    prompt = REPEATED + [300 + i for i in range(9)]
    expected = run(tiny_llama, prompts=[prompt])[0]
    llm = small_llm(tiny_llama, kv_connector="offload", num_kv_blocks=24, max_model_len=96, kv_offload_num_blocks=96,
                    speculative_config=config)
    assert [o.token_ids for o in llm.generate([prompt], GREEDY)] == expected
    for filler in ([500 + i for i in range(60)], [600 + i for i in range(60)]):  # evict its blocks from the device
        llm.generate([filler], GREEDY)
    assert [o.token_ids for o in llm.generate([prompt], GREEDY)] == expected
    assert llm.scheduler.connector.num_loaded_blocks > 0
    assert llm.scheduler.stats().speculative.num_draft_tokens > 0


def test_sliding_window_layers_under_speculation(tmp_path_factory):
    """Gemma 3's local layers (a window of 16) keep their own block tables; the blocks a window
    leaves are released while rows speculate."""
    model = make_tiny_model(tmp_path_factory.mktemp("spec-gemma3"), "gemma3", seed=15)
    prompts = [REPEATED, [300 + i for i in range(40)]]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    options = dict(max_model_len=160, num_kv_blocks=64, max_num_batched_tokens=24)
    expected = run(model, params, prompts=prompts, **options)[0]
    for async_scheduling in (True, False):
        outputs, llm = run(model, params, prompts=prompts, async_scheduling=async_scheduling,
                           speculative_config=NGRAM, **options)
        assert outputs == expected
        assert llm.scheduler.stats().speculative.num_draft_tokens > 0


@pytest.mark.parametrize("config, named", [
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup": 2}, "unknown key 'prompt_lookup'"),
    ({"method": "medusa", "num_speculative_tokens": 3}, "speculative_config.method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min 4 exceeds prompt_lookup_max 2"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model must name"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/nonexistent/draft"}, "speculative_config.model"),
    ("ngram", "must be a JSON object"),
])
def test_a_bad_speculative_config_is_refused_naming_the_key(tiny_llama, config, named):
    with pytest.raises(ValueError, match=named):
        small_llm(tiny_llama, speculative_config=config)


def test_a_draft_model_with_a_larger_vocabulary_is_refused(tiny_llama, tmp_path):
    draft = make_tiny_model(tmp_path / "big-vocab", "llama", seed=1, num_layers=1, vocab_size=2048)
    with pytest.raises(ValueError, match="vocabulary"):
        small_llm(tiny_llama, speculative_config={"method": "draft_model", "model": str(draft),
                                                  "num_speculative_tokens": 2})


@pytest.mark.parametrize("text, named", [
    ("{not json", "--speculative-config is not valid JSON"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "lookahead": 1}', "unknown key 'lookahead'"),
    ('{"method": "draft_model", "num_speculative_tokens": 3, "model": "/nonexistent/x.gguf"}',
     "speculative_config.model"),
])
def test_pipeline_start_refuses_a_bad_speculative_config(tiny_llama, text, named):
    from pipeline.cli import build_parser
    from pipeline.options import engine_config
    from pipeline.errors import PipelineError

    args = build_parser().parse_args(["start", "--model", str(tiny_llama), "--speculative-config", text])
    with pytest.raises(PipelineError, match=named):
        engine_config(args)


def test_a_stop_string_inside_an_accepted_run_ends_the_request_there(tiny_llama):
    """Several tokens of one request arrive in one step: those after the stop string are dropped."""
    spec = small_llm(tiny_llama, speculative_config={"method": "draft_model", "model": str(tiny_llama),
                                                      "num_speculative_tokens": 5})
    full = spec.generate([REPEATED], GREEDY)[0]
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
    plain = small_llm(tiny_llama).generate([REPEATED], params)[0]
    got = spec.generate([REPEATED], params)[0]
    assert (got.text, got.token_ids, got.finish_reason) == (plain.text, plain.token_ids, "stop")
    assert len(got.token_ids) < len(full.token_ids)
