"""Sending one request to a replica: pick one, post, and on a refusal or a dead replica try the
next, until one answers or none is left.

A replica that cannot be reached, or that dies while a request is on it, leaves the ring at once
(its health checks bring it back). So does one taken for hung: a stream that opens, or goes on,
silent past the replica's deadline while its /health does not answer ok (stall.py; relay.py fails
it over). A 5xx answer (overloaded, restarting) sends the request to another replica; a 4xx is
the request's own fault and is returned as it came.
"""
from __future__ import annotations

import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

import aiohttp

from pipeline.router.metrics import RouterMetrics
from pipeline.router.policy import Router
from pipeline.router.prefix import RouteKey
from pipeline.router.replicas import Replica
from pipeline.router.stall import Stalled, StallWatch
from pipeline.serve.openai.errors import OpenAIError, error_body

UNREACHABLE = (aiohttp.ClientError, OSError, TimeoutError)
T = TypeVar("T")


@dataclass(slots=True)
class Refused:
    """What the last replica tried answered, when none took the request."""

    status: int
    body: bytes
    content_type: str = "application/json"


@dataclass(slots=True)
class Opened:
    replica: Replica
    response: aiohttp.ClientResponse


@dataclass(slots=True)
class Sender:
    """One client request's way to the replicas; `tried` are those that refused it this round."""

    session: aiohttp.ClientSession
    router: Router
    metrics: RouterMetrics
    path: str
    headers: dict[str, str]
    key: RouteKey | None
    watch: StallWatch | None = None  # judges a silent stream (opening or mid-way); None: waits for ever
    tried: set[str] = field(default_factory=set)
    num_attempts: int = 0

    async def open(self, body: bytes, *, stream: bool = False) -> Opened | Refused:
        """The first replica that answers 200 with its response (headers read, body not), else
        the last refusal (or a 503 when no replica is left to try). A `stream` whose replica
        is taken for hung before it answers is tried on the next."""
        refused: Refused | None = None
        self.tried.clear()
        while True:
            chosen = self.router.choose(self.key, self.tried)
            if chosen is None:
                return refused or _no_backend(self.router)
            replica, route = chosen
            self.tried.add(replica.url)
            self.num_attempts += 1
            if self.num_attempts > 1:
                self.metrics.retries.inc()
            self.metrics.routed.labels(route.value).inc()
            self.metrics.sent.labels(replica.url).inc()
            replica.num_requests += 1
            self.begin(replica)
            posted = self.session.post(replica.url + self.path, data=body, headers=self.headers)
            try:
                response = await (self.wait(posted, replica, time.monotonic()) if stream else posted)
            except Stalled as stalled:
                self.end(replica)
                self.router.replicas.mark(replica.url, False, str(stalled))
                continue
            except UNREACHABLE as exc:
                self.end(replica)
                self.router.replicas.mark(replica.url, False, f"unreachable: {type(exc).__name__} {exc}".rstrip())
                continue
            if response.status == 200:
                return Opened(replica, response)
            try:
                refused = Refused(response.status, await response.read(),
                                  response.headers.get("content-type", "application/json"))
            except UNREACHABLE:
                refused = Refused(502, error_json(502, f"backend {replica.url} failed while answering {response.status}"))
            finally:
                response.release()
                self.end(replica)
            if response.status < 500:
                return refused

    async def wait(self, pending: Awaitable[T], replica: Replica, since: float) -> T:
        """What `pending` (a step of a stream from `replica`) gives; Stalled when the replica is
        taken for hung first. `since`: when the stream last made progress."""
        return await (pending if self.watch is None else self.watch.wait(pending, replica, since))

    def died(self, replica: Replica, why: str) -> None:
        """`replica` died under a request: its connection ended or broke before the request's end."""
        self.metrics.deaths.labels(replica.url).inc()
        self.router.replicas.mark(replica.url, False, why)

    def begin(self, replica: Replica) -> None:
        replica.outstanding += 1
        self.metrics.outstanding.labels(replica.url).set(replica.outstanding)

    def end(self, replica: Replica) -> None:
        replica.outstanding -= 1
        self.metrics.outstanding.labels(replica.url).set(replica.outstanding)


def error_json(status: int, message: str, code: str | None = None) -> bytes:
    return error_body(OpenAIError(status, message, code=code))


def _no_backend(router: Router) -> Refused:
    reasons = "; ".join(f"{r.url}: {r.reason}" for r in router.replicas.by_url.values())
    return Refused(503, error_json(503, f"no healthy backend can take the request ({reasons})", "no_backend"))
