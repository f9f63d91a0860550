"""The client-daemon wire protocol on the Unix socket: length-prefixed msgpack frames.

A frame is a 4-byte unsigned **big-endian** (network order) payload length, then that many
bytes of msgpack: one message, a msgspec Struct tagged by its "type" field. Decoding never
runs code from the peer (no pickle, no eval): msgspec builds only the types below and checks
every field's type. A frame may hold at most `max_frame_bytes` (16 MiB unless configured).

Conversation, per connection (the daemon serves requests from one connection concurrently;
the client library sends one request per connection at a time, and that request's Abort):
- `Generate` -> `Accepted(request_id)`, then `Delta`* (only when `stream`), then `Done`, or
  `Error` at any point (before `Accepted` its `request_id` is None).
- `Chat` is a Generate of a conversation: the daemon renders its `messages` with the model's
  chat template, as the HTTP chat endpoint does, and the replies are a Generate's. A model
  without a template refuses it with `Error(invalid_params)` for `messages`; `StatsReply`'s
  `chat_template` tells beforehand (an older daemon knows no `Chat` and answers `Error(protocol)`).
- Batched deltas: a daemon whose `HealthReply` says `delta_frames` sends the deltas of every
  request whose Generate set `delta_frames` in one `Deltas` frame per connection per output
  batch instead of one `Delta` frame each (logprob deltas still come one by one). A client
  reads both kinds; it sets the field only after a HealthReply said so, because an older
  daemon refuses a Generate with a field it does not know (the field is omitted when false).
- `Abort(request_id)` -> `Error(aborted)` for that request (how the request itself ends), then
  `Aborted`. A client can abort only its own requests: an Abort counts only on the connection
  that sent the request's Generate, and any other id (another connection's request, one that
  has finished, one never issued) gets `Error(not_found)` and changes nothing. Request ids
  are random (`secrets`, 64 bits), so they tell nothing about other requests either.
- `Health` -> `HealthReply`; `Stats` -> `StatsReply`; `Profile` -> `ProfileReply` (a stop
  replies once every stage has written its trace, which may take seconds).
- Closing the connection aborts every request still running on it.
- A request-level error (`invalid_params`, `prompt_too_long`, ...) ends only that request; the
  connection stays open. After an `Error(protocol)` (a frame or message that does not decode)
  the daemon closes the connection: the byte stream cannot be trusted.
"""
from __future__ import annotations

import dataclasses
import secrets
import struct
import typing
from typing import Annotated, Generic, Literal, NoReturn, TypeVar, Union

import msgspec
from msgspec import Meta, Struct

from pipeline.errors import ErrorCode, PipelineError, ProtocolError
from stages.contracts.params import MAX_TOKEN_ID, InvalidParams, SamplingParams
from stages.contracts.counters import SpeculativeCounts

FRAME_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES_LIMIT = 2**32 - 1  # what the 4-byte header can express
DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024
REQUEST_ID_BYTES = 8

RequestId = Annotated[str, Meta(min_length=1, max_length=64)]
TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
FinishReason = Literal["stop", "length"]


def new_request_id() -> str:
    """A request id nobody can guess: 16 hex characters from the OS's secure random source."""
    return secrets.token_hex(REQUEST_ID_BYTES)


class _WireParams(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """SamplingParams as sent on the wire: its fields, types and defaults, taken from the
    dataclass itself (`WireSamplingParams` below). msgspec checks the types; `to_params` checks
    the ranges. Unknown fields are refused, so a misspelt parameter is an error rather than
    silently ignored."""

    @classmethod
    def from_params(cls, params: SamplingParams) -> WireSamplingParams:
        return cls(**{name: getattr(params, name) for name in cls.__struct_fields__})

    def to_params(self) -> SamplingParams:
        """Raises InvalidParams naming the field and its allowed range."""
        return SamplingParams(**{name: getattr(self, name) for name in self.__struct_fields__})


def _wire_fields() -> list[tuple[str, object, object]]:
    types = typing.get_type_hints(SamplingParams)
    return [(f.name, types[f.name],
             msgspec.field(default_factory=f.default_factory) if f.default is dataclasses.MISSING else f.default)
            for f in dataclasses.fields(SamplingParams)]


WireSamplingParams = msgspec.defstruct("WireSamplingParams", _wire_fields(), bases=(_WireParams,), module=__name__)


# --- client -> daemon ---


class Generate(Struct, tag="generate", forbid_unknown_fields=True, omit_defaults=True):
    prompt: str | list[TokenId]  # text, or token ids that skip the tokenizer
    params: WireSamplingParams = msgspec.field(default_factory=WireSamplingParams)
    stream: bool = False
    delta_frames: bool = False  # this request's deltas may come in `Deltas` frames (see the module's note)


class ChatTurn(Struct, forbid_unknown_fields=True):
    """One message of a conversation, as a chat template takes it."""

    role: str  # system, user, assistant (the template's roles; checked where it is rendered)
    content: str


class Chat(Struct, tag="chat", forbid_unknown_fields=True, omit_defaults=True):
    """Generate from `messages` rendered by the model's chat template, the assistant's turn opened."""

    messages: list[ChatTurn]
    params: WireSamplingParams = msgspec.field(default_factory=WireSamplingParams)
    stream: bool = False
    delta_frames: bool = False


class Abort(Struct, tag="abort", forbid_unknown_fields=True):
    request_id: RequestId


class Health(Struct, tag="health", forbid_unknown_fields=True):
    pass


class Stats(Struct, tag="stats", forbid_unknown_fields=True):
    pass


class Profile(Struct, tag="profile", forbid_unknown_fields=True):
    """Start or stop a torch.profiler capture in every stage (where nsys is not used): `start`
    needs `directory`, an absolute path to a directory only its owner may write; each stage
    writes `<directory>/<stage>.json` at `stop`."""

    action: Literal["start", "stop"]
    directory: str | None = None


ClientMessage = Union[Generate, Chat, Abort, Health, Stats, Profile]

# --- daemon -> client (unknown fields are ignored, so a newer daemon may add some) ---


class TokenLogprobs(Struct, array_like=True):
    """One output token's logprob and the `params.logprobs` most likely alternatives."""

    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int


class Accepted(Struct, tag="accepted"):
    request_id: str


class Delta(Struct, tag="delta"):
    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None


Offset = Annotated[int, Meta(ge=0)]


class Deltas(Struct, tag="deltas"):
    """Many requests' deltas in one frame: delta i is `text[text_ends[i-1]:text_ends[i]]` (in
    characters) and `token_ids[token_ends[i-1]:token_ends[i]]` for `request_ids[i]` (the end
    before the first is 0). Flat arrays: one frame to encode and decode for a whole step."""

    request_ids: list[str]
    text: str
    text_ends: list[Offset]
    token_ids: list[int]
    token_ends: list[Offset]

    def split(self) -> list[Delta]:
        """The `Delta` of each request, in order; ProtocolError if the offsets do not fit."""
        request_ids, text, text_ends, token_ids, token_ends = (
            self.request_ids, self.text, self.text_ends, self.token_ids, self.token_ends)
        if not len(request_ids) == len(text_ends) == len(token_ends):
            raise ProtocolError(f"Deltas of {len(request_ids)} requests has {len(text_ends)} text ends "
                                f"and {len(token_ends)} token ends")
        if request_ids and (text_ends[-1] != len(text) or token_ends[-1] != len(token_ids)
                            or text_ends != sorted(text_ends) or token_ends != sorted(token_ends)):
            raise ProtocolError(f"Deltas offsets do not split its {len(text)} characters and {len(token_ids)} "
                                "tokens in order")
        deltas = []
        start = first = 0
        for request_id, end, last in zip(request_ids, text_ends, token_ends):
            deltas.append(Delta(request_id, text[start:end], token_ids[first:last]))
            start, first = end, last
        return deltas


class Done(Struct, tag="done"):
    """The request's end. Without `stream` it carries the whole output; with it, the deltas did."""

    request_id: str
    finish_reason: FinishReason
    prompt_token_ids: list[int]
    usage: Usage
    text: str | None = None
    token_ids: list[int] | None = None
    logprobs: list[TokenLogprobs] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


class Error(Struct, tag="error"):
    code: str  # an ErrorCode value; a str so that a newer daemon's codes still decode
    message: str
    field: str | None = None  # for invalid_params: the offending request field
    request_id: str | None = None


class Aborted(Struct, tag="aborted"):
    request_id: str


class HealthReply(Struct, tag="health_reply"):
    status: Literal["ok", "degraded"]
    version: str
    uptime_s: float
    stages: dict[str, str] = msgspec.field(default_factory=dict)  # stage name -> state
    reason: str | None = None  # why the status is "degraded"
    instance: str | None = None  # the running stages' instance id (a restart makes a new one)
    stage_pids: dict[str, int] = msgspec.field(default_factory=dict)  # stage name -> process id
    num_restarts: int = 0  # stage restarts since the daemon started
    last_failure: str | None = None  # why the stages last died
    shutdown_grace_s: float = 0.0  # how long a SIGTERM lets requests in flight finish
    http_url: str | None = None  # where the OpenAI HTTP API listens, when the daemon serves it
    delta_frames: bool = False  # it sends `Deltas` frames to requests that ask for them


def _count_fields(counts: type) -> list[tuple[str, type, int]]:
    """A field (int, default 0) for each count of a counters dataclass, under the count's name."""
    return [(f.name, int, 0) for f in dataclasses.fields(counts)]


# Speculative decoding's counts since the engine (re)started: drafts verified, drafts accepted,
# (request, step) pairs that verified drafts, and whatever SpeculativeCounts counts besides.
_SpeculativeFields = msgspec.defstruct("_SpeculativeFields", _count_fields(SpeculativeCounts), module=__name__)


class StatsReply(_SpeculativeFields, tag="stats_reply"):
    num_running_requests: int = 0
    num_waiting_requests: int = 0
    num_finished_requests: int = 0
    num_prompt_tokens_total: int = 0
    num_generated_tokens_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_hit_rate: float = 0.0
    prefix_cache_hit_tokens: int = 0  # admitted tokens found in the prefix cache, since the engine (re)started
    uptime_s: float = 0.0
    generated_tokens_per_s: float = 0.0  # over the last second or so
    num_restarts: int = 0
    num_overloaded_requests: int = 0  # refused with `overloaded` since the daemon started
    max_in_flight_requests: int = 0  # the admission limit: max_num_seqs + max_waiting
    model: str | None = None  # the served model's name
    vocab_size: int = 0  # token ids are in [0, vocab_size)
    max_model_len: int = 0  # prompt + output tokens of one request at most
    cpu_kernels: str = ""  # the runner's CPU kernels: "built (torch ops, avx512)", "plain torch (...)"; "" off CPU
    runs_in: str = ""  # what the model runs in: its weights (quantized, dense), dense dtype, KV cache
    chat_template: bool = False  # the model has a chat template: a `Chat` request can be rendered
    special_token_ids: list[int] = msgspec.field(default_factory=list)  # ids a prompt of text never holds
    num_resumed_requests: int = 0  # resubmitted to restarted stages after a crash (each time counts)
    num_guard_failed_requests: int = 0  # ended by the poison guard: in flight through two crashes of a stage
    num_stage_deaths: int = 0  # stage failures: a stage process exited (each parked the requests in flight)
    num_stall_verdicts: int = 0  # a live stage taken for hung (pipeline/serve/stalls.py): not a death, nothing restarts

    @property
    def speculative(self) -> SpeculativeCounts:
        """The speculative decoding counts, with their acceptance rate and mean accepted length."""
        return SpeculativeCounts(**{name: getattr(self, name) for name in _SpeculativeFields.__struct_fields__})

    @speculative.setter
    def speculative(self, counts: SpeculativeCounts) -> None:
        for name in _SpeculativeFields.__struct_fields__:
            setattr(self, name, getattr(counts, name))

    @property
    def kv_cache_usage(self) -> float:
        """Used / total KV blocks (0 to 1; 0 before the engine reports any)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class ProfileReply(Struct, tag="profile_reply"):
    action: str
    paths: list[str] = msgspec.field(default_factory=list)  # stop: the Chrome trace each stage wrote


ServerMessage = Union[Accepted, Delta, Deltas, Done, Error, Aborted, HealthReply, StatsReply, ProfileReply]


def error_for(exc: PipelineError | InvalidParams, request_id: str | None = None) -> Error:
    """The `Error` message that reports `exc` to the client."""
    if isinstance(exc, InvalidParams):  # an InvalidRequest too: it is both
        return Error(ErrorCode.INVALID_PARAMS.value, str(exc), exc.field, request_id or getattr(exc, "request_id", None))
    code = exc.code if exc.code is not None else ErrorCode.STAGE_FAILED
    return Error(code.value, exc.message, None, request_id or exc.request_id)


_encoder = msgspec.msgpack.Encoder()


def encode_frame(message: Struct, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """The framed bytes of one message; ProtocolError if it exceeds the frame limit."""
    payload = _encoder.encode(message)
    if len(payload) > max_frame_bytes:
        raise ProtocolError(
            f"{type(message).__name__} message is {len(payload)} bytes, over the {max_frame_bytes}-byte frame limit"
        )
    return FRAME_HEADER.pack(len(payload)) + payload


M = TypeVar("M")


class FrameDecoder(Generic[M]):
    """Turns a byte stream into messages of `message_type`, or a ProtocolError naming the problem.

    `feed` what the socket gave, then call `next_message` until it returns None. Memory stays
    within one frame (at most `max_frame_bytes`) plus one feed: a header that announces a larger
    frame is refused as soon as its 4 bytes arrive. After an error the stream cannot be
    re-synchronised, so every later call raises the same error.
    """

    def __init__(self, message_type: object, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        if isinstance(max_frame_bytes, bool) or not isinstance(max_frame_bytes, int):
            raise ValueError(f"max_frame_bytes must be an integer, got {max_frame_bytes!r}")
        if not 1 <= max_frame_bytes <= MAX_FRAME_BYTES_LIMIT:
            raise ValueError(f"max_frame_bytes must be in [1, {MAX_FRAME_BYTES_LIMIT}], got {max_frame_bytes}")
        self._decoder = msgspec.msgpack.Decoder(message_type)
        self._max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()
        self._start = 0  # bytes before this offset are consumed
        self._failure: str | None = None  # why the stream broke; later calls repeat it

    @property
    def buffered_bytes(self) -> int:
        return len(self._buffer) - self._start

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._check_not_failed()
        if self._start:
            del self._buffer[: self._start]
            self._start = 0
        self._buffer += data
        self._frame_length()  # refuse an oversized header now, before its body is buffered

    def next_message(self) -> M | None:
        """The next complete message, or None until more bytes arrive."""
        # Called once per message and once more per feed, on every streamed delta: the common
        # cases (nothing left, a whole frame) take as few calls as they can.
        if self._failure is not None:
            self._check_not_failed()
        buffer = self._buffer
        if len(buffer) - self._start < FRAME_HEADER.size:
            return None
        length = self._frame_length()
        body_start = self._start + FRAME_HEADER.size
        body_end = body_start + length
        if len(buffer) < body_end:
            return None
        try:
            # The slice's view of the buffer is released on leaving, so `feed` may resize it.
            with memoryview(buffer)[body_start:body_end] as body:
                message = self._decoder.decode(body)
        # msgspec reports bad input as DecodeError/ValidationError, but malformed bytes must
        # never escape as another exception type, whatever the decoder raises.
        except Exception as exc:  # noqa: BLE001
            self._fail(f"invalid message in a {length}-byte frame: {exc}")
        self._start = body_end
        return message

    def messages(self) -> list[M]:
        """The complete messages buffered, in order, as `next_message` would give them one by one
        (a read of a multiplexed connection holds a step's deltas for many requests). A bad frame
        after good ones raises at the next call, once those are returned: call until it returns []."""
        if self._failure is not None:
            self._check_not_failed()
        buffer, start, header_size = self._buffer, self._start, FRAME_HEADER.size
        decode, unpack, max_frame_bytes = self._decoder.decode, FRAME_HEADER.unpack_from, self._max_frame_bytes
        messages = []
        with memoryview(buffer) as view:
            while len(buffer) - start >= header_size:
                (length,) = unpack(buffer, start)
                body_start = start + header_size
                body_end = body_start + length
                if length == 0 or length > max_frame_bytes or len(buffer) < body_end:
                    break  # a bad header fails below, as `next_message` does; else the frame is not whole yet
                try:
                    with view[body_start:body_end] as body:
                        messages.append(decode(body))
                except Exception as exc:  # noqa: BLE001 - as in next_message
                    if messages:
                        break  # they go first; the next call fails on this frame
                    self._fail(f"invalid message in a {length}-byte frame: {exc}")
                start = body_end
        self._start = start
        if not messages:
            self._frame_length()  # raises for a bad header
        return messages

    def _frame_length(self) -> int | None:
        if self.buffered_bytes < FRAME_HEADER.size:
            return None
        (length,) = FRAME_HEADER.unpack_from(self._buffer, self._start)
        if length == 0:
            self._fail("empty frame (length 0)")
        if length > self._max_frame_bytes:
            self._fail(f"frame of {length} bytes exceeds the {self._max_frame_bytes}-byte limit")
        return length

    def _check_not_failed(self) -> None:
        if self._failure is not None:
            raise ProtocolError(f"stream unusable after an earlier error: {self._failure}")

    def _fail(self, reason: str) -> NoReturn:
        self._failure = reason
        self._buffer = bytearray()
        self._start = 0
        raise ProtocolError(reason)
