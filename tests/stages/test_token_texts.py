"""A step's plain events on the events ring: four arrays out and back, cut to fit a record."""
from __future__ import annotations

import numpy as np

from stages.contracts.outputs import TokenTexts
from stages.events import decode_token_texts, encode_token_texts, token_texts_batches


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
