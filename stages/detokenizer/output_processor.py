"""Step tokens to per-request output events: text deltas, logprobs, stop strings, finishes.

The one place where a step's sampled tokens become what a client sees: the detokenizer stage,
the offline `LLM` and the in-process backend all feed it the scheduler's reading of each step
(which entries are real outputs of which request, which requests finished) and the step's tokens.
A stop string is matched here: the request ends at once for the client, and the caller tells
the scheduler (`StepEvents.stopped`), whose later tokens for it are dropped.

With a byte-level tokenizer (byte_table.py) a step is decoded whole: the rows of requests that
have no stop strings, logprobs, prompt or finish to report are plain (`StepEvents.plain`). Those
that hold no partial character and got an ASCII token are answered by gathering their bytes from
the table at once; the other plain rows (a character split across tokens) are decoded one by one
but still travel in the batch. Only the rows with more to report become events.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from tokenizers import Tokenizer

from stages.contracts.outputs import FinishReason, OutputEvent, StepTokens, TokenTexts
from stages.contracts.params import SamplingParams
from stages.detokenizer.byte_table import ByteTable
from stages.detokenizer.incremental import IncrementalDetokenizer, stop_token_reason

_NO_TOKENS = np.zeros(0, np.int32)


class StepEntries(Protocol):
    """Which of a step's tokens are real outputs: a StepUpdate, or the manifest sent for it."""

    req_ids: np.ndarray  # int64 [m]
    output_index: np.ndarray  # [m]: row index of entry i's token in the step's tokens
    finished: list[tuple[int, FinishReason]]  # requests that end with this step
    admitted: list[tuple[int, int]]  # requests first admitted in this step: (req_id, CLOCK_MONOTONIC ns)


@dataclass(slots=True)
class StepEvents:
    events: list[OutputEvent] = field(default_factory=list)
    stopped: list[int] = field(default_factory=list)  # requests a stop string ended
    plain: TokenTexts | None = None  # `on_step_batch` only: the plain events, as arrays (not in `events`)


@dataclass(slots=True)
class _Stream:
    detokenizer: IncrementalDetokenizer | None  # None without a tokenizer: token ids only
    prompt_token_ids: np.ndarray | None  # sent with the request's first event, then None
    params: SamplingParams
    scheduled_ns: int | None = None  # its admission time, sent with its next event, then None
    fast: bool = False  # decoded from the byte table, with no stop strings or logprobs to report


class _DecodedRows:
    """Plain rows decoded one by one: they join the step's gathered rows in its `TokenTexts`."""

    __slots__ = ("req_ids", "token_ids", "texts")

    def __init__(self) -> None:
        self.req_ids: list[int] = []
        self.token_ids: list[int] = []
        self.texts: list[bytes] = []

    def add(self, req_id: int, token_id: int, text: str) -> None:
        self.req_ids.append(req_id)
        self.token_ids.append(token_id)
        self.texts.append(text.encode("utf-8"))

    def joined(self, gathered: TokenTexts) -> TokenTexts:
        if not self.req_ids:
            return gathered
        lengths = np.fromiter(map(len, self.texts), np.int64, len(self.texts))
        ends = np.cumsum(lengths) + (int(gathered.text_ends[-1]) if len(gathered) else 0)
        return TokenTexts(np.concatenate((gathered.req_ids, np.array(self.req_ids, np.int64))),
                          np.concatenate((gathered.token_ids, np.array(self.token_ids, np.int32))),
                          np.concatenate((gathered.text, np.frombuffer(b"".join(self.texts), np.uint8))),
                          np.concatenate((gathered.text_ends, ends)))


class OutputProcessor:
    """Follows every running request from `add` to its last event. One thread uses it."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.table = ByteTable.of(tokenizer) if tokenizer is not None else None
        self._streams: dict[int, _Stream] = {}

    def __contains__(self, req_id: int) -> bool:
        return req_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    def add(self, req_id: int, prompt_token_ids: np.ndarray | list[int], params: SamplingParams,
            output_token_ids: np.ndarray | list[int] = ()) -> None:
        """Follow a new request; a resumed one also gives the outputs it already delivered."""
        prompt = np.asarray(prompt_token_ids, np.int32)
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt.tolist(), params, self.table)
            # One token at a time, as they first came: the detokenizer's offsets, held-back
            # stop-string text and min_tokens count end up where the first run left them. The
            # text this gives was delivered then and is not sent again.
            for token_id in np.asarray(output_token_ids, np.int32).tolist():
                detokenizer.add([token_id])
        fast = self.table is not None and not params.stop and params.logprobs is None
        self._streams[req_id] = _Stream(detokenizer, prompt, params, fast=fast)

    def on_step(self, entries: StepEntries, tokens: StepTokens) -> StepEvents:
        """Events of one step: entry i is request entries.req_ids[i]'s token at row
        entries.output_index[i] of the step's `tokens`; entries.finished end with this step."""
        out = self.on_step_batch(entries, tokens)
        if out.plain is not None:
            out.events[:0] = out.plain.to_events()
            out.plain = None
        return out

    def on_step_batch(self, entries: StepEntries, tokens: StepTokens) -> StepEvents:
        """As `on_step`, but the step's plain events come as one `TokenTexts` in `plain`."""
        out = StepEvents()
        this_step: dict[int, OutputEvent] = {}
        for req_id, scheduled_ns in entries.admitted:
            stream = self._streams.get(req_id)
            if stream is not None:
                stream.scheduled_ns = scheduled_ns
        req_ids = np.asarray(entries.req_ids, np.int64)
        step_token_ids = np.asarray(tokens.token_ids)[np.asarray(entries.output_index, np.int64)].astype(np.int32)
        streams = [self._streams.get(req_id) for req_id in req_ids.tolist()]
        rest = range(len(streams))
        plain = decoded = None
        if self.table is not None and len(streams):
            plain, gathered = self._plain_rows(req_ids, step_token_ids, streams, entries.finished)
            if plain.any():
                rest = np.flatnonzero(~gathered).tolist()
                decoded = _DecodedRows()
        for row in rest:
            stream = streams[row]
            req_id, index, token_id = int(req_ids[row]), int(entries.output_index[row]), int(step_token_ids[row])
            if stream is None or self._streams.get(req_id) is not stream:
                continue  # ended by a stop string (maybe at an earlier token of this step); the scheduler has not heard yet
            if decoded is not None and plain[row]:
                decoded.add(req_id, token_id, stream.detokenizer.add([token_id]).text)
                continue
            event = self._event(req_id, stream)
            event.token_ids = np.array([token_id], np.int32)
            if stream.params.logprobs is not None and tokens.logprobs is not None:
                width = 1 + stream.params.logprobs
                event.logprobs = tokens.logprobs[index:index + 1, :width].copy()
                event.logprob_token_ids = tokens.logprob_token_ids[index:index + 1, :width].copy()
            this_step[req_id] = event
            out.events.append(event)
            if stream.detokenizer is None:
                continue
            delta = stream.detokenizer.add([token_id])
            event.text = delta.text
            if delta.stopped:
                event.finish_reason = FinishReason.STOP.value
                event.stop_reason = stream.detokenizer.stop_string
                del self._streams[req_id]
                out.stopped.append(req_id)
        for req_id, reason in entries.finished:
            stream = self._streams.pop(req_id, None)
            if stream is None:
                continue
            event = this_step.get(req_id)
            if event is None:
                event = self._event(req_id, stream)
                out.events.append(event)
            if stream.detokenizer is not None:
                event.text += stream.detokenizer.flush()
            event.finish_reason = reason.value
            if reason == FinishReason.STOP and len(event.token_ids):
                event.stop_reason = stop_token_reason(stream.params, int(event.token_ids[-1]))
        if plain is not None and plain.any():
            ids = step_token_ids[gathered]
            lengths = self.table.lengths_of(ids, skip_special_tokens=False)
            out.plain = decoded.joined(TokenTexts(req_ids[gathered], ids, self.table.gather(ids, lengths),
                                                  np.cumsum(lengths)))
        return out

    def _plain_rows(self, req_ids: np.ndarray, token_ids: np.ndarray, streams: list[_Stream | None],
                    finished: list[tuple[int, FinishReason]]) -> tuple[np.ndarray, np.ndarray]:
        """Which rows' events are plain (a fast stream with nothing owed, such as its prompt or
        admission time, and no finish this step), and which of those are gathered from the table
        at once (nothing held back, and an ASCII token)."""
        plain = np.fromiter((s is not None and s.fast and s.prompt_token_ids is None and s.scheduled_ns is None
                             for s in streams), np.bool_, len(streams))
        if finished:
            plain &= ~np.isin(req_ids, [req_id for req_id, _ in finished])
        if plain.any() and len(np.unique(req_ids)) != len(req_ids):
            plain[:] = False  # several tokens of one request: the per-request path keeps their order
        gathered = plain & self.table.plain[self.table.ids(token_ids)]
        if gathered.any():
            gathered &= np.fromiter((s is None or not s.detokenizer.pending_bytes for s in streams), np.bool_,
                                    len(streams))
        return plain, gathered

    def finish(self, req_id: int, reason: FinishReason) -> OutputEvent | None:
        """The last event of a request that ended outside a step (an abort); None if it had
        already ended here (a stop string)."""
        stream = self._streams.pop(req_id, None)
        if stream is None:
            return None
        event = self._event(req_id, stream)
        if stream.detokenizer is not None:
            event.text = stream.detokenizer.flush()
        event.finish_reason = reason.value
        return event

    @staticmethod
    def reject(req_id: int, code: str, message: str, field_name: str | None) -> OutputEvent:
        """The only event of a request that was refused before it ran."""
        return OutputEvent(req_id, "", _NO_TOKENS, error_code=code, error_message=message, error_field=field_name)

    def _event(self, req_id: int, stream: _Stream) -> OutputEvent:
        event = OutputEvent(req_id, "", _NO_TOKENS, prompt_token_ids=stream.prompt_token_ids,
                            scheduled_ns=stream.scheduled_ns)
        stream.prompt_token_ids = stream.scheduled_ns = None
        return event
