"""Plain events on the events ring: arrays out and back, cut to fit a record, and merged across
steps when a reader fell behind."""
from __future__ import annotations

import numpy as np

from stages.contracts.outputs import OutputEvent, TokenTexts
from stages.events import (
    coalesce_outputs,
    decode_token_texts,
    encode_token_texts,
    merge_token_texts,
    token_texts_batches,
)


def batch(texts: list[str]) -> TokenTexts:
    encoded = [t.encode("utf-8") for t in texts]
    return TokenTexts(np.arange(10, 10 + len(texts), dtype=np.int64), np.arange(len(texts), dtype=np.int32),
                      np.frombuffer(b"".join(encoded), np.uint8), np.cumsum([len(e) for e in encoded], dtype=np.int64))


def test_token_texts_round_trip_to_the_same_events() -> None:
    texts = ["a", "", " b", "é中", "z"]
    back = decode_token_texts(encode_token_texts(batch(texts)))
    assert [(e.req_id, e.text, e.token_ids.tolist()) for e in back.to_events()] == [
        (10 + i, t, [i]) for i, t in enumerate(texts)]


def test_a_large_batch_is_cut_into_records_that_fit() -> None:
    texts = [f"word{i} " * (i % 5) for i in range(300)]
    pieces = token_texts_batches(batch(texts), max_bytes=2000)
    assert len(pieces) > 1
    assert all(len(encode_token_texts(piece)) <= 2000 + 64 for piece in pieces)  # 64: header and padding
    events = [e for piece in pieces for e in piece.to_events()]
    assert [(e.req_id, e.text) for e in events] == [(10 + i, t) for i, t in enumerate(texts)]


def steps(*batches: TokenTexts) -> list[tuple[int, str, list[int]]]:
    """What each request got over `batches`, in order of first appearance: the merged expectation."""
    got: dict[int, tuple[str, list[int]]] = {}
    for b in batches:
        for e in b.to_events():
            text, tokens = got.get(e.req_id, ("", []))
            got[e.req_id] = (text + e.text, tokens + e.token_ids.tolist())
    return [(req_id, text, tokens) for req_id, (text, tokens) in got.items()]


def step(req_ids: list[int], token_ids: list[int], texts: list[str]) -> TokenTexts:
    encoded = [t.encode("utf-8") for t in texts]
    return TokenTexts(np.array(req_ids, np.int64), np.array(token_ids, np.int32),
                      np.frombuffer(b"".join(encoded), np.uint8), np.cumsum([len(e) for e in encoded], dtype=np.int64))


def test_batches_of_several_steps_merge_into_one_entry_per_request() -> None:
    first = step([3, 1, 2], [10, 11, 12], ["a", "é", ""])
    second = step([1, 4, 3], [20, 21, 22], ["b", "中", " c"])
    third = step([2, 3], [30, 31], ["x", "y"])
    merged = merge_token_texts([first, second, third])
    assert [(e.req_id, e.text, e.token_ids.tolist()) for e in merged.to_events()] == steps(first, second, third) == [
        (3, "a cy", [10, 22, 31]), (1, "éb", [11, 20]), (2, "x", [12, 30]), (4, "中", [21])]
    back = decode_token_texts(encode_token_texts(merged))  # several tokens each survive the ring
    assert [(e.req_id, e.text, e.token_ids.tolist()) for e in back.to_events()] == steps(first, second, third)
    pieces = token_texts_batches(merged, max_bytes=40)
    assert len(pieces) > 1
    assert [(e.req_id, e.text, e.token_ids.tolist()) for p in pieces for e in p.to_events()] == steps(first, second,
                                                                                                         third)


def test_a_request_with_an_event_gets_one_event_and_the_rest_stay_one_batch() -> None:
    prompt = np.array([5, 6], np.int32)
    started = OutputEvent(7, "he", np.array([40], np.int32), prompt_token_ids=prompt)  # first event of request 7
    ended = OutputEvent(1, "!", np.array([41], np.int32), finish_reason="stop")
    items = [started, step([1, 2], [10, 11], ["a", "b"]), step([7, 1, 2], [12, 13, 14], ["l", "c", "d"]), ended,
             step([7, 2], [15, 16], ["lo", "e"])]
    out = coalesce_outputs(items)
    batches = [o for o in out if isinstance(o, TokenTexts)]
    events = {o.req_id: o for o in out if isinstance(o, OutputEvent)}
    assert len(batches) == 1 and set(events) == {1, 7}
    assert [(e.req_id, e.text, e.token_ids.tolist()) for e in batches[0].to_events()] == [(2, "bde", [11, 14, 16])]
    assert (events[7].text, events[7].token_ids.tolist(), events[7].prompt_token_ids.tolist()) == (
        "hello", [40, 12, 15], [5, 6])
    assert (events[1].text, events[1].token_ids.tolist(), events[1].finish_reason) == ("ac!", [10, 13, 41], "stop")


def test_one_step_passes_through_unchanged() -> None:
    only = step([1, 2], [3, 4], ["a", "b"])
    assert coalesce_outputs([only]) == [only]
    assert merge_token_texts([only]) is only
