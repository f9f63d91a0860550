"""The daemon writes a connection's replies once per turn of the event loop: a step's deltas for
every stream of one connection leave in one write, in order; a client that leaves too much
unread is dropped; a close flushes first and an abort drops what is gathered."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
from fake_stage_backend import FakeBackend

from pipeline.protocol import Accepted, Delta, FrameDecoder, Generate, ServerMessage, encode_frame
from pipeline.serve.server import DaemonServer
from pipeline.serve.socket_connection import SocketConnection
from stages.contracts.config import EngineConfig
from stages.contracts.outputs import OutputEvent, TokenTexts

pytestmark = pytest.mark.timeout(30)


class FakeTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def get_write_buffer_size(self) -> int:
        return sum(len(w) for w in self.writes)

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True


def decoded(data: bytes) -> list[ServerMessage]:
    decoder: FrameDecoder[ServerMessage] = FrameDecoder(ServerMessage)
    decoder.feed(data)
    messages = []
    while (message := decoder.next_message()) is not None:
        messages.append(message)
    return messages


def open_streams(num_streams: int, max_unread_bytes: int | None = None) -> tuple[DaemonServer, SocketConnection,
                                                                                  FakeTransport]:
    server = DaemonServer(FakeBackend(EngineConfig(model="unused"), "1_a"), max_num_seqs=num_streams)
    if max_unread_bytes is not None:
        server.max_unread_bytes = max_unread_bytes
    connection, transport = SocketConnection(server), FakeTransport()
    connection.connection_made(transport)  # type: ignore[arg-type]
    connection.data_received(b"".join(encode_frame(Generate(prompt=[5, 6], stream=True)) for _ in range(num_streams)))
    server.on_events([OutputEvent(r, "", np.zeros(0, np.int32), prompt_token_ids=np.array([5, 6], np.int32))
                      for r in range(num_streams)])
    return server, connection, transport


def step(req_ids: list[int], token_id: int) -> TokenTexts:
    return TokenTexts(np.array(req_ids, np.int64), np.full(len(req_ids), token_id, np.int32),
                      np.frombuffer(b"x" * len(req_ids), np.uint8), np.arange(1, len(req_ids) + 1))


def test_a_step_of_many_streams_on_one_connection_is_one_write() -> None:
    async def run() -> None:
        server, _, transport = open_streams(4)
        await asyncio.sleep(0)
        accepted = decoded(b"".join(transport.writes))
        assert [type(m) for m in accepted] == [Accepted] * 4
        transport.writes.clear()
        for token_id in (7, 8):
            server.on_events([step([0, 1, 2, 3], token_id)])
            assert transport.writes == []  # gathered until the loop turns
            await asyncio.sleep(0)
            assert len(transport.writes) == 1
            deltas = decoded(transport.writes.pop())
            assert [(d.request_id, d.token_ids) for d in deltas] == [(a.request_id, [token_id]) for a in accepted]
            assert all(isinstance(d, Delta) for d in deltas)
    asyncio.run(run())


def test_a_client_that_leaves_too_much_unread_is_dropped_at_the_write() -> None:
    async def run() -> None:
        server, _, transport = open_streams(2, max_unread_bytes=200)
        await asyncio.sleep(0)
        assert not transport.aborted
        for token_id in range(20):
            server.on_events([step([0, 1], token_id)])
            await asyncio.sleep(0)
            if transport.aborted:
                break
        assert transport.aborted and transport.get_write_buffer_size() <= 200 + 2 * 64
    asyncio.run(run())


def test_close_writes_what_is_gathered_and_abort_drops_it() -> None:
    async def run() -> None:
        server, connection, transport = open_streams(2)
        server.on_events([step([0, 1], 9)])
        connection.close()
        assert transport.closed and [type(m) for m in decoded(b"".join(transport.writes))] == [Accepted] * 2 + [Delta] * 2
        server, connection, transport = open_streams(2)
        connection.abort()
        await asyncio.sleep(0)
        assert transport.aborted and transport.writes == []
    asyncio.run(run())
