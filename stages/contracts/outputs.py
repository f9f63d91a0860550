"""What a step produces: sampled tokens on the host, the scheduler's reading of them, and the
per-request output events the detokenizer sends to the daemon."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


class FinishReason(str, enum.Enum):
    """Why a request ended; the values are the wire strings clients see."""

    STOP = "stop"  # EOS, a stop token id, or a stop string reported by the detokenizer
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"


class StepTokens(Protocol):
    """One step's sampled tokens in row order: a HostStepOutput, or a mailbox slot's copy."""

    token_ids: np.ndarray  # int32 [m]
    logprobs: np.ndarray | None  # float32 [m, 1 + k]
    logprob_token_ids: np.ndarray | None  # int32 [m, 1 + k]


@dataclass(slots=True)
class HostStepOutput:
    """Step `step`'s sampled tokens on the host, one per sampled row of its plan."""

    step: int
    rows: np.ndarray  # int32 [m]: the plan's sampled rows, in plan order
    token_ids: np.ndarray  # int32 [m]
    logprobs: np.ndarray | None  # float32 [m, 1 + k]
    logprob_token_ids: np.ndarray | None  # int32 [m, 1 + k]


@dataclass(slots=True)
class StepUpdate:
    """Tokens that became part of a request's output this step, in plan order.

    Tokens sampled for a request that had already finished (or was aborted) are dropped
    here and never appear. A request in `finished` got its last token in this same update
    (a stop token is reported, then the request ends)."""

    step: int
    req_ids: np.ndarray  # int64 [m]
    token_ids: np.ndarray  # int32 [m]
    output_index: np.ndarray  # int64 [m]: index into `output`'s arrays
    finished: list[tuple[int, FinishReason]]
    output: HostStepOutput  # the step's sampled tokens (and logprobs), row by row
    # Requests this step's plan admitted for the first time: (req_id, CLOCK_MONOTONIC ns of the
    # admission), so whoever saw them arrive can tell how long they waited.
    admitted: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.req_ids.shape[0])


@dataclass(slots=True)
class TokenTexts:
    """Plain events as arrays: request i got tokens and their text, and nothing else (no prompt,
    logprobs, finish or error). Most of a decoding step's events are these, so they cross every
    hop as a few arrays rather than an object each. A step's batch has one token per request
    (`token_ends` None); batches of several steps merged (a reader that fell behind) have a
    request's tokens of all of them together."""

    req_ids: np.ndarray  # int64 [n], each request once
    token_ids: np.ndarray  # int32: every request's tokens, one after another
    text: np.ndarray  # uint8: the UTF-8 of every request's text, one after another
    text_ends: np.ndarray  # int64 [n]: request i's text is text[text_ends[i - 1]:text_ends[i]]
    token_ends: np.ndarray | None = None  # int64 [n], as text_ends for token_ids; None: one token each

    def __len__(self) -> int:
        return int(self.req_ids.shape[0])

    def token_counts(self) -> np.ndarray:
        """How many tokens each request got."""
        if self.token_ends is None:
            return np.ones(len(self), np.int64)
        return np.diff(self.token_ends, prepend=0)

    def to_events(self) -> list[OutputEvent]:
        text = self.text.tobytes()
        starts = [0, *self.text_ends[:-1].tolist()]
        token_ends = np.arange(1, len(self) + 1) if self.token_ends is None else self.token_ends
        token_starts = [0, *token_ends[:-1].tolist()]
        return [OutputEvent(req_id, text[start:end].decode("utf-8"), self.token_ids[first:last].copy())
                for req_id, start, end, first, last in zip(self.req_ids.tolist(), starts, self.text_ends.tolist(),
                                                           token_starts, token_ends.tolist())]


@dataclass(slots=True)
class OutputEvent:
    """New output of one request. The last event of a request has finish_reason or error set."""

    req_id: int
    text: str  # new text since the last event
    token_ids: np.ndarray  # int32: new token ids since the last event
    finish_reason: str | None = None  # a FinishReason value once finished
    prompt_token_ids: np.ndarray | None = None  # int32, in the request's first event
    logprobs: np.ndarray | None = None  # float32 [len(token_ids), 1 + k] when asked
    logprob_token_ids: np.ndarray | None = None  # int32 [len(token_ids), 1 + k]
    error_code: str | None = None  # an ErrorCode value when the request was refused
    error_message: str | None = None
    error_field: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it; None for EOS
    scheduled_ns: int | None = None  # when the scheduler first admitted it (CLOCK_MONOTONIC ns), once

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None or self.error_code is not None
