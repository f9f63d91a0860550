"""Events that go out together are merged per request: the same text, tokens, logprobs and end as
sent one by one, in one event per request, requests in the order they first appeared."""
from __future__ import annotations

import numpy as np

from stages.contracts.outputs import OutputEvent
from stages.events import coalesce


def event(req_id: int, text: str, token_ids: list[int], **fields: object) -> OutputEvent:
    return OutputEvent(req_id, text, np.array(token_ids, np.int32), **fields)


def test_a_requests_steps_merge_into_its_first_event_and_keep_its_end() -> None:
    prompt = np.array([5, 6], np.int32)
    events = [event(1, "He", [10], prompt_token_ids=prompt), event(2, "a", [20]), event(1, "llo", [11]),
              event(2, "b", [21]), event(1, "!", [12], finish_reason="stop", stop_reason=12)]
    merged = coalesce(events)
    assert [(e.req_id, e.text, e.token_ids.tolist()) for e in merged] == [(1, "Hello!", [10, 11, 12]),
                                                                        (2, "ab", [20, 21])]
    assert merged[0].prompt_token_ids is prompt and merged[1].prompt_token_ids is None
    assert (merged[0].finish_reason, merged[0].stop_reason) == ("stop", 12) and not merged[1].is_last


def test_logprobs_follow_their_tokens_and_an_abort_after_steps_ends_the_merged_event() -> None:
    logprobs = [np.full((1, 3), -float(i), np.float32) for i in range(2)]
    ids = [np.full((1, 3), i, np.int32) for i in range(2)]
    events = [event(7, "x", [1], logprobs=logprobs[0], logprob_token_ids=ids[0]),
              event(7, "y", [2], logprobs=logprobs[1], logprob_token_ids=ids[1]),
              event(7, "", [], finish_reason="abort")]
    (merged,) = coalesce(events)
    assert merged.text == "xy" and merged.token_ids.tolist() == [1, 2] and merged.finish_reason == "abort"
    assert merged.logprobs.tolist() == [[0.0] * 3, [-1.0] * 3] and merged.logprob_token_ids[:, 0].tolist() == [0, 1]


def test_one_event_per_request_passes_through_unchanged() -> None:
    events = [event(3, "a", [1]), event(4, "", [], error_code="invalid_params", error_message="bad")]
    assert coalesce(events) == events
