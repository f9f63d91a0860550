"""The status board's scheduler counters and the runner's limits: what the scheduler and the runner
publish is what the daemon reads, every count of every nested counters struct included, the lines
on what the model runs in and on the CPU kernels too, and no area of the board overwrites another."""
from __future__ import annotations

import dataclasses

import pytest

from stages.contracts.config import ModelLimits
from stages.contracts.counters import (
    PrefixCacheCounts,
    SchedulerCounters,
    SpeculativeCounts,
    counts_since,
    from_ints,
    num_counts,
    to_ints,
)
from stages.contracts.config import ModelLimits
from stages.status import (
    CPU_KERNELS_BYTES,
    MAX_STAGES,
    PROFILE_MESSAGE_BYTES,
    RUNS_IN_BYTES,
    ProfileAnswer,
    ProfileOutcome,
    StatusBoard,
)

pytestmark = pytest.mark.timeout(30)


def numbered(start: int) -> SchedulerCounters:
    """Counters whose every int, nested ones included, differs from the others."""
    return from_ints(SchedulerCounters, list(range(start, start + num_counts(SchedulerCounters))))


def test_a_fresh_board_counts_nothing(board: StatusBoard) -> None:
    assert board.counters.read() == SchedulerCounters()


def test_published_counters_read_back_speculative_counts_included(board: StatusBoard) -> None:
    counters = SchedulerCounters(num_waiting=1, num_running=2, num_draining=1, kv_blocks_used=3, kv_blocks_free=4,
                                 kv_blocks_cached=2, tokens_generated=5, num_preemptions=6,
                                 prefix=PrefixCacheCounts(num_queried_tokens=70, num_hit_tokens=35),
                                 speculative=SpeculativeCounts(num_draft_tokens=300, num_accepted_tokens=210,
                                                               num_verifications=100))
    board.counters.publish(counters)
    assert board.counters.read() == counters
    assert board.counters.read().prefix.hit_rate == 0.5


def test_every_count_of_every_nested_struct_travels_on_its_own() -> None:
    """A field added to a counters struct is stored and read back with no other change: the board
    and the stats messages walk the fields."""
    counters = numbered(1)
    flat = to_ints(counters)
    names = [f.name for f in dataclasses.fields(SchedulerCounters)]
    assert len(flat) == num_counts(SchedulerCounters) == len(names) - 2 + num_counts(PrefixCacheCounts) \
        + num_counts(SpeculativeCounts)
    assert len(set(flat)) == len(flat) and from_ints(SchedulerCounters, flat) == counters
    assert counters.speculative == SpeculativeCounts(*to_ints(counters)[-num_counts(SpeculativeCounts):])
    assert counts_since(numbered(10), numbered(1)) == from_ints(SchedulerCounters, [9] * len(flat))
    assert counts_since(numbered(1), numbered(10)) == numbered(1)  # every count fell: they started again
    with pytest.raises(ValueError, match="SchedulerCounters holds"):
        from_ints(SchedulerCounters, flat[:-1])


def test_speculative_counts_and_the_last_profile_message_keep_their_own_bytes(board: StatusBoard) -> None:
    last = MAX_STAGES - 1
    message = "é" * PROFILE_MESSAGE_BYTES  # cut to fit its area, never past it
    counters = dataclasses.replace(numbered(1), speculative=SpeculativeCounts(2**62, 2**61, 2**60))
    board.counters.publish(counters)
    board.profile.answer(last, ProfileAnswer(3, ProfileOutcome.WRITTEN, message))
    assert board.counters.read() == counters
    board.counters.publish(numbered(100))
    assert board.counters.read() == numbered(100)
    answer = board.profile.answer_of(last)
    assert (answer.generation, answer.outcome) == (3, ProfileOutcome.WRITTEN)
    assert message.startswith(answer.message) and len(answer.message) == (PROFILE_MESSAGE_BYTES - 8) // 2


def test_the_runners_limits_and_cpu_kernels_line_read_back(board: StatusBoard) -> None:
    assert board.limits.read() is None
    limits = ModelLimits(7, 512, 1000, [2, 3], num_host_blocks=4, window=16, local_window=8, num_window_blocks=5,
                         cpu_kernels="built (torch ops, avx512+vnni)")
    board.counters.publish(numbered(1))
    board.limits.publish(limits)
    assert board.limits.read() == limits and board.counters.read() == numbered(1)
    long = ModelLimits(7, 512, 1000, cpu_kernels="plain torch (the build failed: " + "x" * CPU_KERNELS_BYTES + ")")
    board.limits.publish(long)
    read = board.limits.read().cpu_kernels
    assert long.cpu_kernels.startswith(read) and len(read) == CPU_KERNELS_BYTES - 8


def test_the_runners_limits_and_what_the_model_runs_in_read_back_beside_the_counters(board: StatusBoard) -> None:
    assert board.limits.read() is None  # before the runner published them
    runs_in = ("weights: 210 Q4_1 + 1 Q8_0 quantized (98.4 MB), 61 float32 dense (0.1 MB: norms and biases) "
               "(quantization gguf); dense dtype float32; KV cache float32, 23296 tokens")
    limits = ModelLimits(num_kv_blocks=1456, max_model_len=8192, vocab_size=49152, eos_token_ids=[2],
                         window=0, local_window=512, num_window_blocks=64, runs_in=runs_in)
    board.counters.publish(numbered(7))
    board.limits.publish(limits)
    assert board.limits.read() == limits
    assert board.counters.read() == numbered(7)
    board.limits.publish(dataclasses.replace(limits, runs_in="é" * RUNS_IN_BYTES))  # cut to fit, never past
    assert len(board.limits.read().runs_in) == (RUNS_IN_BYTES - 8) // 2
    assert board.counters.read() == numbered(7)


def test_the_model_limits_read_back_the_measured_cost_of_verifying_drafts(board: StatusBoard) -> None:
    assert board.limits.read() is None
    limits = ModelLimits(num_kv_blocks=64, max_model_len=512, vocab_size=100, eos_token_ids=[1, 2], window=8,
                         verify_free_tokens=12.345, draft_step_tokens=(3.25, 0.5),
                         verify_costs_by_batch=((1.0, 80.5, 0.0, 0.0), (4.0, 20.25, 1.5, 0.125), (16.0, 12.345, 3.25, 0.5)))
    board.limits.publish(limits)
    assert board.limits.read() == limits
    board.limits.publish(dataclasses.replace(limits, verify_free_tokens=None))  # not measured
    assert board.limits.read().verify_free_tokens is None
