"""OutputProcessor: a step's tokens become per-request events; stop strings, finishes, aborts."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from tokenizers import Tokenizer

from stages.contracts.outputs import FinishReason
from stages.contracts.params import SamplingParams
from stages.detokenizer.output_processor import OutputProcessor

pytestmark = pytest.mark.timeout(30)


@dataclass
class Entries:
    req_ids: np.ndarray
    output_index: np.ndarray
    finished: list[tuple[int, FinishReason]] = field(default_factory=list)
    admitted: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class Tokens:
    token_ids: np.ndarray
    logprobs: np.ndarray | None = None
    logprob_token_ids: np.ndarray | None = None


def step(outputs: OutputProcessor, rows: dict[int, int], finished: list[tuple[int, FinishReason]] = (),
         logprobs: np.ndarray | None = None, logprob_ids: np.ndarray | None = None):
    """One step where request r sampled token rows[r] (row order = dict order)."""
    req_ids = np.array(list(rows), np.int64)
    tokens = Tokens(np.array(list(rows.values()), np.int32), logprobs, logprob_ids)
    return outputs.on_step(Entries(req_ids, np.arange(len(rows)), list(finished)), tokens)


def ids(bpe: Tokenizer, text: str) -> list[int]:
    return bpe.encode(text, add_special_tokens=False).ids


def test_events_carry_the_prompt_once_then_text_deltas_that_join_to_the_decode(bpe: Tokenizer) -> None:
    outputs = OutputProcessor(bpe)
    prompt, text = ids(bpe, "Hello"), ids(bpe, " world, the quick brown fox")
    outputs.add(7, prompt, SamplingParams(max_tokens=len(text)))
    events = []
    for index, token in enumerate(text):
        finished = [(7, FinishReason.LENGTH)] if index == len(text) - 1 else []
        events += step(outputs, {7: token}, finished).events
    assert events[0].prompt_token_ids.tolist() == prompt
    assert all(event.prompt_token_ids is None for event in events[1:])
    assert [int(t) for e in events for t in e.token_ids] == text
    assert "".join(e.text for e in events) == bpe.decode(text)
    assert events[-1].finish_reason == "length" and 7 not in outputs


def test_a_stop_string_ends_the_request_here_and_is_reported(bpe: Tokenizer) -> None:
    outputs = OutputProcessor(bpe)
    text = ids(bpe, " and then STOP here")
    outputs.add(1, ids(bpe, "Mixed"), SamplingParams(max_tokens=50, stop=["STOP"]))
    outputs.add(2, ids(bpe, "Hello"), SamplingParams(max_tokens=50))
    stopped_at = None
    for index, token in enumerate(text):
        result = step(outputs, {1: token, 2: token})
        if result.stopped:
            stopped_at = index
            assert result.stopped == [1]
            last = next(e for e in result.events if e.req_id == 1)
            assert (last.finish_reason, last.stop_reason) == ("stop", "STOP")
            break
    assert stopped_at is not None and 1 not in outputs and 2 in outputs
    # The scheduler has not heard yet: a later token for the request is dropped, not an event.
    assert [e.req_id for e in step(outputs, {1: text[0], 2: text[0]}).events] == [2]


def test_a_finish_without_a_token_flushes_held_back_text_and_stop_tokens_are_named(bpe: Tokenizer) -> None:
    outputs = OutputProcessor(bpe)
    outputs.add(3, ids(bpe, "Hello"), SamplingParams(max_tokens=8, stop=["STOPPED"]))
    held = step(outputs, {3: ids(bpe, " STOP")[0]}).events  # could start "STOPPED": held back
    flushed = step(outputs, {}, [(3, FinishReason.ABORT)]).events
    assert "".join(e.text for e in held + flushed) == bpe.decode(ids(bpe, " STOP")[:1])
    assert flushed[0].finish_reason == "abort" and len(flushed[0].token_ids) == 0

    outputs.add(4, ids(bpe, "Hello"), SamplingParams(max_tokens=8, stop_token_ids=[42]))
    last = step(outputs, {4: 42}, [(4, FinishReason.STOP)]).events[0]
    assert (last.finish_reason, last.stop_reason) == ("stop", 42)


def test_logprobs_are_cut_to_what_each_request_asked(bpe: Tokenizer) -> None:
    outputs = OutputProcessor(bpe)
    outputs.add(1, [5], SamplingParams(logprobs=1))
    outputs.add(2, [5], SamplingParams())
    logprobs = np.array([[-0.1, -0.2, -0.3], [-1.0, -2.0, -3.0]], np.float32)
    logprob_ids = np.array([[9, 9, 8], [7, 7, 6]], np.int32)
    events = step(outputs, {1: 9, 2: 7}, logprobs=logprobs, logprob_ids=logprob_ids).events
    by_id = {e.req_id: e for e in events}
    assert by_id[1].logprobs.tolist() == [[pytest.approx(-0.1), pytest.approx(-0.2)]]
    assert by_id[1].logprob_token_ids.tolist() == [[9, 9]]
    assert by_id[2].logprobs is None


def test_without_a_tokenizer_events_carry_token_ids_only() -> None:
    outputs = OutputProcessor(None)
    outputs.add(1, [5, 6], SamplingParams(stop=["x"]))
    events = step(outputs, {1: 11}, [(1, FinishReason.LENGTH)]).events
    assert [(e.text, e.token_ids.tolist(), e.finish_reason) for e in events] == [("", [11], "length")]


def test_finish_outside_a_step_and_rejections(bpe: Tokenizer) -> None:
    outputs = OutputProcessor(bpe)
    outputs.add(1, [5], SamplingParams())
    event = outputs.finish(1, FinishReason.ABORT)
    assert event.finish_reason == "abort" and event.prompt_token_ids.tolist() == [5] and event.is_last
    assert outputs.finish(1, FinishReason.ABORT) is None  # ended already
    refused = outputs.reject(9, "prompt_too_long", "prompt has 9 tokens", None)
    assert (refused.error_code, refused.error_message, refused.is_last) == ("prompt_too_long", "prompt has 9 tokens", True)


def test_the_admission_time_rides_on_the_requests_next_event(bpe: Tokenizer) -> None:
    outputs = OutputProcessor(bpe)
    outputs.add(1, [5], SamplingParams())
    tokens = Tokens(np.zeros(0, np.int32))
    # Admitted in a step that only computed part of its prompt: no token, no event yet.
    empty = outputs.on_step(Entries(np.zeros(0, np.int64), np.zeros(0, np.int64), admitted=[(1, 123)]), tokens)
    assert empty.events == []
    first = step(outputs, {1: 9}).events[0]
    second = step(outputs, {1: 9}).events[0]
    assert (first.scheduled_ns, second.scheduled_ns) == (123, None)


RESUME_CASES = {
    "multi-byte": ("Mixed", "Un café naïve, 中文 and 😀 then more text", SamplingParams(max_tokens=64)),
    "stop strings": ("Hello", " café 中文 😀 done. Stop here STOP and then", SamplingParams(max_tokens=64,
                                                                                       stop=["STOP", "😀 x"])),
    "min_tokens": ("Hello", "a.b.c.d.e", SamplingParams(max_tokens=64, stop=["."], min_tokens=4)),
    "include stop": ("Hello", "one 中文 two", SamplingParams(max_tokens=64, stop=["中文"],
                                                           include_stop_str_in_output=True)),
}


@pytest.mark.parametrize("case", sorted(RESUME_CASES))
def test_a_resumed_request_goes_on_with_exactly_the_text_of_an_uninterrupted_run(bpe: Tokenizer, case: str) -> None:
    """Resumed after any number of delivered tokens, the request emits the rest of the text the
    uninterrupted run emitted, no more and no less, held-back stop-string text and characters
    split across tokens included."""
    prompt, text, params = RESUME_CASES[case]
    prompt_ids, output_ids = ids(bpe, prompt), ids(bpe, text)

    def run(outputs: OutputProcessor, req_id: int, tokens: list[int]) -> list[tuple[str, str | None, object]]:
        deltas = []
        for index, token in enumerate(tokens):
            finished = [(req_id, FinishReason.LENGTH)] if index == len(tokens) - 1 else []
            for event in step(outputs, {req_id: token}, finished).events:
                deltas.append((event.text, event.finish_reason, event.stop_reason))
            if req_id not in outputs:
                break
        return deltas

    uninterrupted = OutputProcessor(bpe)
    uninterrupted.add(1, prompt_ids, params)
    whole = run(uninterrupted, 1, output_ids)  # one event per token, up to the end or a stop string
    assert whole[-1][1] == ("length" if case == "multi-byte" else "stop")
    for delivered in range(len(whole)):
        resumed = OutputProcessor(bpe)
        resumed.add(2, prompt_ids, params, output_ids[:delivered])
        assert run(resumed, 2, output_ids[delivered:]) == whole[delivered:], f"resumed after {delivered} tokens"
