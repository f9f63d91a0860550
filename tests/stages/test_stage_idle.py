"""How long stage loops block on their input rings: briefly while they work, long once idle (so an
idle daemon costs next to no CPU), and never so long that the daemon's stall check misfires."""
from __future__ import annotations

import pytest

from pipeline.serve.config import MIN_STALL_S, DaemonConfig
from stages.process import IDLE_AFTER_S, IDLE_TICK_S, MIN_SHARE_S, TICK_S, input_wait_s


def test_a_working_stage_blocks_one_tick_and_an_idle_one_the_idle_tick() -> None:
    assert input_wait_s(0.0) == TICK_S
    assert input_wait_s(IDLE_AFTER_S / 2) == TICK_S
    assert input_wait_s(IDLE_AFTER_S + 0.01) == IDLE_TICK_S
    assert IDLE_TICK_S > TICK_S


def test_rings_waited_on_in_turn_share_one_tick_even_when_idle() -> None:
    # A request on the second of two rings must not wait out a long sleep on the first.
    assert input_wait_s(0.0, share=2) == TICK_S / 2
    assert input_wait_s(60.0, share=2) == TICK_S / 2
    assert input_wait_s(60.0, share=1000) == MIN_SHARE_S


def test_the_stall_limit_must_exceed_an_idle_stages_heartbeat_interval() -> None:
    assert MIN_STALL_S >= 2 * IDLE_TICK_S
    DaemonConfig(stall_s=MIN_STALL_S).check()
    with pytest.raises(ValueError, match=r"stall_s must be at least 1 s \(an idle stage beats every 0.5 s\), got 0.2"):
        DaemonConfig(stall_s=0.2).check()
