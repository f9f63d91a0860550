"""Wire protocol: framing, message round trips, error mapping, and FrameDecoder under fuzzing."""
from __future__ import annotations

import dataclasses
import random
import struct

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.errors import (
    ErrorCode,
    InvalidRequest,
    PipelineError,
    PromptTooLong,
    ProtocolError,
    RequestAborted,
    error_from_wire,
)
from pipeline.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    Abort,
    Aborted,
    Accepted,
    ClientMessage,
    Delta,
    Deltas,
    Done,
    Error,
    FrameDecoder,
    Generate,
    Health,
    HealthReply,
    ServerMessage,
    SpeculativeCounts,
    Stats,
    StatsReply,
    TokenLogprobs,
    Usage,
    WireSamplingParams,
    encode_frame,
    error_for,
    new_request_id,
)
from stages.contracts.params import (
    MAX_LOGPROBS,
    MAX_MAX_TOKENS,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_ID,
    MAX_TOP_K,
    InvalidParams,
    SamplingParams,
)
from stages.messages import decode_params, encode_params

pytestmark = pytest.mark.timeout(30)

CLIENT_MESSAGES = [
    Generate("héllo 😀", WireSamplingParams(max_tokens=5, temperature=0.0, stop=["\n"], seed=7), True),
    Generate([1, 2, 2**31 - 1]),
    Abort("0123456789abcdef"),
    Health(),
    Stats(),
]
SERVER_MESSAGES = [
    Accepted("ab"),
    Delta("ab", "中", [5, 6], [TokenLogprobs(5, -0.5, [5, 9], [-0.5, -1.5])]),
    Deltas(["ab", "cd", "ab"], "中x😀", [1, 1, 3], [5, 6, 7], [2, 2, 3]),
    Done("ab", "stop", [1, 2], Usage(2, 3), text="xyz", token_ids=[7, 8, 9], stop_reason="\n"),
    Done("ab", "length", [1], Usage(1, 16)),
    Error("invalid_params", "temperature: must be in [0.0, 100.0], got -1", "temperature", None),
    Aborted("ab"),
    HealthReply("ok", "0.1.0", 12.5, {"runner": "running"}),
    StatsReply(num_running_requests=3, kv_blocks_used=10, kv_blocks_total=100),
]


def decode_all(data: bytes, message_type: object = ClientMessage, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> list:
    decoder: FrameDecoder = FrameDecoder(message_type, max_frame_bytes)
    decoder.feed(data)
    messages = []
    while (message := decoder.next_message()) is not None:
        messages.append(message)
    return messages


def test_frames_are_big_endian_length_then_msgpack() -> None:
    frame = encode_frame(Health())
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    assert msgspec.msgpack.decode(frame[4:]) == {"type": "health"}


def test_every_message_round_trips() -> None:
    assert decode_all(b"".join(encode_frame(m) for m in CLIENT_MESSAGES)) == CLIENT_MESSAGES
    assert decode_all(b"".join(encode_frame(m) for m in SERVER_MESSAGES), ServerMessage) == SERVER_MESSAGES


def test_byte_by_byte_feeding_gives_the_same_messages() -> None:
    data = b"".join(encode_frame(m) for m in CLIENT_MESSAGES)
    decoder: FrameDecoder = FrameDecoder(ClientMessage)
    messages = []
    for i in range(len(data)):
        decoder.feed(data[i : i + 1])
        while (message := decoder.next_message()) is not None:
            messages.append(message)
    assert messages == CLIENT_MESSAGES
    assert decoder.buffered_bytes == 0


def test_wire_params_mirror_sampling_params() -> None:
    fields = {f.name: f for f in dataclasses.fields(SamplingParams)}
    assert list(WireSamplingParams.__struct_fields__) == list(fields)
    wire_defaults = WireSamplingParams()
    for name, field in fields.items():
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        assert getattr(wire_defaults, name) == default, name
    params = SamplingParams(max_tokens=9, top_k=3, stop=["a"], logprobs=2, seed=1)
    assert WireSamplingParams.from_params(params).to_params() == params


def test_params_ranges_are_checked_on_arrival() -> None:
    (message,) = decode_all(encode_frame(Generate("x", WireSamplingParams(top_p=2.0))))
    with pytest.raises(InvalidParams) as excinfo:
        message.params.to_params()
    error = error_for(excinfo.value, "rid")
    assert (error.code, error.field, error.request_id) == ("invalid_params", "top_p", "rid")
    mapped = error_from_wire(error.code, error.message, error.field, error.request_id)
    assert isinstance(mapped, InvalidRequest) and mapped.field == "top_p"
    assert str(mapped) == "top_p: must be in (0.0, 1.0], got 2.0"


LARGEST_PARAMS = dict(max_tokens=MAX_MAX_TOKENS, top_k=MAX_TOP_K, seed=MAX_SEED, logprobs=MAX_LOGPROBS,
                      min_tokens=MAX_MAX_TOKENS, stop=["é" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
                      stop_token_ids=[MAX_TOKEN_ID] * MAX_STOP_TOKEN_IDS)
ONE_TOO_MANY = dict(max_tokens=MAX_MAX_TOKENS + 1, top_k=MAX_TOP_K + 1, seed=MAX_SEED + 1,
                    logprobs=MAX_LOGPROBS + 1, stop=["x"] * (MAX_STOP_STRINGS + 1),
                    stop_token_ids=[MAX_TOKEN_ID + 1])


def test_the_largest_params_allowed_fit_the_stages_binary_layout() -> None:
    params = SamplingParams(**LARGEST_PARAMS)
    assert decode_params(encode_params(params)) == params


@pytest.mark.parametrize("name", sorted(ONE_TOO_MANY))
def test_one_past_each_limit_is_refused_naming_the_field(name: str) -> None:
    with pytest.raises(InvalidParams, match=rf"^{name}: (must be in|at most)") as excinfo:
        SamplingParams(**{name: ONE_TOO_MANY[name]})
    assert excinfo.value.field == name


def test_a_stop_string_one_character_too_long_is_refused() -> None:
    with pytest.raises(InvalidParams, match=rf"^stop: each string at most {MAX_STOP_STRING_CHARS} characters"):
        SamplingParams(stop=["ok", "x" * (MAX_STOP_STRING_CHARS + 1)])


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        ({"type": "generate", "prompt": "x", "params": {"temprature": 1.0}}, "unknown field `temprature`"),
        ({"type": "generate", "prompt": "x", "params": {"temperature": "hot"}}, "$.params.temperature"),
        ({"type": "generate", "prompt": [1, -1]}, "$.prompt[1]"),
        ({"type": "generate"}, "missing required field `prompt`"),
        ({"type": "shutdown"}, "Invalid value 'shutdown'"),
        ({"type": "abort", "request_id": "x" * 65}, "$.request_id"),
        ([1, 2, 3], "Expected `object`"),
    ],
)
def test_wrong_types_name_the_problem(payload: object, problem: str) -> None:
    frame = msgspec.msgpack.encode(payload)
    with pytest.raises(ProtocolError) as excinfo:
        decode_all(struct.pack(">I", len(frame)) + frame)
    assert problem in str(excinfo.value)


def test_oversized_frames_are_refused_before_buffering() -> None:
    decoder: FrameDecoder = FrameDecoder(ClientMessage, max_frame_bytes=1024)
    with pytest.raises(ProtocolError, match="4294967295 bytes exceeds the 1024-byte limit"):
        decoder.feed(b"\xff\xff\xff\xff")
    assert decoder.buffered_bytes == 0
    with pytest.raises(ProtocolError, match="earlier error"):
        decoder.feed(encode_frame(Health()))
    with pytest.raises(ProtocolError, match="earlier error"):
        decoder.next_message()
    with pytest.raises(ProtocolError, match="over the 100-byte frame limit"):
        encode_frame(Generate("x" * 200), max_frame_bytes=100)
    with pytest.raises(ValueError, match="max_frame_bytes"):
        FrameDecoder(ClientMessage, max_frame_bytes=2**32)


def test_empty_frame_is_an_error() -> None:
    with pytest.raises(ProtocolError, match="empty frame"):
        decode_all(b"\x00\x00\x00\x00")


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_error_code_maps_to_its_exception(code: ErrorCode) -> None:
    exc = error_from_wire(code.value, "boom", "prompt", "rid")
    assert exc.code is code
    assert exc.request_id == "rid"
    wire = error_for(exc)
    assert (wire.code, wire.request_id) == (code.value, "rid")


def test_error_mapping_details() -> None:
    assert isinstance(error_from_wire("aborted", "gone"), RequestAborted)
    assert isinstance(error_from_wire("prompt_too_long", "9000 > 4096"), PromptTooLong)
    unknown = error_from_wire("future_code", "something new")
    assert type(unknown) is PipelineError and "future_code" in str(unknown)
    assert error_for(PipelineError("internal")).code == "stage_failed"


def test_request_ids_are_random_hex() -> None:
    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(len(i) == 16 and int(i, 16) >= 0 for i in ids)


# --- fuzzing: only valid messages or ProtocolError, with bounded memory ---

MAX_FUZZ_FRAME_BYTES = 4096


def fuzz_one(data: bytes, chunk_sizes: list[int], whole_reads: bool = False) -> tuple[list, str | None]:
    """Feeds `data` in chunks, taking messages one by one (or a read at a time with `whole_reads`);
    returns the messages and the first ProtocolError's text (None if none came)."""
    decoder: FrameDecoder = FrameDecoder(ClientMessage, MAX_FUZZ_FRAME_BYTES)
    messages: list = []
    position = 0
    error = None
    try:
        for size in chunk_sizes:
            decoder.feed(data[position : position + size])
            position += size
            # Never more than one frame plus one feed is held.
            assert decoder.buffered_bytes <= MAX_FUZZ_FRAME_BYTES + 4 + size
            if whole_reads:
                while batch := decoder.messages():
                    messages.extend(batch)
            else:
                while (message := decoder.next_message()) is not None:
                    messages.append(message)
    except ProtocolError as exc:
        assert str(exc)
        error = str(exc)
    assert all(isinstance(message, (Generate, Abort, Health, Stats)) for message in messages)
    return messages, error


def random_case(rng: random.Random) -> bytes:
    valid = b"".join(encode_frame(rng.choice(CLIENT_MESSAGES)) for _ in range(rng.randint(1, 3)))
    kind = rng.randrange(6)
    if kind == 0:  # random bytes
        return rng.randbytes(rng.randint(0, 200))
    if kind == 1:  # a valid stream cut short
        return valid[: rng.randint(0, len(valid))]
    if kind == 2:  # a valid stream with flipped bytes
        mutated = bytearray(valid)
        for _ in range(rng.randint(1, 8)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        return bytes(mutated)
    if kind == 3:  # a huge declared length
        return struct.pack(">I", rng.randint(MAX_FUZZ_FRAME_BYTES + 1, 2**32 - 1)) + rng.randbytes(16)
    if kind == 4:  # well-formed msgpack of the wrong shape
        payload = msgspec.msgpack.encode(
            rng.choice(
                [
                    {"type": "generate", "prompt": rng.randint(-5, 5)},
                    {"type": "generate", "prompt": "x", "stream": "yes"},
                    {"type": "abort", "request_id": None},
                    {"type": rng.randbytes(4)},
                    [[[[[]]]]] * rng.randint(1, 5),
                    {"type": "generate", "prompt": [2**40]},
                    rng.random(),
                ]
            )
        )
        return struct.pack(">I", len(payload)) + payload
    # deeply nested arrays: a classic decoder stack overflow
    depth = rng.randint(100, 5000)
    payload = b"\x91" * depth + b"\xc0"
    return struct.pack(">I", len(payload)) + payload if len(payload) <= MAX_FUZZ_FRAME_BYTES else payload[:64]


def test_two_thousand_fuzzed_streams_give_messages_or_protocol_errors() -> None:
    rng = random.Random(20240601)
    decoded = 0
    for _ in range(2000):
        data = random_case(rng)
        chunk_sizes = [rng.randint(1, 64) for _ in range(len(data) // 1 + 1)]
        decoded += len(fuzz_one(data, chunk_sizes)[0])
    assert decoded > 100  # the cases include valid (and prefixes of valid) streams


@settings(max_examples=300, derandomize=True, deadline=None)
@given(data=st.binary(max_size=300), chunk=st.integers(1, 50))
def test_arbitrary_bytes_give_messages_or_protocol_errors(data: bytes, chunk: int) -> None:
    fuzz_one(data, [chunk] * (len(data) // chunk + 1))


def test_a_reads_messages_at_once_equal_them_one_by_one_errors_included() -> None:
    rng = random.Random(20251125)
    for _ in range(1000):
        data = random_case(rng) + b"".join(encode_frame(m) for m in CLIENT_MESSAGES[:2])
        chunk_sizes = [rng.choice((1, 7, 64, 4096)) for _ in range(len(data) + 1)]
        assert fuzz_one(data, chunk_sizes, whole_reads=True) == fuzz_one(data, chunk_sizes)


# --- batched deltas: `Deltas` frames, read beside `Delta` frames


def deltas_message(deltas: list[Delta]) -> Deltas:
    """The Deltas frame a daemon sends for `deltas` (plain ones: no logprobs)."""
    text_ends, token_ends, token_ids = [], [], []
    for delta in deltas:
        text_ends.append((text_ends[-1] if text_ends else 0) + len(delta.text))
        token_ids += delta.token_ids
        token_ends.append(len(token_ids))
    return Deltas([d.request_id for d in deltas], "".join(d.text for d in deltas), text_ends, token_ids, token_ends)


plain_deltas = st.lists(st.builds(Delta, st.sampled_from(["a1", "b2", "c3"]), st.text(max_size=6),
                                  st.lists(st.integers(0, MAX_TOKEN_ID), max_size=4)), max_size=8)


@settings(max_examples=200, deadline=None)
@given(frames=st.lists(st.tuples(st.booleans(), plain_deltas), max_size=6), chunk=st.integers(1, 64))
def test_both_frame_kinds_decode_to_the_same_deltas_however_the_bytes_arrive(
        frames: list[tuple[bool, list[Delta]]], chunk: int) -> None:
    data = b"".join(encode_frame(deltas_message(deltas)) if batched else b"".join(encode_frame(d) for d in deltas)
                    for batched, deltas in frames)
    decoder: FrameDecoder = FrameDecoder(ServerMessage)
    received: list[Delta] = []
    for start in range(0, len(data), chunk):
        decoder.feed(data[start : start + chunk])
        for message in decoder.messages():
            received += message.split() if type(message) is Deltas else [message]
    assert received == [delta for _, deltas in frames for delta in deltas]
    assert decoder.buffered_bytes == 0


@settings(max_examples=300, deadline=None)
@given(request_ids=st.lists(st.just("a1"), max_size=4), text=st.text(max_size=8),
       text_ends=st.lists(st.integers(0, 10), max_size=5), token_ids=st.lists(st.integers(0, 9), max_size=6),
       token_ends=st.lists(st.integers(0, 8), max_size=5))
def test_deltas_offsets_that_do_not_split_the_frame_are_a_protocol_error(
        request_ids: list[str], text: str, text_ends: list[int], token_ids: list[int], token_ends: list[int]) -> None:
    message = Deltas(request_ids, text, text_ends, token_ids, token_ends)
    fits = (len(request_ids) == len(text_ends) == len(token_ends)
            and (not request_ids or (text_ends[-1] == len(text) and token_ends[-1] == len(token_ids)
                                     and text_ends == sorted(text_ends) and token_ends == sorted(token_ends))))
    if fits:
        deltas = message.split()
        assert "".join(d.text for d in deltas) == (text if request_ids else "")
        assert [t for d in deltas for t in d.token_ids] == (token_ids if request_ids else [])
    else:
        with pytest.raises(ProtocolError, match="Deltas"):
            message.split()


def test_a_negative_deltas_offset_is_refused_by_the_decoder() -> None:
    frame = encode_frame(Deltas(["a1"], "x", [-1], [], [0]))
    with pytest.raises(ProtocolError, match="text_ends"):
        decode_all(frame, ServerMessage)


def test_generate_omits_delta_frames_unless_set_so_an_older_daemon_reads_it() -> None:
    class OlderGenerate(msgspec.Struct, tag="generate", forbid_unknown_fields=True):
        prompt: str | list[int]
        params: WireSamplingParams = msgspec.field(default_factory=WireSamplingParams)
        stream: bool = False

    older = msgspec.msgpack.Decoder(OlderGenerate)
    assert older.decode(msgspec.msgpack.encode(Generate([1, 2], stream=True))).stream is True
    with pytest.raises(msgspec.ValidationError, match="delta_frames"):
        older.decode(msgspec.msgpack.encode(Generate([1, 2], stream=True, delta_frames=True)))
    from_older_client = msgspec.msgpack.encode(OlderGenerate([1, 2], stream=True))
    assert decode_all(framed(from_older_client)) == [Generate([1, 2], stream=True)]


def framed(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def test_a_request_that_turns_speculation_off_says_so_on_the_wire() -> None:
    params = SamplingParams(max_tokens=4, speculative=False)
    (message,) = decode_all(encode_frame(Generate([1, 2], WireSamplingParams.from_params(params))))
    assert message.params.to_params() == params
    # The default is left out, so a daemon that does not know the field reads the request.
    assert "speculative" not in msgspec.msgpack.decode(msgspec.msgpack.encode(Generate([1, 2])))["params"]
    with pytest.raises(ProtocolError, match=r"\$\.params\.speculative"):
        decode_all(encode_frame(Generate([1, 2], WireSamplingParams(speculative="no"))))  # type: ignore[arg-type]


def test_stats_carry_speculative_counts_and_derive_their_rates() -> None:
    reply = StatsReply(num_draft_tokens=300, num_accepted_tokens=210, num_verifications=100)
    (decoded,) = decode_all(encode_frame(reply), ServerMessage)
    assert (decoded.num_draft_tokens, decoded.num_accepted_tokens, decoded.num_verifications) == (300, 210, 100)
    assert decoded.speculative.draft_acceptance_rate == pytest.approx(0.7)
    assert decoded.speculative.mean_accepted_length == pytest.approx(3.1)  # 2.1 accepted drafts, one sampled token


def test_stats_from_a_daemon_without_speculative_counts_read_as_none_drafted() -> None:
    class OlderStatsReply(msgspec.Struct, tag="stats_reply"):
        num_running_requests: int = 0

    (decoded,) = decode_all(framed(msgspec.msgpack.encode(OlderStatsReply(2))), ServerMessage)
    assert decoded.num_running_requests == 2
    assert decoded.speculative == SpeculativeCounts(0, 0, 0)
    assert (decoded.speculative.draft_acceptance_rate, decoded.speculative.mean_accepted_length) == (0.0, 0.0)
