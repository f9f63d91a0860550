"""FakeDaemon: a test double of the daemon's socket side, speaking the real wire protocol.

It has no model. A text prompt is echoed back one character per token (token id = code
point); a token-id prompt is echoed as its ids, with text chr(ord("a") + id % 26). max_tokens
cuts the echo short (finish "length"). Special prompts:
- "error:<code>": an Error with that code before Accepted (field "temperature" for invalid_params);
- "late-error:<code>": Accepted, one Delta, then an Error with that code;
- "endless": streams until max_tokens, which tests set huge; the socket's backpressure keeps it
  running until the client aborts or disconnects (not streamed, it never replies);
- "garbage": Accepted, then bytes that are not a frame.
An Abort counts only on the connection that made the request, as in the daemon: it gets
Error(aborted) for the request, then Aborted; any other id gets Error(not_found).
It records what clients did, so tests can wait for an abort to arrive.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

from pipeline.errors import ErrorCode, ProtocolError
from pipeline.protocol import (
    Abort,
    Aborted,
    Accepted,
    ClientMessage,
    Delta,
    Done,
    Error,
    FrameDecoder,
    Generate,
    Health,
    HealthReply,
    Stats,
    StatsReply,
    Usage,
    encode_frame,
    error_for,
    new_request_id,
)
from stages.contracts.params import InvalidParams


class FakeDaemon:
    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.received: list[ClientMessage] = []
        self.aborted_by_message: set[str] = set()  # running requests an Abort stopped
        self.aborted_by_disconnect: set[str] = set()  # running requests whose connection closed
        self.finished: set[str] = set()
        self._changed = threading.Condition()
        self._running: dict[str, tuple[asyncio.Task[None], asyncio.StreamWriter]] = {}
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-daemon", daemon=True)
        self._server: asyncio.AbstractServer | None = None

    def start(self) -> FakeDaemon:
        if not self._thread.is_alive():
            self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout=10)
        return self

    def stop(self) -> None:
        """Stops listening and drops every connection (the socket file is removed)."""
        asyncio.run_coroutine_threadsafe(self._close_server(), self._loop).result(timeout=10)

    def shutdown(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def wait_until(self, condition: Callable[[FakeDaemon], bool], timeout_s: float = 10.0) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: condition(self), timeout=timeout_s)

    def messages_of(self, kind: type) -> list[ClientMessage]:
        with self._changed:
            return [m for m in self.received if isinstance(m, kind)]

    def _record(self, update: Callable[[], None]) -> None:
        with self._changed:
            update()
            self._changed.notify_all()

    async def _listen(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.socket_path))

    async def _close_server(self) -> None:
        if self._server is not None:
            self._server.close()
            for task, _ in list(self._running.values()):
                task.cancel()
            for writer in list(self._writers):
                writer.close()
            await self._server.wait_closed()
            self._server = None
        self.socket_path.unlink(missing_ok=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder: FrameDecoder[ClientMessage] = FrameDecoder(ClientMessage)
        mine: set[str] = set()  # requests started on this connection
        self._writers.add(writer)
        try:
            while data := await reader.read(65536):
                try:
                    decoder.feed(data)
                    while (message := decoder.next_message()) is not None:
                        self._record(lambda m=message: self.received.append(m))
                        await self._handle(message, writer, mine)
                except ProtocolError as exc:
                    writer.write(encode_frame(error_for(exc)))
                    return
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            for request_id in list(mine):
                entry = self._running.pop(request_id, None)
                if entry is not None:
                    entry[0].cancel()
                    self._record(lambda r=request_id: self.aborted_by_disconnect.add(r))
            self._writers.discard(writer)
            writer.close()

    async def _handle(self, message: ClientMessage, writer: asyncio.StreamWriter, mine: set[str]) -> None:
        if isinstance(message, Generate):
            request_id = new_request_id()
            mine.add(request_id)
            task = asyncio.ensure_future(self._generate(request_id, message, writer))
            self._running[request_id] = (task, writer)
            task.add_done_callback(lambda _, r=request_id: self._running.pop(r, None))
        elif isinstance(message, Abort):
            # Like the daemon: only the connection that made a request may abort it.
            entry = self._running.get(message.request_id) if message.request_id in mine else None
            if entry is None:
                reply = Error(ErrorCode.NOT_FOUND.value, f"no running request {message.request_id} on this connection",
                              None, message.request_id)
                await self._send(writer, reply)
                return
            del self._running[message.request_id]
            entry[0].cancel()
            self._record(lambda: self.aborted_by_message.add(message.request_id))
            await self._send(writer, Error(ErrorCode.ABORTED.value, "aborted by the client", None, message.request_id))
            await self._send(writer, Aborted(message.request_id))
        elif isinstance(message, Health):
            await self._send(writer, HealthReply("ok", "fake", 1.5, {"scheduler": "running"}))
        elif isinstance(message, Stats):
            await self._send(writer, StatsReply(num_running_requests=len(self._running), model="fake", vocab_size=1024,
                                                max_model_len=2048, special_token_ids=[0, 1]))

    async def _generate(self, request_id: str, message: Generate, writer: asyncio.StreamWriter) -> None:
        try:
            await self._reply(request_id, message, writer)
        except ConnectionError:
            pass  # the client went away; _serve records the abort

    async def _reply(self, request_id: str, message: Generate, writer: asyncio.StreamWriter) -> None:
        prompt = message.prompt
        try:
            params = message.params.to_params()
        except InvalidParams as exc:
            await self._send(writer, error_for(exc))
            return
        if isinstance(prompt, str) and prompt.startswith("error:"):
            code = prompt.removeprefix("error:")
            field = "temperature" if code == ErrorCode.INVALID_PARAMS.value else None
            await self._send(writer, Error(code, f"fake {code}", field, None))
            return
        await self._send(writer, Accepted(request_id))
        if isinstance(prompt, str) and prompt.startswith("late-error:"):
            await self._send(writer, Delta(request_id, "x", [120]))
            await self._send(writer, Error(prompt.removeprefix("late-error:"), "fake late error", None, request_id))
            return
        if prompt == "garbage":
            writer.write(b"\x00\x00\x00\x03\xc1\xc1\xc1")  # 0xc1 is never valid msgpack
            await writer.drain()
            return
        if isinstance(prompt, str):
            prompt_ids = [ord(c) for c in prompt]
            out_ids, out_text = prompt_ids, list(prompt)
        else:
            prompt_ids = list(prompt)
            out_ids, out_text = prompt_ids, [chr(ord("a") + i % 26) for i in prompt_ids]
        if prompt == "endless" and not message.stream:
            await asyncio.Future()  # runs until aborted: a non-streamed endless reply never comes
        if prompt == "endless":
            num_tokens = params.max_tokens
            tokens = ((101, "e") for _ in range(num_tokens))
            finish_reason = "length"
        else:
            num_tokens = min(len(out_ids), params.max_tokens)
            tokens = zip(out_ids[:num_tokens], out_text[:num_tokens])
            finish_reason = "length" if num_tokens < len(out_ids) else "stop"
        if message.stream:
            for token_id, text in tokens:
                await self._send(writer, Delta(request_id, text, [token_id]))
        done = Done(
            request_id,
            finish_reason,
            prompt_ids,
            Usage(len(prompt_ids), num_tokens),
            text=None if message.stream else "".join(out_text[:num_tokens]),
            token_ids=None if message.stream else out_ids[:num_tokens],
        )
        await self._send(writer, done)
        self._record(lambda: self.finished.add(request_id))

    async def _send(self, writer: asyncio.StreamWriter, message: object) -> None:
        """Raises ConnectionError once the client has gone, which ends a generating task."""
        if writer.is_closing():
            raise ConnectionResetError("client connection closed")
        writer.write(encode_frame(message))  # type: ignore[arg-type]
        await writer.drain()
