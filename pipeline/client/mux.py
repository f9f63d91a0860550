"""Many requests over one asyncio connection to the daemon: `SharedConnection` reads the socket in
one task, a whole buffer at a time, and files each reply with its request's `Channel`.

The daemon serves any number of requests on one connection and writes a step's replies for all
of them at once, so a client with hundreds of streams reads one socket instead of hundreds.
A `Channel` offers what a request needs of a connection (send its Generate, receive its replies,
abort it, close it), as `AsyncConnection` does, so `AsyncClient(multiplex=True)` uses it in
place of a connection of its own.

Routing: the daemon answers Generates in the order they were sent (`Accepted`, or an `Error`
without a request id), so the channels awaiting their answer wait in a queue; after that,
replies go by request id. Closing a channel aborts its request if it is still running (as
closing a connection of its own would) and drops whatever comes for it later.

Batched deltas: on opening, the connection asks the daemon's health; a daemon that reads
`delta_frames` gets Generates that ask for them, and a step's deltas for every stream then come
in one `Deltas` frame, split here into each request's `Delta` (protocol.py). An older daemon
gets plain Generates and sends a frame per delta; both kinds are read.

Nothing waits on a slow reader: the reading task never blocks on a channel, and the deltas a
channel's reader has not taken yet are merged into one (text and tokens appended), so what one
stream holds unread is at most its own output, in one delta, and the other streams flow on.
The daemon's limit on unread bytes (`max_unread_bytes`) then bounds the socket itself, since this
end reads it whole as fast as it comes.

A channel lives until it is closed (a stream's loop ending closes it; `AsyncClient.close` closes
the shared connection, which aborts everything on it): a stream dropped unread without a close
keeps its request running until then, where a connection of its own would close when collected.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from pipeline.client.connection import BATCH_RECV_BYTES, RECV_BYTES, _Inbox, abort_with_inbox, open_unix_streams
from pipeline.errors import ConnectionLost, ErrorCode
from pipeline.protocol import (
    Abort, Accepted, Delta, Deltas, Done, Error, FrameDecoder, Generate, Health, HealthReply, ServerMessage, encode_frame,
)

T = TypeVar("T")


class Channel:
    """One request's share of a `SharedConnection`: the part of `AsyncConnection` a request uses."""

    def __init__(self, shared: SharedConnection) -> None:
        self._shared = shared
        self._inbox = _Inbox()
        self._changed = asyncio.Event()
        self._abort_lock = asyncio.Lock()
        self._lost: ConnectionLost | None = None
        self.request_id: str | None = None  # set once the daemon has accepted the request
        self.finished = False  # its Done or Error has come
        self.released = False

    @property
    def closed(self) -> bool:
        return self.released or self._shared.closed

    @property
    def num_unread(self) -> int:
        """Messages filed here and not yet received."""
        return len(self._inbox.messages)

    async def send(self, message: Any) -> None:
        await self._shared.send(message, self)

    async def receive(self) -> ServerMessage:
        return await self._wait_for(self._inbox.next_message)

    async def abort(self, request_id: str) -> bool:
        """As `AsyncConnection.abort`."""
        return await abort_with_inbox(self, self._inbox, self._abort_lock, request_id)

    def close(self) -> None:
        """Lets go of the request, aborting it if it still runs. Synchronous, as `AsyncConnection.close`."""
        if not self.released:
            self.released = True
            self._shared.release(self)
            self._changed.set()

    def put(self, message: ServerMessage) -> None:
        """Files a reply (the reading task calls this); unread deltas merge into one."""
        messages = self._inbox.messages
        if type(message) is Delta and messages and type(messages[-1]) is Delta:
            last = messages[-1]
            last.text += message.text
            last.token_ids = last.token_ids + message.token_ids
            if message.logprobs:
                last.logprobs = (last.logprobs or []) + message.logprobs
        else:
            self._inbox.put(message)
        if type(message) is Done or (type(message) is Error and message.code != ErrorCode.NOT_FOUND.value):
            self.finished = True
        self._changed.set()

    def lose(self, error: ConnectionLost) -> None:
        self._lost = error
        self._changed.set()

    async def _wait_for(self, take: Callable[[], T | None]) -> T:
        while (item := take()) is None:
            if self._lost is not None:
                raise self._lost
            if self.released:
                raise ConnectionLost("the request's channel was closed")
            self._changed.clear()
            await self._changed.wait()
        return item


class SharedConnection:
    """One asyncio connection carrying the requests of many `Channel`s."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 decoder: FrameDecoder[ServerMessage] | None = None, delta_frames: bool = False) -> None:
        """`decoder` holds what was read before (the health reply's frame); with `delta_frames`
        the Generates sent here ask for `Deltas` frames."""
        self._reader = reader
        self._writer = writer
        self._decoder: FrameDecoder[ServerMessage] = decoder or FrameDecoder(ServerMessage)
        self.delta_frames = delta_frames
        self._router = ReplyRouter(self._abort_quietly)
        self._task = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def open(cls, socket_path: Path) -> SharedConnection:
        """Connects, and asks the daemon's health to learn whether it sends `Deltas` frames."""
        reader, writer = await open_unix_streams(socket_path)
        decoder: FrameDecoder[ServerMessage] = FrameDecoder(ServerMessage)
        try:
            writer.write(encode_frame(Health()))
            while (reply := decoder.next_message()) is None:
                data = await reader.read(RECV_BYTES)
                if not data:
                    raise ConnectionLost("the daemon closed the connection")
                decoder.feed(data)
        except BaseException:
            writer.close()
            raise
        return cls(reader, writer, decoder, type(reply) is HealthReply and reply.delta_frames)

    @property
    def closed(self) -> bool:
        return self._writer.is_closing() or self._task.done()

    @property
    def num_channels(self) -> int:
        return self._router.num_ends

    def channel(self) -> Channel:
        return Channel(self)

    async def send(self, message: Any, channel: Channel) -> None:
        if self.closed:
            raise ConnectionLost("the connection to the daemon is closed")
        if isinstance(message, Generate):
            message.delta_frames = self.delta_frames
            self._router.expect([channel])  # before the write: the answer comes in this order
        self._writer.write(encode_frame(message))  # one whole frame per write: never interleaved
        await self._writer.drain()

    def send_all(self, generates: list[Generate], channels: list[RequestEnd]) -> None:
        """Sends many Generates in one write, `channels[i]` awaiting the answer to `generates[i]`
        (any `RequestEnd`)."""
        if self.closed:
            raise ConnectionLost("the connection to the daemon is closed")
        self._router.expect(channels)
        for generate in generates:
            generate.delta_frames = self.delta_frames
        self._writer.write(b"".join(encode_frame(generate) for generate in generates))

    def release(self, channel: Channel) -> None:
        """`channel` is closed: abort its request if it runs; what comes for it later is dropped."""
        self._router.release(channel)

    def close(self) -> None:
        """Closes the socket, which aborts every request still running on it."""
        if not self._writer.is_closing():
            self._writer.close()
        self._task.cancel()
        self._router.lose_all(ConnectionLost("the connection to the daemon was closed"))

    def _abort_quietly(self, request_id: str) -> None:
        if not self._writer.is_closing():
            self._writer.write(encode_frame(Abort(request_id)))  # its replies are dropped

    async def _read(self) -> None:
        try:
            while True:
                data = await self._reader.read(BATCH_RECV_BYTES)
                if not data:
                    raise ConnectionLost("the daemon closed the connection")
                self._decoder.feed(data)
                while messages := self._decoder.messages():
                    self._router.file_all(messages)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every request on the connection hears of it
            self._router.lose_all(exc if isinstance(exc, ConnectionLost) else ConnectionLost(str(exc)))
            if not self._writer.is_closing():
                self._writer.close()


class RequestEnd(Protocol):
    """What the router files replies with: a `Channel`, or a request of a batch (batches.py)."""

    request_id: str | None
    released: bool
    finished: bool  # its Done or Error has come

    def put(self, message: ServerMessage) -> None: ...

    def lose(self, error: ConnectionLost) -> None: ...


class ReplyRouter:
    """Files each reply of a connection carrying many requests with its request's end.

    The daemon answers Generates in the order they were sent (`Accepted`, or an `Error` without
    a request id), so the ends awaiting their answer wait in a queue; after that, replies go by
    request id, and a `Deltas` frame is split into each request's `Delta`. `abort(request_id)`
    sends an Abort without waiting; a released end's request is aborted and its replies dropped.
    """

    def __init__(self, abort: Callable[[str], None]) -> None:
        self._abort = abort
        self._accepting: list[RequestEnd] = []  # sent a Generate, awaiting its answer; oldest first
        self._ends: dict[str, RequestEnd] = {}  # by request id, from its Accepted until it is released

    @property
    def num_ends(self) -> int:
        return len(self._ends) + len(self._accepting)

    def expect(self, ends: list[RequestEnd]) -> None:
        """`ends[i]` awaits the answer to the i-th Generate sent from now on."""
        self._accepting.extend(ends)

    def release(self, end: RequestEnd) -> None:
        request_id = end.request_id
        if request_id is None or self._ends.get(request_id) is not end:
            return  # not accepted yet: its Accepted, when it comes, gets the abort
        del self._ends[request_id]
        if not end.finished:
            self._abort(request_id)

    def file_all(self, messages: list[ServerMessage]) -> None:
        for message in messages:
            if type(message) is Deltas:
                for delta in message.split():
                    self.file(delta)
            else:
                self.file(message)

    def file(self, message: ServerMessage) -> None:
        if type(message) is Delta:  # nearly every message
            end = self._ends.get(message.request_id)
            if end is not None:
                end.put(message)
            return
        request_id = getattr(message, "request_id", None)
        if type(message) is Accepted or (type(message) is Error and request_id is None):
            if not self._accepting:
                raise ConnectionLost(f"the daemon sent {type(message).__name__} for no request")
            end = self._accepting.pop(0)
            if type(message) is Accepted:
                end.request_id = message.request_id
                if end.released:
                    self._abort(message.request_id)
                    return
                self._ends[message.request_id] = end
            end.put(message)
            return
        end = self._ends.get(request_id) if request_id is not None else None
        if end is not None:
            end.put(message)

    def lose_all(self, error: ConnectionLost) -> None:
        for end in [*self._accepting, *self._ends.values()]:
            end.lose(error)
