"""Slow is not dead: the pace-adaptive stall rule, a silent replica whose /health answers waited for,
one that does not taken for hung (a stall verdict, counted and logged apart from deaths), and the
poison guard blaming a request only for the deaths of replicas it was in flight on."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import aiohttp
import pytest
from fake_replicas import (FakeReplica, Pause, Stop, counted, replicas_and_router, serve_fleet, stream,  # noqa: F401
                           tiny_model)

from pipeline.router.metrics import RouterMetrics
from pipeline.router.pace import GAP_WEIGHT, Pace, StallRule
from pipeline.router.replicas import MISSED_CHECKS, Replicas

pytestmark = pytest.mark.timeout(60)

WANT = "".join(f"t{t} " for t in range(6))


def test_the_deadline_is_the_floor_until_the_pace_is_slower_then_grows_with_it() -> None:
    rule = StallRule(2.0)
    pace = Pace()
    assert rule.deadline_s(pace) == 2.0 and rule.limit_s(pace) == 20.0  # nothing seen yet: the floor
    for _ in range(50):
        pace.observe(0.02)  # a quiet machine: a frame every 20 ms
    assert pace.gap_s == pytest.approx(0.02)
    assert rule.deadline_s(pace) == 2.0  # ten gaps are 0.2 s: the floor holds
    pace.observe(1.02)  # the machine gets busy: one gap of a second moves the mean by a fifth of it
    assert pace.gap_s == pytest.approx(0.02 + GAP_WEIGHT * 1.0)
    for _ in range(30):
        pace.observe(0.5)
    assert rule.deadline_s(pace) == pytest.approx(5.0, rel=0.01)  # ten gaps of the pace it learned
    assert rule.limit_s(pace) == pytest.approx(50.0, rel=0.01)
    assert "a frame every 0.500 s" in rule.describe(pace)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="stall timeout must be a positive number"):
            StallRule(bad)


def test_a_silent_replica_whose_health_answers_is_slow_and_waited_for(tiny_model: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    bodies: list[dict] = []
    script = [Pause(3, 1.5)]  # silent 1.5 s after 3 chunks, five times the floor, its /health answering
    fakes = [FakeReplica(script, bodies), FakeReplica(script, bodies)]

    async def scenario(url: str, replicas: Replicas, urls: list[str], metrics: RouterMetrics) -> None:
        texts, errors, _ = await stream(url, {"prompt": "hello", "max_tokens": 6})
        assert errors == [] and texts == {0: WANT}
        assert len(bodies) == 1  # no failover: the whole stream came from its first replica
        assert all(replica.healthy for replica in replicas.by_url.values())
        slow_url = next(u for u in urls if counted(metrics, "pipeline:router_backend_slow_streams", u) == 1)
        assert counted(metrics, "pipeline:router_backend_stall_verdicts", slow_url) == 0
        assert counted(metrics, "pipeline:router_backend_deaths", slow_url) == 0

    with caplog.at_level(logging.INFO, logger="pipeline.router"):
        asyncio.run(serve_fleet(tiny_model, fakes, scenario, stall_timeout_s=0.3))
    assert any("slow, not hung" in record.getMessage() for record in caplog.records)


def test_a_stall_verdict_logs_the_pace_expected_and_the_silence_seen(tiny_model: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    script = [Stop(4)]
    fakes = [FakeReplica(script, []), FakeReplica(script, [])]

    async def scenario(url: str, replicas: Replicas, urls: list[str], metrics: RouterMetrics) -> None:
        texts, errors, _ = await stream(url, {"prompt": "hello", "max_tokens": 6})
        assert errors == [] and texts == {0: WANT}

    with caplog.at_level(logging.WARNING, logger="pipeline.router"):
        asyncio.run(serve_fleet(tiny_model, fakes, scenario, stall_timeout_s=0.3))
    verdicts = [record.getMessage() for record in caplog.records if "taken for hung" in record.getMessage()]
    assert len(verdicts) == 1, verdicts
    assert "sent nothing for " in verdicts[0] and "expected a frame every " in verdicts[0], verdicts[0]
    assert "/health did not answer within" in verdicts[0], verdicts[0]


def test_a_stream_silent_past_the_limit_is_hung_though_its_replica_answers(tiny_model: Path) -> None:
    bodies: list[dict] = []
    script = [Pause(2, 30.0)]  # silent far past the limit (10 deadlines of 0.1 s), its /health answering
    fakes = [FakeReplica(script, bodies), FakeReplica(script, bodies)]

    async def scenario(url: str, replicas: Replicas, urls: list[str], metrics: RouterMetrics) -> None:
        texts, errors, _ = await stream(url, {"prompt": "hello", "max_tokens": 6})
        assert errors == [] and texts == {0: WANT}
        assert [b.get("resume_token_ids") for b in bodies] == [None, [0, 1]]
        muted = next(u for u in urls if not replicas.by_url[u].healthy)
        assert "past the limit of 1.0 s of silence" in replicas.by_url[muted].reason
        assert counted(metrics, "pipeline:router_backend_slow_streams", muted) == 1
        assert counted(metrics, "pipeline:router_backend_stall_verdicts", muted) == 1

    asyncio.run(serve_fleet(tiny_model, fakes, scenario, stall_timeout_s=0.1))


def test_the_poison_guard_counts_deaths_only_not_a_replica_taken_for_hung(tiny_model: Path) -> None:
    bodies: list[dict] = []
    # The first replica dies under the request, the second stops under its resumption (hung, not
    # dead), the third finishes it: one death only, so the request is not blamed.
    script = [2, Stop(1), None]
    fakes = [FakeReplica(script, bodies) for _ in range(3)]

    async def scenario(url: str, replicas: Replicas, urls: list[str], metrics: RouterMetrics) -> None:
        texts, errors, _ = await stream(url, {"prompt": "hello", "max_tokens": 6})
        assert errors == [] and texts == {0: WANT}
        assert [b.get("resume_token_ids") for b in bodies] == [None, [0, 1], [0, 1, 2]]
        assert sum(counted(metrics, "pipeline:router_backend_deaths", u) for u in urls) == 1
        assert sum(counted(metrics, "pipeline:router_backend_stall_verdicts", u) for u in urls) == 1
        assert metrics.registry.get_sample_value("pipeline:router_requests_failed_total",
                                                 {"reason": "replica_deaths"}) is None

    asyncio.run(serve_fleet(tiny_model, fakes, scenario, stall_timeout_s=0.3))


def test_a_choice_on_three_replicas_in_a_row_taken_for_hung_fails_clearly(tiny_model: Path) -> None:
    bodies: list[dict] = []
    script = [Stop(1), Stop(0), Stop(0)]  # one token, then three replicas silent under it, none with a token
    fakes = [FakeReplica(script, bodies) for _ in range(4)]

    async def scenario(url: str, replicas: Replicas, urls: list[str], metrics: RouterMetrics) -> None:
        texts, errors, _ = await stream(url, {"prompt": "hello", "max_tokens": 6})
        assert texts == {0: "t0 "}
        assert len(errors) == 1 and "on 3 replicas in a row that went silent" in errors[0], errors
        assert len(bodies) == 3  # not sent to the fourth
        assert metrics.registry.get_sample_value("pipeline:router_requests_failed_total",
                                                 {"reason": "replica_stalls"}) == 1

    asyncio.run(serve_fleet(tiny_model, fakes, scenario, stall_timeout_s=0.2))


def test_an_unanswered_health_check_takes_a_replica_out_only_when_it_repeats(tiny_model: Path) -> None:
    fake = FakeReplica([], [])

    async def scenario(url: str, replicas: Replicas, urls: list[str], metrics: RouterMetrics) -> None:
        quick, _ = replicas_and_router(urls)
        quick.timeout_s = 0.2
        async with aiohttp.ClientSession() as session:
            await quick.check(session, urls[0])
            assert quick.by_url[urls[0]].healthy
            fake.stopped.set()  # its /health no longer answers
            for _ in range(MISSED_CHECKS - 1):
                await quick.check(session, urls[0])
                assert quick.by_url[urls[0]].healthy  # a busy machine answers late: not yet a verdict
            await quick.check(session, urls[0])
            replica = quick.by_url[urls[0]]
            assert not replica.healthy and f"{MISSED_CHECKS} checks in a row" in replica.reason
            fake.stopped.clear()
            fake.wake.set()
            await quick.check(session, urls[0])
            assert quick.by_url[urls[0]].healthy and quick.by_url[urls[0]].missed_checks == 0

    asyncio.run(serve_fleet(tiny_model, [fake], scenario))
