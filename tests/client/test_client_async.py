"""The asyncio AsyncClient against the FakeDaemon test double."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from fake_daemon import FakeDaemon

from pipeline.client import AsyncClient
from pipeline.errors import DaemonNotRunning, InvalidRequest, Overloaded, PromptTooLong, RequestAborted
from pipeline.protocol import Abort, Generate

pytestmark = pytest.mark.timeout(20)

ENDLESS = {"max_tokens": 10**9}


def test_generate_and_stream(daemon: FakeDaemon) -> None:
    async def main() -> None:
        client = AsyncClient(daemon.socket_path)
        completion = await client.generate("async 中文", {"max_tokens": 100})
        assert (completion.text, completion.finish_reason) == ("async 中文", "stop")
        stream = client.stream([0, 1, 2], {"max_tokens": 2})
        deltas = [delta async for delta in stream]
        assert "".join(d.text for d in deltas) == "ab"
        assert stream.finish_reason == "length"
        assert stream.completion is not None and stream.completion.token_ids == [0, 1]
        assert (await client.health()).status == "ok"
        assert (await client.stats()).num_running_requests == 0

    asyncio.run(main())


def test_concurrent_requests(daemon: FakeDaemon) -> None:
    async def main() -> list[str]:
        client = AsyncClient(daemon.socket_path)
        completions = await asyncio.gather(*(client.generate(f"req {i}") for i in range(20)))
        return [c.text for c in completions]

    assert asyncio.run(main()) == [f"req {i}" for i in range(20)]


def test_breaking_out_of_an_async_stream_aborts_the_request(daemon: FakeDaemon) -> None:
    async def main() -> None:
        stream = AsyncClient(daemon.socket_path).stream("endless", ENDLESS)
        count = 0
        async for _ in stream:
            count += 1
            if count == 3:
                break
        # asyncio finalises the abandoned generator, which closes the connection, while this
        # loop still runs (not only when asyncio.run shuts down).
        aborted = await asyncio.to_thread(daemon.wait_until, lambda d: stream.request_id in d.aborted_by_disconnect)
        assert aborted

    asyncio.run(main())


def test_closing_the_async_client_and_cancelling_abort(daemon: FakeDaemon) -> None:
    async def main() -> None:
        client = AsyncClient(daemon.socket_path)
        stream = client.stream("endless", ENDLESS)
        await stream.start()
        await client.close()
        aborted = await asyncio.to_thread(daemon.wait_until, lambda d: stream.request_id in d.aborted_by_disconnect)
        assert aborted
        # A cancelled generate closes its connection too.
        task = asyncio.ensure_future(client.generate("endless", ENDLESS))
        await asyncio.to_thread(daemon.wait_until, lambda d: len(d.messages_of(Generate)) == 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        aborted = await asyncio.to_thread(daemon.wait_until, lambda d: len(d.aborted_by_disconnect) == 2)
        assert aborted
        assert not daemon.finished

    asyncio.run(main())


def test_async_errors(daemon: FakeDaemon, socket_dir: Path) -> None:
    async def main() -> None:
        client = AsyncClient(daemon.socket_path)
        with pytest.raises(Overloaded):
            await client.generate("error:overloaded")
        with pytest.raises(PromptTooLong):
            async for _ in client.stream("late-error:prompt_too_long"):
                pass
        with pytest.raises(InvalidRequest) as excinfo:
            client.stream("hi", {"top_k": -5})
        assert excinfo.value.field == "top_k"
        async with client.stream("endless", ENDLESS) as stream:
            assert stream.request_id is not None
            assert await client.abort(stream.request_id) is True
            with pytest.raises(RequestAborted):
                async for _ in stream:
                    pass
        assert await client.abort(stream.request_id) is False
        missing = socket_dir / "missing.sock"
        with pytest.raises(DaemonNotRunning, match=str(missing)):
            await AsyncClient(missing).health()

    asyncio.run(main())


def test_abort_by_id_from_another_task_ends_the_stream_with_request_aborted(daemon: FakeDaemon) -> None:
    async def main() -> None:
        client = AsyncClient(daemon.socket_path)
        other = AsyncClient(daemon.socket_path)
        stream = client.stream("endless", ENDLESS)
        first_delta = asyncio.Event()

        async def read_all() -> int:
            count = 0
            async for _ in stream:
                count += 1
                first_delta.set()
            return count

        reader = asyncio.ensure_future(read_all())
        await first_delta.wait()
        assert stream.request_id is not None
        assert client.running_request_ids() == [stream.request_id]
        assert await other.abort(stream.request_id) is False  # not its request: nothing is sent
        assert await client.abort(stream.request_id) is True  # while the reader task reads on
        with pytest.raises(RequestAborted):
            await reader
        assert daemon.aborted_by_message == {stream.request_id}
        assert client.running_request_ids() == []
        assert await client.abort(stream.request_id) is False

    asyncio.run(main())
    assert len(daemon.messages_of(Abort)) == 1


def test_abort_of_a_generate_waiting_in_another_task_and_stream_abort(daemon: FakeDaemon) -> None:
    async def main() -> None:
        client = AsyncClient(daemon.socket_path)
        task = asyncio.ensure_future(client.generate("endless", ENDLESS))  # never answered
        while not client.running_request_ids():
            await asyncio.sleep(0.001)
        [request_id] = client.running_request_ids()
        assert await client.abort(request_id) is True
        with pytest.raises(RequestAborted):
            await task
        # AsyncStream.abort from the task that owns the stream, before reading anything.
        async with client.stream("endless", ENDLESS) as stream:
            assert await stream.abort() is True
            with pytest.raises(RequestAborted):
                async for delta in stream:
                    assert delta.text == "e"
            assert await stream.abort() is False
        assert daemon.aborted_by_message == {request_id, stream.request_id}
        assert not daemon.aborted_by_disconnect

    asyncio.run(main())
