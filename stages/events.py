"""Output events on the events ring: one columnar batch per record, cutting a list of events into
batches that each fit a record, and merging a request's events that go out together. Plain events
(`TokenTexts`) travel as their own record, a few arrays copied as they are."""
from __future__ import annotations

import numpy as np

from shm.codec import Layout
from stages.contracts.outputs import FinishReason, OutputEvent, TokenTexts
from stages.messages import NO_REASON, REASON_CODE, REASONS

_EMPTY = np.zeros(0, np.int32)

EVENTS = Layout("events", [
    ("num_events", "I"), ("num_text_bytes", "I"), ("num_tokens", "I"), ("num_prompt_tokens", "I"),
    ("num_logprob_values", "I"), ("num_error_bytes", "I"), ("num_stop_bytes", "I"),
], [
    ("req_ids", "int64", "num_events"), ("reasons", "int8", "num_events"), ("has_prompt", "bool", "num_events"),
    ("text_ends", "int32", "num_events"), ("token_ends", "int32", "num_events"),
    ("prompt_ends", "int32", "num_events"), ("logprob_widths", "int32", "num_events"),
    ("error_ends", "int32", "num_events"), ("text", "uint8", "num_text_bytes"), ("token_ids", "int32", "num_tokens"),
    ("prompt_token_ids", "int32", "num_prompt_tokens"), ("logprobs", "float32", "num_logprob_values"),
    ("logprob_token_ids", "int32", "num_logprob_values"), ("errors", "uint8", "num_error_bytes"),
    ("stop_token_ids", "int32", "num_events"), ("stop_ends", "int32", "num_events"),
    ("stop_strings", "uint8", "num_stop_bytes"), ("scheduled_ns", "int64", "num_events"),
])
NO_STOP_TOKEN = -1  # stop_token_ids entry of an event whose stop_reason is not a token id
NOT_SCHEDULED = -1  # scheduled_ns entry of an event that does not carry the admission time
_ERROR_SEPARATOR = "\x00"  # joins code, field and message of an error event


TOKEN_TEXTS = Layout("token_texts", [("num_events", "I"), ("num_tokens", "I"), ("num_token_ends", "I"),
                                     ("num_text_bytes", "I")], [
    ("req_ids", "int64", "num_events"), ("token_ids", "int32", "num_tokens"), ("text_ends", "int64", "num_events"),
    ("token_ends", "int64", "num_token_ends"), ("text", "uint8", "num_text_bytes"),
])
_NO_ENDS = np.zeros(0, np.int64)


def encode_token_texts(batch: TokenTexts) -> bytes:
    token_ends = _NO_ENDS if batch.token_ends is None else batch.token_ends
    return TOKEN_TEXTS.encode({}, {"req_ids": batch.req_ids, "token_ids": batch.token_ids,
                                   "text_ends": batch.text_ends, "token_ends": token_ends, "text": batch.text})


def decode_token_texts(payload: memoryview | bytes) -> TokenTexts:
    """The batch; arrays are copies."""
    m = TOKEN_TEXTS.decode(payload, copy=True)
    token_ends = m["token_ends"] if len(m["token_ends"]) else None
    return TokenTexts(m["req_ids"], m["token_ids"], m["text"], m["text_ends"], token_ends)


def token_texts_batches(batch: TokenTexts, max_bytes: int) -> list[TokenTexts]:
    """`batch` cut into pieces that each encode to at most about `max_bytes`."""
    num_bytes = 20 * len(batch) + 4 * len(batch.token_ids) + len(batch.text)
    if num_bytes <= max_bytes or len(batch) < 2:
        return [batch]
    half = len(batch) // 2
    start = int(batch.text_ends[half - 1])
    if batch.token_ends is None:
        first_ends = second_ends = None
        token_start = half
    else:
        token_start = int(batch.token_ends[half - 1])
        first_ends, second_ends = batch.token_ends[:half], batch.token_ends[half:] - token_start
    first = TokenTexts(batch.req_ids[:half], batch.token_ids[:token_start], batch.text[:start],
                       batch.text_ends[:half], first_ends)
    second = TokenTexts(batch.req_ids[half:], batch.token_ids[token_start:], batch.text[start:],
                        batch.text_ends[half:] - start, second_ends)
    return token_texts_batches(first, max_bytes) + token_texts_batches(second, max_bytes)


def coalesce_outputs(items: list[OutputEvent | TokenTexts]) -> list[OutputEvent | TokenTexts]:
    """`coalesce` for events and plain batches together: each request's output of all `items` as
    one entry. A request that has an event among them gets one event (its plain entries turned
    into events, in order); the others share one `TokenTexts`, merged with array operations."""
    events = [item for item in items if isinstance(item, OutputEvent)]
    if len(events) == len(items):
        return list(coalesce(events))
    if len(items) == 1:
        return items
    with_events = np.fromiter({event.req_id for event in events}, np.int64)
    ordered: list[OutputEvent] = []
    plain: list[TokenTexts] = []
    for item in items:
        if isinstance(item, OutputEvent):
            ordered.append(item)
            continue
        owed = np.isin(item.req_ids, with_events) if len(with_events) else None
        if owed is None or not owed.any():
            plain.append(item)
            continue
        ordered.extend(_rows(item, owed).to_events())  # few: requests starting or ending in these steps
        if not owed.all():
            plain.append(_rows(item, ~owed))
    merged: list[OutputEvent | TokenTexts] = [merge_token_texts(plain)] if plain else []
    return merged + coalesce(ordered)


def _rows(batch: TokenTexts, keep: np.ndarray) -> TokenTexts:
    """The requests of `batch` where `keep` is True."""
    counts, lengths = batch.token_counts(), np.diff(batch.text_ends, prepend=0)
    token_ids = batch.token_ids[_segments(np.cumsum(counts) - counts, counts, keep)]
    text = batch.text[_segments(batch.text_ends - lengths, lengths, keep)]
    token_ends = None if batch.token_ends is None else np.cumsum(counts[keep])
    return TokenTexts(batch.req_ids[keep], token_ids, text, np.cumsum(lengths[keep]), token_ends)


def _segments(starts: np.ndarray, lengths: np.ndarray, keep: np.ndarray | slice = slice(None)) -> np.ndarray:
    """Indices of the segments [starts[i], starts[i] + lengths[i]) picked by `keep`, one after another."""
    starts, lengths = starts[keep], lengths[keep]
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    offsets = np.cumsum(lengths) - lengths  # where each segment begins in the result
    return np.repeat(starts - offsets, lengths) + np.arange(total)


def merge_token_texts(batches: list[TokenTexts]) -> TokenTexts:
    """One batch with each request once, in order of first appearance: its tokens and text of
    every batch, in batch order."""
    if len(batches) == 1:
        return batches[0]
    req_ids = np.concatenate([b.req_ids for b in batches])
    counts = np.concatenate([b.token_counts() for b in batches])
    lengths = np.concatenate([np.diff(b.text_ends, prepend=0) for b in batches])
    token_ids = np.concatenate([b.token_ids for b in batches])
    text = np.concatenate([b.text for b in batches])
    unique, first, inverse = np.unique(req_ids, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # requests by first appearance
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    entry_rank = rank[inverse.reshape(-1)]
    by_request = np.argsort(entry_rank, kind="stable")  # entries grouped by request, in batch order
    token_starts, text_starts = np.cumsum(counts) - counts, np.cumsum(lengths) - lengths
    per_request_tokens = np.bincount(entry_rank, weights=counts, minlength=len(order)).astype(np.int64)
    per_request_bytes = np.bincount(entry_rank, weights=lengths, minlength=len(order)).astype(np.int64)
    return TokenTexts(unique[order], token_ids[_segments(token_starts[by_request], counts[by_request])],
                      text[_segments(text_starts[by_request], lengths[by_request])],
                      np.cumsum(per_request_bytes), np.cumsum(per_request_tokens))


def encode_events(events: list[OutputEvent]) -> bytes:
    """A batch of events, column by column: one record per batch, so the cost per event is a
    few list appends rather than a message of its own."""
    texts, errors, widths, reasons = [], [], [], []
    tokens, prompts, logprobs, logprob_ids = [], [], [], []
    stop_tokens, stop_strings = [], []
    for event in events:
        stop = event.stop_reason
        stop_tokens.append(stop if isinstance(stop, int) else NO_STOP_TOKEN)
        stop_strings.append(stop.encode("utf-8") if isinstance(stop, str) else b"")
        texts.append(event.text.encode("utf-8"))
        tokens.append(event.token_ids)
        prompts.append(_EMPTY if event.prompt_token_ids is None else event.prompt_token_ids)
        reasons.append(NO_REASON if event.finish_reason is None else REASON_CODE[FinishReason(event.finish_reason)])
        if event.logprobs is None:
            widths.append(0)
        else:
            widths.append(event.logprobs.shape[1])
            logprobs.append(event.logprobs.reshape(-1))
            logprob_ids.append(event.logprob_token_ids.reshape(-1))
        errors.append(b"" if event.error_code is None else _ERROR_SEPARATOR.join(
            (event.error_code, event.error_field or "", event.error_message or "")).encode("utf-8"))
    return EVENTS.encode({}, {
        "req_ids": np.array([e.req_id for e in events], np.int64), "reasons": np.array(reasons, np.int8),
        "has_prompt": np.array([e.prompt_token_ids is not None for e in events], np.bool_),
        "text_ends": np.cumsum([len(t) for t in texts], dtype=np.int32),
        "token_ends": np.cumsum([len(t) for t in tokens], dtype=np.int32),
        "prompt_ends": np.cumsum([len(p) for p in prompts], dtype=np.int32),
        "logprob_widths": np.array(widths, np.int32),
        "error_ends": np.cumsum([len(e) for e in errors], dtype=np.int32),
        "text": np.frombuffer(b"".join(texts), np.uint8), "token_ids": _concat(tokens, np.int32),
        "prompt_token_ids": _concat(prompts, np.int32), "logprobs": _concat(logprobs, np.float32),
        "logprob_token_ids": _concat(logprob_ids, np.int32), "errors": np.frombuffer(b"".join(errors), np.uint8),
        "stop_token_ids": np.array(stop_tokens, np.int32),
        "stop_ends": np.cumsum([len(s) for s in stop_strings], dtype=np.int32),
        "stop_strings": np.frombuffer(b"".join(stop_strings), np.uint8),
        "scheduled_ns": np.array([NOT_SCHEDULED if e.scheduled_ns is None else e.scheduled_ns for e in events], np.int64),
    })


def _concat(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)


def decode_events(payload: memoryview | bytes) -> list[OutputEvent]:
    """The batch's events; arrays are copies."""
    m = EVENTS.decode(payload, copy=True)
    text = m["text"].tobytes()
    errors = m["errors"].tobytes()
    stop_strings = m["stop_strings"].tobytes()
    events = []
    text_start = token_start = prompt_start = logprob_start = error_start = stop_start = 0
    for (req_id, reason, has_prompt, text_end, token_end, prompt_end, width, error_end, stop_token, stop_end,
         scheduled_ns) in zip(
            m["req_ids"].tolist(), m["reasons"].tolist(), m["has_prompt"].tolist(), m["text_ends"].tolist(),
            m["token_ends"].tolist(), m["prompt_ends"].tolist(), m["logprob_widths"].tolist(),
            m["error_ends"].tolist(), m["stop_token_ids"].tolist(), m["stop_ends"].tolist(),
            m["scheduled_ns"].tolist()):
        token_ids = m["token_ids"][token_start:token_end]
        logprobs = logprob_ids = None
        if width:
            logprob_end = logprob_start + len(token_ids) * width
            logprobs = m["logprobs"][logprob_start:logprob_end].reshape(-1, width)
            logprob_ids = m["logprob_token_ids"][logprob_start:logprob_end].reshape(-1, width)
            logprob_start = logprob_end
        error_code = error_field = error_message = None
        if error_end > error_start:
            error_code, error_field, error_message = errors[error_start:error_end].decode("utf-8").split(
                _ERROR_SEPARATOR, 2)
        events.append(OutputEvent(
            req_id=req_id, text=text[text_start:text_end].decode("utf-8"), token_ids=token_ids,
            finish_reason=None if reason == NO_REASON else REASONS[reason].value,
            prompt_token_ids=m["prompt_token_ids"][prompt_start:prompt_end] if has_prompt else None,
            logprobs=logprobs, logprob_token_ids=logprob_ids, error_code=error_code,
            error_message=error_message, error_field=error_field or None,
            stop_reason=stop_strings[stop_start:stop_end].decode("utf-8") if stop_end > stop_start else
            (None if stop_token == NO_STOP_TOKEN else stop_token),
            scheduled_ns=None if scheduled_ns == NOT_SCHEDULED else scheduled_ns))
        text_start, token_start, prompt_start, error_start = text_end, token_end, prompt_end, error_end
        stop_start = stop_end
    return events


def coalesce(events: list[OutputEvent]) -> list[OutputEvent]:
    """`events` with each request's later events merged into its first (text and tokens appended,
    the last one's finish kept), in order. A reader that fell behind takes several steps at once;
    merged, they cost every later hop one event, one delta and one socket write per request
    instead of one per step, so the stream catches up instead of falling further behind."""
    first_of: dict[int, OutputEvent] = {}
    merged: list[OutputEvent] = []
    for event in events:
        first = first_of.get(event.req_id)
        if first is None:
            first_of[event.req_id] = event
            merged.append(event)
        else:
            _append(first, event)
    return merged


def _append(first: OutputEvent, later: OutputEvent) -> None:
    first.text += later.text
    if len(later.token_ids):
        first.token_ids = np.concatenate((first.token_ids, later.token_ids))
    if later.logprobs is not None:
        first.logprobs = later.logprobs if first.logprobs is None else np.concatenate((first.logprobs, later.logprobs))
        first.logprob_token_ids = later.logprob_token_ids if first.logprob_token_ids is None else np.concatenate(
            (first.logprob_token_ids, later.logprob_token_ids))
    if later.is_last:
        first.finish_reason, first.stop_reason = later.finish_reason, later.stop_reason
        first.error_code, first.error_message, first.error_field = (later.error_code, later.error_message,
                                                                    later.error_field)


def event_batches(events: list[OutputEvent], max_bytes: int) -> list[list[OutputEvent]]:
    """`events` in order, cut into batches that each encode to at most about `max_bytes` (an
    event larger than that goes alone), so every batch fits one record of the events ring."""
    batches: list[list[OutputEvent]] = []
    start, size = 0, 0
    for index, event in enumerate(events):
        num_bytes = _event_bytes(event)
        if index > start and size + num_bytes > max_bytes:
            batches.append(events[start:index])
            start, size = index, 0
        size += num_bytes
    if start < len(events):
        batches.append(events[start:])
    return batches


def _event_bytes(event: OutputEvent) -> int:
    """An upper bound of the encoded size of one event."""
    size = 64 + 4 * len(event.text) + 4 * len(event.token_ids)
    if event.prompt_token_ids is not None:
        size += 4 * len(event.prompt_token_ids)
    if event.logprobs is not None:
        size += 8 * event.logprobs.size
    if event.error_message is not None:
        size += 4 * len(event.error_message) + 64
    if isinstance(event.stop_reason, str):
        size += 4 * len(event.stop_reason) + 8
    return size
