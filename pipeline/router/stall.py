"""Waiting on a replica's stream without taking slow for dead.

A replica that died is known by fact: its connection is refused, or a stream from it ends (EOF,
reset) before its end. A stream that is only silent says nothing by itself: on a busy machine a
healthy replica can fall silent for seconds. So silence is a question, not a verdict: once a
stream has been silent for half its replica's deadline (pace.py), the replica's `/health` is
asked, with the other half to answer. An answer of `200 {"status": "ok"}` is a sign of life: its
server and its stages go round (the daemon reports a stage that stopped going round as
degraded), so it is slow, and the wait goes on, the replica asked again half a deadline after
each answer, up to the rule's limit. A replica that shows no sign of life for a whole deadline, no
line on the stream and no ok answer (a stopped process, a stuck server, stages the daemon itself
calls stuck), is taken for hung: the stream fails over, as a stall verdict, which is not a death.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import TypeVar

import aiohttp

from pipeline.router.metrics import RouterMetrics
from pipeline.router.pace import StallRule
from pipeline.router.replicas import Replica, Replicas

log = logging.getLogger("pipeline.router")
T = TypeVar("T")


class Stalled(Exception):
    """A replica taken for hung under a stream; the message says what was expected and seen."""


class StallWatch:
    """The router's judge of silent streams: one per router, shared by every request."""

    def __init__(self, rule: StallRule, session: aiohttp.ClientSession, replicas: Replicas,
                 metrics: RouterMetrics) -> None:
        self.rule = rule
        self.session = session
        self.replicas = replicas
        self.metrics = metrics

    async def wait(self, pending: Awaitable[T], replica: Replica, since: float) -> T:
        """What `pending` gives, waited for while `replica` is alive; Stalled when it is taken for
        hung. `since` is when the stream last made progress (time.monotonic())."""
        task = asyncio.ensure_future(pending)
        try:
            return await self._wait(task, replica, since)
        finally:
            if not task.done():
                task.cancel()

    async def _wait(self, task: asyncio.Future[T], replica: Replica, since: float) -> T:
        slow = False
        alive_at = since  # the replica's last sign of life: a line of the stream, or an ok /health
        while True:
            deadline_s = self.rule.deadline_s(replica.pace)  # its other streams may teach a slower pace meanwhile
            if await _done_by(task, alive_at + deadline_s / 2):
                return task.result()
            silent_s = time.monotonic() - since
            if silent_s >= self.rule.limit_s(replica.pace):
                raise self._hung(replica, silent_s, f"it is past the limit of {self.rule.limit_s(replica.pace):.1f} s "
                                                    "of silence, though its /health answers")
            asked = asyncio.ensure_future(self.replicas.ask(self.session, replica.url, deadline_s / 2))
            try:
                await asyncio.wait((task, asked), return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not asked.done():
                    asked.cancel()
            if task.done():
                return task.result()
            healthy, why = asked.result()
            if not healthy:
                if await _done_by(task, alive_at + deadline_s):
                    return task.result()
                raise self._hung(replica, time.monotonic() - since, why)
            alive_at = time.monotonic()
            if not slow:
                slow = True
                self.metrics.slow.labels(replica.url).inc()
                log.info("backend %s: a stream from it has sent nothing for %.1f s (%s); its /health answers: "
                         "slow, not hung, still waited for", replica.url, silent_s, self.rule.describe(replica.pace))

    def _hung(self, replica: Replica, silent_s: float, why: str) -> Stalled:
        self.metrics.stalls.labels(replica.url).inc()
        expected = self.rule.describe(replica.pace)
        log.warning("backend %s: a stream from it sent nothing for %.1f s (%s), and %s: taken for hung",
                    replica.url, silent_s, expected, why)
        return Stalled(f"a stream from it sent nothing for {silent_s:.1f} s ({expected}), and {why}")


async def _done_by(task: asyncio.Future, at: float) -> bool:
    """Whether `task` is done by `at` (time.monotonic()), waiting for it until then."""
    done, _ = await asyncio.wait((task,), timeout=max(0.0, at - time.monotonic()))
    return bool(done)
