"""The replicas behind the router: their health, as polled from each one's `/health`, and the
requests the router has outstanding on each.

A replica is in the ring while its health checks answer `200 {"status": "ok"}`. Any other answer
takes it out at once: a refused or broken connection (it is gone), a 503 (degraded, restarting,
shutting down), or an answer that is not the daemon's JSON (a process on that port that is not a
daemon is not trusted with requests). No answer within the timeout is not yet a verdict, as a
busy machine answers late: it takes the replica out only when MISSED_CHECKS checks in a row go
unanswered. A replica whose stream broke or hung under a request is taken out at once, before
its next check.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import msgspec

from pipeline.router.pace import Pace

MISSED_CHECKS = 2  # unanswered health checks in a row that take a replica out of the ring
log = logging.getLogger("pipeline.router")


@dataclass(slots=True)
class Replica:
    url: str  # http://host:port, no trailing slash
    healthy: bool = False
    reason: str = "not checked yet"
    outstanding: int = 0  # requests the router has on it now
    num_requests: int = 0  # requests the router sent it, failovers included
    pace: Pace = field(default_factory=Pace)  # of its streams' frames, as the router read them
    missed_checks: int = 0  # health checks in a row it did not answer in time


class _HealthBody(msgspec.Struct):
    status: str
    reason: str | None = None


_health_decoder = msgspec.json.Decoder(_HealthBody)


def check_url(url: str) -> str:
    """`url` without a trailing slash; ValueError naming it when it is not http(s)://host[:port]."""
    url = url.rstrip("/")
    scheme, _, rest = url.partition("://")
    if scheme not in ("http", "https") or not rest or "/" in rest:
        raise ValueError(f"a backend must be a URL like http://host:port, got {url!r}")
    return url


def health_verdict(status: int, body: bytes) -> tuple[bool, str]:
    """(healthy, why) for a `/health` answer."""
    try:
        health = _health_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False, f"/health answered {status} with a body that is not the daemon's health JSON"
    if status == 200 and health.status == "ok":
        return True, "ok"
    return False, f"/health answered {status}: {health.status}" + (f" ({health.reason})" if health.reason else "")


class Replicas:
    """Every replica by URL; `on_change(url, healthy)` runs when one enters or leaves the ring."""

    def __init__(self, urls: list[str], on_change: Callable[[str, bool], None], *,
                 interval_s: float, timeout_s: float) -> None:
        if not urls:
            raise ValueError("the router needs at least one backend")
        checked = [check_url(url) for url in urls]
        if len(set(checked)) != len(checked):
            raise ValueError(f"a backend is named twice: {checked}")
        self.by_url = {url: Replica(url) for url in checked}
        self._on_change = on_change
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._task: asyncio.Task[None] | None = None

    def healthy(self) -> list[Replica]:
        return [replica for replica in self.by_url.values() if replica.healthy]

    def mark(self, url: str, healthy: bool, reason: str) -> None:
        replica = self.by_url[url]
        replica.reason = reason
        if replica.healthy != healthy:
            replica.healthy = healthy
            log.warning("backend %s %s: %s", url, "joins the ring" if healthy else "leaves the ring", reason)
            self._on_change(url, healthy)

    async def ask(self, session: aiohttp.ClientSession, url: str, timeout_s: float) -> tuple[bool | None, str]:
        """(healthy, why) from one `/health` request; healthy is None when no answer came in time."""
        try:
            async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                return health_verdict(response.status, await response.content.read(64 * 1024))
        except asyncio.TimeoutError:
            return None, f"/health did not answer within {timeout_s:.1f} s"
        except (aiohttp.ClientError, OSError) as exc:
            return False, f"/health unreachable: {type(exc).__name__} {exc}".rstrip()

    async def check(self, session: aiohttp.ClientSession, url: str) -> None:
        healthy, why = await self.ask(session, url, self.timeout_s)
        replica = self.by_url[url]
        if healthy is None:
            replica.missed_checks += 1
            if replica.missed_checks < MISSED_CHECKS:
                return
            why = f"{why}, {replica.missed_checks} checks in a row"
        else:
            replica.missed_checks = 0
        self.mark(url, bool(healthy), why)

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self.check(session, url) for url in self.by_url))

    def start(self, session: aiohttp.ClientSession) -> None:
        async def poll() -> None:
            while True:
                await self.check_all(session)
                await asyncio.sleep(self.interval_s)

        self._task = asyncio.ensure_future(poll())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
