"""`AsyncClient.stream_batches` (and the blocking `Client.stream_batches`) against the daemon's
socket server in this process with a fake backend: the same text and tokens as per-stream reads,
one request's abort or refusal ends it alone, leaving the loop aborts the rest, a dropped
connection ends the loop."""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from test_multiplexed_streams import WAIT_S, daemon, eventually, finish, read_all, run, sent_kinds, step

from pipeline.client import AsyncClient, Client, Completion
from pipeline.client.batches import StreamBatches
from pipeline.errors import ConnectionLost, Overloaded, PipelineError, RequestAborted
from pipeline.serve.server import DaemonServer
from stages.contracts.outputs import OutputEvent

pytestmark = pytest.mark.timeout(30)


def admit(server: DaemonServer, req_ids: list[int]) -> None:
    server.on_events([OutputEvent(r, "", np.zeros(0, np.int32), prompt_token_ids=np.array([5, 6], np.int32))
                      for r in req_ids])


def test_batches_carry_the_same_deltas_as_per_stream_reads() -> None:
    async def test() -> None:
        async with daemon() as (server, backend, path), AsyncClient(path, multiplex=True) as client:
            batches = client.stream_batches([[5, 6]] * 3, {"max_tokens": 100})
            await batches.start()
            assert len(server.connections) == 1 and len(batches.request_ids) == 3
            per_stream = client.stream([5, 6], {"max_tokens": 100})  # req 3, on the same connection
            await per_stream.start()
            admit(server, [0, 1, 2, 3])
            reader = asyncio.ensure_future(read_all(per_stream))
            texts, tokens, sizes = ["", "", ""], [[], [], []], []
            consumer = aiter(batches)
            for token_id in range(6):
                server.on_events([step([0, 1, 2, 3], token_id)])
                batch = await anext(consumer)
                sizes.append(len(batch))
                for index, delta in batch:
                    texts[index] += delta.text
                    tokens[index] += delta.token_ids
            finish(server, [0, 1, 2, 3])
            assert [batch async for batch in consumer] == []
            expected = [await reader] + texts
            assert expected == ["".join(f"{r}:{t} " for t in range(6)) for r in (3, 0, 1, 2)]
            assert tokens == [list(range(6))] * 3 and set(sizes) == {3}  # one batch per step, all rows
            results = batches.results()
            assert all(isinstance(r, Completion) and r.finish_reason == "length" for r in results)
            assert [r.text for r in results] == texts and [r.token_ids for r in results] == tokens
            assert per_stream.completion.token_ids == list(range(6)) and client.running_request_ids() == []
    run(test)


def test_an_aborted_request_ends_alone_and_leaving_the_loop_aborts_the_rest() -> None:
    async def test() -> None:
        async with daemon() as (server, backend, path), AsyncClient(path, multiplex=True) as client:
            async with client.stream_batches([[5, 6]] * 3, {"max_tokens": 100}) as batches:
                admit(server, [0, 1, 2])
                assert sorted(client.running_request_ids()) == sorted(batches.request_ids)
                consumer = aiter(batches)
                server.on_events([step([0, 1, 2], 7)])
                assert [i for i, _ in await anext(consumer)] == [0, 1, 2]
                assert await client.abort(batches.request_ids[1]) is True  # through the client, by id
                await eventually(lambda: backend.aborted == [1])
                server.on_events([step([0, 2], 8)])
                got: list[int] = []
                while 0 not in got:  # the abort's end and the next step may come in one read or two
                    got += [i for i, _ in await anext(consumer)]
                assert got == [0, 2]
                results = batches.results()
                assert isinstance(results[1], RequestAborted) and results[0] is None and results[2] is None
                assert await batches.abort(1) is False  # ended already
            await eventually(lambda: sorted(backend.aborted) == [0, 1, 2])  # leaving aborted the others
            assert client.running_request_ids() == []
            again = client.stream([5, 6])  # the shared connection still serves
            await again.start()
            assert len(server.connections) == 1
    run(test)


def test_a_refused_request_ends_alone() -> None:
    async def test() -> None:
        async with daemon() as (server, backend, path), AsyncClient(path) as client:
            server.max_in_flight_requests = 1  # the second Generate is refused as overloaded
            batches = client.stream_batches([[5, 6], [5, 6]], {"max_tokens": 100})
            await batches.start()
            assert batches.request_ids[1] is None and isinstance(batches.results()[1], Overloaded)
            admit(server, [0])
            server.on_events([step([0], 3)])
            finish(server, [0])
            assert [pair[0] async for batch in batches for pair in batch] == [0]
            assert batches.results()[0].text == "0:3 "
    run(test)


def test_a_dropped_connection_ends_the_loop() -> None:
    async def test() -> None:
        async with daemon() as (server, backend, path), AsyncClient(path) as client:
            batches = client.stream_batches([[5, 6]] * 2)
            await batches.start()
            admit(server, [0, 1])
            consumer = asyncio.ensure_future(read_batches(batches))
            await asyncio.sleep(0.01)
            for connection in list(server.connections):
                connection.abort()
            with pytest.raises(ConnectionLost):
                await consumer
            assert batches.results() == [None, None]
    run(test)


async def read_batches(batches: StreamBatches) -> int:
    return sum([len(batch) async for batch in batches])


def test_the_blocking_client_reads_batches_of_deltas_frames_and_one_abort_ends_one_request() -> None:
    async def test() -> None:
        async with daemon() as (server, backend, path):
            first_batch = threading.Event()

            def consume() -> tuple[list[str], list[Completion | PipelineError | None]]:
                texts = ["", "", ""]
                with Client(path, timeout_s=WAIT_S).stream_batches(
                        [[5, 6]] * 3, [{"max_tokens": 100}, {"max_tokens": 100, "seed": 1}, None]) as batches:
                    for batch in batches:
                        for index, delta in batch:
                            texts[index] += delta.text
                        if not first_batch.is_set():
                            assert batches.abort(1) is True
                            first_batch.set()
                    return texts, batches.results()

            consumer = asyncio.ensure_future(asyncio.to_thread(consume))
            await eventually(lambda: len(backend.submitted) == 3)
            admit(server, [0, 1, 2])
            kinds = sent_kinds(server)
            server.on_events([step([0, 1, 2], 0)])
            await eventually(lambda: backend.aborted == [1])
            assert first_batch.is_set()
            for token_id in (1, 2):
                server.on_events([step([0, 1, 2], token_id)])  # request 1's share goes nowhere now
            finish(server, [0, 2])
            texts, results = await consumer
            assert texts == ["0:0 0:1 0:2 ", "1:0 ", "2:0 2:1 2:2 "]
            assert isinstance(results[1], RequestAborted)
            assert [r.token_ids for r in (results[0], results[2])] == [[0, 1, 2], [0, 1, 2]]
            assert set(kinds) == {"Deltas", "Error", "Aborted", "Done"} and kinds.count("Deltas") == 3
    run(test)
