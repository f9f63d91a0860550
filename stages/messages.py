"""Binary layouts of every record the stages exchange, with their encoders and decoders.

A record is one `Layout` message (struct header + raw arrays), or, when it carries
sub-messages (a request and its sampling params; a plan, its admitted requests and theirs),
*frames* back to back: `[u64 length | message | pad to 8]`. Output events travel as one
columnar batch per record. Nothing is pickled: sampling params are a fixed header, stop strings
utf-8 bytes with int32 lengths, and stop_token_ids int64 (they are validated as non-negative,
not as int32).
"""
from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import numpy as np

from pipeline.sampling_params import SamplingParams
from shm.codec import Layout
from stages.scheduler.plan import KVCopyMeta, NewRequest, StepPlan
from stages.scheduler.request import FinishReason


class Kind(enum.IntEnum):
    """Record kinds; each ring carries a few of them."""

    GENERATE = 1  # daemon -> tokenizer
    NEW_REQUEST = 2  # tokenizer -> scheduler, scheduler -> detokenizer
    REJECT = 3  # tokenizer -> scheduler -> detokenizer: the request was refused
    ABORT = 4  # daemon -> scheduler
    PLAN = 5  # scheduler -> runner
    CONNECTOR_FLUSH = 6  # scheduler -> runner: connector copies to run with no step
    DONE = 7  # runner -> scheduler, detokenizer (broadcast)
    MANIFEST = 8  # scheduler -> detokenizer: what step N's tokens mean
    FINISHED = 9  # scheduler -> detokenizer: a request ended outside a step (abort)
    STOP_STRING = 10  # detokenizer -> scheduler: finish this request
    EVENTS = 11  # detokenizer -> daemon: a batch of output events


_FRAME = struct.Struct("<Q")
REASONS = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT)
_REASON_CODE = {reason: code for code, reason in enumerate(REASONS)}
NO_REASON = -1


def _pad8(num_bytes: int) -> int:
    return (num_bytes + 7) & -8


def frames(*messages: bytes) -> list[bytes]:
    """The parts of one record holding `messages` (pass them to RingWriter.write)."""
    parts: list[bytes] = []
    for message in messages:
        parts.append(_FRAME.pack(len(message)))
        parts.append(message)
        if len(message) % 8:
            parts.append(bytes(8 - len(message) % 8))
    return parts


def split_frames(payload: memoryview | bytes) -> list[memoryview]:
    """The messages of one record, as views of `payload`."""
    view = memoryview(payload)
    messages = []
    offset = 0
    while offset < view.nbytes:
        (length,) = _FRAME.unpack_from(view, offset)
        start = offset + _FRAME.size
        if start + length > view.nbytes:
            raise ValueError(f"frame of {length} bytes at offset {offset} overruns the {view.nbytes}-byte record")
        messages.append(view[start:start + length])
        offset = start + _pad8(length)
    return messages


def _utf8(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8)


def _text(array: np.ndarray) -> str:
    return array.tobytes().decode("utf-8")


# ---- sampling params

PARAMS = Layout("params", [
    ("max_tokens", "q"), ("temperature", "d"), ("top_p", "d"), ("top_k", "q"), ("min_p", "d"),
    ("seed", "q"), ("has_seed", "?"), ("presence_penalty", "d"), ("frequency_penalty", "d"),
    ("repetition_penalty", "d"), ("min_tokens", "q"), ("ignore_eos", "?"), ("logprobs", "q"),
    ("skip_special_tokens", "?"), ("include_stop_str_in_output", "?"),
    ("num_stops", "I"), ("num_stop_bytes", "I"), ("num_stop_token_ids", "I"),
], [("stop_lengths", "int32", "num_stops"), ("stop_bytes", "uint8", "num_stop_bytes"),
    ("stop_token_ids", "int64", "num_stop_token_ids")])


def encode_params(params: SamplingParams) -> bytes:
    stops = [s.encode("utf-8") for s in params.stop]
    return PARAMS.encode({
        "max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
        "top_k": params.top_k, "min_p": params.min_p, "seed": params.seed or 0, "has_seed": params.seed is not None,
        "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty, "min_tokens": params.min_tokens,
        "ignore_eos": params.ignore_eos, "logprobs": -1 if params.logprobs is None else params.logprobs,
        "skip_special_tokens": params.skip_special_tokens,
        "include_stop_str_in_output": params.include_stop_str_in_output,
    }, {"stop_lengths": np.array([len(s) for s in stops], np.int32),
        "stop_bytes": np.frombuffer(b"".join(stops), np.uint8),
        "stop_token_ids": np.array(params.stop_token_ids, np.int64)})


def decode_params(payload: memoryview | bytes) -> SamplingParams:
    m = PARAMS.decode(payload)
    stop_bytes = m["stop_bytes"].tobytes()
    stops, offset = [], 0
    for length in m["stop_lengths"].tolist():
        stops.append(stop_bytes[offset:offset + length].decode("utf-8"))
        offset += length
    return SamplingParams(
        max_tokens=m["max_tokens"], temperature=m["temperature"], top_p=m["top_p"], top_k=m["top_k"],
        min_p=m["min_p"], seed=m["seed"] if m["has_seed"] else None, presence_penalty=m["presence_penalty"],
        frequency_penalty=m["frequency_penalty"], repetition_penalty=m["repetition_penalty"],
        min_tokens=m["min_tokens"], stop=stops, stop_token_ids=m["stop_token_ids"].tolist(),
        ignore_eos=m["ignore_eos"], logprobs=None if m["logprobs"] < 0 else m["logprobs"],
        skip_special_tokens=m["skip_special_tokens"], include_stop_str_in_output=m["include_stop_str_in_output"])


# ---- requests in

GENERATE = Layout("generate", [("req_id", "q"), ("is_text", "?"), ("num_ids", "I"), ("num_text_bytes", "I")],
                  [("prompt_ids", "int64", "num_ids"), ("text", "uint8", "num_text_bytes")])


@dataclass(slots=True)
class Generate:
    req_id: int
    prompt: str | list[int]
    params: SamplingParams


def encode_generate(req_id: int, prompt: str | list[int], params: SamplingParams) -> list[bytes]:
    if isinstance(prompt, str):
        head = GENERATE.encode({"req_id": req_id, "is_text": True},
                               {"prompt_ids": np.zeros(0, np.int64), "text": _utf8(prompt)})
    else:
        # int64 so an out-of-vocabulary id reaches the tokenizer stage intact and is refused there.
        head = GENERATE.encode({"req_id": req_id, "is_text": False},
                               {"prompt_ids": np.array(prompt, np.int64), "text": np.zeros(0, np.uint8)})
    return frames(head, encode_params(params))


def decode_generate(payload: memoryview) -> Generate:
    head, params = split_frames(payload)
    m = GENERATE.decode(head)
    prompt = _text(m["text"]) if m["is_text"] else m["prompt_ids"].tolist()
    return Generate(m["req_id"], prompt, decode_params(params))


NEW_REQUEST = Layout("new_request", [("req_id", "q"), ("num_tokens", "I")],
                     [("prompt_ids", "int32", "num_tokens")])


@dataclass(slots=True)
class NewPrompt:
    req_id: int
    prompt_ids: np.ndarray  # int32, owned (copied out of the ring)
    params: SamplingParams


def encode_new_request(req_id: int, prompt_ids: np.ndarray, params: SamplingParams | bytes) -> list[bytes]:
    """`params` may be already encoded (a stage forwarding a request re-uses the bytes)."""
    encoded = params if isinstance(params, (bytes, memoryview)) else encode_params(params)
    return frames(NEW_REQUEST.encode({"req_id": req_id}, {"prompt_ids": prompt_ids}), bytes(encoded))


def decode_new_request(payload: memoryview) -> NewPrompt:
    head, params = split_frames(payload)
    m = NEW_REQUEST.decode(head, copy=True)
    return NewPrompt(m["req_id"], m["prompt_ids"], decode_params(params))


REJECT = Layout("reject", [("req_id", "q"), ("code_len", "I"), ("field_len", "I"), ("message_len", "I")],
                [("code", "uint8", "code_len"), ("field", "uint8", "field_len"), ("message", "uint8", "message_len")])


@dataclass(slots=True)
class Rejection:
    req_id: int
    code: str  # a pipeline.errors.ErrorCode value
    field: str  # "" when the problem is not one field's
    message: str


def encode_reject(rejection: Rejection) -> bytes:
    return REJECT.encode({"req_id": rejection.req_id}, {
        "code": _utf8(rejection.code), "field": _utf8(rejection.field), "message": _utf8(rejection.message)})


def decode_reject(payload: memoryview) -> Rejection:
    m = REJECT.decode(payload)
    return Rejection(m["req_id"], _text(m["code"]), _text(m["field"]), _text(m["message"]))


REQ_ID = Layout("req_id", [("req_id", "q"), ("reason", "b")])


def encode_req_id(req_id: int, reason: FinishReason | None = None) -> bytes:
    return REQ_ID.encode({"req_id": req_id, "reason": NO_REASON if reason is None else _REASON_CODE[reason]})


def decode_req_id(payload: memoryview) -> tuple[int, FinishReason | None]:
    m = REQ_ID.decode(payload)
    return m["req_id"], None if m["reason"] == NO_REASON else REASONS[m["reason"]]


# ---- the step plan

PLAN = Layout("plan", [
    ("step", "q"), ("num_new_requests", "I"), ("has_meta", "?"), ("num_rows", "I"), ("num_new_block_ids", "I"),
    ("num_freed_rows", "I"), ("num_loads", "I"), ("num_saves", "I"),
], [
    ("rows", "int32", "num_rows"), ("num_computed_tokens", "int32", "num_rows"),
    ("num_scheduled_tokens", "int32", "num_rows"), ("sample", "bool", "num_rows"),
    ("num_new_blocks", "int32", "num_rows"), ("new_block_ids", "int32", "num_new_block_ids"),
    ("freed_rows", "int32", "num_freed_rows"), ("load_host_slots", "int32", "num_loads"),
    ("load_block_ids", "int32", "num_loads"), ("save_block_ids", "int32", "num_saves"),
    ("save_host_slots", "int32", "num_saves"),
])
ADMIT = Layout("admit", [("req_id", "q"), ("row", "i"), ("num_prompt_tokens", "i"), ("num_tokens", "I")],
               [("token_ids", "int32", "num_tokens")])
_EMPTY = np.zeros(0, np.int32)


def encode_plan(plan: StepPlan) -> list[bytes]:
    meta = plan.connector_meta
    if meta is not None and not isinstance(meta, KVCopyMeta):
        raise TypeError(f"plan {plan.step}: connector metadata of type {type(meta).__name__} has no binary layout")
    head = PLAN.encode({"step": plan.step, "num_new_requests": len(plan.new_requests), "has_meta": meta is not None}, {
        "rows": plan.rows, "num_computed_tokens": plan.num_computed_tokens,
        "num_scheduled_tokens": plan.num_scheduled_tokens, "sample": plan.sample,
        "num_new_blocks": plan.num_new_blocks, "new_block_ids": plan.new_block_ids, "freed_rows": plan.freed_rows,
        "load_host_slots": _EMPTY if meta is None else meta.load_host_slots,
        "load_block_ids": _EMPTY if meta is None else meta.load_block_ids,
        "save_block_ids": _EMPTY if meta is None else meta.save_block_ids,
        "save_host_slots": _EMPTY if meta is None else meta.save_host_slots,
    })
    parts = [head]
    for new in plan.new_requests:
        parts.append(ADMIT.encode({"req_id": new.req_id, "row": new.row, "num_prompt_tokens": new.num_prompt_tokens},
                                  {"token_ids": new.token_ids}))
        parts.append(encode_params(new.params))
    return frames(*parts)


def decode_plan(payload: memoryview) -> StepPlan:
    """The plan, with arrays copied out of the ring (the runner keeps some of them)."""
    messages = split_frames(payload)
    m = PLAN.decode(messages[0], copy=True)
    new_requests = []
    for index in range(m["num_new_requests"]):
        admit = ADMIT.decode(messages[1 + 2 * index], copy=True)
        new_requests.append(NewRequest(admit["req_id"], admit["row"], admit["token_ids"], admit["num_prompt_tokens"],
                                       decode_params(messages[2 + 2 * index])))
    meta = None
    if m["has_meta"]:
        meta = KVCopyMeta(m["load_host_slots"], m["load_block_ids"], m["save_block_ids"], m["save_host_slots"])
    return StepPlan(step=m["step"], new_requests=new_requests, rows=m["rows"],
                    num_computed_tokens=m["num_computed_tokens"], num_scheduled_tokens=m["num_scheduled_tokens"],
                    sample=m["sample"], num_new_blocks=m["num_new_blocks"], new_block_ids=m["new_block_ids"],
                    freed_rows=m["freed_rows"], connector_meta=meta)


def encode_connector_flush(meta: KVCopyMeta) -> list[bytes]:
    """Connector copies to run with no step: an empty plan (step -1) carrying them."""
    return encode_plan(StepPlan(-1, [], _EMPTY, _EMPTY, _EMPTY, np.zeros(0, np.bool_), _EMPTY, _EMPTY,
                                connector_meta=meta))


# ---- step results

DONE = Layout("done", [("step", "q"), ("slot", "I"), ("num_rows", "I")])


def encode_done(step: int, slot: int, num_rows: int) -> bytes:
    return DONE.encode({"step": step, "slot": slot, "num_rows": num_rows})


def decode_done(payload: memoryview) -> tuple[int, int, int]:
    m = DONE.decode(payload)
    return m["step"], m["slot"], m["num_rows"]


MANIFEST = Layout("manifest", [("step", "q"), ("num_entries", "I"), ("num_finished", "I")], [
    ("req_ids", "int64", "num_entries"), ("output_index", "int32", "num_entries"),
    ("finished_ids", "int64", "num_finished"), ("finished_reasons", "int8", "num_finished")])


@dataclass(slots=True)
class Manifest:
    """Step `step`'s valid outputs: entry i is request req_ids[i]'s token at row index
    output_index[i] of the step's mailbox slot. Requests in finished_ids end with this step."""

    step: int
    req_ids: np.ndarray  # int64
    output_index: np.ndarray  # int32
    finished: list[tuple[int, FinishReason]]


def encode_manifest(manifest: Manifest) -> bytes:
    return MANIFEST.encode({"step": manifest.step}, {
        "req_ids": manifest.req_ids, "output_index": manifest.output_index.astype(np.int32),
        "finished_ids": np.array([r for r, _ in manifest.finished], np.int64),
        "finished_reasons": np.array([_REASON_CODE[reason] for _, reason in manifest.finished], np.int8)})


def decode_manifest(payload: memoryview) -> Manifest:
    m = MANIFEST.decode(payload, copy=True)
    finished = [(req_id, REASONS[code]) for req_id, code in
                zip(m["finished_ids"].tolist(), m["finished_reasons"].tolist())]
    return Manifest(m["step"], m["req_ids"], m["output_index"], finished)


# ---- output events

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
    ("stop_strings", "uint8", "num_stop_bytes"),
])
NO_STOP_TOKEN = -1  # stop_token_ids entry of an event whose stop_reason is not a token id
_ERROR_SEPARATOR = "\x00"  # joins code, field and message of an error event


def encode_events(events: list) -> bytes:
    """A batch of pipeline.backend.OutputEvent, column by column: one record per batch, so the
    cost per event is a few list appends rather than a message of its own."""
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
        reasons.append(NO_REASON if event.finish_reason is None else _REASON_CODE[FinishReason(event.finish_reason)])
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
    })


def _concat(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)


def decode_events(payload: memoryview | bytes, make: type) -> list:
    """The batch as `make(...)` objects (pipeline.backend.OutputEvent); arrays are copies."""
    m = EVENTS.decode(payload, copy=True)
    text = m["text"].tobytes()
    errors = m["errors"].tobytes()
    stop_strings = m["stop_strings"].tobytes()
    events = []
    text_start = token_start = prompt_start = logprob_start = error_start = stop_start = 0
    for req_id, reason, has_prompt, text_end, token_end, prompt_end, width, error_end, stop_token, stop_end in zip(
            m["req_ids"].tolist(), m["reasons"].tolist(), m["has_prompt"].tolist(), m["text_ends"].tolist(),
            m["token_ends"].tolist(), m["prompt_ends"].tolist(), m["logprob_widths"].tolist(),
            m["error_ends"].tolist(), m["stop_token_ids"].tolist(), m["stop_ends"].tolist()):
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
        events.append(make(
            req_id=req_id, text=text[text_start:text_end].decode("utf-8"), token_ids=token_ids,
            finish_reason=None if reason == NO_REASON else REASONS[reason].value,
            prompt_token_ids=m["prompt_token_ids"][prompt_start:prompt_end] if has_prompt else None,
            logprobs=logprobs, logprob_token_ids=logprob_ids, error_code=error_code,
            error_message=error_message, error_field=error_field or None,
            stop_reason=stop_strings[stop_start:stop_end].decode("utf-8") if stop_end > stop_start else
            (None if stop_token == NO_STOP_TOKEN else stop_token)))
        text_start, token_start, prompt_start, error_start = text_end, token_end, prompt_end, error_end
        stop_start = stop_end
    return events
