"""What the daemon server routes between: a request in flight and the connection it answers to.

A connection is anything that takes replies without waiting: a Unix-socket client
(socket_connection.py) or one HTTP call (openai/call.py).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pipeline.protocol import ServerMessage, TokenLogprobs
from pipeline.serve.metrics import RequestTimeline
from pipeline.serve.recovery import ResumeState

log = logging.getLogger("pipeline.serve")


class Connection(Protocol):
    """One client's end, as the server sees it: replies go out through `send`, which never waits."""

    requests: dict[str, Request]  # this connection's running requests by public id

    def send(self, message: ServerMessage) -> None: ...

    def send_text(self, request_id: str, text: str, token_ids: list[int]) -> None:
        """`send(Delta(request_id, text, token_ids))`, where the connection can do without the Delta."""

    def close(self) -> None: ...

    def abort(self) -> None: ...


class Flushable(Protocol):
    def flush(self) -> None: ...


class FlushLater:
    """`flush_later(connection)`: `connection.flush()` runs when this turn of the event loop is
    over, with every other connection's that asked in this turn: one callback a turn, however
    many connections write. A connection asks once per turn."""

    def __init__(self) -> None:
        self._due: list[Flushable] = []

    def __call__(self, connection: Flushable) -> None:
        if not self._due:
            asyncio.get_running_loop().call_soon(self._flush)
        self._due.append(connection)

    def _flush(self) -> None:
        due, self._due = self._due, []
        for connection in due:
            try:
                connection.flush()
            except Exception:  # one connection's failure must not keep the others' replies back
                log.exception("writing to a connection failed")


@dataclass(slots=True)
class Request:
    req_id: int
    request_id: str
    connection: Connection
    stream: bool
    delta_frames: bool  # its deltas go in its connection's `Deltas` frames
    num_logprobs: int | None
    timeline: RequestTimeline
    resume: ResumeState
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # every output delivered: a restart resumes after them
    queue_time_s: float | None = None  # from arrival to the scheduler's first admission
    # Text and logprobs, kept only for requests that are not streamed (Done carries them).
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Set by a connection that frames a streamed request's plain deltas itself (HttpCall): each
    # goes here at once, as its text and number of tokens. The sink may leave (write, data) in
    # the list it is given: the server makes those writes back to back once the batch is routed.
    text_sink: Callable[[str, int, list[tuple[Callable[[bytes], object], bytes]]], None] | None = None
