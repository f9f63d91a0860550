"""The daemon: an asyncio (uvloop) Unix-socket server that owns a Backend and routes requests.

Each `Generate` gets a small integer `req_id` (the backend's name for it) and a public request
id nobody can guess (what clients see). One thread blocks in `backend.read_events` and hands
each batch of events to the event loop, which fans them out to the connections. Writes to a
connection never wait: a client that stops reading only grows its own transport buffer, and
once that holds more than `max_unread_bytes` the daemon drops the connection (aborting its
requests) rather than let one slow reader hold memory or stall the others.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import uvloop

from pipeline.backend import Backend, EngineConfig, OutputEvent
from pipeline.errors import ErrorCode, PipelineError, ProtocolError, StageFailed
from pipeline.paths import ensure_socket_dir
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
    ServerMessage,
    Stats,
    StatsReply,
    TokenLogprobs,
    Usage,
    encode_frame,
    error_for,
    new_request_id,
)
from pipeline.sampling_params import InvalidParams
from shm.naming import new_instance_id

log = logging.getLogger("pipeline.daemon")

SOCKET_MODE = 0o600
DEFAULT_MAX_UNREAD_BYTES = 64 * 1024 * 1024
SHUTDOWN_FLUSH_S = 1.0
EVENT_POLL_S = 0.1  # how long the reader thread blocks per call: bounds how late it sees shutdown

BackendFactory = Callable[[EngineConfig, str], Backend]


class DaemonAlreadyRunning(PipelineError):
    """Another daemon answers on the socket this one was asked to use."""


def pid_file_for(socket_path: Path) -> Path:
    """Where the daemon serving `socket_path` writes its pid (`pipeline stop` reads it)."""
    return socket_path.with_name(socket_path.name + ".pid")


def _version() -> str:
    try:
        return metadata.version("pipeline")
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass(slots=True)
class _Request:
    req_id: int
    request_id: str
    connection: _Connection
    stream: bool
    num_logprobs: int | None
    prompt_token_ids: list[int] = field(default_factory=list)
    num_output_tokens: int = 0
    # Whole output, kept only for requests that are not streamed (Done carries it).
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)


def _token_logprobs(event: OutputEvent) -> list[TokenLogprobs] | None:
    if event.logprobs is None or event.logprob_token_ids is None:
        return None
    logprobs = event.logprobs.tolist()
    token_ids = event.logprob_token_ids.tolist()
    return [TokenLogprobs(ids[0], lps[0], ids[1:], lps[1:]) for ids, lps in zip(token_ids, logprobs)]


class _Connection(asyncio.Protocol):
    """One client connection: decodes its frames, sends replies without ever awaiting."""

    def __init__(self, server: DaemonServer) -> None:
        self._server = server
        self._decoder: FrameDecoder[ClientMessage] = FrameDecoder(ClientMessage)
        self.transport: asyncio.Transport | None = None
        self.requests: dict[str, _Request] = {}  # this connection's running requests by public id

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
        transport.write(frame)
        if transport.get_write_buffer_size() > self._server.max_unread_bytes:
            log.warning("dropping a client that left %d bytes unread", transport.get_write_buffer_size())
            transport.abort()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()  # flushes what is buffered, then connection_lost runs

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()  # drops what is buffered


class DaemonServer:
    """Routing between connections and the backend. Runs on the event loop's thread only."""

    def __init__(self, backend: Backend, *, max_unread_bytes: int = DEFAULT_MAX_UNREAD_BYTES) -> None:
        if isinstance(max_unread_bytes, bool) or not isinstance(max_unread_bytes, int) or max_unread_bytes < 1:
            raise ValueError(f"max_unread_bytes must be a positive integer, got {max_unread_bytes!r}")
        self.backend = backend
        self.max_unread_bytes = max_unread_bytes
        self.connections: set[_Connection] = set()
        self.started_at = time.monotonic()
        self.failure: str | None = None  # why the backend stopped working
        self._requests: dict[int, _Request] = {}  # by backend req_id
        self._next_req_id = 0
        self._num_finished = 0
        self._num_prompt_tokens = 0
        self._num_generated_tokens = 0

    # ---- client messages

    def handle(self, connection: _Connection, message: ClientMessage) -> None:
        if isinstance(message, Generate):
            self._generate(connection, message)
        elif isinstance(message, Abort):
            self._abort(connection, message.request_id)
        elif isinstance(message, Health):
            connection.send(self._health())
        elif isinstance(message, Stats):
            connection.send(self._stats())

    def _generate(self, connection: _Connection, message: Generate) -> None:
        try:
            params = message.params.to_params()
        except InvalidParams as exc:
            connection.send(error_for(exc))
            return
        if self.failure is not None:
            connection.send(Error(ErrorCode.STAGE_FAILED.value, self.failure))
            return
        request_id = new_request_id()
        req_id = self._next_req_id
        self._next_req_id += 1
        request = _Request(req_id, request_id, connection, message.stream, params.logprobs)
        if isinstance(message.prompt, list):
            request.prompt_token_ids = list(message.prompt)
        try:
            self.backend.submit(req_id, message.prompt, params)
        except (PipelineError, InvalidParams) as exc:
            connection.send(error_for(exc))
            return
        self._requests[req_id] = request
        connection.requests[request_id] = request
        connection.send(Accepted(request_id))

    def _abort(self, connection: _Connection, request_id: str) -> None:
        # Only the connection that made a request may abort it by message.
        request = connection.requests.get(request_id)
        if request is None:
            connection.send(Error(ErrorCode.NOT_FOUND.value, f"no running request {request_id} on this connection",
                                  None, request_id))
            return
        self._forget(request)
        self.backend.abort(request.req_id)
        connection.send(Error(ErrorCode.ABORTED.value, "aborted by the client", None, request_id))
        connection.send(Aborted(request_id))

    def drop_connection(self, connection: _Connection) -> None:
        """A closed connection aborts every request still running on it."""
        self.connections.discard(connection)
        for request in list(connection.requests.values()):
            self._forget(request)
            if self.failure is None:
                self.backend.abort(request.req_id)

    def _forget(self, request: _Request) -> None:
        self._requests.pop(request.req_id, None)
        request.connection.requests.pop(request.request_id, None)

    # ---- backend output

    def on_events(self, events: list[OutputEvent]) -> None:
        for event in events:
            request = self._requests.get(event.req_id)
            if request is None:
                continue  # aborted or dropped meanwhile: its last tokens go nowhere
            self._on_event(request, event)

    def _on_event(self, request: _Request, event: OutputEvent) -> None:
        connection = request.connection
        if event.prompt_token_ids is not None:
            request.prompt_token_ids = event.prompt_token_ids.tolist()
        if event.error_code is not None:
            self._forget(request)
            connection.send(Error(event.error_code, event.error_message or event.error_code, event.error_field,
                                  request.request_id))
            return
        token_ids = event.token_ids.tolist()
        request.num_output_tokens += len(token_ids)
        self._num_generated_tokens += len(token_ids)
        logprobs = _token_logprobs(event) if request.num_logprobs is not None else None
        if request.stream:
            if event.text or token_ids:
                connection.send(Delta(request.request_id, event.text, token_ids, logprobs))
        else:
            request.texts.append(event.text)
            request.token_ids.extend(token_ids)
            if logprobs:
                request.logprobs.extend(logprobs)
        if event.finish_reason is None:
            return
        self._forget(request)
        if event.finish_reason not in ("stop", "length"):
            connection.send(Error(ErrorCode.ABORTED.value, f"request ended: {event.finish_reason}", None,
                                  request.request_id))
            return
        self._num_finished += 1
        self._num_prompt_tokens += len(request.prompt_token_ids)
        usage = Usage(len(request.prompt_token_ids), request.num_output_tokens)
        if request.stream:
            done = Done(request.request_id, event.finish_reason, request.prompt_token_ids, usage)
        else:
            done = Done(request.request_id, event.finish_reason, request.prompt_token_ids, usage,
                        text="".join(request.texts), token_ids=request.token_ids,
                        logprobs=request.logprobs if request.num_logprobs is not None else None)
        connection.send(done)

    def on_backend_failed(self, reason: str) -> None:
        """Every request in flight ends with stage_failed at once; new ones are refused."""
        self.failure = reason
        log.error("backend failed: %s", reason)
        for request in list(self._requests.values()):
            self._forget(request)
            request.connection.send(Error(ErrorCode.STAGE_FAILED.value, reason, None, request.request_id))

    def shut_down(self) -> None:
        """Tells every request still running that it ends, then closes every connection."""
        for request in list(self._requests.values()):
            self._forget(request)
            request.connection.send(Error(ErrorCode.ABORTED.value, "the daemon is shutting down", None,
                                          request.request_id))
        for connection in list(self.connections):
            connection.close()

    # ---- health and stats

    def _health(self) -> HealthReply:
        uptime_s = time.monotonic() - self.started_at
        try:
            stages = self.backend.health()
        except Exception as exc:  # noqa: BLE001 - a broken backend is what health must report
            return HealthReply("degraded", _version(), uptime_s, {"backend": f"unavailable: {exc}"})
        states = {
            stage.name: f"{'alive' if stage.alive else 'dead'} pid {stage.pid} heartbeat {stage.heartbeat_age_s:.2f}s"
            for stage in stages
        }
        if self.failure is not None:
            states["backend"] = f"failed: {self.failure}"
        healthy = self.failure is None and all(stage.alive for stage in stages)
        return HealthReply("ok" if healthy else "degraded", _version(), uptime_s, states)

    def _stats(self) -> StatsReply:
        uptime_s = time.monotonic() - self.started_at
        reply = StatsReply(
            num_finished_requests=self._num_finished,
            num_prompt_tokens_total=self._num_prompt_tokens,
            num_generated_tokens_total=self._num_generated_tokens,
            uptime_s=uptime_s,
        )
        try:
            stats = self.backend.stats()
        except Exception:  # noqa: BLE001 - the daemon's own counters still answer
            return reply
        reply.num_running_requests = stats.num_running
        reply.num_waiting_requests = stats.num_waiting
        reply.kv_blocks_used = stats.kv_blocks_used
        reply.kv_blocks_total = stats.kv_blocks_used + stats.kv_blocks_free
        return reply


class _EventPump:
    """The thread that blocks in `backend.read_events` and hands each batch to the loop."""

    def __init__(self, backend: Backend, server: DaemonServer, loop: asyncio.AbstractEventLoop) -> None:
        self._backend = backend
        self._server = server
        self._loop = loop
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipeline-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                events = self._backend.read_events(EVENT_POLL_S)
            except StageFailed as exc:
                self._loop.call_soon_threadsafe(self._server.on_backend_failed, exc.message)
                return
            except Exception as exc:  # noqa: BLE001 - any reader failure leaves the requests unserved
                log.exception("reading backend events failed")
                self._loop.call_soon_threadsafe(self._server.on_backend_failed, f"{type(exc).__name__}: {exc}")
                return
            if events:
                self._loop.call_soon_threadsafe(self._server.on_events, events)


def claim_socket_path(socket_path: Path) -> None:
    """Makes the socket's directory (0700) and removes a stale socket file.

    Raises DaemonAlreadyRunning if a daemon answers there, and PipelineError if the path holds
    something that is not a socket (it is not ours to delete).
    """
    ensure_socket_dir(socket_path)
    try:
        info = os.lstat(socket_path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise PipelineError(f"{socket_path} exists and is not a socket; remove it or choose another --socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(socket_path))
    except (ConnectionRefusedError, FileNotFoundError):
        socket_path.unlink(missing_ok=True)  # left by a daemon that died
        return
    finally:
        probe.close()
    raise DaemonAlreadyRunning(f"a pipeline daemon is already running on {socket_path} (stop it with `pipeline stop`)")


async def _serve(backend: Backend, socket_path: Path, ready: Callable[[], None] | None) -> None:
    loop = asyncio.get_running_loop()
    server = DaemonServer(backend)
    old_umask = os.umask(0o177)  # the socket is born 0600: no window in which others may connect
    try:
        listener = await loop.create_unix_server(lambda: _Connection(server), path=str(socket_path))
    finally:
        os.umask(old_umask)
    os.chmod(socket_path, SOCKET_MODE)
    pid_file = pid_file_for(socket_path)
    pid_file.write_text(f"{os.getpid()}\n")
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    pump = _EventPump(backend, server, loop)
    pump.start()
    log.info("pipeline daemon (pid %d) listening on %s", os.getpid(), socket_path)
    if ready is not None:
        ready()
    try:
        await stop.wait()
    finally:
        log.info("pipeline daemon shutting down")
        listener.close()
        server.shut_down()
        # Closing transports flush their last replies first; a client that reads nothing
        # would hold that up for ever, so whatever is left after a grace period is cut off.
        deadline = loop.time() + SHUTDOWN_FLUSH_S
        while server.connections and loop.time() < deadline:
            await asyncio.sleep(0.01)
        for connection in list(server.connections):
            connection.abort()
        await loop.run_in_executor(None, pump.stop)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        socket_path.unlink(missing_ok=True)
        pid_file.unlink(missing_ok=True)


def run_daemon(config: EngineConfig, socket_path: Path | str, backend_factory: BackendFactory = Backend,
               ready: Callable[[], None] | None = None) -> int:
    """Serves until SIGTERM or SIGINT, then closes the backend and removes the socket; returns 0.

    `ready` is called once the socket answers. Raises DaemonAlreadyRunning when another daemon
    serves `socket_path`.
    """
    socket_path = Path(socket_path)
    claim_socket_path(socket_path)
    backend = backend_factory(config, new_instance_id())
    try:
        loop = uvloop.new_event_loop()
        try:
            loop.run_until_complete(_serve(backend, socket_path, ready))
        finally:
            loop.close()
    finally:
        backend.close()
    return 0


__all__ = ["DaemonAlreadyRunning", "DaemonServer", "claim_socket_path", "pid_file_for", "run_daemon"]
