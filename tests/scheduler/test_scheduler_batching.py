"""Scheduler + fake runner: batching, chunked prefill, limits, stop reasons, async vs sync."""
from __future__ import annotations

import numpy as np
import pytest

from fake_engine_loop import Driver, make_scheduler
from fake_step_runner import FakeRunner, reference_tokens
from stages.contracts.params import SamplingParams
from stages.contracts.config import EngineConfig, ModelLimits
from stages.contracts.outputs import FinishReason
from stages.scheduler.scheduler import Scheduler

pytestmark = pytest.mark.timeout(20)
BLOCK = 4


def make(num_blocks: int = 64, async_mode: bool = True, eos: tuple[int, ...] = (), **config: object) -> Driver:
    config.setdefault("max_model_len", 128)
    scheduler = make_scheduler(num_blocks, BLOCK, eos, **config)
    return Driver(scheduler, FakeRunner(num_blocks, BLOCK), async_mode)


def assert_no_leak(driver: Driver) -> None:
    stats = driver.scheduler.stats()
    assert (stats.num_waiting, stats.num_running, stats.num_draining) == (0, 0, 0)
    assert stats.kv_blocks_free == driver.scheduler.block_manager.num_blocks
    manager = driver.scheduler.block_manager
    assert all(manager.ref_count(b) == 0 for b in range(manager.num_blocks))


def prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 1000, length).tolist() for _ in range(count)]


@pytest.mark.parametrize("async_mode", [True, False])
def test_chunked_prefill_exact_token_counts_while_decodes_run(async_mode: bool) -> None:
    driver = make(async_mode=async_mode, max_num_batched_tokens=8)
    short, long = prompts(1, 3)[0], prompts(1, 20, seed=1)[0]
    driver.scheduler.add_request(0, short, SamplingParams(max_tokens=6, temperature=0))
    driver.step()  # request 0 prefills alone (3 tokens)
    driver.scheduler.add_request(1, long, SamplingParams(max_tokens=2, temperature=0))
    driver.run()
    counts = [dict(zip(p.rows.tolist(), p.num_scheduled_tokens.tolist())) for p in driver.plans]
    # Row 0 decodes one token every step while row 1's 20-token prompt is chunked 7 + 7 + 6,
    # then row 1 decodes once more (max_tokens 2).
    assert counts[:6] == [{0: 3}, {0: 1, 1: 7}, {0: 1, 1: 7}, {0: 1, 1: 6}, {0: 1, 1: 1}, {0: 1}]
    assert [p.sample.tolist() for p in driver.plans[1:4]] == [[True, False], [True, False], [True, True]]
    assert driver.outputs[0] == reference_tokens(short, 6)
    assert driver.outputs[1] == reference_tokens(long, 2)
    assert driver.finished == {0: FinishReason.LENGTH, 1: FinishReason.LENGTH}
    assert_no_leak(driver)


@pytest.mark.parametrize("async_mode", [True, False])
def test_many_requests_match_reference_under_limits(async_mode: bool) -> None:
    driver = make(num_blocks=48, async_mode=async_mode, max_num_seqs=5, max_num_batched_tokens=16)
    batch = [p[: 3 + i % 9] for i, p in enumerate(prompts(12, 12))]
    for req_id, prompt in enumerate(batch):
        driver.scheduler.add_request(req_id, prompt, SamplingParams(max_tokens=4 + req_id % 5))
    driver.run()
    for plan in driver.plans:
        assert plan.num_rows <= 5 and plan.num_tokens <= 16
        assert set(plan.rows.tolist()) <= set(range(5))
    for req_id, prompt in enumerate(batch):
        assert driver.outputs[req_id] == reference_tokens(prompt, 4 + req_id % 5)
    assert_no_leak(driver)


def test_async_and_sync_give_identical_outputs_with_async_one_step_ahead() -> None:
    results = {}
    for async_mode in (True, False):
        driver = make(async_mode=async_mode, max_num_batched_tokens=10, max_num_seqs=4)
        for req_id, prompt in enumerate(prompts(6, 9)):
            driver.scheduler.add_request(req_id, prompt, SamplingParams(max_tokens=7))
        driver.run()
        results[async_mode] = (dict(driver.outputs), len(driver.plans))
        assert_no_leak(driver)
    assert results[True][0] == results[False][0]


@pytest.mark.parametrize("async_mode", [True, False])
def test_eos_and_stop_token_finish_with_stop_and_report_the_stop_token(async_mode: bool) -> None:
    prompt_a, prompt_b = prompts(2, 5, seed=3)
    ref_a, ref_b = reference_tokens(prompt_a, 10), reference_tokens(prompt_b, 10)
    driver = make(async_mode=async_mode, eos=(ref_a[3],))
    driver.scheduler.add_request(0, prompt_a, SamplingParams(max_tokens=10))
    driver.scheduler.add_request(1, prompt_b, SamplingParams(max_tokens=10, stop_token_ids=[ref_b[2]]))
    driver.scheduler.add_request(2, prompt_a, SamplingParams(max_tokens=10, ignore_eos=True))
    driver.scheduler.add_request(3, prompt_a, SamplingParams(max_tokens=10, min_tokens=5))
    driver.run()
    assert driver.outputs[0] == ref_a[:4] and driver.finished[0] is FinishReason.STOP
    assert driver.outputs[1] == ref_b[:3] and driver.finished[1] is FinishReason.STOP
    assert driver.outputs[2] == ref_a and driver.finished[2] is FinishReason.LENGTH
    assert driver.outputs[3] == ref_a and driver.finished[3] is FinishReason.LENGTH  # EOS before min_tokens
    assert_no_leak(driver)


@pytest.mark.parametrize("async_mode", [True, False])
def test_max_model_len_finishes_with_length(async_mode: bool) -> None:
    driver = make(async_mode=async_mode, max_model_len=12)
    prompt = prompts(1, 9)[0]
    driver.scheduler.add_request(0, prompt, SamplingParams(max_tokens=50))
    driver.run()
    assert driver.outputs[0] == reference_tokens(prompt, 3)
    assert driver.finished[0] is FinishReason.LENGTH
    assert_no_leak(driver)


def test_max_tokens_guard_never_schedules_a_step_whose_token_would_be_discarded() -> None:
    driver = make(async_mode=True)
    driver.scheduler.add_request(0, prompts(1, 4)[0], SamplingParams(max_tokens=3))
    driver.run()
    # Steps: prefill (1st token), 2 decodes; no 4th step although async runs one step ahead.
    assert len(driver.plans) == 3 and all(p.sample.all() for p in driver.plans)
    assert len(driver.outputs[0]) == 3
    assert_no_leak(driver)


def test_token_sampled_after_a_finish_is_discarded_not_reported() -> None:
    prompt = prompts(1, 4)[0]
    ref = reference_tokens(prompt, 10)
    driver = make(async_mode=True, eos=(ref[1],))
    driver.scheduler.add_request(0, prompt, SamplingParams(max_tokens=10))
    driver.run()
    # Plan 2 (3rd token) was built before step 1's EOS was seen: it ran, its token was dropped.
    assert len(driver.plans) == 3 and driver.runner.steps[2].sample.tolist() == [True]
    assert driver.outputs[0] == ref[:2] and driver.finished[0] is FinishReason.STOP
    # The row is freed only after that extra step was processed.
    assert driver.plans[2].freed_rows.size == 0
    assert_no_leak(driver)


def test_rows_freed_in_next_plan_after_last_in_flight_step_and_reused() -> None:
    driver = make(async_mode=True, max_num_seqs=1)
    driver.scheduler.add_request(0, prompts(1, 4)[0], SamplingParams(max_tokens=2))
    driver.scheduler.add_request(1, prompts(1, 4, seed=9)[0], SamplingParams(max_tokens=2))
    driver.run()
    assert [p.rows.tolist() for p in driver.plans] == [[0], [0], [0], [0]]
    assert [p.freed_rows.tolist() for p in driver.plans] == [[], [], [0], []]
    assert [[n.req_id for n in p.new_requests] for p in driver.plans] == [[0], [], [1], []]
    assert_no_leak(driver)


def test_config_and_prompt_errors_name_the_bad_value() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match=r"attention_backend must be one of \['auto', 'torch', 'triton'\], got 'flash'"):
        EngineConfig(attention_backend="flash")
    with pytest.raises(ValueError, match="enforce_eager must be True or False"):
        EngineConfig(enforce_eager="yes")
    with pytest.raises(ValueError, match="max_model_len 256 exceeds the KV cache"):
        Scheduler(EngineConfig(block_size=16), ModelLimits(num_kv_blocks=8, max_model_len=256, vocab_size=1000))
    scheduler = Scheduler(EngineConfig(block_size=4), ModelLimits(num_kv_blocks=8, max_model_len=16, vocab_size=1000))
    with pytest.raises(ValueError, match="16 tokens; max_model_len 16"):
        scheduler.add_request(0, list(range(16)), SamplingParams())
    with pytest.raises(ValueError, match="non-empty"):
        scheduler.add_request(1, [], SamplingParams())
