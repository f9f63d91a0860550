"""Client library for the daemon's Unix socket: `Client` (blocking) and `AsyncClient` (asyncio).

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

Sampling params are validated here (by building `SamplingParams`) before anything is sent.
"""
from __future__ import annotations

import asyncio
import dataclasses
import select
import socket as socket_module
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from pipeline.errors import ConnectionLost, DaemonNotRunning, ErrorCode, InvalidRequest, ProtocolError, error_from_wire
from pipeline.paths import default_socket_path
from pipeline.protocol import (
    Abort,
    Aborted,
    Accepted,
    Delta,
    Done,
    Error,
    FrameDecoder,
    Generate,
    Health,
    HealthReply,
    Profile,
    ProfileReply,
    ServerMessage,
    Stats,
    StatsReply,
    TokenLogprobs,
    Usage,
    WireSamplingParams,
    encode_frame,
)
from pipeline.sampling_params import MAX_TOKEN_ID, InvalidParams, SamplingParams

RECV_BYTES = 64 * 1024
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))

Prompt = str | list[int]
Params = SamplingParams | dict[str, Any] | None
T = TypeVar("T")
C = TypeVar("C")


@dataclass(slots=True)
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" or "length"
    prompt_token_ids: list[int]
    usage: Usage  # prompt_tokens, completion_tokens
    logprobs: list[TokenLogprobs] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


@dataclass(slots=True)
class StreamDelta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None


def make_generate(prompt: Prompt, params: Params, stream: bool) -> Generate:
    """The Generate message; InvalidRequest (naming the field) before anything is sent."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt", "must not be empty")
    elif isinstance(prompt, list):
        if not prompt:
            raise InvalidRequest("prompt", "must not be empty")
        for token_id in prompt:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id <= MAX_TOKEN_ID:
                raise InvalidRequest("prompt", f"token ids must be integers in [0, {MAX_TOKEN_ID}], got {token_id!r}")
    else:
        raise InvalidRequest("prompt", f"must be a str or a list of token ids, got {type(prompt).__name__}")
    try:
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            unknown = sorted(set(params) - _SAMPLING_FIELDS)
            if unknown:
                raise InvalidRequest(unknown[0], f"not a sampling parameter (known: {', '.join(sorted(_SAMPLING_FIELDS))})")
            params = SamplingParams(**params)
        elif isinstance(params, SamplingParams):
            params.validate()  # it may have been changed since it was made
        else:
            raise InvalidRequest("params", f"must be SamplingParams, a dict or None, got {type(params).__name__}")
    except InvalidRequest:
        raise
    except InvalidParams as exc:
        raise InvalidRequest.from_invalid_params(exc) from None
    return Generate(prompt=prompt, params=WireSamplingParams.from_params(params), stream=stream)


class RequestReplies:
    """Follows the replies to one Generate: the same logic for the blocking and asyncio clients."""

    __slots__ = ("request_id", "done", "completion", "_texts", "_token_ids", "_logprobs")

    def __init__(self) -> None:
        self.request_id: str | None = None
        self.done = False
        self.completion: Completion | None = None
        self._texts: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprobs] = []

    def result(self) -> Completion:
        if self.completion is None:
            raise ProtocolError(f"request {self.request_id} has no Done reply yet")
        return self.completion

    def on_message(self, message: ServerMessage) -> StreamDelta | None:
        """A delta to yield, or None; raises the request's error when the daemon reports one."""
        if isinstance(message, Error):
            self.done = True
            raise error_from_wire(message.code, message.message, message.field, message.request_id or self.request_id)
        if isinstance(message, Accepted) and self.request_id is None:
            self.request_id = message.request_id
            return None
        if isinstance(message, Delta) and message.request_id == self.request_id:
            self._texts.append(message.text)
            self._token_ids.extend(message.token_ids)
            if message.logprobs:
                self._logprobs.extend(message.logprobs)
            return StreamDelta(message.text, message.token_ids, message.logprobs)
        if isinstance(message, Done) and message.request_id == self.request_id:
            self.done = True
            streamed = message.text is None
            self.completion = Completion(
                request_id=message.request_id,
                text="".join(self._texts) if streamed else message.text,
                token_ids=self._token_ids if streamed else list(message.token_ids or []),
                finish_reason=message.finish_reason,
                prompt_token_ids=message.prompt_token_ids,
                usage=message.usage,
                logprobs=(self._logprobs or None) if streamed else message.logprobs,
                stop_reason=message.stop_reason,
            )
            return None
        raise ProtocolError(f"unexpected {type(message).__name__} for request {self.request_id}")


def _profile_message(action: str, directory: str | Path | None) -> Profile:
    if action not in ("start", "stop"):
        raise InvalidRequest("action", f"must be 'start' or 'stop', got {action!r}")
    return Profile(action, None if directory is None else str(directory))


def _unary_reply(message: ServerMessage, expected: type) -> Any:
    if isinstance(message, Error):
        raise error_from_wire(message.code, message.message, message.field, message.request_id)
    if not isinstance(message, expected):
        raise ProtocolError(f"expected {expected.__name__}, got {type(message).__name__}")
    return message


class _Inbox:
    """What one connection received and its owner has not taken yet, sorted: the verdict on the
    pending Abort goes to the caller that sent it, everything else waits in order for the
    request's reader. The daemon answers an Abort with Error(aborted) (the request's end, which
    its reader must see too) and then Aborted, or with Error(not_found). The verdict is taken
    from the first of these, since a stream closes its connection as soon as it has ended."""

    __slots__ = ("messages", "abort_due", "abort_result")

    def __init__(self) -> None:
        self.messages: deque[ServerMessage] = deque()
        self.abort_due: str | None = None  # the request id of the Abort awaiting its verdict
        self.abort_result: bool | None = None  # True: aborted; False: not_found

    def expect_abort_reply(self, request_id: str) -> None:
        self.abort_due = request_id
        self.abort_result = None

    def put(self, message: ServerMessage) -> None:
        if isinstance(message, Aborted):  # only ever a reply to an Abort: no request reader wants it
            if message.request_id == self.abort_due:
                self.abort_result, self.abort_due = True, None
            return
        if isinstance(message, Error) and message.request_id is not None and message.request_id == self.abort_due:
            if message.code == ErrorCode.NOT_FOUND.value:
                self.abort_result, self.abort_due = False, None
                return
            if message.code == ErrorCode.ABORTED.value:
                self.abort_result, self.abort_due = True, None
        self.messages.append(message)

    def next_message(self) -> ServerMessage | None:
        return self.messages.popleft() if self.messages else None


# --- blocking ---


class Connection:
    """One blocking connection to the daemon, sending and receiving whole messages.

    Safe for two threads at once, as `abort` needs: one waiting for its request's replies and
    one aborting that request. Sends are serialised; one thread at a time reads the socket and
    files each message in the inbox, where the thread it belongs to takes it.
    """

    def __init__(self, socket_path: Path, timeout_s: float | None) -> None:
        self._sock = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(str(socket_path))
        except (FileNotFoundError, ConnectionRefusedError):
            self._sock.close()
            raise DaemonNotRunning(socket_path) from None
        except BaseException:
            self._sock.close()
            raise
        self._decoder: FrameDecoder[ServerMessage] = FrameDecoder(ServerMessage)
        self._send_lock = threading.Lock()
        self._abort_lock = threading.Lock()  # one Abort in flight per connection
        self._state = threading.Condition()  # guards _inbox and _reading
        self._inbox = _Inbox()
        self._reading = False  # a thread is reading the socket and will file what it gets
        self.closed = False

    def is_usable(self) -> bool:
        """False once the daemon has closed its end (it restarted, say) or we closed ours."""
        if self.closed:
            return False
        with self._state:
            if self._inbox.abort_due is not None:
                return True  # what is readable may be that reply, which the abort caller awaits
        # Idle, nothing may be unread: readable means end of file, or bytes nobody asked for.
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        return not poller.poll(0)

    def send(self, message: Any) -> None:
        frame = encode_frame(message)
        with self._send_lock:
            self._sock.sendall(frame)

    def receive(self) -> ServerMessage:
        """The next message for this connection's request (an Abort's reply goes to `abort`)."""
        return self._wait_for(self._inbox.next_message)

    def abort(self, request_id: str) -> bool:
        """Sends Abort for a request running on this connection and waits for the verdict: True
        if the daemon aborted it, False if it was no longer running (or this end was closed)."""
        with self._abort_lock:
            with self._state:
                self._inbox.expect_abort_reply(request_id)
            try:
                self.send(Abort(request_id))
                return self._wait_for(lambda: self._inbox.abort_result)
            except (ConnectionLost, OSError):
                if self.closed:  # closed here meanwhile, which aborts the request just the same
                    return False
                raise

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:  # wakes a thread blocked reading this socket, which close alone would not
                self._sock.shutdown(socket_module.SHUT_RDWR)
            except OSError:
                pass  # not connected any more
            self._sock.close()

    def _wait_for(self, take: Callable[[], T | None]) -> T:
        """What `take` returns once it is not None, reading the socket while no other thread does."""
        with self._state:
            while (item := take()) is None:
                if self._reading:
                    self._state.wait()
                    continue
                self._reading = True
                self._state.release()
                try:
                    message = self._read_message()
                finally:
                    self._state.acquire()
                    self._reading = False
                    self._state.notify_all()
                self._inbox.put(message)
            return item

    def _read_message(self) -> ServerMessage:
        while (message := self._decoder.next_message()) is None:
            data = self._sock.recv(RECV_BYTES)
            if not data:
                raise ConnectionLost("the daemon closed the connection before replying")
            self._decoder.feed(data)
        return message


class _RunningRequests(Generic[C]):
    """The connection of each request a client has running, by request id: where its Abort goes.

    Connections are held weakly, so a stream dropped without closing still closes its socket
    (and so aborts its request) when it is collected.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._connections: weakref.WeakValueDictionary[str, C] = weakref.WeakValueDictionary()

    def add(self, request_id: str, connection: C) -> None:
        with self._lock:
            self._connections[request_id] = connection

    def discard(self, request_id: str | None) -> None:
        if request_id is not None:
            with self._lock:
                self._connections.pop(request_id, None)

    def get(self, request_id: str) -> C | None:
        with self._lock:
            return self._connections.get(request_id)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._connections)


class _StreamResult:
    """What a finished stream tells, sync or async: the completion and its finish reason."""

    _replies: RequestReplies

    @property
    def completion(self) -> Completion | None:
        return self._replies.completion

    @property
    def finish_reason(self) -> str | None:
        return None if self._replies.completion is None else self._replies.completion.finish_reason


class Stream(_StreamResult):
    """A streaming request: iterate for `StreamDelta`s; afterwards `finish_reason` and `completion`.

    Made by `Client.stream`, which has already sent the request (so `request_id` is known, and
    a request the daemon refuses raises there). Leaving the loop early aborts the request, and
    so does `abort()`, from any thread: the loop then raises RequestAborted.
    """

    def __init__(self, connection: Connection, replies: RequestReplies,
                 running: _RunningRequests[Connection]) -> None:
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
        self._running: _RunningRequests[Connection] = _RunningRequests()

    def generate(self, prompt: Prompt, params: Params = None) -> Completion:
        generate = make_generate(prompt, params, stream=False)
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
        generate = make_generate(prompt, params, stream=True)
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
        return _unary_reply(self._round_trip(Health()), HealthReply)

    def stats(self) -> StatsReply:
        return _unary_reply(self._round_trip(Stats()), StatsReply)

    def profile(self, action: str, directory: str | Path | None = None) -> list[str]:
        """Starts (into `directory`) or stops a torch.profiler capture in every stage; a stop returns
        the Chrome-trace files written. See `Profile`; tools/profile.py is the command for it."""
        return _unary_reply(self._round_trip(_profile_message(action, directory)), ProfileReply).paths

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


# --- asyncio ---


class AsyncConnection:
    """One asyncio connection to the daemon, sending and receiving whole messages.

    Like `Connection`, two tasks may use it at once (one waiting for its request's replies, one
    aborting that request): one task at a time reads, and files each message for its owner.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._decoder: FrameDecoder[ServerMessage] = FrameDecoder(ServerMessage)
        self._inbox = _Inbox()
        self._reading = False
        self._num_waiting = 0
        self._changed = asyncio.Event()  # set (and replaced) after each message is filed
        self._abort_lock = asyncio.Lock()

    @classmethod
    async def open(cls, socket_path: Path) -> AsyncConnection:
        try:
            reader, writer = await asyncio.open_unix_connection(str(socket_path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise DaemonNotRunning(socket_path) from None
        return cls(reader, writer)

    @property
    def closed(self) -> bool:
        return self._writer.is_closing()

    async def send(self, message: Any) -> None:
        self._writer.write(encode_frame(message))  # one whole frame per write: never interleaved
        await self._writer.drain()

    async def receive(self) -> ServerMessage:
        return await self._wait_for(self._inbox.next_message)

    async def round_trip(self, message: Any) -> ServerMessage:
        try:
            await self.send(message)
            return await self.receive()
        finally:
            self.close()

    async def abort(self, request_id: str) -> bool:
        """As `Connection.abort`."""
        async with self._abort_lock:
            self._inbox.expect_abort_reply(request_id)
            try:
                await self.send(Abort(request_id))
                return await self._wait_for(lambda: self._inbox.abort_result)
            except (ConnectionLost, OSError):
                if self.closed:
                    return False
                raise

    def close(self) -> None:
        """Synchronous, so `finally` blocks and generator finalisers can abort with it."""
        if not self._writer.is_closing():
            self._writer.close()

    async def _wait_for(self, take: Callable[[], T | None]) -> T:
        while (item := take()) is None:
            if self._reading:
                self._num_waiting += 1
                try:
                    await self._changed.wait()
                finally:
                    self._num_waiting -= 1
                continue
            self._reading = True
            try:
                self._inbox.put(await self._read_message())
            finally:
                self._reading = False
                if self._num_waiting:
                    changed, self._changed = self._changed, asyncio.Event()
                    changed.set()
        return item

    async def _read_message(self) -> ServerMessage:
        while (message := self._decoder.next_message()) is None:
            data = await self._reader.read(RECV_BYTES)
            if not data:
                raise ConnectionLost("the daemon closed the connection before replying")
            self._decoder.feed(data)
        return message


class AsyncStream(_StreamResult):
    """`async for delta in client.stream(...)`, or `async with client.stream(...) as s`.

    The request is sent on first use (entering `async with`, or the first iteration).
    `await abort()` (from any task) aborts it; the loop then raises RequestAborted.
    """

    def __init__(self, client: AsyncClient, generate: Generate) -> None:
        self._client = client
        self._generate = generate
        self._connection: AsyncConnection | None = None
        self._replies = RequestReplies()

    @property
    def request_id(self) -> str | None:
        return self._replies.request_id

    async def start(self) -> None:
        """Sends the request and waits for the daemon to accept it (raises if it refuses)."""
        if self._connection is not None:
            return
        self._connection = await AsyncConnection.open(self._client.socket_path)
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
    """asyncio client: each call or stream has its own connection, so calls may run concurrently."""

    def __init__(self, socket: str | Path | None = None) -> None:
        self.socket_path = Path(socket) if socket is not None else default_socket_path()
        self._streams: weakref.WeakSet[AsyncStream] = weakref.WeakSet()
        self._running: _RunningRequests[AsyncConnection] = _RunningRequests()

    async def generate(self, prompt: Prompt, params: Params = None) -> Completion:
        generate = make_generate(prompt, params, stream=False)
        connection = await AsyncConnection.open(self.socket_path)
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
        return _unary_reply(await connection.round_trip(Health()), HealthReply)

    async def stats(self) -> StatsReply:
        connection = await AsyncConnection.open(self.socket_path)
        return _unary_reply(await connection.round_trip(Stats()), StatsReply)

    async def profile(self, action: str, directory: str | Path | None = None) -> list[str]:
        """Starts (into `directory`) or stops a torch.profiler capture in every stage (see Client.profile)."""
        message = _profile_message(action, directory)
        connection = await AsyncConnection.open(self.socket_path)
        return _unary_reply(await connection.round_trip(message), ProfileReply).paths

    async def close(self) -> None:
        """Closes every open stream, aborting their requests."""
        for stream in list(self._streams):
            stream.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
