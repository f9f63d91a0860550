"""The stall judge (pipeline/serve/stalls.py) on made-up heartbeats: a live stage is hung only past
the limit its pace allows, never less than the floor; a busy machine's slower beats raise the
limit; a verdict is counted once per hang, a dead stage gets none, and a restarted one starts afresh."""
from __future__ import annotations

import logging

import pytest

from pipeline.engine.backend import StageHealth
from pipeline.serve.stalls import StallJudge


def _beats(judge: StallJudge, gap_s: float, start_s: float, count: int, pid: int = 10) -> float:
    """`count` beats of stage 'runner' `gap_s` apart, looked at every 0.1 s; returns the time after."""
    now_s = start_s
    for _ in range(count):
        for age_s in [i * 0.1 for i in range(int(round(gap_s / 0.1)) + 1)]:
            assert judge.observe([StageHealth("runner", pid, True, age_s)], now_s + age_s) == {}
        now_s += gap_s
    return now_s


def test_the_floor_decides_on_a_quiet_machine_and_a_stopped_stage_is_taken_for_hung_once(
        caplog: pytest.LogCaptureFixture) -> None:
    judge = StallJudge(floor_s=1.0)
    now_s = _beats(judge, 0.5, 0.0, 4)  # idle beats: 2 x 0.5 s is the floor itself
    assert judge.limit_s(now_s) == 1.0
    with caplog.at_level(logging.WARNING, logger="pipeline.serve.stalls"):
        hung = judge.observe([StageHealth("runner", 10, True, 1.2)], now_s + 1.2)
        assert judge.observe([StageHealth("runner", 10, True, 3.0)], now_s + 3.0) == hung
    assert "stage 'runner' has not gone round its loop for 1.2 s (stall limit 1 s" in hung["runner"]
    assert judge.num_verdicts == 1  # one hang, one verdict
    assert "expected pace: a beat at least every 1.00 s (the slowest gap lately 0.50 s x 2, floor 1 s); seen: no " \
        "beat for 1.2 s" in caplog.text
    assert judge.observe([StageHealth("runner", 10, True, 0.0)], now_s + 3.1) == {}  # it went round again
    assert judge.limit_s(now_s + 3.1) == pytest.approx(6.0)  # and that gap is the pace now: slow, not dead


def test_a_busy_machine_raises_the_limit_and_the_window_forgets_it() -> None:
    judge = StallJudge(floor_s=1.0, window_s=10.0)
    now_s = _beats(judge, 2.0, _beats(judge, 1.0, _beats(judge, 0.5, 0.0, 2), 2), 3)  # the load comes on
    assert judge.limit_s(now_s) == pytest.approx(4.0)
    assert judge.observe([StageHealth("runner", 10, True, 3.5)], now_s + 3.5) == {}  # slow, not hung
    assert judge.num_verdicts == 0
    now_s = _beats(judge, 0.2, now_s + 3.5, 60)  # quiet again, for longer than the window
    assert judge.limit_s(now_s) == 1.0


def test_dead_restarted_and_unstarted_stages_get_no_verdict() -> None:
    judge = StallJudge(floor_s=1.0)
    assert judge.observe([StageHealth("runner", 10, False, 50.0)], 0.0) == {}  # dead: the supervisor's, not ours
    assert judge.observe([StageHealth("runner", 11, True, float("inf"))], 0.0) == {}  # not begun beating
    judge.observe([StageHealth("runner", 12, True, 5.0)], 5.0)
    assert judge.num_verdicts == 1
    assert judge.observe([StageHealth("runner", 13, True, 0.1)], 5.1) == {}  # a fresh process: a fresh start
