"""Waiting on a replica's stream without taking slow for dead.

A replica that died is known by fact: its connection is refused, or a stream from it ends (EOF,
reset) before its end. A stream that is only silent says nothing by itself: on a busy machine a
healthy replica can fall silent for seconds. So a silence past the replica's deadline (pace.py)
is a question, not a verdict: the replica's `/health` is asked, with as long to answer as the
stream had. An answer of `200 {"status": "ok"}` means its server and its stages go round (the
daemon reports a stage that stopped going round as degraded): it is slow, and the wait goes on,
checked again each deadline, up to the rule's limit. No answer, or any other, means it is hung
(a stopped process, a stuck server, stages the daemon itself calls stuck): the stream is taken
for broken and fails over, as a stall verdict, which is not a death.
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
        check_at = since + self.rule.deadline_s(replica.pace)
        while True:
            done, _ = await asyncio.wait((task,), timeout=max(0.0, check_at - time.monotonic()))
            if done:
                return task.result()
            silent_s = time.monotonic() - since
            deadline_s = self.rule.deadline_s(replica.pace)  # its other streams may have taught a slower pace
            if silent_s < deadline_s:
                check_at = since + deadline_s
                continue
            if silent_s >= self.rule.limit_s(replica.pace):
                raise self._hung(replica, silent_s, f"it is past the limit of {self.rule.limit_s(replica.pace):.1f} s "
                                                    "of silence, though its /health answers")
            healthy, why = await self.replicas.ask(self.session, replica.url, deadline_s)
            if task.done():
                return task.result()
            if not healthy:
                raise self._hung(replica, time.monotonic() - since, why)
            if not slow:
                slow = True
                self.metrics.slow.labels(replica.url).inc()
                log.info("backend %s: a stream from it has sent nothing for %.1f s (%s); its /health answers: "
                         "slow, not hung, still waited for", replica.url, silent_s, self.rule.describe(replica.pace))
            check_at = time.monotonic() + deadline_s

    def _hung(self, replica: Replica, silent_s: float, why: str) -> Stalled:
        self.metrics.stalls.labels(replica.url).inc()
        expected = self.rule.describe(replica.pace)
        log.warning("backend %s: a stream from it sent nothing for %.1f s (%s), and %s: taken for hung",
                    replica.url, silent_s, expected, why)
        return Stalled(f"a stream from it sent nothing for {silent_s:.1f} s ({expected}), and {why}")
