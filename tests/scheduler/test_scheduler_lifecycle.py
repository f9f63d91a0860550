"""Scheduler + fake runner: aborts, prefix caching, preemption, offload connector."""
from __future__ import annotations

import numpy as np
import pytest

from fake_engine_loop import Driver, make_scheduler
from fake_step_runner import FakeRunner, reference_tokens
from stages.contracts.params import SamplingParams
from stages.scheduler.block_manager import BlockManager, hash_block
from stages.scheduler.offload import OffloadConnectorScheduler
from stages.contracts.outputs import FinishReason

pytestmark = pytest.mark.timeout(30)
BLOCK = 4


def make(num_blocks: int = 64, async_mode: bool = True, num_host_blocks: int = 0, **config: object) -> Driver:
    config.setdefault("max_model_len", 64)
    connector = OffloadConnectorScheduler(num_host_blocks) if num_host_blocks else None
    scheduler = make_scheduler(num_blocks, BLOCK, (), connector, **config)
    return Driver(scheduler, FakeRunner(num_blocks, BLOCK, num_host_blocks), async_mode)


def assert_no_leak(driver: Driver) -> None:
    stats = driver.scheduler.stats()
    assert (stats.num_waiting, stats.num_running, stats.num_draining) == (0, 0, 0)
    manager = driver.scheduler.block_manager
    assert stats.kv_blocks_free == manager.num_blocks
    assert all(manager.ref_count(b) == 0 for b in range(manager.num_blocks))


def prompt(length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(1, 1000, length).tolist()


def first_plan_of(driver: Driver, req_id: int):
    for plan in driver.plans:
        for new in plan.new_requests:
            if new.req_id == req_id:
                index = plan.rows.tolist().index(new.row)
                return plan, new, index
    raise AssertionError(f"request {req_id} never admitted")


@pytest.mark.parametrize("async_mode", [True, False])
def test_abort_at_every_point_of_a_request_life(async_mode: bool) -> None:
    victim_prompt, other_prompt = prompt(10, 1), prompt(5, 2)
    for abort_before in range(9):
        driver = make(async_mode=async_mode, max_num_batched_tokens=4)
        driver.scheduler.add_request(0, other_prompt, SamplingParams(max_tokens=8))
        driver.scheduler.add_request(1, victim_prompt, SamplingParams(max_tokens=5))
        aborted_at: list[int] = []

        def before_step(index: int) -> None:
            if index == abort_before:
                aborted_at.append(len(driver.outputs[1]))
                driver.scheduler.abort(1)
                driver.finish_externally(1, FinishReason.ABORT)

        driver.run(before_step=before_step)
        # Waiting, mid-prefill, in flight, decoding, already finished: no token after the abort.
        assert driver.outputs[1] == reference_tokens(victim_prompt, 5)[: aborted_at[0]]
        assert driver.outputs[0] == reference_tokens(other_prompt, 8)
        assert_no_leak(driver)


def test_abort_of_unknown_or_finished_request_is_ignored() -> None:
    driver = make()
    driver.scheduler.add_request(0, prompt(3), SamplingParams(max_tokens=2))
    driver.run()
    driver.scheduler.abort(0)
    driver.scheduler.abort(42)
    assert_no_leak(driver)


@pytest.mark.parametrize("async_mode", [True, False])
def test_prefix_hit_skips_cached_blocks_and_keeps_outputs(async_mode: bool) -> None:
    driver = make(async_mode=async_mode)
    shared = prompt(9, 5)
    first, second = shared + [7, 8], shared[:8] + [3, 3, 3]
    driver.scheduler.add_request(0, first, SamplingParams(max_tokens=6))
    driver.run()
    driver.scheduler.add_request(1, second, SamplingParams(max_tokens=6))
    driver.scheduler.add_request(2, first + driver.outputs[0][:3], SamplingParams(max_tokens=3))
    driver.run()
    plan, new, index = first_plan_of(driver, 1)
    assert plan.num_computed_tokens[index] == 8 and plan.num_scheduled_tokens[index] == 3
    # Request 2's hit covers blocks holding request 0's generated tokens (14 tokens → 3 blocks).
    plan, new, index = first_plan_of(driver, 2)
    assert plan.num_computed_tokens[index] == 12
    assert driver.outputs[1] == reference_tokens(second, 6)
    assert driver.outputs[2] == reference_tokens(first + driver.outputs[0][:3], 3)
    stats = driver.scheduler.stats()  # the prefix cache hit rate's counts: 0 + 8 + 12 of 11 + 11 + 14
    assert (stats.prefix.num_hit_tokens, stats.prefix.num_queried_tokens) == (20, 36)
    assert_no_leak(driver)


def test_same_prefix_in_one_step_is_cached_once_and_hit_later() -> None:
    driver = make(async_mode=True)
    shared = prompt(12, 6)
    driver.scheduler.add_request(0, shared + [1], SamplingParams(max_tokens=2))
    driver.scheduler.add_request(1, shared + [2], SamplingParams(max_tokens=2))
    driver.run()
    assert len(driver.plans[0].new_requests) == 2
    manager = driver.scheduler.block_manager
    # Both computed the 3 shared blocks; one copy is cached, the duplicates went back plain.
    shared_hashes = [hash_block(None, np.array(shared[:4]))]
    for start in (4, 8):
        shared_hashes.append(hash_block(shared_hashes[-1], np.array(shared[start:start + 4])))
    assert manager.match_prefix(shared_hashes) and len(manager.match_prefix(shared_hashes)) == 3
    assert manager.num_cached_blocks == 3  # the 4th blocks never filled with computed tokens
    driver.scheduler.add_request(2, shared + [3], SamplingParams(max_tokens=2))
    driver.run()
    plan, new, index = first_plan_of(driver, 2)
    assert plan.num_computed_tokens[index] == 12
    assert driver.outputs[2] == reference_tokens(shared + [3], 2)
    assert_no_leak(driver)


def test_lru_evicts_least_recently_freed_cached_blocks_first() -> None:
    manager = BlockManager(6, BLOCK)
    hashes = [bytes([i]) * 16 for i in range(4)]
    first = manager.allocate(2)
    second = manager.allocate(2)
    for block_id, block_hash in zip(first + second, hashes):
        manager.commit(block_id, block_hash)
    manager.free(first[::-1])  # freed first: the oldest
    manager.free(second[::-1])
    assert manager.num_free_blocks == 6 and manager.num_cached_blocks == 4
    manager.allocate(3)  # 2 plain blocks, then evicts the oldest cached: first[1]
    assert manager.match_prefix(hashes[:2]) == [first[0]]
    assert manager.match_prefix(hashes[2:]) == second
    manager.take(second)  # a hit takes idle cached blocks out of the free pool
    assert manager.num_free_blocks == 1
    manager.allocate(1)
    assert manager.match_prefix(hashes[:1]) == []
    with pytest.raises(RuntimeError, match="asked for 1 blocks, 0 free"):
        manager.allocate(1)


@pytest.mark.parametrize("async_mode", [True, False])
def test_preemption_with_tiny_pool_recomputes_and_matches_reference(async_mode: bool) -> None:
    driver = make(num_blocks=8, async_mode=async_mode, max_model_len=32, max_num_batched_tokens=16)
    prompts = [prompt(6, 10 + i) for i in range(4)]
    for req_id, tokens in enumerate(prompts):
        driver.scheduler.add_request(req_id, tokens, SamplingParams(max_tokens=12))
    driver.run()
    assert driver.scheduler.num_preemptions > 0
    for req_id, tokens in enumerate(prompts):
        assert driver.outputs[req_id] == reference_tokens(tokens, 12)
        assert driver.finished[req_id] is FinishReason.LENGTH
    readmitted = [(p, n) for p in driver.plans for n in p.new_requests if n.token_ids.shape[0] > 6]
    assert readmitted
    for plan, new in readmitted:
        num_outputs = new.token_ids.shape[0] - 6
        assert new.num_prompt_tokens == 6
        assert new.token_ids.tolist() == prompts[new.req_id] + driver.outputs[new.req_id][:num_outputs]
    for plan in driver.plans:
        assert plan.new_block_ids.shape[0] == plan.num_new_blocks.sum()
    assert_no_leak(driver)


def test_preemption_while_steps_in_flight_drains_before_readmission() -> None:
    driver = make(num_blocks=6, async_mode=True, max_model_len=24, max_num_batched_tokens=32)
    prompts = [prompt(7, 20), prompt(7, 21)]
    for req_id, tokens in enumerate(prompts):
        driver.scheduler.add_request(req_id, tokens, SamplingParams(max_tokens=16))
    held: dict[int, int] = {}
    for _ in range(200):
        more = driver.step()
        plan = driver.plans[-1]
        for row in plan.freed_rows.tolist():
            held.pop(row, None)
        for new in plan.new_requests:
            # A row is never handed to a request while another still owns it.
            assert new.row not in held
            held[new.row] = new.req_id
        if not more:
            break
    assert driver.scheduler.num_preemptions > 0
    for req_id, tokens in enumerate(prompts):
        assert driver.outputs[req_id] == reference_tokens(tokens, 16)
    assert_no_leak(driver)


@pytest.mark.parametrize("async_mode", [True, False])
def test_offload_connector_hits_after_device_eviction_equal_outputs_from_scratch(async_mode: bool) -> None:
    driver = make(num_blocks=16, async_mode=async_mode, num_host_blocks=32, max_model_len=48)
    base = prompt(6, 30)
    driver.scheduler.add_request(0, base, SamplingParams(max_tokens=12))
    driver.run()
    connector = driver.scheduler.connector
    # Blocks holding generated tokens were saved only once computed (6 + 12 = 18 tokens;
    # the 18th token's KV is never computed: 4 full computed blocks).
    assert connector.num_stored_blocks == 4
    assert driver.scheduler.block_manager.reset_prefix_cache() == 4
    follow_up = base + driver.outputs[0][:10] + [5]  # 17 tokens: 4 full blocks can be loaded
    driver.scheduler.add_request(1, follow_up, SamplingParams(max_tokens=4))
    driver.run()
    plan, new, index = first_plan_of(driver, 1)
    assert plan.num_computed_tokens[index] == 16
    assert plan.connector_meta.load_block_ids.tolist() == plan.new_block_ids[:4].tolist()
    assert driver.runner.num_loaded_blocks == 4
    assert driver.outputs[1] == reference_tokens(follow_up, 4)
    assert_no_leak(driver)


def test_offload_host_pool_is_bounded_lru() -> None:
    driver = make(num_blocks=16, num_host_blocks=3, max_model_len=48)
    first, second = prompt(9, 40), prompt(9, 41)
    for req_id, tokens in enumerate((first, second)):
        driver.scheduler.add_request(req_id, tokens, SamplingParams(max_tokens=1))
        driver.run()
    connector = driver.scheduler.connector
    assert connector.num_stored_blocks == 3
    # first's 2 blocks were saved before second's: the host pool evicted first's oldest.
    driver.scheduler.block_manager.reset_prefix_cache()
    driver.scheduler.add_request(2, second + [1], SamplingParams(max_tokens=2))
    driver.scheduler.add_request(3, first + [1], SamplingParams(max_tokens=2))
    driver.run()
    assert first_plan_of(driver, 2)[0].num_computed_tokens[first_plan_of(driver, 2)[2]] == 8
    assert first_plan_of(driver, 3)[0].num_computed_tokens[first_plan_of(driver, 3)[2]] == 0
    assert driver.outputs[2] == reference_tokens(second + [1], 2)
    assert driver.outputs[3] == reference_tokens(first + [1], 2)
    assert_no_leak(driver)
