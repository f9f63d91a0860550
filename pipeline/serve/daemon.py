"""The daemon process: `pipeline start` serves the Unix socket (and, with a port, the OpenAI HTTP
API) on an asyncio (uvloop) event loop.

It claims the socket path (refusing when another daemon answers there) and the HTTP port,
starts the backend and its supervisor, writes a pid file beside the socket, and routes both
listeners' requests through one `DaemonServer` (server.py). SIGTERM (`pipeline stop`) or SIGINT: stop accepting, let the requests in flight
finish for up to `grace_s`, end the rest with `aborted`, close the stages, exit. A second
signal ends the wait.
"""
from __future__ import annotations

import asyncio
import logging
import os
import resource
import signal
import socket
import stat
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import uvloop

from pipeline.errors import PipelineError
from pipeline.paths import ensure_socket_dir
from pipeline.engine.backend import BackendFactory
from pipeline.engine.multiprocess import StageBackend
from pipeline.serve.config import DaemonConfig
from pipeline.serve.http import HttpListener, bind
from pipeline.serve.model import ServedModel
from pipeline.serve.openai.app import OpenAIApi
from pipeline.serve.server import DaemonServer
from pipeline.serve.socket_connection import SocketConnection
from pipeline.serve.supervisor import StageSupervisor
from shm.naming import new_instance_id
from stages.contracts.config import EngineConfig

log = logging.getLogger("pipeline.serve")

SOCKET_MODE = 0o600
SHUTDOWN_FLUSH_S = 1.0
LISTEN_BACKLOG = 1024  # connections the kernel queues before the loop accepts them: bursts of clients
SUPERVISOR_STOP_S = 60.0  # how long shutting down waits for a restart in progress


class DaemonAlreadyRunning(PipelineError):
    """Another daemon answers on the socket this one was asked to use."""


def pid_file_for(socket_path: Path) -> Path:
    """Where the daemon serving `socket_path` writes its pid (`pipeline stop` reads it)."""
    return socket_path.with_name(socket_path.name + ".pid")


def read_daemon_pid(socket_path: Path) -> int:
    """The pid in the pid file of the daemon on `socket_path`. Ask the daemon something first: the
    file alone could name a recycled pid. PipelineError if the file is missing or unreadable."""
    pid_file = pid_file_for(socket_path)
    try:
        return int(pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        raise PipelineError(f"a daemon answers on {socket_path} but its pid file {pid_file} is missing "
                            f"or unreadable") from None


def claim_socket_path(socket_path: Path) -> None:
    """Makes the socket's directory (0700) and removes a stale socket file.

    Raises DaemonAlreadyRunning if a daemon answers there, and PipelineError if the path holds
    something that is not a socket (it is not ours to delete).
    """
    ensure_socket_dir(socket_path)
    try:
        info = os.lstat(socket_path)
    except FileNotFoundError:
        pid_file_for(socket_path).unlink(missing_ok=True)  # no socket: any pid file there is stale
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise PipelineError(f"{socket_path} exists and is not a socket; remove it or choose another --socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(socket_path))
    except (ConnectionRefusedError, FileNotFoundError):
        socket_path.unlink(missing_ok=True)  # left by a daemon that died, with its pid file
        pid_file_for(socket_path).unlink(missing_ok=True)
        return
    finally:
        probe.close()
    raise DaemonAlreadyRunning(f"a pipeline daemon is already running on {socket_path} (stop it with `pipeline stop`)")


def raise_open_file_limit() -> int:
    """Lifts the soft limit on open files to the hard one, since every client connection holds a
    descriptor; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):  # an unlimited hard limit may exceed what the kernel allows
        return soft
    return hard


@contextmanager
def _exit_on_sigterm() -> Iterator[None]:
    """Until the event loop handles signals, SIGTERM raises SystemExit: the stages starting then
    are stopped and their /dev/shm entries removed, instead of the daemon dying with them live."""

    def exit_now(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


async def _wait_first(*waits: Awaitable[object], timeout_s: float) -> None:
    """Returns when the first of `waits` is done, or after timeout_s."""
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    try:
        await asyncio.wait(tasks, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


def _unlink_if_ours(path: Path, inode: int) -> None:
    """Removes `path` unless it is no longer the file we made (a daemon started after us made it)."""
    try:
        if os.lstat(path).st_ino == inode:
            path.unlink()
    except FileNotFoundError:
        pass


async def _serve(server: DaemonServer, supervisor: StageSupervisor, socket_path: Path,
                 ready: Callable[[], None] | None, http_socket: socket.socket | None) -> None:
    loop = asyncio.get_running_loop()
    http = None
    if http_socket is not None:
        http = HttpListener(OpenAIApi(server, server.config.api_key).app(), http_socket)
        await http.start()
        server.http_url = http.url
    old_umask = os.umask(0o177)  # the socket is born 0600: no window in which others may connect
    try:
        listener = await loop.create_unix_server(lambda: SocketConnection(server), path=str(socket_path),
                                                 backlog=LISTEN_BACKLOG)
    finally:
        os.umask(old_umask)
    os.chmod(socket_path, SOCKET_MODE)
    pid_file = pid_file_for(socket_path)
    pid_file.write_text(f"{os.getpid()}\n")
    ours = {socket_path: os.lstat(socket_path).st_ino, pid_file: os.lstat(pid_file).st_ino}
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (hurry if stop.is_set() else stop).set()  # a second signal cuts the grace period short

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal)
    supervisor.start()
    log.info("pipeline daemon (pid %d) listening on %s", os.getpid(), socket_path)
    if ready is not None:
        ready()
    try:
        await stop.wait()
        grace_s = server.config.grace_s
        log.info("pipeline daemon shutting down: %d requests in flight get up to %g s to finish",
                 server.num_in_flight, grace_s)
        listener.close()
        if http is not None:
            http.stop_accepting()
        server.begin_shutdown()
        supervisor.stop_restarting()
        await _wait_first(server.wait_idle(), hurry.wait(), timeout_s=grace_s)
    finally:
        listener.close()
        server.shut_down()
        # Closing transports flush their last replies first; a client that reads nothing
        # would hold that up for ever, so whatever is left after a grace period is cut off.
        deadline = loop.time() + SHUTDOWN_FLUSH_S
        while server.connections and loop.time() < deadline:
            await asyncio.sleep(0.01)
        for connection in list(server.connections):
            connection.abort()
        if http is not None:
            await http.stop()
        await loop.run_in_executor(None, supervisor.stop, SUPERVISOR_STOP_S)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        for path, inode in ours.items():
            _unlink_if_ours(path, inode)


def run_daemon(config: EngineConfig, socket_path: Path | str, backend_factory: BackendFactory = StageBackend,
               ready: Callable[[], None] | None = None, settings: DaemonConfig | None = None) -> int:
    """Serves until SIGTERM or SIGINT, then shuts down as DaemonConfig says (grace period),
    closes the stages and removes the socket; returns 0.

    `ready` is called once the socket answers. Raises DaemonAlreadyRunning when another daemon
    serves `socket_path`, ValueError naming a bad setting.
    """
    settings = settings or DaemonConfig()
    settings.check()
    socket_path = Path(socket_path)
    claim_socket_path(socket_path)
    raise_open_file_limit()
    http_socket = None if settings.http_port is None else bind(settings.http_host, settings.http_port)
    try:
        with _exit_on_sigterm():
            backend = backend_factory(config, new_instance_id())  # sweeps what dead instances left in /dev/shm
        try:
            model = ServedModel.load(config, backend.limits, settings.served_model_name)
            if model.runs_in:
                log.info("model %s: %s", model.name, model.runs_in)
        except BaseException:
            backend.close()
            raise
        loop = uvloop.new_event_loop()
        server = DaemonServer(backend, config.max_num_seqs, settings, model)
        supervisor = StageSupervisor(backend, backend_factory, config, settings.restart_policy(), server, loop,
                                     server.stalls)
        try:
            loop.run_until_complete(_serve(server, supervisor, socket_path, ready, http_socket))
        finally:
            supervisor.stop(SUPERVISOR_STOP_S)  # closes the stages, if _serve did not get that far
            loop.close()
    finally:
        if http_socket is not None:
            http_socket.close()
    return 0


