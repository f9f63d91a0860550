"""The blocking client: `Client`, and `Stream` for a streamed request.

The client library for the daemon's Unix socket is `Client` (here) and `AsyncClient` (aio.py).

Connections: a `Client` keeps one connection for `generate`, `health` and `stats`; a call made
while another thread is using it opens a connection of its own for that call, and every
`stream` has its own connection. An `AsyncClient` opens one connection per call or stream.
One request is in flight per connection at a time, so its replies need no routing; only the
reply to an `Abort` is set aside for the caller that sent it.

A client can abort only its own requests, because the daemon honours an `Abort` only on the
connection that sent the request. So each client remembers the connection of every request it
has running (streams, and `generate` calls blocked in other threads or tasks), and `abort`
sends the Abort on that connection: the request then ends with `RequestAborted` where it is
being waited for. Any thread may call `abort` while another reads the same connection: writes
are serialised by a lock, and whichever caller is reading routes each reply to its owner.

Ending a request early in other ways (leaving a stream's `for` loop, `close()`, closing the
client, an exception or cancellation while waiting) closes the request's connection, and the
daemon aborts every request of a connection that closes.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.client.batches import BlockingStreamBatches
from pipeline.client.connection import Connection
from pipeline.client.replies import (
    Completion,
    Messages,
    Params,
    Prompt,
    RequestReplies,
    RunningRequests,
    StreamDelta,
    make_chat,
    make_generate,
    make_stream_generates,
    profile_message,
    unary_reply,
)
from pipeline.paths import default_socket_path
from pipeline.protocol import Chat, Generate, Health, HealthReply, ProfileReply, ServerMessage, Stats, StatsReply

class StreamResult:
    """What a finished stream tells, sync or async: the completion and its finish reason."""

    _replies: RequestReplies

    @property
    def completion(self) -> Completion | None:
        return self._replies.completion

    @property
    def finish_reason(self) -> str | None:
        return None if self._replies.completion is None else self._replies.completion.finish_reason


class Stream(StreamResult):
    """A streaming request: iterate for `StreamDelta`s; afterwards `finish_reason` and `completion`.

    Made by `Client.stream`, which has already sent the request (so `request_id` is known, and
    a request the daemon refuses raises there). Leaving the loop early aborts the request, and
    so does `abort()`, from any thread: the loop then raises RequestAborted.
    """

    def __init__(self, connection: Connection, replies: RequestReplies,
                 running: RunningRequests[Connection]) -> None:
        self._connection = connection
        self._replies = replies
        self._running = running

    @property
    def request_id(self) -> str:
        return str(self._replies.request_id)  # set before the Stream is made

    def __iter__(self) -> Iterator[StreamDelta]:
        try:
            while not self._replies.done:
                delta = self._replies.on_message(self._connection.receive())
                if delta is not None:
                    yield delta
        finally:
            self.close()

    def abort(self) -> bool:
        """Aborts the request, keeping the connection open so the loop sees RequestAborted;
        False if it had already ended."""
        if self._replies.done:
            return False
        return self._connection.abort(self.request_id)

    def close(self) -> None:
        """Closes the stream's connection, which aborts the request if it is still running."""
        self._running.discard(self._replies.request_id)
        self._connection.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Client:
    """Blocking client. `socket` defaults to `default_socket_path()`; `timeout_s` bounds each
    socket operation (None waits as long as generation takes)."""

    def __init__(self, socket: str | Path | None = None, *, timeout_s: float | None = None) -> None:
        self.socket_path = Path(socket) if socket is not None else default_socket_path()
        self._timeout_s = timeout_s
        self._connection: Connection | None = None
        self._lock = threading.Lock()
        self._streams: weakref.WeakSet[Stream] = weakref.WeakSet()
        self._running: RunningRequests[Connection] = RunningRequests()

    def generate(self, prompt: Prompt, params: Params = None) -> Completion:
        return self._call(make_generate(prompt, params, stream=False))

    def chat(self, messages: Messages, params: Params = None) -> Completion:
        """`generate` for a conversation, rendered by the daemon with the model's chat template
        (InvalidRequest for `messages` when the model has none: see `StatsReply.chat_template`)."""
        return self._call(make_chat(messages, params, stream=False))

    def _call(self, generate: Generate | Chat) -> Completion:
        with self._connection_for_call() as connection:
            replies = RequestReplies()
            try:
                connection.send(generate)
                while replies.request_id is None:
                    replies.on_message(connection.receive())
                self._running.add(replies.request_id, connection)  # abort() may come from another thread now
                while not replies.done:
                    replies.on_message(connection.receive())
            except BaseException:
                if not replies.done:  # interrupted or broken: closing aborts the request
                    connection.close()
                raise
            finally:
                self._running.discard(replies.request_id)
        return replies.result()

    def stream(self, prompt: Prompt, params: Params = None) -> Stream:
        return self._stream(make_generate(prompt, params, stream=True))

    def stream_chat(self, messages: Messages, params: Params = None) -> Stream:
        """`stream` for a conversation, rendered as `chat` renders it."""
        return self._stream(make_chat(messages, params, stream=True))

    def _stream(self, generate: Generate | Chat) -> Stream:
        connection = Connection(self.socket_path, self._timeout_s)
        replies = RequestReplies()
        try:
            connection.send(generate)
            while replies.request_id is None:
                replies.on_message(connection.receive())
        except BaseException:
            connection.close()
            raise
        stream = Stream(connection, replies, self._running)
        self._running.add(stream.request_id, connection)
        self._streams.add(stream)
        return stream

    def stream_batches(self, prompts: list[Prompt], params: Params | list[Params] = None) -> BlockingStreamBatches:
        """Streams one request per prompt (validated now, sent on first use; `params` for all, or
        a list of one per prompt) on a connection they share, read as one batch of `(index,
        StreamDelta)` per socket read, as `AsyncClient.stream_batches` (see batches.py)."""
        return BlockingStreamBatches(self.socket_path, self._timeout_s, make_stream_generates(prompts, params))

    def abort(self, request_id: str) -> bool:
        """Aborts one of this client's running requests (a stream, or a `generate` waiting in
        another thread), which then raises RequestAborted. True once the daemon has aborted it;
        False if this client has no running request by that id: it finished, or it is another
        client's (a client can abort only its own requests)."""
        connection = self._running.get(request_id)
        if connection is None:
            return False
        return connection.abort(request_id)

    def running_request_ids(self) -> list[str]:
        """Ids of this client's requests that the daemon has accepted and not yet finished."""
        return self._running.ids()

    def health(self) -> HealthReply:
        return unary_reply(self._round_trip(Health()), HealthReply)

    def stats(self) -> StatsReply:
        return unary_reply(self._round_trip(Stats()), StatsReply)

    def profile(self, action: str, directory: str | Path | None = None) -> list[str]:
        """Starts (into `directory`) or stops a torch.profiler capture in every stage; a stop returns
        the Chrome-trace files written. See `Profile`; tools/profiling/profile_daemon.py is the command
        for it."""
        return unary_reply(self._round_trip(profile_message(action, directory)), ProfileReply).paths

    def close(self) -> None:
        """Closes the connection and every open stream (aborting their requests)."""
        for stream in list(self._streams):
            stream.close()
        with self._lock:
            if self._connection is not None:
                self._connection.close()
                self._connection = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _round_trip(self, message: Any) -> ServerMessage:
        with self._connection_for_call() as connection:
            try:
                connection.send(message)
                return connection.receive()
            except BaseException:
                connection.close()
                raise

    def _connection_for_call(self) -> _Lease:
        """The client's connection if no other thread is using it, else a fresh one."""
        if self._lock.acquire(blocking=False):
            if self._connection is None or not self._connection.is_usable():
                if self._connection is not None:
                    self._connection.close()
                try:
                    self._connection = Connection(self.socket_path, self._timeout_s)
                except BaseException:
                    self._lock.release()
                    raise
            return _Lease(self._connection, self._lock)
        return _Lease(Connection(self.socket_path, self._timeout_s), None)


class _Lease:
    """Use of a connection for one call: releases the shared one, or closes a temporary one."""

    __slots__ = ("connection", "_lock")

    def __init__(self, connection: Connection, lock: threading.Lock | None) -> None:
        self.connection = connection
        self._lock = lock

    def __enter__(self) -> Connection:
        return self.connection

    def __exit__(self, *exc_info: object) -> None:
        if self._lock is None:
            self.connection.close()
        else:
            self._lock.release()
