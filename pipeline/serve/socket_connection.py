"""One client connection on the daemon's Unix socket: frames in, messages out, never awaiting.

Replies are gathered and written once per turn of the event loop (DaemonServer.flush_later): a
step's deltas for every request of a connection leave in one write, however many streams it
carries."""
from __future__ import annotations

import asyncio
import logging

from pipeline.errors import ProtocolError
from pipeline.protocol import ClientMessage, Delta, FrameDecoder, ServerMessage, encode_frame, error_for
from pipeline.serve.requests import Request
from pipeline.serve.server import DaemonServer

log = logging.getLogger("pipeline.serve")


class SocketConnection(asyncio.Protocol):
    """One client connection: decodes its frames, sends replies without ever awaiting."""

    def __init__(self, server: DaemonServer) -> None:
        self._server = server
        self._decoder: FrameDecoder[ClientMessage] = FrameDecoder(ClientMessage)
        self.transport: asyncio.Transport | None = None
        self.requests: dict[str, Request] = {}  # this connection's running requests by public id
        self._frames: list[bytes] = []  # encoded replies not yet written: `flush` writes them

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            self._decoder.feed(data)
            while (message := self._decoder.next_message()) is not None:
                self._server.handle(self, message)
        except ProtocolError as exc:
            self.send(error_for(exc))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.drop_connection(self)

    def send(self, message: ServerMessage) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        try:
            frame = encode_frame(message)
        except ProtocolError as exc:  # a reply over the frame limit: report it instead
            frame = encode_frame(error_for(exc, getattr(message, "request_id", None)))
        if not self._frames:
            self._server.flush_later(self)
        self._frames.append(frame)

    def send_text(self, request_id: str, text: str, token_ids: list[int]) -> None:
        self.send(Delta(request_id, text, token_ids))

    def flush(self) -> None:
        """Writes the replies gathered since the last flush, in one write."""
        frames, self._frames = self._frames, []
        transport = self.transport
        if not frames or transport is None or transport.is_closing():
            return
        transport.write(frames[0] if len(frames) == 1 else b"".join(frames))
        if transport.get_write_buffer_size() > self._server.max_unread_bytes:
            log.warning("dropping a client that left %d bytes unread", transport.get_write_buffer_size())
            transport.abort()

    def close(self) -> None:
        if self.transport is not None:
            self.flush()
            self.transport.close()  # flushes what is buffered, then connection_lost runs

    def abort(self) -> None:
        self._frames.clear()
        if self.transport is not None:
            self.transport.abort()  # drops what is buffered
