"""A step's plain tokens routed to the requests they belong to: the daemon's per-token loop.

The stages send a step's plain events as one `TokenTexts` (a flat text and flat token ids, with
their ends per row); each row goes to its request's connection as a `Delta`, in a `Deltas`
frame for a connection that reads those, through the text sink of an HTTP call that frames its
text itself, or into the request's text when it is not streamed.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pipeline.protocol import Delta, Deltas
from pipeline.serve.metrics import Metrics
from pipeline.serve.requests import Connection, Request
from stages.contracts.outputs import TokenTexts

log = logging.getLogger("pipeline.serve")


@dataclass(slots=True)
class DeltaFrame:
    """The rows of an output batch bound for one connection that reads `Deltas` frames."""

    rows: list[int] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)

    def message(self, text: str, text_ends: list[int], token_ids: list[int],
                token_ends: list[int]) -> Deltas | Delta:
        """Its `Deltas` (a `Delta` for one row), sliced from the batch's flat text and tokens
        (`*_ends` per row)."""
        rows = self.rows
        if len(rows) == len(text_ends) > 1:  # the whole batch, as for a client that multiplexes every stream
            return Deltas(self.request_ids, text, text_ends, token_ids, token_ends)
        pieces, tokens, piece_ends, tokens_ends = [], [], [], []
        num_chars = 0
        for row in rows:
            start, first = (text_ends[row - 1], token_ends[row - 1]) if row else (0, 0)
            pieces.append(text[start:text_ends[row]])
            num_chars += text_ends[row] - start
            piece_ends.append(num_chars)
            tokens += token_ids[first:token_ends[row]]
            tokens_ends.append(len(tokens))
        if len(rows) == 1:
            return Delta(self.request_ids[0], pieces[0], tokens)
        return Deltas(self.request_ids, "".join(pieces), piece_ends, tokens, tokens_ends)


def route_token_texts(batch: TokenTexts, requests: dict[int, Request], metrics: Metrics) -> int:
    """Sends each row of `batch` to its request's connection (`requests` by req_id: rows of
    requests not there go nowhere); returns the number of tokens routed. Plain events: tokens
    and their text each, nothing that ends a request. The loop over the rows is the daemon's
    per-token cost, so it does only what each row needs."""
    raw = batch.text.tobytes()
    text = raw.decode("utf-8")  # one decode for the batch: no piece splits a character
    text_ends = batch.text_ends
    if len(text) != len(raw):  # not ASCII: byte offsets to character offsets
        continuation_bytes = np.concatenate(([0], np.cumsum((batch.text & 0xC0) == 0x80)))
        text_ends = text_ends - continuation_bytes[text_ends]
    token_ids = batch.token_ids.tolist()
    token_ends = list(range(1, len(token_ids) + 1)) if batch.token_ends is None else batch.token_ends.tolist()
    text_ends = text_ends.tolist()
    get, reached, now = requests.get, metrics.tokens_reached, time.monotonic()
    frames: dict[Connection, DeltaFrame] = {}  # per connection that reads `Deltas`
    writes: list[tuple[Callable[[bytes], object], bytes]] = []  # the text sinks'
    num_tokens = 0
    start = first = 0
    for row, (req_id, end, last) in enumerate(zip(batch.req_ids.tolist(), text_ends, token_ends)):
        request = get(req_id)
        if request is None:  # aborted or dropped meanwhile: its last tokens go nowhere
            start, first = end, last
            continue
        count = last - first
        request.resume.answered = True
        if count == 1:
            request.token_ids.append(token_ids[first])
        else:
            request.token_ids += token_ids[first:last]
        num_tokens += count
        reached(request.timeline, count, now)
        sink = request.text_sink
        if sink is not None:
            sink(text[start:end], count, writes)
        elif request.delta_frames:
            frame = frames.get(request.connection)
            if frame is None:
                frame = frames[request.connection] = DeltaFrame()
            frame.rows.append(row)
            frame.request_ids.append(request.request_id)
        elif request.stream:
            request.connection.send_text(request.request_id, text[start:end], token_ids[first:last])
        else:
            request.texts.append(text[start:end])
        start, first = end, last
    for connection, frame in frames.items():
        connection.send(frame.message(text, text_ends, token_ids, token_ends))
    # Back to back: a reader woken by one write finds the next ones there too, so the clients
    # wake a few times a step rather than at every write spread over the routing.
    for write, data in writes:
        try:
            write(data)
        except Exception:  # one connection's failure must not keep the others' text back
            log.exception("writing to a connection failed")
    metrics.tokens_counted(num_tokens)
    return num_tokens
