"""A streamed HTTP call of one choice takes its plain text straight from the server's batch loop:
each row's frame is made as an HTTP chunk there, and the batch's chunks are written back to back
once every row is routed. Order holds against whatever the response's task still has to write."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
from fake_stage_backend import FakeBackend, RecordingConnection

from pipeline.protocol import Done, Generate
from pipeline.serve.openai.asgi import DirectWriter, chunk
from pipeline.serve.openai.call import HttpCall, Reply
from pipeline.serve.openai.params import ChoiceRequest
from pipeline.serve.openai.sse import ChatStream, CompletionStream
from pipeline.serve.server import DaemonServer
from pipeline.serve.socket_connection import handle_message
from stages.contracts.config import EngineConfig
from stages.contracts.outputs import OutputEvent, TokenTexts
from stages.contracts.params import SamplingParams

pytestmark = pytest.mark.timeout(30)

CREATED = 1700000000


def texts(req_ids: list[int], token_ids: list[int], pieces: list[str], token_ends: list[int] | None = None) -> TokenTexts:
    encoded = [p.encode("utf-8") for p in pieces]
    return TokenTexts(np.array(req_ids, np.int64), np.array(token_ids, np.int32),
                      np.frombuffer(b"".join(encoded), np.uint8), np.cumsum([len(e) for e in encoded]),
                      None if token_ends is None else np.array(token_ends))


def first_tokens(req_ids: list[int]) -> list[OutputEvent]:
    return [OutputEvent(r, "a", np.array([7], np.int32), prompt_token_ids=np.array([5, 6], np.int32)) for r in req_ids]


class Wire:
    """What reached each connection, in the order it was written, across connections."""

    def __init__(self) -> None:
        self.log: list[tuple[str, bytes]] = []
        self.fail: set[str] = set()  # connections whose writes raise

    def writer(self, name: str) -> tuple[DirectWriter, SimpleNamespace]:
        def write(data: bytes) -> None:
            if name in self.fail:
                raise ConnectionResetError(f"{name} is gone")
            self.log.append((name, data))

        cycle = SimpleNamespace(disconnected=False, response_complete=False, transport=SimpleNamespace(write=write),
                                flow=SimpleNamespace(write_paused=False))
        return DirectWriter(cycle), cycle

    def of(self, name: str) -> list[bytes]:
        return [data for who, data in self.log if who == name]


def daemon_server() -> DaemonServer:
    return DaemonServer(FakeBackend(EngineConfig(model="unused"), "1_a"), max_num_seqs=8)


def http_call(server: DaemonServer, wire: Wire, name: str, num_choices: int = 1, stream_interval: int = 1,
              kind: type = CompletionStream) -> tuple[HttpCall, SimpleNamespace]:
    choices = [ChoiceRequest(i, [5, 6], SamplingParams(max_tokens=100)) for i in range(num_choices)]
    call = HttpCall(server, choices, keep_logprobs=False, stream_interval=stream_interval)
    call.start()
    call.frame_text(kind(f"cmpl-{name}", "tiny", CREATED, str, include_usage=False))
    writer, cycle = wire.writer(name)
    call.attach_writer(writer)
    return call, cycle


def frames(name: str, *texts: str, kind: type = CompletionStream) -> list[bytes]:
    """A fresh stream's frames of `texts`, one each."""
    reference = kind(f"cmpl-{name}", "tiny", CREATED, str, include_usage=False)
    return [reference.chunk(0, text) for text in texts]


def sse(name: str, *texts: str, kind: type = CompletionStream) -> list[bytes]:
    """`frames`, each as the HTTP chunk that goes on the wire."""
    return [chunk(frame) for frame in frames(name, *texts, kind=kind)]


@pytest.mark.parametrize("kind", [CompletionStream, ChatStream])
def test_the_chunks_made_from_the_template_are_the_streams_frames_byte_for_byte(kind: type) -> None:
    pieces = [" Hello", "", 'say "hi"', "back\\slash", "new\nline\ttab\x01", "é ü", "日本語", "🙂", "</script>",
              "\u2028", "long " * 1000]  # the last is past the chunk heads made ahead

    async def run() -> None:
        wire = Wire()
        server = daemon_server()
        http_call(server, wire, "c", kind=kind)
        server.on_events(first_tokens([0]))
        await asyncio.sleep(0)
        for token, piece in enumerate(pieces):
            server.on_events([texts([0], [8 + token], [piece])])
        shown = ["a", *(piece for piece in pieces if piece)]  # an open choice's empty text shows nothing
        assert wire.of("c") == sse("c", *shown, kind=kind)

    asyncio.run(run())


def test_a_batchs_text_chunks_leave_back_to_back_once_every_row_is_routed() -> None:
    async def run() -> None:
        wire = Wire()
        server = daemon_server()
        one, _ = http_call(server, wire, "one")  # req_id 0
        two, _ = http_call(server, wire, "two")  # req_id 1
        socket = RecordingConnection()
        handle_message(server, socket, Generate(prompt=[5, 6], stream=True))  # req_id 2
        both, _ = http_call(server, wire, "both", num_choices=2)  # req_id 3; its second choice waits for the first
        requests = server._requests
        assert requests[0].text_sink is not None and requests[1].text_sink is not None
        assert requests[2].text_sink is None and requests[3].text_sink is None  # a socket; two choices
        server.on_events(first_tokens([0, 1, 2, 3]))
        await asyncio.sleep(0)  # the first frames, made by the calls, go at the end of the turn
        wire.log.clear()
        log_at_send: list[int] = []
        socket.send_text = lambda *args: log_at_send.append(len(wire.log))  # type: ignore[method-assign]
        # Rows in the order two, socket, one (two tokens, a character split over none), both.
        server.on_events([texts([1, 2, 0, 3], [8, 9, 10, 11, 12], ["é", "s", 'say "hi"', " z"], [1, 2, 4, 5])])
        assert log_at_send == [0]  # the socket's row was routed before any chunk was written
        assert wire.of("two") == sse("two", "a", "é")[1:]
        assert wire.of("one") == sse("one", "a", 'say "hi"')[1:]
        assert [who for who, _ in wire.log] == ["two", "one"]  # the batch's row order
        await asyncio.sleep(0)  # the two-choice call writes its frames once the turn is over
        assert [who for who, _ in wire.log] == ["two", "one", "both"]
        assert [c.num_tokens for c in one.choices] == [3] and [c.num_tokens for c in two.choices] == [2]
        assert requests[0].token_ids == [7, 10, 11] and requests[1].token_ids == [7, 8]
        task = asyncio.ensure_future(one.next_replies())
        await asyncio.sleep(0)
        assert not task.done()  # the response's task was never woken for them
        task.cancel()

    asyncio.run(run())


def test_text_waits_behind_what_the_task_has_to_write_and_for_a_full_connection() -> None:
    async def run() -> None:
        wire = Wire()
        server = daemon_server()
        call, cycle = http_call(server, wire, "c")  # req_id 0
        expected = frames("c", "a", " b", " c")
        server.on_events(first_tokens([0]))
        await asyncio.sleep(0)
        assert wire.of("c") == sse("c", "a")
        cycle.flow.write_paused = True  # the client reads slowly: the frame goes through the task
        server.on_events([texts([0], [8], [" b"])])
        assert await asyncio.wait_for(call.next_replies(), 1.0) == [expected[1]]
        assert wire.of("c") == sse("c", "a")
        cycle.flow.write_paused = False
        server.on_events([texts([0], [9], [" c"])])  # the task holds replies it has not written yet
        assert wire.of("c") == sse("c", "a")
        assert await asyncio.wait_for(call.next_replies(), 1.0) == [expected[2]]
        server.on_events([OutputEvent(0, "", np.zeros(0, np.int32), finish_reason="length")])
        server.on_events([texts([0], [10], [" d"])])  # the request ended: its late row goes nowhere
        replies = await asyncio.wait_for(call.next_replies(), 1.0)
        assert len(replies) == 1 and isinstance(replies[0], Reply) and replies[0].finish_reason == "length"
        assert wire.of("c") == sse("c", "a")
        assert isinstance(call.choices[0].done, Done) and call.choices[0].num_tokens == 3

    asyncio.run(run())


def test_a_write_that_fails_keeps_no_other_streams_text_back() -> None:
    async def run() -> None:
        wire = Wire()
        server = daemon_server()
        http_call(server, wire, "gone")  # req_id 0
        http_call(server, wire, "here")  # req_id 1
        server.on_events(first_tokens([0, 1]))
        await asyncio.sleep(0)
        wire.fail.add("gone")
        server.on_events([texts([0, 1], [8, 9], [" x", " y"])])
        assert wire.of("here") == sse("here", "a", " y")

    asyncio.run(run())


def test_a_stream_interval_frames_every_nth_token_from_the_batch_loop_and_the_rest_before_the_end() -> None:
    async def run() -> None:
        wire = Wire()
        server = daemon_server()
        call, _ = http_call(server, wire, "c", stream_interval=3)  # req_id 0
        assert server._requests[0].text_sink is not None
        server.on_events(first_tokens([0]))  # a choice's first token goes at once
        await asyncio.sleep(0)
        for token, piece in enumerate([" b", "", "c", " d"]):  # the third held token frames " b" + "" + "c"
            server.on_events([texts([0], [8 + token], [piece])])
        assert wire.of("c") == sse("c", "a", " bc")
        server.on_events([OutputEvent(0, "", np.zeros(0, np.int32), finish_reason="length")])
        replies = await asyncio.wait_for(call.next_replies(), 1.0)  # the held " d" before the finish
        assert replies[0] == frames("c", "a", " bc", " d")[2]
        assert isinstance(replies[1], Reply) and replies[1].finish_reason == "length"
        assert call.choices[0].num_tokens == 5

    asyncio.run(run())
