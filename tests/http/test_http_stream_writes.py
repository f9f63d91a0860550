"""Streamed responses' fast path: text frames made from templates, byte for byte the full encode,
and a call's plain frames written straight to the connection once per loop turn, in order."""
from __future__ import annotations

import asyncio

import pytest

from pipeline.protocol import Delta, Done, Error, TokenLogprobs, Usage
from pipeline.serve.openai.asgi import chunk
from pipeline.serve.openai.call import HttpCall, Reply
from pipeline.serve.openai.params import ChoiceRequest
from pipeline.serve.openai.responses import encoder
from pipeline.serve.openai.sse import ChatStream, CompletionStream
from pipeline.serve.config import DaemonConfig
from pipeline.serve.requests import FlushLater
from stages.contracts.params import SamplingParams

CREATED = 1700000000
TEXTS = [" Hello", "", 'say "hi"', "back\\slash", "new\nline\ttab\x01", "é ü", "日本語", "🙂", "</script>", "\u2028"]


def token_text(token_id: int) -> str:
    return f"<{token_id}>"


@pytest.mark.parametrize("kind", [CompletionStream, ChatStream])
@pytest.mark.parametrize("include_usage", [False, True])
def test_text_frames_equal_full_chunks_byte_for_byte(kind: type, include_usage: bool) -> None:
    full = kind("id-1", "tiny/model \"q\"", CREATED, token_text, include_usage=include_usage)
    fast = kind("id-1", "tiny/model \"q\"", CREATED, token_text, include_usage=include_usage)
    for index in (0, 3):
        assert fast.text_frame(index, "") == full.chunk(index, "")  # a choice's first frame, even empty
        for text in TEXTS:
            expected = full.chunk(index, text) if text else b""  # an open choice's empty text shows nothing
            assert fast.text_frame(index, text) == expected
    # Where the text reached is kept alike: later logprobs' offsets agree.
    logprobs = [TokenLogprobs(5, -0.5, [6], [-1.0])]
    assert fast.chunk(0, "<5>", logprobs=logprobs) == full.chunk(0, "<5>", logprobs=logprobs)


@pytest.mark.parametrize("kind", [CompletionStream, ChatStream])
def test_a_chunk_template_around_the_encoded_text_is_the_text_frame_as_an_http_chunk(kind: type) -> None:
    stream = kind("id-1", "tiny/model", CREATED, token_text, include_usage=False)
    for index in (0, 3):
        stream.text_frame(index, "")  # opens the choice
        assert stream.chunk_template(index) is None  # made with the first frame of an open choice's text
        stream.text_frame(index, "x")
        template = stream.chunk_template(index)
        assert template is not None
        before, after, size = template
        for text in filter(None, TEXTS):
            body = encoder.encode(text)
            assert b"%x\r\n" % (size + len(body)) + before + body + after == chunk(stream.text_frame(index, text))


class FakeServer:
    def __init__(self) -> None:
        self.started: list[str] = []
        self.dropped = 0
        self.flush_later = FlushLater()

    def start_request(self, connection: HttpCall, prompt: object, params: SamplingParams, *, stream: bool,
                      resume_token_ids: list[int] | None = None) -> str:
        request_id = f"r{len(self.started)}"
        self.started.append(request_id)
        return request_id

    def drop_connection(self, connection: HttpCall) -> None:
        self.dropped += 1


def make_call(num_choices: int, stream_interval: int = 1) -> tuple[HttpCall, CompletionStream, list[bytes]]:
    choices = [ChoiceRequest(i, f"prompt {i}", SamplingParams(max_tokens=8)) for i in range(num_choices)]
    call = HttpCall(FakeServer(), choices, keep_logprobs=False,  # type: ignore[arg-type]
                    stream_interval=stream_interval)
    call.start()
    stream = CompletionStream("cmpl-1", "tiny", CREATED, token_text, include_usage=False)
    call.text_frame = stream.text_frame
    written: list[bytes] = []
    call.attach_writer(lambda body: written.append(body) or True)
    return call, stream, written


async def one_turn() -> None:
    await asyncio.sleep(0)


def test_a_turns_text_frames_leave_in_one_write_without_the_task() -> None:
    async def run() -> None:
        call, stream, written = make_call(2)
        reference = CompletionStream("cmpl-1", "tiny", CREATED, token_text, include_usage=False)
        call.send(Delta("r0", " a", [5]))
        call.send(Delta("r1", " b", [6]))
        call.send(Delta("r0", "", [7]))  # partial character: nothing to show for an open choice
        await one_turn()
        assert written == [reference.chunk(0, " a") + reference.chunk(1, " b")]
        task = asyncio.ensure_future(call.next_replies())
        await one_turn()
        assert not task.done()  # the task was never woken for them
        task.cancel()
        assert [c.num_tokens for c in call.choices] == [2, 1]

    asyncio.run(run())


def test_a_finish_after_text_sends_both_through_the_task_in_order() -> None:
    async def run() -> None:
        call, stream, written = make_call(1)
        reference = CompletionStream("cmpl-1", "tiny", CREATED, token_text, include_usage=False)
        call.send(Delta("r0", " a", [5]))
        call.send(Done("r0", "length", [1, 2], Usage(2, 1)))
        await one_turn()
        assert written == []  # a reply the task formats is queued: the frame before it waits too
        replies = await call.next_replies()
        assert replies[0] == reference.chunk(0, " a")
        assert isinstance(replies[1], Reply) and replies[1].finish_reason == "length"
        call.send(Delta("r0", " late", [9]))  # while the task writes, nothing overtakes it
        await one_turn()
        assert written == []
        assert await call.next_replies() == [reference.chunk(0, " late")]

    asyncio.run(run())


def test_a_stream_interval_frames_every_nth_token_and_sends_the_first_and_the_rest_at_once() -> None:
    async def run() -> None:
        call, _, written = make_call(2, stream_interval=3)
        reference = CompletionStream("cmpl-1", "tiny", CREATED, token_text, include_usage=False)
        call.send(Delta("r0", " a", [5]))  # a choice's first token: at once
        call.send(Delta("r1", "", [6]))  # an empty first delta still opens its choice at once
        call.send_text("r0", " b", [7])
        call.send_text("r0", "", [8])  # a token with no text yet counts toward the interval
        await one_turn()
        assert written == [reference.chunk(0, " a") + reference.chunk(1, "")]
        call.send_text("r0", "c", [9])  # the third held token: " b" + "" + "c" in one frame
        call.send_text("r1", " x", [10, 11])
        call.send_text("r1", "y", [12])  # 3 tokens held for r1
        await one_turn()
        assert written[1:] == [reference.chunk(0, " bc") + reference.chunk(1, " xy")]
        call.send_text("r0", " d", [13])
        await one_turn()
        assert len(written) == 2  # held
        call.send(Done("r0", "length", [1, 2], Usage(2, 6)))  # what is held goes out before the end
        await one_turn()
        replies = await call.next_replies()
        assert replies[0] == reference.chunk(0, " d")
        assert isinstance(replies[1], Reply) and replies[1].finish_reason == "length"
        assert [c.num_tokens for c in call.choices] == [5, 4]

    asyncio.run(run())


def test_a_stream_intervals_held_text_goes_out_before_an_error() -> None:
    async def run() -> None:
        call, _, written = make_call(1, stream_interval=4)
        reference = CompletionStream("cmpl-1", "tiny", CREATED, token_text, include_usage=False)
        call.send_text("r0", " a", [5])
        call.send_text("r0", " b", [6])
        call.send(Error("aborted", "request ended: abort", None, "r0"))
        await one_turn()
        replies = await call.next_replies()
        assert written == []  # the error goes through the task: the frames before it do too
        assert replies[:2] == [reference.chunk(0, " a"), reference.chunk(0, " b")]
        assert isinstance(replies[2], Reply) and replies[2].error is not None

    asyncio.run(run())


def test_a_stream_interval_below_one_is_refused() -> None:
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match=f"stream_interval must be a positive integer, got {bad!r}"):
            DaemonConfig(stream_interval=bad).check()  # type: ignore[arg-type]


def test_a_full_connection_leaves_the_frames_to_the_task() -> None:
    async def run() -> None:
        call, _, written = make_call(1)
        reference = CompletionStream("cmpl-1", "tiny", CREATED, token_text, include_usage=False)
        call.attach_writer(lambda body: False)
        call.send(Delta("r0", " a", [5]))
        await one_turn()
        assert await asyncio.wait_for(call.next_replies(), 1.0) == [reference.chunk(0, " a")]

    asyncio.run(run())


def test_direct_writes_on_the_daemons_uvicorn_arrive_in_order_with_sent_ones() -> None:
    import httpx

    from pipeline.serve.http import HttpListener, bind
    from pipeline.serve.openai.asgi import direct_body_writer

    writers: list[object] = []

    async def app(scope: dict, receive: object, send: object) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        write = direct_body_writer(send)
        writers.append(write)
        assert write is not None and write(b"one ")
        await send({"type": "http.response.body", "body": b"two ", "more_body": True})
        assert write(b"three")
        await send({"type": "http.response.body", "body": b""})
        assert not write(b" after the end")

    async def run() -> str:
        listener = HttpListener(app, bind("127.0.0.1", 0))
        await listener.start()
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                return (await client.get(listener.url)).text
        finally:
            await listener.stop()

    assert asyncio.run(run()) == "one two three"
    assert len(writers) == 1
