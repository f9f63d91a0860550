"""Incremental detokenization of one request's output tokens, UTF-8 safe, with stop strings.

Decoding follows vLLM's two-offset scheme over the token list. `prefix_offset..read_offset`
is the window of tokens whose text was already emitted; each call decodes that window and the
window plus the new tokens, and emits the difference. While the difference ends in U+FFFD the
new tokens end inside a multi-byte character (byte-level BPE splits characters across tokens),
so the text is held back until the character completes. Decoding the window rather than single
tokens keeps decoder effects that depend on neighbours (leading-space stripping, byte fallback)
right, and each call decodes only the previous emission plus the new tokens, so its cost does
not grow with the output.

The window starts on the last few prompt tokens, so the first output token decodes in context
(a sentencepiece "▁word" keeps its space). For byte-level BPE the emitted text is exactly
`tokenizer.decode(output_token_ids)`.

With a `ByteTable` (byte-level tokenizers, byte_table.py) the same text comes from the table with
no call into the library: the bytes not yet emitted are kept, and released once they no longer
end inside a character. Byte-level decoding is plain concatenation, so no context is needed.

Stop strings are matched on the decoded text. Text that could be the start of a stop string is
held back until the next tokens show whether it is one; `flush()` releases it at the end.
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

from stages.contracts.params import SamplingParams
from stages.detokenizer.byte_table import ByteTable

# How many prompt tokens give the first output token its decoding context (vLLM uses 5).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


@dataclass(slots=True)
class DetokenizerDelta:
    text: str  # new text safe to emit: never half a character, never a possible stop-string prefix
    stopped: bool  # a stop string matched; text ends where the output ends


def stop_token_reason(params: SamplingParams, last_token_id: int) -> int | None:
    """The stop token id that ended a request the scheduler finished with "stop", or None when
    it was an EOS token (vLLM's `stop_reason`; a stop string is `IncrementalDetokenizer.stop_string`)."""
    if last_token_id in params.stop_token_ids:
        return last_token_id
    return None


class StopStringMatcher:
    """Finds stop strings in streamed text and says how much of it may be released.

    Only the text not yet released is searched: released text never ends with a possible
    stop-string prefix, so no match can start inside it.
    """

    __slots__ = ("_stops", "_include_stop", "_ends_by_char")

    def __init__(self, stops: list[str], include_stop_str_in_output: bool) -> None:
        self._stops = list(stops)
        self._include_stop = include_stop_str_in_output
        # For the last character c of pending text: the lengths k such that stop[:k] ends in c,
        # i.e. the only candidate lengths of a held-back prefix. Avoids testing every length.
        self._ends_by_char: dict[str, list[tuple[str, int]]] = {}
        for stop in self._stops:
            for k in range(1, len(stop)):
                self._ends_by_char.setdefault(stop[k - 1], []).append((stop, k))

    def find(self, pending: str) -> tuple[int, str] | None:
        """(end of the text to keep, the stop string) when a stop string occurs in `pending`."""
        best_start = -1
        best_stop = ""
        for stop in self._stops:
            start = pending.find(stop)
            if start != -1 and (best_start == -1 or start < best_start):
                best_start, best_stop = start, stop
        if best_start == -1:
            return None
        return (best_start + len(best_stop) if self._include_stop else best_start), best_stop

    def held_back_chars(self, pending: str) -> int:
        """Length of the longest suffix of `pending` that is a proper prefix of a stop string."""
        if not pending:
            return 0
        longest = 0
        for stop, k in self._ends_by_char.get(pending[-1], ()):
            if longest < k <= len(pending) and pending.endswith(stop[:k]):
                longest = k
        return longest


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas as they are sampled.

    Stop strings are checked once the request has at least `params.min_tokens` output tokens;
    a match ends the text before the stop string (after it with `include_stop_str_in_output`)
    and every later `add` returns an empty, stopped delta.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams,
                 table: ByteTable | None = None) -> None:
        self._tokenizer = tokenizer
        self._table = table
        self._skip_special_tokens = params.skip_special_tokens
        self._min_tokens = params.min_tokens
        self._matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None
        self.pending_bytes = b""  # with a table: output bytes not yet emitted (they end inside a character)

        context = [] if table is not None else list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: its text is not a stable prefix of what
            # follows, so the output decodes without prompt context.
            context = []
        self._token_ids: list[int] = context  # prompt context, then every output token
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._num_output_tokens = 0

        self._pending = ""  # decoded but not yet emitted (a possible stop-string prefix)
        self._emitted: list[str] = []
        self._emitted_text = ""  # cache of "".join(self._emitted), rebuilt on demand
        self._emitted_joined = 0
        self._stopped = False
        self.stop_string: str | None = None  # the stop string that ended the output

    def add(self, token_ids: list[int]) -> DetokenizerDelta:
        """Feed newly sampled tokens; returns the text that may be emitted now."""
        if self._stopped:
            return DetokenizerDelta("", True)
        self._token_ids.extend(token_ids)
        self._num_output_tokens += len(token_ids)
        return self._release(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """At the request's end: the text held back (possible stop-string prefix), now safe."""
        if self._stopped:
            return ""
        return self._release(self._decode_new(final=True), final=True).text

    @property
    def text(self) -> str:
        """All output text emitted so far (after stop-string truncation)."""
        if self._emitted_joined != len(self._emitted):
            self._emitted_text = "".join(self._emitted)
            self._emitted = [self._emitted_text] if self._emitted_text else []
            self._emitted_joined = len(self._emitted)
        return self._emitted_text

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def has_stop_strings(self) -> bool:
        return self._matcher is not None

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_new(self, *, final: bool) -> str:
        """Text of the tokens past read_offset, or "" while it ends inside a character."""
        if self._table is not None:
            return self._decode_new_bytes(final=final)
        if self._read_offset == len(self._token_ids):
            return ""
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return new_text[len(prefix_text) :]

    def _decode_new_bytes(self, *, final: bool) -> str:
        """As `_decode_new`, from the table: the bytes of the tokens not yet emitted."""
        if self._read_offset < len(self._token_ids):
            self.pending_bytes += self._table.decode(self._token_ids[self._read_offset:], self._skip_special_tokens)
            self._token_ids.clear()  # the table needs no window of earlier tokens
            self._read_offset = 0
        if not self.pending_bytes:
            return ""
        text = self.pending_bytes.decode("utf-8", "replace")
        if text.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        self.pending_bytes = b""
        return text

    def _release(self, new_text: str, *, final: bool) -> DetokenizerDelta:
        pending = self._pending + new_text
        if self._matcher is None:
            self._pending = ""
            return self._emit(pending, stopped=False)
        if self._num_output_tokens >= self._min_tokens:
            match = self._matcher.find(pending)
            if match is not None:
                stop_end, self.stop_string = match
                self._pending = ""
                self._stopped = True
                return self._emit(pending[:stop_end], stopped=True)
        held = 0 if final else self._matcher.held_back_chars(pending)
        self._pending = pending[len(pending) - held :] if held else ""
        return self._emit(pending[: len(pending) - held], stopped=False)

    def _emit(self, text: str, *, stopped: bool) -> DetokenizerDelta:
        if text:
            self._emitted.append(text)
        return DetokenizerDelta(text, stopped)
