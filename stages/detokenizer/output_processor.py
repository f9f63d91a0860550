"""Step tokens to per-request output events: text deltas, logprobs, stop strings, finishes.

The one place where a step's sampled tokens become what a client sees: the detokenizer stage,
the offline `LLM` and the in-process backend all feed it the scheduler's reading of each step
(which entries are real outputs of which request, which requests finished) and the step's tokens.
A stop string is matched here: the request ends at once for the client, and the caller tells
the scheduler (`StepEvents.stopped`), whose later tokens for it are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from tokenizers import Tokenizer

from stages.contracts.outputs import FinishReason, OutputEvent, StepTokens
from stages.contracts.params import SamplingParams
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


@dataclass(slots=True)
class _Stream:
    detokenizer: IncrementalDetokenizer | None  # None without a tokenizer: token ids only
    prompt_token_ids: np.ndarray | None  # sent with the request's first event, then None
    params: SamplingParams
    scheduled_ns: int | None = None  # its admission time, sent with its next event, then None


class OutputProcessor:
    """Follows every running request from `add` to its last event. One thread uses it."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
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
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt.tolist(), params)
            # One token at a time, as they first came: the detokenizer's offsets, held-back
            # stop-string text and min_tokens count end up where the first run left them. The
            # text this gives was delivered then and is not sent again.
            for token_id in np.asarray(output_token_ids, np.int32).tolist():
                detokenizer.add([token_id])
        self._streams[req_id] = _Stream(detokenizer, prompt, params)

    def on_step(self, entries: StepEntries, tokens: StepTokens) -> StepEvents:
        """Events of one step: entry i is request entries.req_ids[i]'s token at row
        entries.output_index[i] of the step's `tokens`; entries.finished end with this step."""
        out = StepEvents()
        this_step: dict[int, OutputEvent] = {}
        for req_id, scheduled_ns in entries.admitted:
            stream = self._streams.get(req_id)
            if stream is not None:
                stream.scheduled_ns = scheduled_ns
        for req_id, index in zip(entries.req_ids.tolist(), entries.output_index.tolist()):
            stream = self._streams.get(req_id)
            if stream is None:
                continue  # ended here by a stop string; the scheduler has not heard yet
            token_id = int(tokens.token_ids[index])
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
        return out

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
