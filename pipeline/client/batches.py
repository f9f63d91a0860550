"""Many streamed requests read as one batch of deltas per socket read: `StreamBatches`.

`AsyncStream` hands each stream's deltas to its own task, which costs an asyncio wake-up per
stream per step; with hundreds of streams that wake-up is most of a client's CPU. Here the
requests share the client's multiplexed connection (mux.py) and its reading task files every
reply in one list, so the consumer wakes once per read and takes what came for all of them:

    async with client.stream_batches(prompts, params) as batches:
        async for batch in batches:          # [(index, StreamDelta), ...] in arrival order
            ...
        batches.results()                    # per prompt: its Completion, or the error it ended with

The blocking `Client.stream_batches` is the same with `with` and `for`; its requests share a
connection of their own.

`index` is the prompt's position in `prompts`. A request that ends with an error (aborted, say)
ends alone: the others go on and `results()` holds its error. A lost connection ends all of them
(the loop raises ConnectionLost). Leaving the loop or the `async with` early aborts every request
still running. Nothing waits on a slow consumer: unread replies wait in the list, and the
daemon's limit on unread bytes bounds the socket, as for `AsyncClient(multiplex=True)`.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

from pipeline.client.connection import Connection
from pipeline.client.mux import ReplyRouter, SharedConnection
from pipeline.client.replies import Completion, RequestReplies, RunningRequests, StreamDelta
from pipeline.errors import ConnectionLost, ErrorCode, PipelineError
from pipeline.protocol import Abort, Aborted, Done, Error, Generate, Health, HealthReply, ServerMessage


DeltaBatch = list[tuple[int, StreamDelta]]


class BatchRequest:
    """One request of a batch of streams, as the connection's `ReplyRouter` sees it."""

    __slots__ = ("_batches", "index", "replies", "request_id", "finished", "released", "outcome",
                 "__weakref__")  # the client's table of running requests holds it weakly

    def __init__(self, batches: BatchReplies, index: int) -> None:
        self._batches = batches
        self.index = index
        self.replies = RequestReplies()
        self.request_id: str | None = None  # the shared connection sets it from Accepted
        self.finished = False  # its Done or Error has come
        self.released = False
        self.outcome: Completion | PipelineError | None = None

    def put(self, message: ServerMessage) -> None:
        kind = type(message)
        if kind is Aborted or (kind is Error and message.code == ErrorCode.NOT_FOUND.value
                               and message.request_id is not None):
            return  # the verdict on an Abort: the request's own end (Error(aborted) or Done) says it
        if kind is Done or kind is Error:
            self.finished = True
        self._batches._filed.append((self, message))
        self._batches._wake()

    def lose(self, error: ConnectionLost) -> None:
        self._batches._lost = error
        self._batches._wake()

    async def abort(self, request_id: str) -> bool:
        """For `AsyncClient.abort`: True once the Abort is sent (see `StreamBatches.abort`)."""
        return request_id == self.request_id and await self._batches.abort(self.index)


class BatchReplies:
    """What a batch of streams makes of its replies, blocking or asyncio: each request's
    `RequestReplies`, the replies filed and not yet taken, and each prompt's outcome."""

    def __init__(self, generates: list[Generate]) -> None:
        self._generates = generates
        self._members = [BatchRequest(self, index) for index in range(len(generates))]
        self._filed: list[tuple[BatchRequest, ServerMessage]] = []  # replies not yet taken, oldest first
        self._lost: ConnectionLost | None = None
        self._num_running = 0
        self._started = False
        self._carried: DeltaBatch = []  # deltas that came while others still awaited their answer

    @property
    def request_ids(self) -> list[str | None]:
        """Each prompt's request id once the daemon has accepted it (None before, or if it refused)."""
        return [member.replies.request_id for member in self._members]

    def results(self) -> list[Completion | PipelineError | None]:
        """Per prompt: its Completion, the error it ended with, or None while it runs."""
        return [member.outcome for member in self._members]

    def _wake(self) -> None:
        """A reply was filed (or the connection lost): the asyncio reader waits for this."""

    def _release(self, member: BatchRequest) -> None:
        """Lets go of `member`'s request on the connection, aborting it if it still runs."""
        raise NotImplementedError

    def _take(self) -> DeltaBatch:
        """The deltas of every reply filed so far; a request's end is recorded in its outcome."""
        filed, self._filed = self._filed, []
        batch: DeltaBatch = []
        for member, message in filed:
            if member.outcome is not None:
                continue
            try:
                delta = member.replies.on_message(message)
            except PipelineError as exc:
                self._end(member, exc)
                continue
            if delta is not None:
                batch.append((member.index, delta))
            elif member.replies.done:
                self._end(member, member.replies.result())
        return batch

    def _end(self, member: BatchRequest, outcome: Completion | PipelineError) -> None:
        member.outcome = outcome
        self._num_running -= 1
        self._ended(member)
        if not member.released:
            member.released = True
            self._release(member)

    def _ended(self, member: BatchRequest) -> None:
        """`member`'s request has ended (its outcome is set)."""


class StreamBatches(BatchReplies):
    """Streams one request per prompt on the client's shared connection; `async for` yields a
    list of `(index, StreamDelta)` per read of the socket. See the module's note."""

    def __init__(self, shared_connection: Callable[[], Awaitable[SharedConnection]], running: RunningRequests,
                 generates: list[Generate]) -> None:
        """`shared_connection` opens (or gives) the client's multiplexed connection; each accepted
        request is registered in the client's `running` requests, so `AsyncClient.abort` finds it."""
        super().__init__(generates)
        self._shared_connection = shared_connection
        self._running = running
        self._changed = asyncio.Event()
        self._shared: SharedConnection | None = None

    async def start(self) -> None:
        """Sends every request in one write and waits until the daemon has answered each (a
        refused request ends at once, its error in `results()`)."""
        if self._started:
            return
        self._started = True
        self._shared = await self._shared_connection()
        self._shared.send_all(self._generates, self._members)
        self._num_running = len(self._members)
        pending = list(self._members)
        while pending:
            await self._wait()
            self._carried += self._take()
            pending = [member for member in pending if member.replies.request_id is None and member.outcome is None]
        for member in self._members:
            if member.outcome is None:
                self._running.add(member.replies.request_id, member)

    def __aiter__(self) -> AsyncIterator[DeltaBatch]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[DeltaBatch]:
        try:
            await self.start()
            carried, self._carried = self._carried + self._take(), []
            if carried:
                yield carried
            while self._num_running:
                await self._wait()
                batch = self._take()
                if batch:
                    yield batch
        finally:
            self.close()

    async def abort(self, index: int) -> bool:
        """Asks the daemon to abort prompt `index`'s request; False if it is not running. Its end
        comes through the loop: `results()[index]` becomes RequestAborted (or its Completion, if
        it finished first)."""
        member = self._members[index]
        if self._shared is None or member.outcome is not None or member.request_id is None or member.released:
            return False
        await self._shared.send(Abort(member.request_id), member)
        return True

    def close(self) -> None:
        """Lets go of every request, aborting those still running. Synchronous."""
        for member in self._members:
            if not member.released:
                member.released = True
                self._running.discard(member.replies.request_id)
                self._release(member)

    async def __aenter__(self) -> StreamBatches:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def _wake(self) -> None:
        self._changed.set()

    def _release(self, member: BatchRequest) -> None:
        if self._shared is not None:
            self._shared.release(member)

    def _ended(self, member: BatchRequest) -> None:
        self._running.discard(member.replies.request_id)

    async def _wait(self) -> None:
        while not self._filed:
            if self._lost is not None:
                raise self._lost
            self._changed.clear()
            await self._changed.wait()


class BlockingStreamBatches(BatchReplies):
    """The blocking client's `StreamBatches`: the requests share a connection of their own, and
    `for` yields a list of `(index, StreamDelta)` per read of the socket. A refused request ends
    alone at the start, as in `StreamBatches`; leaving the loop or the `with` early, or `close()`,
    closes the connection, which aborts every request still running. `abort(index)` may come
    from any thread. These requests are not in `Client.running_request_ids()`: `abort` here
    is how one of them is aborted."""

    def __init__(self, socket_path: Path, timeout_s: float | None, generates: list[Generate]) -> None:
        super().__init__(generates)
        self._socket_path = socket_path
        self._timeout_s = timeout_s
        self._connection: Connection | None = None
        self._router = ReplyRouter(self._abort_quietly)

    def start(self) -> None:
        """Connects, asks the daemon's health (whether it sends `Deltas` frames), sends every
        request in one write and waits until the daemon has answered each."""
        if self._started:
            return
        self._started = True
        self._connection = connection = Connection(self._socket_path, self._timeout_s)
        try:
            connection.send(Health())
            reply = connection.receive()
            delta_frames = type(reply) is HealthReply and reply.delta_frames
            for generate in self._generates:
                generate.delta_frames = delta_frames
            self._router.expect(self._members)
            connection.send_all(self._generates)
            self._num_running = len(self._members)
            pending = list(self._members)
            while pending:
                self._read()
                self._carried += self._take()
                pending = [member for member in pending
                           if member.replies.request_id is None and member.outcome is None]
        except BaseException:
            self.close()
            raise

    def __iter__(self) -> Iterator[DeltaBatch]:
        try:
            self.start()
            carried, self._carried = self._carried + self._take(), []
            if carried:
                yield carried
            while self._num_running:
                self._read()
                batch = self._take()
                if batch:
                    yield batch
        finally:
            self.close()

    def abort(self, index: int) -> bool:
        """Asks the daemon to abort prompt `index`'s request; False if it is not running. Its end
        comes through the loop: `results()[index]` becomes RequestAborted (or its Completion, if
        it finished first)."""
        member = self._members[index]
        connection = self._connection
        if connection is None or connection.closed or member.outcome is not None or member.request_id is None:
            return False
        connection.send(Abort(member.request_id))
        return True

    def close(self) -> None:
        """Closes the connection, which aborts every request still running."""
        for member in self._members:
            member.released = True
        if self._connection is not None:
            self._connection.close()

    def __enter__(self) -> BlockingStreamBatches:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _read(self) -> None:
        if self._connection is None:
            raise ConnectionLost("the batch of streams was not started")
        self._router.file_all(self._connection.receive_all())

    def _release(self, member: BatchRequest) -> None:
        self._router.release(member)

    def _abort_quietly(self, request_id: str) -> None:
        if self._connection is not None and not self._connection.closed:
            self._connection.send(Abort(request_id))
