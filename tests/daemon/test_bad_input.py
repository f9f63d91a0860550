"""Bad input against a live daemon: 10,000 malformed frames and invalid requests, each answered by
an error that names the problem; a protocol error closes its connection, a request error does
not; the daemon stays healthy, and good requests served meanwhile give the same output."""
from __future__ import annotations

import asyncio
import math
import random
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from live_daemon import LiveDaemon, memory_kib, wait_idle

from pipeline.client import AsyncClient, Client, Completion
from pipeline.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    FRAME_HEADER,
    MAX_FRAME_BYTES_LIMIT,
    Accepted,
    Error,
    FrameDecoder,
    Health,
    HealthReply,
    ServerMessage,
    encode_frame,
)
from stages.contracts.params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

pytestmark = pytest.mark.timeout(60)

NUM_MALFORMED_FRAMES = 6_000  # one fresh connection each: the daemon closes it after the error
NUM_INVALID_REQUESTS = 4_000  # many per connection: the connection stays open after each
REQUESTS_PER_CONNECTION = 250
FUZZ_THREADS = 4  # connections at once: the daemon works while this process makes the next
VOCAB_SIZE = 1024  # the tiny checkpoint's
MAX_MODEL_LEN = 2048  # live_daemon's --max-model-len
GOOD_PARAMS = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
MAX_RSS_GROWTH_BYTES = 256 << 20

_encode = msgspec.msgpack.Encoder().encode


def framed(payload: bytes) -> bytes:
    return FRAME_HEADER.pack(len(payload)) + payload


@dataclass(slots=True)
class Malformed:
    kind: str
    data: bytes  # sent on a fresh connection
    problem: str  # a regular expression the protocol error's message must match
    num_replies_first: int = 0  # replies due to valid frames sent before the bad one


# --- malformed frames: each kind makes one case from its own seeded generator


def random_payload(rng: random.Random) -> Malformed:
    body = rng.randbytes(rng.randint(1, 256))
    return Malformed("random payload", framed(body), r"invalid message in a \d+-byte frame")


def oversized_length(rng: random.Random) -> Malformed:
    length = rng.choice([DEFAULT_MAX_FRAME_BYTES + 1, MAX_FRAME_BYTES_LIMIT,
                         rng.randint(DEFAULT_MAX_FRAME_BYTES + 1, MAX_FRAME_BYTES_LIMIT)])
    return Malformed("oversized length", FRAME_HEADER.pack(length) + rng.randbytes(rng.randint(0, 64)),
                     rf"frame of {length} bytes exceeds the {DEFAULT_MAX_FRAME_BYTES}-byte limit")


def little_endian_length(rng: random.Random) -> Malformed:
    payload = _encode({"type": "generate", "prompt": "x" * rng.randint(1, 200)})
    length = int.from_bytes(len(payload).to_bytes(4, "little"), "big")  # a classic client bug
    return Malformed("little-endian length", len(payload).to_bytes(4, "little") + payload,
                     rf"frame of {length} bytes exceeds")


def empty_frame(rng: random.Random) -> Malformed:
    return Malformed("empty frame", FRAME_HEADER.pack(0) + rng.randbytes(rng.randint(0, 8)), r"empty frame")


def truncated_message(rng: random.Random) -> Malformed:
    message = rng.choice([
        {"type": "generate", "prompt": "truncated " * rng.randint(1, 20), "params": {"max_tokens": 4}},
        {"type": "generate", "prompt": list(range(rng.randint(1, 50))), "stream": True},
        {"type": "abort", "request_id": "0123456789abcdef"},
        {"type": "health"},
    ])
    payload = _encode(message)
    cut = payload[: rng.randint(1, len(payload) - 1)]
    return Malformed("truncated message", framed(cut), r"invalid message in a \d+-byte frame")


def trailing_bytes(rng: random.Random) -> Malformed:
    payload = _encode({"type": "stats"}) + rng.randbytes(rng.randint(1, 16))
    return Malformed("trailing bytes", framed(payload), r"invalid message")


WRONG_TYPES: list[tuple[dict[str, object], str]] = [
    ({"type": "generate", "prompt": 5}, r"\$\.prompt"),
    ({"type": "generate", "prompt": {"text": "hi"}}, r"\$\.prompt"),
    ({"type": "generate", "prompt": b"raw bytes"}, r"\$\.prompt"),
    ({"type": "generate", "prompt": [1.5]}, r"\$\.prompt\[0\]"),
    ({"type": "generate", "prompt": [1, "two"]}, r"\$\.prompt\[1\]"),
    ({"type": "generate", "prompt": [7, -1]}, r"\$\.prompt\[1\]"),
    ({"type": "generate", "prompt": [2**40]}, r"\$\.prompt\[0\]"),
    ({"type": "generate", "prompt": None}, r"\$\.prompt"),
    ({"type": "generate", "prompt": "hi", "params": [16]}, r"\$\.params"),
    ({"type": "generate", "prompt": "hi", "params": {"max_tokens": "10"}}, r"\$\.params\.max_tokens"),
    ({"type": "generate", "prompt": "hi", "params": {"max_tokens": 2.5}}, r"\$\.params\.max_tokens"),
    ({"type": "generate", "prompt": "hi", "params": {"temperature": "hot"}}, r"\$\.params\.temperature"),
    ({"type": "generate", "prompt": "hi", "params": {"stop": "x"}}, r"\$\.params\.stop"),
    ({"type": "generate", "prompt": "hi", "params": {"stop": [1]}}, r"\$\.params\.stop\[0\]"),
    ({"type": "generate", "prompt": "hi", "params": {"stop_token_ids": ["1"]}}, r"\$\.params\.stop_token_ids"),
    ({"type": "generate", "prompt": "hi", "params": {"seed": 1.5}}, r"\$\.params\.seed"),
    ({"type": "generate", "prompt": "hi", "params": {"logprobs": True}}, r"\$\.params\.logprobs"),
    ({"type": "generate", "prompt": "hi", "params": {"ignore_eos": "yes"}}, r"\$\.params\.ignore_eos"),
    ({"type": "generate", "prompt": "hi", "stream": "yes"}, r"\$\.stream"),
    ({"type": "abort", "request_id": 5}, r"\$\.request_id"),
    ({"type": "abort", "request_id": ""}, r"\$\.request_id"),
    ({"type": "abort", "request_id": "x" * 65}, r"\$\.request_id"),
    ({"type": 1}, r"\$\.type"),
]


def wrong_type(rng: random.Random) -> Malformed:
    message, path = rng.choice(WRONG_TYPES)
    return Malformed("wrong type", framed(_encode(message)), rf"Expected .* - at `{path}")


MALFORMED_MESSAGES: list[tuple[object, str]] = [
    ({"type": "frobnicate"}, r"Invalid value 'frobnicate'"),
    ({"type": "generate"}, r"missing required field `prompt`"),
    ({"type": "abort"}, r"missing required field `request_id`"),
    ({"prompt": "hi"}, r"missing required field `type`"),
    ({}, r"missing required field `type`"),
    ({"type": "generate", "prompt": "hi", "priority": 1}, r"unknown field `priority`"),
    ({"type": "generate", "prompt": "hi", "params": {"temprature": 0.5}}, r"unknown field `temprature`"),
    ({"type": "health", "verbose": True}, r"unknown field `verbose`"),
    (5, r"Expected `object`, got `int`"),
    ("generate", r"Expected `object`, got `str`"),
    (["generate", "hi"], r"Expected `object`, got `array`"),
    (None, r"Expected `object`, got `None`"),
    (msgspec.msgpack.Ext(1, b"\x00" * 8), r"Expected `object`, got `ext`"),
    ({"type": "generate", "prompt": msgspec.msgpack.Ext(7, b"payload")}, r"got `ext` - at `\$\.prompt`"),
]


def malformed_message(rng: random.Random) -> Malformed:
    message, problem = rng.choice(MALFORMED_MESSAGES)
    return Malformed("malformed message", framed(_encode(message)), problem)


def invalid_utf8(rng: random.Random) -> Malformed:
    size = rng.randint(1, 64)
    placeholder = "~" * size  # 0x7e: not a byte of any msgpack header for a string this short
    message = rng.choice([{"type": "generate", "prompt": placeholder},
                          {"type": "generate", "prompt": "hi", "params": {"stop": ["ok", placeholder]}},
                          {"type": "abort", "request_id": placeholder}])
    bad = bytearray(rng.randbytes(size))
    bad[rng.randrange(size)] = 0xFF  # never valid in UTF-8
    payload = _encode(message).replace(placeholder.encode(), bytes(bad))
    # msgspec names it "Invalid UTF-8 encoded string" from 0.23 on, the codec's "can't decode byte" before
    return Malformed("invalid UTF-8", framed(payload), r"can't decode byte|Invalid UTF-8")


def huge_nesting(rng: random.Random) -> Malformed:
    depth = 1_000_000 if rng.random() < 0.02 else rng.choice([1_000, 100_000])  # deepest: megabytes
    shape = rng.choice(["array", "map", "prompt"])
    if shape == "array":
        return Malformed("huge nesting", framed(b"\x91" * depth + b"\xc0"), r"Expected `object`, got `array`")
    if shape == "map":  # skipping the unknown key's value recurses: msgspec bounds the depth
        return Malformed("huge nesting", framed(b"\x81\xa1a" * depth + b"\xc0"), r"invalid message")
    head = _encode({"type": "generate", "prompt": []})[:-1]  # ends in the empty array's byte
    return Malformed("huge nesting", framed(head + b"\x91" * depth + b"\xc0"), r"at `\$\.prompt\[0\]`")


def bad_after_good(rng: random.Random) -> Malformed:
    """Valid frames first: they are answered, then the bad one ends the connection."""
    num_good = rng.randint(1, 3)
    bad = rng.choice([random_payload, oversized_length, truncated_message, wrong_type])(rng)
    return Malformed("bad after good", encode_frame(Health()) * num_good + bad.data, bad.problem, num_good)


MALFORMED_KINDS: list[Callable[[random.Random], Malformed]] = [
    random_payload, oversized_length, little_endian_length, empty_frame, truncated_message, trailing_bytes,
    wrong_type, malformed_message, invalid_utf8, huge_nesting, bad_after_good,
]


def malformed_frames(count: int, seed: int) -> Iterator[Malformed]:
    rng = random.Random(seed)
    for i in range(count):
        yield MALFORMED_KINDS[i % len(MALFORMED_KINDS)](rng)


# --- invalid requests: well-formed messages that ask for something the daemon must refuse


@dataclass(slots=True)
class Invalid:
    message: dict[str, object]
    code: str
    field: str | None  # the request field the error must name (None: not one field's problem)
    problem: str  # a regular expression the error's message must match


def bad_param(name: str, value: object, problem: str = r"must be in [(\[]") -> Invalid:
    return Invalid({"type": "generate", "prompt": "hi", "params": {name: value}}, "invalid_params", name, problem)


def bad_prompt(prompt: object, code: str, problem: str) -> Invalid:
    return Invalid({"type": "generate", "prompt": prompt, "params": {"max_tokens": 1}}, code,
                   "prompt" if code == "invalid_params" else None, problem)


NAN, INF = math.nan, math.inf
LIGHT_INVALID: list[Invalid] = [
    *(bad_param("max_tokens", v) for v in (0, -1, -2**63, 2**31, 2**63 - 1, 2**64 - 1)),
    *(bad_param("temperature", v) for v in (NAN, INF, -INF, -0.5, 100.5)),
    *(bad_param("top_p", v, r"must be in \(0\.0, 1\.0\]") for v in (0.0, -0.1, 1.0000001, 2.0, NAN, INF)),
    *(bad_param("top_k", v) for v in (-2, 2**31, -2**63, 2**64 - 1)),
    *(bad_param("min_p", v) for v in (-0.1, 1.5, NAN)),
    bad_param("presence_penalty", 2.5), bad_param("presence_penalty", NAN),
    bad_param("frequency_penalty", -3.0), bad_param("repetition_penalty", 0.0),
    bad_param("repetition_penalty", -1.0), bad_param("repetition_penalty", INF),
    bad_param("min_tokens", -1),
    Invalid({"type": "generate", "prompt": "hi", "params": {"max_tokens": 4, "min_tokens": 5}},
            "invalid_params", "min_tokens", r"must be in \[0, 4\], got 5"),
    *(bad_param("seed", v) for v in (-1, 2**63, 2**64 - 1)),
    *(bad_param("logprobs", v) for v in (-1, 21, 2**31, 2**64 - 1)),
    bad_param("stop", ["x"] * (MAX_STOP_STRINGS + 1), rf"at most {MAX_STOP_STRINGS} strings, got 65"),
    bad_param("stop", ["x" * (MAX_STOP_STRING_CHARS + 1)], rf"at most {MAX_STOP_STRING_CHARS} characters"),
    bad_param("stop", ["é" * 300], r"at most \d+ characters, got one of 300"),
    bad_param("stop", [""], r"non-empty strings"), bad_param("stop", ["ok", ""], r"non-empty strings"),
    bad_param("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1)), rf"at most {MAX_STOP_TOKEN_IDS} ids"),
    *(bad_param("stop_token_ids", [v]) for v in (-1, 2**31, 2**64 - 1)),
    bad_prompt("", "invalid_params", r"prompt is empty"),
    bad_prompt([], "invalid_params", r"prompt is empty"),
    bad_prompt([VOCAB_SIZE], "invalid_params", r"outside the vocabulary \[0, 1024\): \[1024\]"),
    bad_prompt([5, 2**31 - 1], "invalid_params", r"outside the vocabulary"),
    bad_prompt([5] * MAX_MODEL_LEN, "prompt_too_long", r"prompt has 2048 tokens; max_model_len 2048"),
]
# Costly to send or to tokenize: each once per fuzz run.
HEAVY_INVALID: list[Invalid] = [
    bad_param("stop", [f"stop {i}" for i in range(5000)], r"at most 64 strings, got 5000"),
    bad_param("stop", ["y" * 100_000], r"got one of 100000"),
    bad_prompt("word " * 4000, "prompt_too_long", r"max_model_len 2048"),
    bad_prompt("z" * (5 << 20), "prompt_too_long", r"prompt of 5242880 characters is too large|max_model_len"),
    bad_prompt(list(range(5, 1000)) * 600, "prompt_too_long", r"too large|max_model_len"),
]


def invalid_requests(count: int) -> list[Invalid]:
    light = [LIGHT_INVALID[i % len(LIGHT_INVALID)] for i in range(count - len(HEAVY_INVALID))]
    return HEAVY_INVALID + light


# --- talking to the daemon


def read_replies(sock: socket.socket) -> tuple[list[ServerMessage], bool]:
    """Every message until the daemon closes the connection; and whether it did so cleanly."""
    decoder: FrameDecoder[ServerMessage] = FrameDecoder(ServerMessage)
    replies: list[ServerMessage] = []
    while True:
        try:
            data = sock.recv(1 << 16)
        except ConnectionResetError:
            return replies, False
        if not data:
            return replies, True
        decoder.feed(data)
        while (message := decoder.next_message()) is not None:
            replies.append(message)


def send_malformed(socket_path: Path, case: Malformed) -> str | None:
    """None if the daemon answered as it must, else what went wrong."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(socket_path))
        try:
            sock.sendall(case.data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed while a long frame was still being sent: the reply is already there
        replies, closed = read_replies(sock)
    if not closed:
        return f"{case.kind}: connection reset instead of closed after {replies}"
    *first, last = replies or [None]
    if len(first) != case.num_replies_first or not all(isinstance(m, HealthReply) for m in first):
        return f"{case.kind}: expected {case.num_replies_first} health replies first, got {replies}"
    if not (isinstance(last, Error) and last.code == "protocol" and re.search(case.problem, last.message)):
        return f"{case.kind}: expected a protocol error matching {case.problem!r}, got {last}"
    return None


def check_invalid_requests(socket_path: Path, cases: list[Invalid]) -> list[str]:
    """Sends `cases` pipelined on one connection, then Health: every case must get its error,
    and the connection must still answer afterwards. Returns the problems found."""
    problems: list[str] = []
    pending = list(reversed(cases))  # immediate replies arrive in the order requests were sent
    accepted: dict[str, Invalid] = {}
    num_done = 0
    health = False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(20)
        sock.connect(str(socket_path))

        def send_all() -> None:
            try:
                sock.sendall(b"".join(framed(_encode(c.message)) for c in cases) + encode_frame(Health()))
            except OSError:
                pass  # the daemon hung up: the reader reports it

        sender = threading.Thread(target=send_all)  # send and read at once, so no buffer fills up
        sender.start()
        decoder: FrameDecoder[ServerMessage] = FrameDecoder(ServerMessage)
        while num_done < len(cases) or not health:
            try:
                data = sock.recv(1 << 16)
            except ConnectionResetError:
                data = b""
            if not data:
                problems.append(f"connection closed after {num_done} of {len(cases)} invalid requests")
                break
            decoder.feed(data)
            while (message := decoder.next_message()) is not None:
                if isinstance(message, HealthReply):
                    health = True
                    continue
                case = None
                if isinstance(message, Accepted) and pending:
                    accepted[message.request_id] = pending.pop()
                    continue
                if isinstance(message, Error) and message.request_id is None and pending:
                    case = pending.pop()
                elif isinstance(message, Error):
                    case = accepted.pop(message.request_id, None)
                num_done += 1
                if case is None or not isinstance(message, Error):
                    problems.append(f"unexpected reply {message}")
                elif (message.code, message.field) != (case.code, case.field) or not re.search(case.problem,
                                                                                               message.message):
                    problems.append(f"{case.message} got {message}, expected {case.code} {case.field} {case.problem}")
        sender.join()
    return problems


def stage_pids(client: Client) -> dict[str, str]:
    return {name: state.split(" pid ")[1].split()[0] for name, state in client.health().stages.items()}


GOOD_PROMPTS: list[str | list[int]] = [
    "The scheduler plans the next step", "Rings carry token ids between stages", [5, 17, 300, 42, 9],
    "A daemon that survives bad input", [900, 3, 3, 3, 77, 1000, 12], "Stop strings may straddle tokens",
]


async def good_round(client: AsyncClient) -> list[list[int]]:
    async def streamed(prompt: str | list[int]) -> list[int]:
        token_ids: list[int] = []
        async for delta in client.stream(prompt, GOOD_PARAMS):
            token_ids.extend(delta.token_ids)
        return token_ids

    async def whole(prompt: str | list[int]) -> list[int]:
        completion: Completion = await client.generate(prompt, GOOD_PARAMS)
        return completion.token_ids

    return list(await asyncio.gather(*(streamed(p) if i % 2 else whole(p) for i, p in enumerate(GOOD_PROMPTS))))


def test_fuzzing_gets_clear_errors_and_leaves_good_requests_unharmed(live_daemon: LiveDaemon) -> None:
    socket_path = live_daemon.socket_path
    client = AsyncClient(socket_path)
    reference = asyncio.run(good_round(client))  # the same requests without the fuzzing
    with Client(socket_path, timeout_s=10) as sync_client:
        pids_before = stage_pids(sync_client)
    rss_before = memory_kib(live_daemon.process.pid)[0] * 1024

    fuzzing_done = threading.Event()
    rounds: list[list[list[int]]] = []
    good_errors: list[BaseException] = []

    def good_requests() -> None:
        async def run() -> None:
            while not fuzzing_done.is_set() or not rounds:
                rounds.append(await good_round(client))

        try:
            asyncio.run(run())
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            good_errors.append(exc)

    worker = threading.Thread(target=good_requests)
    worker.start()
    try:
        started = time.monotonic()
        with ThreadPoolExecutor(FUZZ_THREADS) as pool:
            replies = pool.map(lambda case: send_malformed(socket_path, case),
                               malformed_frames(NUM_MALFORMED_FRAMES, seed=7))
            malformed_problems = [p for p in replies if p is not None]
        cases = invalid_requests(NUM_INVALID_REQUESTS)
        request_problems = [p for i in range(0, len(cases), REQUESTS_PER_CONNECTION)
                            for p in check_invalid_requests(socket_path, cases[i:i + REQUESTS_PER_CONNECTION])]
        fuzz_s = time.monotonic() - started
    finally:
        fuzzing_done.set()
        worker.join(timeout=30)

    assert malformed_problems == [], f"{len(malformed_problems)} bad replies, e.g. {sorted(set(malformed_problems))[:8]}"
    assert request_problems == [], f"{len(request_problems)} bad replies, e.g. {sorted(set(request_problems))[:8]}"
    assert good_errors == []
    assert len(rounds) >= 1 and all(r == reference for r in rounds), f"{len(rounds)} rounds during {fuzz_s:.1f} s"
    assert live_daemon.process.poll() is None
    with Client(socket_path, timeout_s=10) as sync_client:
        assert sync_client.health().status == "ok"
        assert stage_pids(sync_client) == pids_before  # no stage died and was restarted
    assert memory_kib(live_daemon.process.pid)[0] * 1024 - rss_before < MAX_RSS_GROWTH_BYTES
    wait_idle(socket_path, timeout_s=5.0)
    assert "Traceback" not in live_daemon.log_path.read_text()


def test_a_frame_cut_off_by_the_client_closing_changes_nothing(live_daemon: LiveDaemon) -> None:
    # Nobody is left to tell: the daemon drops the partial frame with the connection.
    payload = _encode({"type": "generate", "prompt": "never finished", "params": {"max_tokens": 4}})
    for cut in (1, 3, 4, 10, len(payload) + 3):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(str(live_daemon.socket_path))
            sock.sendall(framed(payload)[:cut])
            sock.shutdown(socket.SHUT_WR)
            replies, closed = read_replies(sock)
        assert (replies, closed) == ([], True)
    with Client(live_daemon.socket_path, timeout_s=10) as client:
        assert client.health().status == "ok"
        assert client.stats().num_running_requests == 0
