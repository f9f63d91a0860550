"""The status board's scheduler counters: what the scheduler publishes is what the daemon reads,
the speculative decoding counts included, and no area of the board overwrites another."""
from __future__ import annotations

import pytest

from stages.status import (
    MAX_STAGES,
    PROFILE_MESSAGE_BYTES,
    ProfileAnswer,
    ProfileOutcome,
    SchedulerCounters,
    StatusBoard,
)

pytestmark = pytest.mark.timeout(30)


def test_a_fresh_board_counts_nothing(board: StatusBoard) -> None:
    assert board.counters() == SchedulerCounters(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)


def test_published_counters_read_back_speculative_counts_included(board: StatusBoard) -> None:
    counters = SchedulerCounters(num_waiting=1, num_running=2, kv_blocks_used=3, kv_blocks_free=4, tokens_generated=5,
                                 num_preemptions=6, num_prefix_queried_tokens=70, num_prefix_hit_tokens=35,
                                 num_draft_tokens=300, num_accepted_tokens=210, num_verifications=100)
    board.publish_counters(counters)
    assert board.counters() == counters
    assert board.counters().prefix_cache_hit_rate == 0.5


def test_speculative_counts_and_the_last_profile_message_keep_their_own_bytes(board: StatusBoard) -> None:
    last = MAX_STAGES - 1
    message = "é" * PROFILE_MESSAGE_BYTES  # cut to fit its area, never past it
    counters = SchedulerCounters(1, 2, 3, 4, 5, 6, 7, 8, 2**62, 2**61, 2**60)
    board.publish_counters(counters)
    board.answer_profile(last, ProfileAnswer(3, ProfileOutcome.WRITTEN, message))
    assert board.counters() == counters
    board.publish_counters(SchedulerCounters(0, 0, 0, 0, 0, 0, 0, 0, 9, 8, 7))
    answer = board.profile_answer(last)
    assert (answer.generation, answer.outcome) == (3, ProfileOutcome.WRITTEN)
    assert message.startswith(answer.message) and len(answer.message) == (PROFILE_MESSAGE_BYTES - 8) // 2
