"""The little of ASGI the API needs: a request's method, path, headers and body; a whole response or
a stream of frames; routes by path and method.

uvicorn parses HTTP; this layer only routes and moves bytes, so a streamed chunk costs one
`send` and nothing else (a framework's middleware wraps every `send` of every chunk). On
uvicorn's httptools server a stream may also write body bytes straight to the connection
(`direct_body_writer`), with no coroutine per write.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


async def until_disconnect(receive: Receive, then: Callable[[], None]) -> None:
    """Once the body has been read, the next message is the client going away: then `then` runs."""
    while (await receive())["type"] != "http.disconnect":
        pass
    then()


class BodyTooLarge(Exception):
    def __init__(self, num_bytes: int) -> None:
        super().__init__(num_bytes)
        self.num_bytes = num_bytes


class ClientGone(Exception):
    """The client closed the connection before sending the whole body."""


@dataclass(slots=True)
class HttpRequest:
    method: str
    path: str
    headers: dict[str, str]  # names lower-cased
    receive: Receive

    @classmethod
    def from_scope(cls, scope: Scope, receive: Receive) -> HttpRequest:
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        return cls(scope["method"], scope["path"], headers, receive)

    async def body(self, max_bytes: int) -> bytes:
        """The whole body; BodyTooLarge past `max_bytes`, ClientGone if the client left."""
        declared = self.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            raise BodyTooLarge(int(declared))
        chunks, size = [], 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > max_bytes:
                raise BodyTooLarge(size)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


@dataclass(slots=True)
class Response:
    body: bytes
    status: int = 200
    content_type: str = "application/json"

    async def __call__(self, send: Send, receive: Receive) -> None:
        await send({"type": "http.response.start", "status": self.status,
                    "headers": [(b"content-type", self.content_type.encode()),
                                (b"content-length", str(len(self.body)).encode())]})
        await send({"type": "http.response.body", "body": self.body})


@dataclass(slots=True)
class StreamResponse:
    """`frames` sent as they come (chunked); when the client goes away, `on_disconnect` runs and
    the stream is closed."""

    frames: AsyncIterator[bytes]
    on_disconnect: Callable[[], None]
    content_type: str = "text/event-stream"
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    # Called once the head is sent, with `direct_body_writer(send)`: body bytes may go that way
    # too, as long as they never overtake the frames still to come from `frames`.
    on_started: Callable[[DirectWriter | None], None] | None = None

    async def __call__(self, send: Send, receive: Receive) -> None:
        watcher = asyncio.ensure_future(until_disconnect(receive, self.on_disconnect))
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", self.content_type.encode()), *self.headers]})
            if self.on_started is not None:
                self.on_started(direct_body_writer(send))
            async for frames in self.frames:
                await send({"type": "http.response.body", "body": frames, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            watcher.cancel()
            await self.frames.aclose()


class DirectWriter:
    """For a chunked response on uvicorn's httptools server: writes body bytes to the connection
    as `send` would, framed as one chunk, without a coroutine (`writer(body)`). It writes nothing
    and returns False when the client is gone, the response has ended, or the connection's buffer
    is full (`send` would wait): the caller then goes through `send`. A caller that writes many
    connections at once may ask `ready()` first, then write `chunk(body)` with `write_chunk`."""

    __slots__ = ("_cycle", "_flow", "write_chunk")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle
        self._flow = cycle.flow
        self.write_chunk: Callable[[bytes], object] = cycle.transport.write

    def ready(self) -> bool:
        cycle = self._cycle
        return not (cycle.disconnected or cycle.response_complete or self._flow.write_paused)

    def __call__(self, body: bytes) -> bool:
        if not self.ready():
            return False
        self.write_chunk(chunk(body))
        return True


def chunk(body: bytes) -> bytes:
    """`body` framed as one chunk of a chunked HTTP/1.1 body: its head, itself, CHUNK_END."""
    return b"%x\r\n%b\r\n" % (len(body), body)


CHUNK_END = b"\r\n"
NUM_CHUNK_HEADS = 4096
CHUNK_HEADS = [b"%x\r\n" % size for size in range(NUM_CHUNK_HEADS)]  # a chunk's head by its body's size, made once


def direct_body_writer(send: Send) -> DirectWriter | None:
    """The connection's DirectWriter when `send` is uvicorn's httptools server's for a chunked
    response; None on any other server."""
    cycle = getattr(send, "__self__", None)
    if type(cycle).__module__ != "uvicorn.protocols.http.httptools_impl" or cycle.chunked_encoding is not True:
        return None
    return DirectWriter(cycle)


Handler = Callable[[HttpRequest], Awaitable[Response | StreamResponse]]


class Router:
    """An ASGI app: each (path, method) to its handler; `fallback(request, status)` answers an
    unknown path (404) or method (405)."""

    def __init__(self, routes: dict[tuple[str, str], Handler],
                 fallback: Callable[[HttpRequest, int], Response]) -> None:
        self._routes = routes
        self._paths = {path for path, _ in routes}
        self._fallback = fallback

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        request = HttpRequest.from_scope(scope, receive)
        handler = self._routes.get((request.path, request.method))
        if handler is None:
            response: Response | StreamResponse = self._fallback(request, 405 if request.path in self._paths else 404)
        else:
            response = await handler(request)
        await response(send, receive)
