"""The step loop: async keeps one plan ahead, sync applies each step first; waits are bounded;
and the scheduler's stage bookkeeping (early and late aborts) in one process."""
from __future__ import annotations

import numpy as np
import pytest
from fake_engine_loop import make_scheduler
from fake_step_runner import FakeRunner

from stages.contracts.outputs import HostStepOutput
from stages.contracts.params import SamplingParams
from stages.contracts.plan import StepPlan
from stages.scheduler.registry import RequestRegistry
from stages.scheduler.step_loop import StepLoop

pytestmark = pytest.mark.timeout(20)
BLOCK = 4


class RecordingExecutor:
    """Runs plans on the fake runner; a step's tokens are ready only once `ready` says so."""

    def __init__(self) -> None:
        self.runner = FakeRunner(64, BLOCK)
        self.events: list[str] = []
        self.outputs: list[HostStepOutput] = []
        self.num_ready = 10**9

    def launch(self, plan: StepPlan) -> None:
        self.events.append(f"launch {plan.step}")
        self.outputs.append(self.runner.execute(plan))

    def poll(self, timeout_s: float | None) -> HostStepOutput | None:
        if self.num_ready <= 0:
            return None
        self.num_ready -= 1
        output = self.outputs.pop(0)
        self.events.append(f"apply {output.step}")
        return output


def loop_with_one_request(async_scheduling: bool, max_tokens: int = 3) -> tuple[StepLoop, RecordingExecutor]:
    scheduler = make_scheduler(64, BLOCK, max_model_len=64)
    scheduler.add_request(0, [5, 6, 7], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    executor = RecordingExecutor()
    return StepLoop(scheduler, executor, async_scheduling=async_scheduling), executor


@pytest.mark.parametrize("async_scheduling, order", [
    (True, ["launch 0", "launch 1", "apply 0", "launch 2", "apply 1", "apply 2"]),
    (False, ["launch 0", "apply 0", "launch 1", "apply 1", "launch 2", "apply 2"]),
])
def test_async_plans_step_n_plus_1_before_applying_step_n(async_scheduling: bool, order: list[str]) -> None:
    loop, executor = loop_with_one_request(async_scheduling)
    tokens = []
    while loop.busy:
        update = loop.turn()
        if update is not None:
            tokens += update.token_ids.tolist()
    assert executor.events == order
    assert len(tokens) == 3 and loop.num_steps == 3
    assert loop.scheduler.num_steps_in_flight == 0


def test_a_step_not_ready_in_time_is_applied_by_a_later_turn() -> None:
    loop, executor = loop_with_one_request(async_scheduling=True)
    executor.num_ready = 0
    assert loop.turn(wait_s=0.0) is None and loop.turn(wait_s=0.0) is None
    assert executor.events == ["launch 0", "launch 1"]  # never more than one plan ahead
    assert loop.turn(wait_s=0.0) is None and loop.scheduler.num_steps_in_flight == 2
    executor.num_ready = 1
    update = loop.turn(wait_s=0.0)
    assert update is not None and update.step == 0 and executor.events[-1] == "apply 0"


def test_update_refuses_tokens_of_another_step() -> None:
    scheduler = make_scheduler(64, BLOCK, max_model_len=64)
    with pytest.raises(RuntimeError, match="no step is in flight"):
        scheduler.update(HostStepOutput(0, np.zeros(0, np.int32), np.zeros(0, np.int32), None, None))
    scheduler.add_request(0, [5, 6], SamplingParams(max_tokens=4))
    plan = scheduler.schedule()
    with pytest.raises(RuntimeError, match="update for step 1, expected step 0"):
        scheduler.update(HostStepOutput(1, plan.sampled_rows, np.ones(1, np.int32), None, None))


def test_an_early_abort_waits_for_its_request_and_a_late_one_is_dropped() -> None:
    registry = RequestRegistry(recently_ended=2)
    assert registry.abort(5) is False  # request 5 is still in a tokenizer
    assert registry.admit(5) is False  # so it ends on arrival
    assert registry.admit(6) is True
    assert registry.abort(6) is True and registry.live == set()
    assert registry.abort(6) is False and registry.early_aborts == set()  # late: it ended just now
    for req_id in (7, 8, 9):
        registry.admit(req_id)
        registry.ended(req_id)
    # Only the last `recently_ended` are remembered; an older id looks early again.
    assert registry.abort(9) is False and registry.early_aborts == set()
    assert registry.abort(6) is False and registry.early_aborts == {6}


def test_updates_name_each_request_first_admitted_in_their_step_once() -> None:
    scheduler = make_scheduler(6, BLOCK, max_model_len=24, max_num_batched_tokens=4)
    loop = StepLoop(scheduler, RecordingExecutor(), async_scheduling=False)
    for req_id in (0, 1):  # 2 x 10 prompt tokens in 4-token steps, and KV for one at a time: preemption
        scheduler.add_request(req_id, list(range(2, 12)), SamplingParams(max_tokens=8, ignore_eos=True))
    admitted = []
    while loop.busy:
        update = loop.turn()
        if update is not None:
            admitted += update.admitted
    assert sorted(req_id for req_id, _ in admitted) == [0, 1]
    assert all(isinstance(ns, int) and ns > 0 for _, ns in admitted)
    assert scheduler.num_preemptions > 0  # re-admitted after preemption, yet named once
