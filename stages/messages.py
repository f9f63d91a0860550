"""Binary layouts of every record the stages exchange, with their encoders and decoders.

A record is one `Layout` message (struct header + raw arrays), or, when it carries
sub-messages (a request and its sampling params; a plan, its admitted requests and theirs),
*frames* back to back: `[u64 length | message | pad to 8]`. Output events travel as one
columnar batch per record (stages/events.py). Nothing is pickled: sampling params are a fixed header derived from
SamplingParams' fields (a number each, plus a "has" flag for an optional one), a string as utf-8
bytes (a schema or grammar: variable length, like the stop strings), string lists as
utf-8 bytes with int32 lengths, an int -> float map as two arrays, and int lists int64 (stop_token_ids are validated as
non-negative, not as int32). Params are validated once, where a request enters; decoding
rebuilds them without checking again.
"""
from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from shm.codec import Layout
from stages.contracts.outputs import FinishReason, StepUpdate
from stages.contracts.params import SamplingParams
from stages.contracts.plan import KVCopyMeta, NewRequest, StepPlan


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
    TOKEN_TEXTS = 12  # detokenizer -> daemon: a step's plain events, as arrays


_FRAME = struct.Struct("<Q")
_EMPTY = np.zeros(0, np.int32)
REASONS = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT)
REASON_CODE = {reason: code for code, reason in enumerate(REASONS)}
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


# ---- sampling params: the layout follows SamplingParams' fields

_SCALAR_CODES = {"int": "q", "float": "d", "bool": "?"}
_PARAM_FIELDS = [(f.name, str(f.type)) for f in fields(SamplingParams)]


def _params_layout() -> Layout:
    header: list[tuple[str, str]] = []
    arrays: list[tuple[str, str, str]] = []
    for name, kind in _PARAM_FIELDS:
        if kind in _SCALAR_CODES:
            header.append((name, _SCALAR_CODES[kind]))
        elif kind.endswith(" | None") and kind[:-len(" | None")] in _SCALAR_CODES:
            header += [(name, _SCALAR_CODES[kind[:-len(" | None")]]), (f"has_{name}", "?")]
        elif kind == "list[str]":
            header += [(f"num_{name}", "I"), (f"num_{name}_bytes", "I")]
            arrays += [(f"{name}_lengths", "int32", f"num_{name}"), (f"{name}_bytes", "uint8", f"num_{name}_bytes")]
        elif kind == "list[int]":
            header.append((f"num_{name}", "I"))
            arrays.append((name, "int64", f"num_{name}"))
        elif kind == "str":
            header.append((f"num_{name}_bytes", "I"))
            arrays.append((f"{name}_bytes", "uint8", f"num_{name}_bytes"))
        elif kind == "dict[int, float]":
            header.append((f"num_{name}", "I"))
            arrays += [(f"{name}_keys", "int64", f"num_{name}"), (f"{name}_values", "float64", f"num_{name}")]
        else:
            raise TypeError(f"SamplingParams.{name} has type {kind}, which has no binary layout")
    return Layout("params", header, arrays)


PARAMS = _params_layout()


def encode_params(params: SamplingParams) -> bytes:
    values: dict[str, object] = {}
    arrays: dict[str, np.ndarray] = {}
    for name, kind in _PARAM_FIELDS:
        value = getattr(params, name)
        if kind in _SCALAR_CODES:
            values[name] = value
        elif kind.endswith(" | None"):
            values[name], values[f"has_{name}"] = (0, False) if value is None else (value, True)
        elif kind == "list[str]":
            encoded = [text.encode("utf-8") for text in value]
            arrays[f"{name}_lengths"] = np.array([len(b) for b in encoded], np.int32)
            arrays[f"{name}_bytes"] = np.frombuffer(b"".join(encoded), np.uint8)
        elif kind == "str":
            arrays[f"{name}_bytes"] = _utf8(value)
        elif kind == "dict[int, float]":
            arrays[f"{name}_keys"] = np.fromiter(value.keys(), np.int64, len(value))
            arrays[f"{name}_values"] = np.fromiter(value.values(), np.float64, len(value))
        else:
            arrays[name] = np.array(value, np.int64)
    return PARAMS.encode(values, arrays)


def decode_params(payload: memoryview | bytes) -> SamplingParams:
    m = PARAMS.decode(payload)
    values: dict[str, object] = {}
    for name, kind in _PARAM_FIELDS:
        if kind in _SCALAR_CODES:
            values[name] = m[name]
        elif kind.endswith(" | None"):
            values[name] = m[name] if m[f"has_{name}"] else None
        elif kind == "list[str]":
            data, texts, offset = m[f"{name}_bytes"].tobytes(), [], 0
            for length in m[f"{name}_lengths"].tolist():
                texts.append(data[offset:offset + length].decode("utf-8"))
                offset += length
            values[name] = texts
        elif kind == "str":
            values[name] = _text(m[f"{name}_bytes"])
        elif kind == "dict[int, float]":
            values[name] = dict(zip(m[f"{name}_keys"].tolist(), m[f"{name}_values"].tolist()))
        else:
            values[name] = m[name].tolist()
    return SamplingParams.trusted(**values)


# ---- requests in

GENERATE = Layout("generate", [("req_id", "q"), ("is_text", "?"), ("num_ids", "I"), ("num_text_bytes", "I"),
                               ("num_outputs", "I")],
                  [("prompt_ids", "int64", "num_ids"), ("text", "uint8", "num_text_bytes"),
                   ("output_ids", "int32", "num_outputs")])


@dataclass(slots=True)
class Generate:
    req_id: int
    prompt: str | list[int]
    params: SamplingParams
    # Outputs a resumed request already delivered (after a stage restart): it continues after them.
    output_token_ids: list[int] = field(default_factory=list)


def encode_generate(req_id: int, prompt: str | list[int], params: SamplingParams,
                    output_token_ids: Sequence[int] = ()) -> list[bytes]:
    outputs = np.array(output_token_ids, np.int32)
    if isinstance(prompt, str):
        head = GENERATE.encode({"req_id": req_id, "is_text": True},
                               {"prompt_ids": np.zeros(0, np.int64), "text": _utf8(prompt), "output_ids": outputs})
    else:
        # int64 so an out-of-vocabulary id reaches the tokenizer stage intact and is refused there.
        head = GENERATE.encode({"req_id": req_id, "is_text": False},
                               {"prompt_ids": np.array(prompt, np.int64), "text": np.zeros(0, np.uint8),
                                "output_ids": outputs})
    return frames(head, encode_params(params))


def decode_generate(payload: memoryview) -> Generate:
    head, params = split_frames(payload)
    m = GENERATE.decode(head)
    prompt = _text(m["text"]) if m["is_text"] else m["prompt_ids"].tolist()
    return Generate(m["req_id"], prompt, decode_params(params), m["output_ids"].tolist())


NEW_REQUEST = Layout("new_request", [("req_id", "q"), ("num_tokens", "I"), ("num_outputs", "I")],
                     [("prompt_ids", "int32", "num_tokens"), ("output_ids", "int32", "num_outputs")])


@dataclass(slots=True)
class NewPrompt:
    req_id: int
    prompt_ids: np.ndarray  # int32, owned (copied out of the ring)
    params: SamplingParams
    output_ids: np.ndarray  # int32: the outputs a resumed request already delivered; empty for a new one


def encode_new_request(req_id: int, prompt_ids: np.ndarray, params: SamplingParams | bytes,
                       output_ids: np.ndarray | None = None) -> list[bytes]:
    """`params` may be already encoded (a stage forwarding a request re-uses the bytes)."""
    encoded = params if isinstance(params, (bytes, memoryview)) else encode_params(params)
    outputs = _EMPTY if output_ids is None else output_ids
    return frames(NEW_REQUEST.encode({"req_id": req_id}, {"prompt_ids": prompt_ids, "output_ids": outputs}),
                  bytes(encoded))


def decode_new_request(payload: memoryview) -> NewPrompt:
    head, params = split_frames(payload)
    m = NEW_REQUEST.decode(head, copy=True)
    return NewPrompt(m["req_id"], m["prompt_ids"], decode_params(params), m["output_ids"])


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
    return REQ_ID.encode({"req_id": req_id, "reason": NO_REASON if reason is None else REASON_CODE[reason]})


def decode_req_id(payload: memoryview) -> tuple[int, FinishReason | None]:
    m = REQ_ID.decode(payload)
    return m["req_id"], None if m["reason"] == NO_REASON else REASONS[m["reason"]]


# ---- the step plan

PLAN = Layout("plan", [
    ("step", "q"), ("num_new_requests", "I"), ("has_meta", "?"), ("num_rows", "I"), ("num_new_block_ids", "I"),
    ("num_window_block_ids", "I"), ("num_freed_rows", "I"), ("num_loads", "I"), ("num_saves", "I"),
    ("num_spec_rows", "I"),
], [
    ("rows", "int32", "num_rows"), ("num_computed_tokens", "int32", "num_rows"),
    ("num_scheduled_tokens", "int32", "num_rows"), ("sample", "bool", "num_rows"),
    ("num_new_blocks", "int32", "num_rows"), ("new_block_ids", "int32", "num_new_block_ids"),
    ("window_block_ids", "int32", "num_window_block_ids"), ("freed_rows", "int32", "num_freed_rows"),
    ("freed_num_tokens", "int32", "num_freed_rows"), ("load_host_slots", "int32", "num_loads"),
    ("load_block_ids", "int32", "num_loads"), ("save_block_ids", "int32", "num_saves"),
    ("save_host_slots", "int32", "num_saves"), ("num_draft_tokens", "int32", "num_spec_rows"),
    ("lagged", "bool", "num_spec_rows"),
])
ADMIT = Layout("admit", [("req_id", "q"), ("row", "i"), ("num_prompt_tokens", "i"), ("num_tokens", "I")],
               [("token_ids", "int32", "num_tokens")])


def encode_plan(plan: StepPlan) -> list[bytes]:
    meta = plan.connector_meta
    if meta is not None and not isinstance(meta, KVCopyMeta):
        raise TypeError(f"plan {plan.step}: connector metadata of type {type(meta).__name__} has no binary layout")
    if len(plan.freed_num_tokens) != len(plan.freed_rows):
        raise ValueError(f"plan {plan.step} frees {len(plan.freed_rows)} rows but gives {len(plan.freed_num_tokens)} "
                         f"token counts (freed_num_tokens)")
    head = PLAN.encode({"step": plan.step, "num_new_requests": len(plan.new_requests), "has_meta": meta is not None}, {
        "rows": plan.rows, "num_computed_tokens": plan.num_computed_tokens,
        "num_scheduled_tokens": plan.num_scheduled_tokens, "sample": plan.sample,
        "num_new_blocks": plan.num_new_blocks, "new_block_ids": plan.new_block_ids,
        "window_block_ids": plan.window_block_ids, "freed_rows": plan.freed_rows,
        "freed_num_tokens": plan.freed_num_tokens,
        "num_draft_tokens": plan.num_draft_tokens, "lagged": plan.lagged,
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
                    freed_rows=m["freed_rows"], freed_num_tokens=m["freed_num_tokens"], connector_meta=meta,
                    window_block_ids=m["window_block_ids"],
                    num_draft_tokens=m["num_draft_tokens"], lagged=m["lagged"])


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


MANIFEST = Layout("manifest", [("step", "q"), ("slot", "I"), ("num_entries", "I"), ("num_finished", "I"),
                               ("num_admitted", "I")], [
    ("req_ids", "int64", "num_entries"), ("output_index", "int32", "num_entries"),
    ("finished_ids", "int64", "num_finished"), ("finished_reasons", "int8", "num_finished"),
    ("admitted_ids", "int64", "num_admitted"), ("admitted_ns", "int64", "num_admitted")])


@dataclass(slots=True)
class Manifest:
    """Step `step`'s valid outputs: entry i is request req_ids[i]'s token at row index
    output_index[i] of the step's mailbox slot `slot`. Requests in finished_ids end with this step.

    The scheduler sends it once it has read the step's tokens from the slot itself, so the slot
    is complete by then (on CPU the slot's sequence number was stored after its data; on CUDA the
    slot's event was recorded before the runner announced the step, and is recorded again only
    for step + num_slots, after every consumer released this one)."""

    step: int
    req_ids: np.ndarray  # int64
    output_index: np.ndarray  # int32
    finished: list[tuple[int, FinishReason]]
    slot: int
    admitted: list[tuple[int, int]] = field(default_factory=list)  # first admissions: (req_id, ns)

    @classmethod
    def for_update(cls, update: StepUpdate, slot: int) -> Manifest:
        return cls(update.step, update.req_ids.astype(np.int64), update.output_index.astype(np.int32),
                   update.finished, slot, update.admitted)


def encode_manifest(manifest: Manifest) -> bytes:
    return MANIFEST.encode({"step": manifest.step, "slot": manifest.slot}, {
        "req_ids": manifest.req_ids, "output_index": manifest.output_index.astype(np.int32),
        "finished_ids": np.array([r for r, _ in manifest.finished], np.int64),
        "finished_reasons": np.array([REASON_CODE[reason] for _, reason in manifest.finished], np.int8),
        "admitted_ids": np.array([r for r, _ in manifest.admitted], np.int64),
        "admitted_ns": np.array([ns for _, ns in manifest.admitted], np.int64)})


def decode_manifest(payload: memoryview) -> Manifest:
    m = MANIFEST.decode(payload, copy=True)
    finished = [(req_id, REASONS[code]) for req_id, code in
                zip(m["finished_ids"].tolist(), m["finished_reasons"].tolist())]
    admitted = list(zip(m["admitted_ids"].tolist(), m["admitted_ns"].tolist()))
    return Manifest(m["step"], m["req_ids"], m["output_index"], finished, m["slot"], admitted)
