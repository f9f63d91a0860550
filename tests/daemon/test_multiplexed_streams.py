"""Many streams over one connection (`AsyncClient(multiplex=True)`), against the daemon's socket
server in this process with a fake backend: each stream gets its own tokens; an abort, a close
or a slow reader of one stream does not stall the others; what a slow stream holds unread stays
one merged delta; a dropped connection ends every stream on it."""
from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import numpy as np
import pytest
from fake_stage_backend import FakeBackend

from pipeline.client import AsyncClient
from pipeline.client.aio import AsyncStream
from pipeline.client.mux import Channel
from pipeline.errors import ConnectionLost, PipelineError, RequestAborted
from pipeline.serve.server import DaemonServer
from pipeline.serve.socket_connection import SocketConnection
from stages.contracts.config import EngineConfig
from stages.contracts.outputs import OutputEvent, TokenTexts

pytestmark = pytest.mark.timeout(30)
WAIT_S = 5.0


@asynccontextmanager
async def daemon() -> AsyncIterator[tuple[DaemonServer, FakeBackend, Path]]:
    backend = FakeBackend(EngineConfig(model="unused"), "1_a")
    server = DaemonServer(backend, max_num_seqs=16)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "daemon.sock"
        listener = await asyncio.get_running_loop().create_unix_server(lambda: SocketConnection(server), path=str(path))
        try:
            yield server, backend, path
        finally:
            listener.close()
            for connection in list(server.connections):
                connection.abort()
            await listener.wait_closed()


async def started(client: AsyncClient, backend: FakeBackend, server: DaemonServer, n: int) -> list[AsyncStream]:
    streams = []
    for _ in range(n):
        stream = client.stream([5, 6], {"max_tokens": 100})
        await stream.start()
        streams.append(stream)
    server.on_events([OutputEvent(r, "", np.zeros(0, np.int32), prompt_token_ids=np.array([5, 6], np.int32))
                      for r in backend.submitted])
    return streams


def step(req_ids: list[int], token_id: int) -> TokenTexts:
    pieces = [f"{r}:{token_id} ".encode() for r in req_ids]
    return TokenTexts(np.array(req_ids, np.int64), np.full(len(req_ids), token_id, np.int32),
                      np.frombuffer(b"".join(pieces), np.uint8), np.cumsum([len(p) for p in pieces]))


def finish(server: DaemonServer, req_ids: list[int]) -> None:
    server.on_events([OutputEvent(r, "", np.zeros(0, np.int32), finish_reason="length") for r in req_ids])


async def eventually(check: Callable[[], bool]) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def read_all(stream: AsyncStream) -> str:
    return "".join([delta.text async for delta in stream])


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 20))


def test_many_streams_share_one_connection_and_each_gets_its_own_tokens() -> None:
    async def test() -> None:
        async with daemon() as (server, backend, path), AsyncClient(path, multiplex=True) as client:
            streams = await started(client, backend, server, 3)
            assert len(server.connections) == 1
            readers = [asyncio.ensure_future(read_all(s)) for s in streams]
            for token_id in range(5):
                server.on_events([step([0, 1, 2], token_id)])
                await asyncio.sleep(0.001)
            finish(server, [0, 1, 2])
            texts = await asyncio.gather(*readers)
            assert texts == ["".join(f"{r}:{t} " for t in range(5)) for r in range(3)]
            assert [s.completion.token_ids for s in streams] == [list(range(5))] * 3
            assert [s.finish_reason for s in streams] == ["length"] * 3
            generated = asyncio.ensure_future(client.generate([5, 6]))  # a unary call shares it too
            await eventually(lambda: len(backend.submitted) == 4)
            server.on_events([OutputEvent(3, "hi", np.array([9], np.int32), prompt_token_ids=np.array([5], np.int32),
                                          finish_reason="stop")])
            assert (await generated).text == "hi" and len(server.connections) == 1
    run(test)


def test_an_abort_and_a_close_of_one_stream_leave_the_others_running() -> None:
    async def test() -> None:
        async with daemon() as (server, backend, path), AsyncClient(path, multiplex=True) as client:
            aborted, closed, running = await started(client, backend, server, 3)
            server.on_events([step([0, 1, 2], 7)])
            assert await aborted.abort() is True
            with pytest.raises(RequestAborted):
                await read_all(aborted)
            closed.close()  # as leaving its loop early: the daemon aborts that request only
            await eventually(lambda: backend.aborted == [0, 1])
            reader = asyncio.ensure_future(read_all(running))
            server.on_events([step([2], 8)])
            finish(server, [2])
            assert await reader == "2:7 2:8 " and running.finish_reason == "length"
            assert client.running_request_ids() == []
    run(test)


def test_a_slow_reader_holds_one_merged_delta_and_does_not_stall_the_others() -> None:
    async def test() -> None:
        async with daemon() as (server, backend, path), AsyncClient(path, multiplex=True) as client:
            slow, fast = await started(client, backend, server, 2)
            deltas = aiter(fast)
            for token_id in range(50):
                server.on_events([step([0, 1], token_id)])
                assert (await anext(deltas)).token_ids == [token_id]  # the fast one is answered every step
            finish(server, [0, 1])
            assert [d async for d in deltas] == []
            channel = slow._connection
            assert isinstance(channel, Channel) and channel.num_unread == 2  # one merged delta, then Done
            pieces = [d async for d in slow]
            assert len(pieces) == 1 and pieces[0].token_ids == list(range(50))
            assert pieces[0].text == "".join(f"0:{t} " for t in range(50)) and slow.finish_reason == "length"
    run(test)


def test_a_dropped_connection_ends_every_stream_on_it() -> None:
    async def test() -> None:
        async with daemon() as (server, backend, path), AsyncClient(path, multiplex=True) as client:
            streams = await started(client, backend, server, 2)
            readers = [asyncio.ensure_future(read_all(s)) for s in streams]
            await asyncio.sleep(0.01)
            for connection in list(server.connections):
                connection.abort()
            for reader in readers:
                with pytest.raises(ConnectionLost):
                    await reader
            again = client.stream([5, 6])  # a new stream opens a new connection
            await again.start()
            await eventually(lambda: len(server.connections) == 1)
    run(test)


def sent_kinds(server: DaemonServer) -> list[str]:
    """Records the type of every message the daemon sends on its connections, from now on."""
    kinds: list[str] = []
    for connection in server.connections:
        send = connection.send
        connection.send = lambda message, send=send: (kinds.append(type(message).__name__), send(message))[1]
    return kinds


def test_a_step_of_many_streams_is_one_deltas_frame_and_mixed_ends_reach_each_stream() -> None:
    async def test() -> None:
        async with daemon() as (server, backend, path), AsyncClient(path, multiplex=True) as client:
            streams = await started(client, backend, server, 4)
            kinds = sent_kinds(server)
            readers = [asyncio.ensure_future(read_all(s)) for s in streams]
            server.on_events([step([0, 1, 2, 3], 1)])
            server.on_events([step([3, 0, 1, 2], 2),  # in one batch of events: ends of each kind
                              OutputEvent(0, "", np.zeros(0, np.int32), finish_reason="stop", stop_reason=7),
                              OutputEvent(1, "", np.zeros(0, np.int32), error_code="stage_failed",
                                          error_message="boom"),
                              OutputEvent(2, "", np.zeros(0, np.int32), finish_reason="abort")])
            server.on_events([step([3], 3)])
            finish(server, [3])
            results = await asyncio.gather(*readers, return_exceptions=True)
            assert results[0] == "0:1 0:2 " and streams[0].finish_reason == "stop"
            assert streams[0].completion.stop_reason == 7 and streams[0].completion.token_ids == [1, 2]
            assert isinstance(results[1], PipelineError) and "boom" in str(results[1])
            assert isinstance(results[2], RequestAborted)
            assert results[3] == "3:1 3:2 3:3 " and streams[3].completion.token_ids == [1, 2, 3]
            assert kinds == ["Deltas", "Deltas", "Done", "Error", "Error", "Delta", "Done"]  # one row: a Delta
    run(test)


def test_an_older_client_and_a_daemon_without_deltas_frames_get_a_frame_per_delta() -> None:
    async def test() -> None:
        async with daemon() as (server, backend, path):
            async with AsyncClient(path) as client:  # a connection per request asks for no Deltas frames
                streams = await started(client, backend, server, 2)
                kinds = sent_kinds(server)
                readers = [asyncio.ensure_future(read_all(s)) for s in streams]
                server.on_events([step([0, 1], 4)])
                finish(server, [0, 1])
                assert await asyncio.gather(*readers) == ["0:4 ", "1:4 "]
                assert sorted(kinds) == ["Delta", "Delta", "Done", "Done"]
            health = server.health
            server.health = lambda: msgspec.structs.replace(health(), delta_frames=False)  # as an older daemon
            async with AsyncClient(path, multiplex=True) as client:
                streams = await started(client, backend, server, 2)
                kinds = sent_kinds(server)
                readers = [asyncio.ensure_future(read_all(s)) for s in streams]
                server.on_events([step([2, 3], 5)])
                finish(server, [2, 3])
                assert await asyncio.gather(*readers) == ["2:5 ", "3:5 "]
                assert kinds == ["Delta", "Delta", "Done", "Done"]
    run(test)


def test_two_connections_interleaved_in_a_batch_each_get_their_rows_whole() -> None:
    async def test() -> None:
        async with daemon() as (server, backend, path), AsyncClient(path, multiplex=True) as a, \
                AsyncClient(path, multiplex=True) as b:
            streams = await started(a, backend, server, 2) + await started(b, backend, server, 2)
            readers = [asyncio.ensure_future(read_all(s)) for s in streams]
            rows = [2, 0, 3, 1]  # b, a, b, a
            pieces = [f"é{r}€".encode() for r in rows]  # multi-byte text: offsets count characters
            server.on_events([TokenTexts(np.array(rows, np.int64), np.array([20, 21, 0, 30, 31, 10, 11], np.int32),
                                         np.frombuffer(b"".join(pieces), np.uint8),
                                         np.cumsum([len(p) for p in pieces]), np.array([2, 3, 5, 7]))])
            finish(server, [0, 1, 2, 3])
            assert await asyncio.gather(*readers) == ["é0€", "é1€", "é2€", "é3€"]
            assert [s.completion.token_ids for s in streams] == [[0], [10, 11], [20, 21], [30, 31]]
    run(test)
