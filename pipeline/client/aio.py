"""The asyncio client: `AsyncClient`, and `AsyncStream` for a streamed request."""
from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator
from pathlib import Path

from pipeline.client.batches import BatchRequest, StreamBatches
from pipeline.client.connection import AsyncConnection
from pipeline.client.mux import Channel, SharedConnection
from pipeline.client.replies import (
    Completion,
    Params,
    Prompt,
    RequestReplies,
    RunningRequests,
    StreamDelta,
    make_generate,
    make_stream_generates,
    profile_message,
    unary_reply,
)
from pipeline.client.sync import StreamResult
from pipeline.paths import default_socket_path
from pipeline.protocol import Generate, Health, HealthReply, ProfileReply, Stats, StatsReply


class AsyncStream(StreamResult):
    """`async for delta in client.stream(...)`, or `async with client.stream(...) as s`.

    The request is sent on first use (entering `async with`, or the first iteration).
    `await abort()` (from any task) aborts it; the loop then raises RequestAborted.
    """

    def __init__(self, client: AsyncClient, generate: Generate) -> None:
        self._client = client
        self._generate = generate
        self._connection: AsyncConnection | Channel | None = None
        self._replies = RequestReplies()

    @property
    def request_id(self) -> str | None:
        return self._replies.request_id

    async def start(self) -> None:
        """Sends the request and waits for the daemon to accept it (raises if it refuses)."""
        if self._connection is not None:
            return
        self._connection = await self._client._open()
        self._client._streams.add(self)
        try:
            await self._connection.send(self._generate)
            while self._replies.request_id is None:
                self._replies.on_message(await self._connection.receive())
        except BaseException:
            self.close()
            raise
        self._client._running.add(self._replies.request_id, self._connection)

    def __aiter__(self) -> AsyncIterator[StreamDelta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[StreamDelta]:
        # An async generator: when a loop breaks out, asyncio finalises it, running `finally`.
        try:
            await self.start()
            connection = self._connection
            if connection is None:
                return
            while not self._replies.done:
                delta = self._replies.on_message(await connection.receive())
                if delta is not None:
                    yield delta
        finally:
            self.close()

    async def abort(self) -> bool:
        """Aborts the request (see `AsyncClient.abort`); False if it is not running."""
        if self._connection is None or self._replies.done or self._replies.request_id is None:
            return False
        return await self._connection.abort(self._replies.request_id)

    def close(self) -> None:
        """Closes the stream's connection, which aborts the request if it is still running."""
        self._client._running.discard(self._replies.request_id)
        if self._connection is not None:
            self._connection.close()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> AsyncStream:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


class AsyncClient:
    """asyncio client: each call or stream has its own connection, so calls may run concurrently.

    With `multiplex=True` every `generate` and `stream` shares one connection instead (mux.py):
    one socket and one read per batch of replies however many streams run, and a stream whose
    reader is slow holds only its own unread output, merged into one delta.
    """

    def __init__(self, socket: str | Path | None = None, *, multiplex: bool = False) -> None:
        self.socket_path = Path(socket) if socket is not None else default_socket_path()
        self.multiplex = multiplex
        self._streams: weakref.WeakSet[AsyncStream] = weakref.WeakSet()
        self._running: RunningRequests[AsyncConnection | Channel | BatchRequest] = RunningRequests()
        self._shared: SharedConnection | None = None
        self._opening = asyncio.Lock()

    async def _open(self) -> AsyncConnection | Channel:
        """A request's connection: its own, or its channel of the shared one."""
        if not self.multiplex:
            return await AsyncConnection.open(self.socket_path)
        return (await self._shared_connection()).channel()

    async def _shared_connection(self) -> SharedConnection:
        """The connection that multiplexed requests share, opened on first use (and after a loss)."""
        async with self._opening:  # many tasks starting at once open one socket, not one each
            if self._shared is None or self._shared.closed:
                self._shared = await SharedConnection.open(self.socket_path)
            return self._shared

    async def generate(self, prompt: Prompt, params: Params = None) -> Completion:
        generate = make_generate(prompt, params, stream=False)
        connection = await self._open()
        replies = RequestReplies()
        try:
            await connection.send(generate)
            while replies.request_id is None:
                replies.on_message(await connection.receive())
            self._running.add(replies.request_id, connection)  # abort() may come from another task now
            while not replies.done:
                replies.on_message(await connection.receive())
        finally:  # also on cancellation: closing aborts a request nobody waits for
            self._running.discard(replies.request_id)
            connection.close()
        return replies.result()

    def stream(self, prompt: Prompt, params: Params = None) -> AsyncStream:
        """Validates now; sends on first use (see AsyncStream)."""
        return AsyncStream(self, make_generate(prompt, params, stream=True))

    def stream_batches(self, prompts: list[Prompt], params: Params | list[Params] = None) -> StreamBatches:
        """Streams one request per prompt (validated now, sent on first use; `params` for all, or
        a list of one per prompt) on the shared connection, read as one batch of `(index,
        StreamDelta)` per socket read: one wake-up per read for all of them, where `stream` costs
        one per stream (see batches.py)."""
        return StreamBatches(self._shared_connection, self._running, make_stream_generates(prompts, params))

    async def abort(self, request_id: str) -> bool:
        """As `Client.abort`: True once the daemon has aborted one of this client's running
        requests (its stream or generate then raises RequestAborted); False if this client has
        none by that id (a client can abort only its own requests)."""
        connection = self._running.get(request_id)
        if connection is None:
            return False
        return await connection.abort(request_id)

    def running_request_ids(self) -> list[str]:
        """Ids of this client's requests that the daemon has accepted and not yet finished."""
        return self._running.ids()

    async def health(self) -> HealthReply:
        connection = await AsyncConnection.open(self.socket_path)
        return unary_reply(await connection.round_trip(Health()), HealthReply)

    async def stats(self) -> StatsReply:
        connection = await AsyncConnection.open(self.socket_path)
        return unary_reply(await connection.round_trip(Stats()), StatsReply)

    async def profile(self, action: str, directory: str | Path | None = None) -> list[str]:
        """Starts (into `directory`) or stops a torch.profiler capture in every stage (see Client.profile)."""
        message = profile_message(action, directory)
        connection = await AsyncConnection.open(self.socket_path)
        return unary_reply(await connection.round_trip(message), ProfileReply).paths

    async def close(self) -> None:
        """Closes every open stream, aborting their requests."""
        for stream in list(self._streams):
            stream.close()
        if self._shared is not None:
            self._shared.close()
            self._shared = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
