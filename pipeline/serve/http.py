"""The daemon's HTTP listener: uvicorn (httptools) serving the OpenAI API on the daemon's own loop.

uvicorn is the ASGI server the ecosystem runs vLLM's and SGLang's APIs on; here it serves from
the daemon process, beside the Unix socket, on the same uvloop event loop, so an HTTP request
reaches the engine exactly as a socket request does. The daemon binds the listening socket
itself (a taken port is an error at start, naming the address) and keeps its own signal
handling: SIGTERM drains both listeners alike.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn

from pipeline.errors import PipelineError

log = logging.getLogger("pipeline.serve")

GRACEFUL_CLOSE_S = 2.0  # open HTTP connections get this long once the daemon's requests have ended
START_TIMEOUT_S = 10.0


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free one); PipelineError naming the
    address when it cannot be had."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise PipelineError(f"cannot listen on {host}:{port}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise PipelineError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.setblocking(False)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its own signal handlers: the daemon's decide when to stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpListener:
    """Serves `app` on an already bound socket until `stop`."""

    def __init__(self, app: object, sock: socket.socket) -> None:
        config = uvicorn.Config(app, loop="none", http="httptools", lifespan="off", access_log=False,
                                log_level="warning", timeout_graceful_shutdown=GRACEFUL_CLOSE_S)
        self.url = url_of(sock)
        self._socket = sock
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._server.serve(sockets=[self._socket]))
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what kept it from starting
                raise PipelineError(f"the HTTP server on {self.url} stopped while starting")
            if asyncio.get_running_loop().time() > deadline:
                raise PipelineError(f"the HTTP server on {self.url} did not start within {START_TIMEOUT_S:g} s")
            await asyncio.sleep(0.01)
        log.info("OpenAI API listening on %s", self.url)

    def stop_accepting(self) -> None:
        for server in getattr(self._server, "servers", []):
            server.close()

    async def stop(self) -> None:
        """Closes the listener and the connections (their requests have ended by then)."""
        if self._task is None:
            self._socket.close()
            return
        self._server.should_exit = True
        await self._task
