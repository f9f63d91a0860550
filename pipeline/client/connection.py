"""One connection to the daemon, blocking (`Connection`) or asyncio (`AsyncConnection`).

One request is in flight per connection at a time, so its replies need no routing; only the
reply to an `Abort` is set aside (`_Inbox`) for the caller that sent it. Two threads (or tasks)
may use a connection at once, as `abort` needs: one waiting for its request's replies and one
aborting that request.
"""
from __future__ import annotations

import asyncio
import select
import socket as socket_module
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from pipeline.errors import ConnectionLost, DaemonNotRunning, ErrorCode
from pipeline.protocol import Abort, Aborted, Error, FrameDecoder, ServerMessage, encode_frame

RECV_BYTES = 64 * 1024
BATCH_RECV_BYTES = 16 * RECV_BYTES  # one read takes a step's replies for many streams
T = TypeVar("T")


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


async def open_unix_streams(socket_path: Path) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """An asyncio connection to the daemon's socket; DaemonNotRunning if nothing listens there."""
    try:
        return await asyncio.open_unix_connection(str(socket_path))
    except (FileNotFoundError, ConnectionRefusedError):
        raise DaemonNotRunning(socket_path) from None


class _AsyncRequestEnd(Protocol):
    """What `abort_with_inbox` needs of an asyncio connection (or a channel of a shared one)."""

    @property
    def closed(self) -> bool: ...

    async def send(self, message: Any) -> None: ...

    async def _wait_for(self, take: Callable[[], T | None]) -> T: ...


async def abort_with_inbox(end: _AsyncRequestEnd, inbox: _Inbox, lock: asyncio.Lock, request_id: str) -> bool:
    """Sends Abort for `request_id` on `end` and waits for the verdict that `inbox` sets aside:
    True if the daemon aborted it, False if it was no longer running (or `end` was closed)."""
    async with lock:
        inbox.expect_abort_reply(request_id)
        try:
            await end.send(Abort(request_id))
            return await end._wait_for(lambda: inbox.abort_result)
        except (ConnectionLost, OSError):
            if end.closed:
                return False
            raise


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

    def send_all(self, messages: list[Any]) -> None:
        """Sends the messages in one write."""
        data = b"".join(encode_frame(message) for message in messages)
        with self._send_lock:
            self._sock.sendall(data)

    def receive_all(self) -> list[ServerMessage]:
        """Every message one read of the socket completes (at least one), as they came: for a
        reader that has the connection to itself (no other thread reading, no Abort awaiting
        its verdict here), such as a batch of streams (batches.py)."""
        while not (messages := self._decoder.messages()):
            data = self._sock.recv(BATCH_RECV_BYTES)
            if not data:
                raise ConnectionLost("the daemon closed the connection")
            self._decoder.feed(data)
        return messages

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
        return cls(*await open_unix_streams(socket_path))

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
        return await abort_with_inbox(self, self._inbox, self._abort_lock, request_id)

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
