"""A sliding window's KV group holds only the blocks its window reaches: blocks wholly behind it
are released as the request moves on, never while a step in flight may still read them, and a
prefix hit needs only the blocks the next token's window reaches."""
from __future__ import annotations

import numpy as np
import pytest
from fake_engine_loop import Driver
from fake_step_runner import VOCAB, FakeRunner

from stages.contracts.config import EngineConfig, ModelLimits
from stages.contracts.params import SamplingParams
from stages.scheduler.kv_groups import NULL_BLOCK
from stages.scheduler.scheduler import Scheduler

BLOCK = 16
WINDOW = 40


def windowed_scheduler(num_blocks: int, num_window_blocks: int, **config: object) -> Scheduler:
    """Gemma 3's layout: global layers in group 0, local layers with WINDOW in group 1."""
    limits = ModelLimits(num_kv_blocks=num_blocks, max_model_len=1024, vocab_size=VOCAB, local_window=WINDOW,
                         num_window_blocks=num_window_blocks)
    return Scheduler(EngineConfig(block_size=BLOCK, **config), limits)


def check_in_flight_blocks_held(scheduler: Scheduler) -> None:
    """Every step in flight still finds the window blocks its queries read."""
    for plan in scheduler._in_flight:
        for row, start, count in zip(plan.rows.tolist(), plan.num_computed_tokens.tolist(),
                                     plan.num_scheduled_tokens.tolist()):
            request = scheduler._row_request[row]
            if request is None or not request.window_block_ids:
                continue
            first = max(0, start - WINDOW + 1) // BLOCK
            needed = request.window_block_ids[first:-(-(start + count) // BLOCK)]
            assert NULL_BLOCK not in needed, f"step {plan.step} reads blocks from {first}, released: {needed}"


@pytest.mark.parametrize("async_mode", [True, False])
def test_local_layers_hold_a_window_of_blocks_while_global_ones_hold_all(async_mode):
    scheduler = windowed_scheduler(64, 64, max_num_batched_tokens=64, async_scheduling=async_mode)
    scheduler.add_request(0, np.arange(1, 401) % VOCAB, SamplingParams(max_tokens=40, ignore_eos=True))
    driver = Driver(scheduler, FakeRunner(64, BLOCK), async_mode)
    global_used, local_used = [], []

    def observe(_: int) -> None:
        check_in_flight_blocks_held(scheduler)
        global_used.append(scheduler.kv.groups[0].manager.num_used_blocks)
        local_used.append(scheduler.kv.groups[1].manager.num_used_blocks)

    driver.run(before_step=observe)
    assert len(driver.outputs[0]) == 40
    assert max(global_used) == -(-439 // BLOCK)  # every token's block, until the request ends
    # The window's blocks and the partial ones at its ends, plus the chunks of the steps in flight.
    assert max(local_used) <= -(-WINDOW // BLOCK) + 2 + (2 if async_mode else 1) * (64 // BLOCK)
    assert max(local_used[-20:]) <= -(-WINDOW // BLOCK) + 2  # decoding: the window alone
    assert scheduler.kv.groups[0].manager.num_used_blocks == scheduler.kv.groups[1].manager.num_used_blocks == 0


def test_a_prefix_hit_past_the_window_takes_only_the_window_blocks():
    scheduler = windowed_scheduler(64, 64)
    prompt = np.arange(3, 203) % VOCAB
    scheduler.add_request(0, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    Driver(scheduler, FakeRunner(64, BLOCK), async_mode=True).run()
    # Blocks behind the window went back to the pool early, committed: still in the prefix cache.
    assert scheduler.kv.groups[1].manager.num_cached_blocks == 200 // BLOCK

    shared = 12 * BLOCK
    scheduler.add_request(1, np.concatenate([prompt[:shared], np.arange(500, 520)]), SamplingParams(max_tokens=4))
    plan = scheduler.schedule()
    request = scheduler._requests[1]
    first_read = (shared - WINDOW + 1) // BLOCK
    assert scheduler.prefix.num_hit_tokens == shared and plan.num_computed_tokens.tolist() == [shared]
    assert request.window_block_ids[:first_read] == [NULL_BLOCK] * first_read
    assert NULL_BLOCK not in request.window_block_ids[first_read:] and NULL_BLOCK not in request.block_ids


def test_a_hit_whose_window_blocks_were_evicted_is_cut_to_what_both_groups_hold():
    scheduler = windowed_scheduler(64, 64)
    prompt = np.arange(3, 203) % VOCAB
    scheduler.add_request(0, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    Driver(scheduler, FakeRunner(64, BLOCK), async_mode=False).run()
    scheduler.kv.groups[1].manager.reset_prefix_cache()  # the local layers' cached blocks are gone
    scheduler.add_request(1, prompt[:120], SamplingParams(max_tokens=2))
    plan = scheduler.schedule()
    assert scheduler.prefix.num_hit_tokens == 0 and plan.num_computed_tokens.tolist() == [0]
