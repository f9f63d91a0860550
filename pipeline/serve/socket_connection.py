"""One client connection on the daemon's Unix socket: frames in, messages out, never awaiting.

Each client message becomes a call of the daemon server (`handle_message`), as each HTTP call
becomes one in openai/.

Replies are gathered and written once per turn of the event loop (DaemonServer.flush_later): a
step's deltas for every request of a connection leave in one write, however many streams it
carries."""
from __future__ import annotations

import asyncio
import logging

from pipeline.errors import PipelineError, ProtocolError
from pipeline.protocol import (Abort, Accepted, Chat, ClientMessage, Delta, FrameDecoder, Generate, Health, Profile,
                               ServerMessage, Stats, encode_frame, error_for)
from pipeline.serve.model import chat_prompt
from pipeline.serve.profile_control import answer_profile
from pipeline.serve.requests import Connection, Request
from pipeline.serve.server import DaemonServer
from stages.contracts.params import InvalidParams
from stages.grammar import check_guided

log = logging.getLogger("pipeline.serve")


def handle_message(server: DaemonServer, connection: Connection, message: ClientMessage) -> None:
    """Answers one client message: a Generate, or a Chat whose messages the model's chat template
    renders, starts a request (Accepted, or the Error that
    refused it), an Abort ends one of the connection's requests; Health, Stats and Profile get
    their replies."""
    if isinstance(message, (Generate, Chat)):
        _generate(server, connection, message)
    elif isinstance(message, Abort):
        server.abort_request(connection, message.request_id)
    elif isinstance(message, Health):
        connection.send(server.health())
    elif isinstance(message, Stats):
        connection.send(server.stats())
    elif isinstance(message, Profile):
        answer_profile(server.backend, message, connection.send)


def _generate(server: DaemonServer, connection: Connection, message: Generate | Chat) -> None:
    try:
        params = message.params.to_params()
        check_guided(params)
        prompt = message.prompt if isinstance(message, Generate) else chat_prompt(server.model, message.messages)
        request_id = server.start_request(connection, prompt, params, message.stream,
                                          delta_frames=message.delta_frames)
    except (PipelineError, InvalidParams) as exc:
        connection.send(error_for(exc))
        return
    connection.send(Accepted(request_id))


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
                handle_message(self._server, self, message)
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
