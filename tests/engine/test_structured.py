"""Structured output in the offline engine: every constrained sample validates; greedy with a grammar
is masked greedy over the engine's own logits; async, sync, chunked and preempted runs agree."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import llguidance
import numpy as np
import pytest
import torch
from small_engine import small_llm
from structured_cases import CASES, CHOICES, MAX_TOKENS, REGEX, check_json_schema, closing_bias
from tokenizers import Tokenizer

from pipeline import LLM, SamplingParams
from stages.contracts.params import InvalidParams
from stages.grammar import GrammarCompiler

pytestmark = pytest.mark.timeout(120)
NUM_SAMPLES = 50
NUM_SYNC_SAMPLES = 10  # of them, also run with sync scheduling


def llm(model: Path, **options: object) -> LLM:
    options.setdefault("num_kv_blocks", 512)
    return small_llm(model, **options)


def case_params(model: Path, kind: str, **values: object) -> dict:
    fields = dict(CASES[kind][0])
    if kind == "json_object":
        fields["logit_bias"] = closing_bias(Tokenizer.from_file(str(model / "tokenizer.json")).token_to_id)
    return {**fields, **values}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The tiny model's CPU ops are too small to share: on a busy machine torch's intra-op threads
    spin against each other and a batch of 50 rows runs twenty times slower (the simulated device
    runs on one thread for the same reason)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engines(tiny_llama: Path) -> dict[str, LLM]:
    return {"async": llm(tiny_llama, async_scheduling=True), "sync": llm(tiny_llama, async_scheduling=False)}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_seeded_samples_of_every_kind_validate_and_async_equals_sync(tiny_llama: Path, engines: dict[str, LLM],
                                                                     kind: str) -> None:
    check = CASES[kind][1]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=1000 + i,
                             **case_params(tiny_llama, kind)) for i in range(NUM_SAMPLES)]
    prompts = [f"request {i}: the answer is" for i in range(NUM_SAMPLES)]
    outputs = engines["async"].generate(prompts, params)
    for out in outputs:
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        check(out.text)
    assert len({o.text for o in outputs}) > 1  # it really sampled
    # Seeded samples do not depend on their batch: sync on a part of them gives the same tokens.
    sync = engines["sync"].generate(prompts[:NUM_SYNC_SAMPLES], params[:NUM_SYNC_SAMPLES])
    assert [o.token_ids for o in sync] == [o.token_ids for o in outputs[:NUM_SYNC_SAMPLES]]


class RecordingSampler:
    """The runner's sampler, recording the raw logits it is given for each step's first row."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits, meta, constrain=None):
        self.logits.append(logits[0].detach().to(torch.float32).cpu().clone())
        return self.sampler(logits, meta, constrain)


@pytest.mark.parametrize("kind", ["json_schema", "regex", "grammar"])
def test_greedy_with_a_grammar_is_masked_greedy_over_the_engines_logits(tiny_llama: Path, kind: str) -> None:
    engine = llm(tiny_llama)
    recorder = RecordingSampler(engine.runner.sampler)
    engine.runner.sampler = recorder
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, **case_params(tiny_llama, kind))
    out = engine.generate("the answer is", params)[0]
    assert out.finish_reason == "stop"
    CASES[kind][1](out.text)

    # The reference: a matcher of its own, fed the reference's own tokens, masking each step's logits.
    vocab_size = engine.vocab_size
    compiler = GrammarCompiler((tiny_llama / "tokenizer.json").read_text(), vocab_size, engine.runner.eos_token_ids)
    matcher = compiler.matcher(params.guided)
    expected = []
    for logits in recorder.logits:
        bitmask = np.zeros((1, -(-vocab_size // 32)), np.int32)
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab_size].astype(bool)
        token = int(np.flatnonzero(allowed)[np.argmax(logits.numpy()[allowed])])
        expected.append(token)
        matcher.consume_token(token)
    # Async scheduling samples one step past the end (its token is discarded, never streamed).
    assert len(recorder.logits) in (len(out.token_ids), len(out.token_ids) + 1)
    assert out.token_ids == expected[:len(out.token_ids)]
    unconstrained = engine.generate("the answer is", SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert unconstrained.token_ids != expected[:8]  # the mask changed what greedy picks


def test_constrained_requests_agree_across_chunking_and_preemption(tiny_llama: Path) -> None:
    """A preempted request's matcher is rebuilt from its outputs when it is re-admitted."""
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7 + i,
                             **case_params(tiny_llama, kind)) for i, kind in enumerate(sorted(CASES))]
    prompts = [f"prompt number {i} " * 3 for i in range(len(params))]
    reference = [o.token_ids for o in llm(tiny_llama, async_scheduling=False).generate(prompts, params)]
    for options in (dict(async_scheduling=True, max_num_batched_tokens=16),
                    dict(async_scheduling=True, num_kv_blocks=40, max_model_len=128),
                    dict(async_scheduling=False, max_num_batched_tokens=8)):
        engine = llm(tiny_llama, **options)
        assert [o.token_ids for o in engine.generate(prompts, params)] == reference, options
        if "num_kv_blocks" in options:
            assert engine.scheduler.stats().num_preemptions > 0, options


def test_constrained_and_free_rows_share_a_batch(tiny_llama: Path, engines: dict[str, LLM]) -> None:
    free = SamplingParams(max_tokens=12, temperature=0.0)
    alone = engines["async"].generate(["a free row"], free)[0].token_ids
    mixed = engines["async"].generate(["a free row", "a constrained row"],
                                      [free, SamplingParams(max_tokens=MAX_TOKENS, seed=3,
                                                            **case_params(tiny_llama, "json_schema"))])
    assert mixed[0].token_ids == alone
    check_json_schema(mixed[1].text)


def test_a_grammar_cut_by_max_tokens_ends_with_length(engines: dict[str, LLM]) -> None:
    out = engines["async"].generate("hi", SamplingParams(max_tokens=2, regex="[a-z]{20}"))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 2


def test_logit_bias_moves_greedy(engines: dict[str, LLM]) -> None:
    engine = engines["async"]
    plain = engine.generate("bias me", SamplingParams(max_tokens=6, temperature=0.0))[0].token_ids
    forced = engine.generate("bias me", SamplingParams(max_tokens=6, temperature=0.0, logit_bias={77: 100.0}))[0]
    assert forced.token_ids == [77] * 6
    banned = engine.generate("bias me", SamplingParams(max_tokens=6, temperature=0.0,
                                                        logit_bias={plain[0]: -100.0}))[0]
    assert banned.token_ids[0] != plain[0]
    assert engine.generate("bias me", SamplingParams(max_tokens=6, temperature=0.0))[0].token_ids == plain


@pytest.mark.parametrize(("fields", "field", "problem"), [
    ({"regex": "a(b"}, "regex", "unclosed group"),
    ({"json_schema": '{"type": "objectx"}'}, "json_schema", "objectx"),
    ({"json_schema": "{not json"}, "json_schema", "not valid JSON"),
    ({"grammar": 'start: a\na: "x" b'}, "grammar", "unknown name"),
    ({"regex": REGEX, "choice": CHOICES}, "choice", "only one of"),
    ({"logit_bias": {5: 300.0}}, "logit_bias[5]", r"\[-100.0, 100.0\]"),
    ({"logit_bias": {5: 1.0, 900_000: 2.0, 800_000: 1.0}}, "logit_bias[800000]", "outside the model's vocabulary"),
])
def test_invalid_constraints_are_refused_naming_the_field(engines: dict[str, LLM], fields: dict, field: str,
                                                          problem: str) -> None:
    engine = engines["sync"]
    with pytest.raises(InvalidParams, match=problem) as info:
        params = SamplingParams(max_tokens=4)
        for name, value in fields.items():
            setattr(params, name, value)
        engine.generate("hi", params)
    assert info.value.field == field
    assert len(engine.generate("hi", SamplingParams(max_tokens=2))[0].token_ids) == 2


def test_static_decode_path_applies_the_same_masks(tiny_llama: Path) -> None:
    """Greedy constrained rows leave the in-graph argmax for the sampler, with the same tokens."""
    from stages.contracts.config import EngineConfig
    from stages.gpu_runner.runner import ModelRunner

    options = dict(device="cpu", max_model_len=256, num_kv_blocks=512, block_size=4, max_num_seqs=8)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, **case_params(tiny_llama, kind))
              for kind in sorted(CASES)] + [SamplingParams(max_tokens=20, temperature=0.0)]
    prompts = [f"static {i}" for i in range(len(params))]
    results = []
    for static_decode in (False, True):
        runner = ModelRunner(EngineConfig(model=str(tiny_llama), **options), static_decode=static_decode)
        engine = LLM(model=tiny_llama, runner=runner, **options)
        outputs = engine.generate(prompts, params)
        for out, kind in zip(outputs, sorted(CASES)):
            CASES[kind][1](out.text)
        results.append([o.token_ids for o in outputs])
    assert results[0] == results[1]


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("values", [{"min_tokens": 30}, {"ignore_eos": True}, {"min_tokens": 30, "ignore_eos": True}])
def test_a_complete_grammar_ends_the_request_whatever_min_tokens_and_ignore_eos_say(
        engines: dict[str, LLM], mode: str, values: dict) -> None:
    """The grammar wins: the output is what it would be without min_tokens and ignore_eos (the
    same seeded and greedy tokens, ending at the grammar's EOS), never a sampled row that the
    grammar and min_tokens left with no token to choose."""
    def run(**extra: object) -> list:
        params = [SamplingParams(max_tokens=40, temperature=1.0, seed=70 + i, choice=CHOICES, **extra) for i in range(4)]
        params.append(SamplingParams(max_tokens=40, temperature=0.0, choice=CHOICES, **extra))
        return engines[mode].generate(["pick one"] * len(params), params)

    plain = run()
    for out, expected in zip(run(**values), plain, strict=True):
        assert out.text in CHOICES and out.finish_reason == "stop", (out.text, out.finish_reason)
        assert out.token_ids == expected.token_ids
    free = SamplingParams(max_tokens=6, temperature=0.0, min_tokens=6, ignore_eos=True)  # unguided: held as asked
    assert len(engines[mode].generate("after", free)[0].token_ids) == 6
