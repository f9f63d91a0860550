"""The engine's step loop over a scheduler and a fake runner, for tests."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from fake_step_runner import VOCAB, FakeRunner

from stages.contracts.config import EngineConfig, ModelLimits
from stages.contracts.connector import KVConnectorScheduler
from stages.contracts.outputs import FinishReason, HostStepOutput, StepUpdate
from stages.contracts.plan import StepPlan
from stages.scheduler.scheduler import Scheduler
from stages.scheduler.step_loop import StepLoop


def make_scheduler(num_blocks: int, block_size: int, eos: tuple[int, ...] = (),
                   connector: KVConnectorScheduler | None = None, *, max_model_len: int = 2048,
                   **config: object) -> Scheduler:
    """A scheduler over a KV pool of `num_blocks` blocks; `config` holds EngineConfig fields."""
    limits = ModelLimits(num_kv_blocks=num_blocks, max_model_len=max_model_len, vocab_size=VOCAB,
                         eos_token_ids=list(eos))
    return Scheduler(EngineConfig(block_size=block_size, **config), limits, connector)


class _FakeExecutor:
    """The fake runner computes a step's tokens at launch; they are ready at once."""

    def __init__(self, runner: FakeRunner, plans: list[StepPlan]) -> None:
        self.runner = runner
        self.plans = plans
        self.outputs: list[HostStepOutput] = []

    def launch(self, plan: StepPlan) -> None:
        self.plans.append(plan)
        self.outputs.append(self.runner.execute(plan))

    def poll(self, timeout_s: float | None) -> HostStepOutput:
        return self.outputs.pop(0)


class Driver:
    def __init__(self, scheduler: Scheduler, runner: FakeRunner, async_mode: bool) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.async_mode = async_mode
        self.outputs: dict[int, list[int]] = defaultdict(list)
        self.finished: dict[int, FinishReason] = {}
        self.plans: list[StepPlan] = []
        self.loop = StepLoop(scheduler, _FakeExecutor(runner, self.plans), async_scheduling=async_mode)

    def step(self) -> bool:
        """One loop turn: launch step N, then process step N-1 (async) or step N (sync)."""
        update = self.loop.turn()
        if update is not None:
            self._apply(update)
        elif self.loop.stuck:
            raise AssertionError("scheduler stalled: nothing scheduled, nothing in flight")
        return self.loop.busy

    def run(self, max_steps: int = 10_000, before_step: Callable[[int], None] | None = None) -> None:
        for index in range(max_steps):
            if before_step is not None:
                before_step(index)
            if not self.step():
                meta = self.scheduler.flush_connector()
                if meta is not None:
                    self.runner.save(meta)
                return
        raise AssertionError(f"not done after {max_steps} steps")

    def _apply(self, update: StepUpdate) -> None:
        for req_id, token_id in zip(update.req_ids.tolist(), update.token_ids.tolist()):
            if req_id in self.finished:
                raise AssertionError(f"token {token_id} reported for finished request {req_id}")
            self.outputs[req_id].append(token_id)
        for req_id, reason in update.finished:
            self.finished[req_id] = reason

    def finish_externally(self, req_id: int, reason: FinishReason) -> None:
        self.finished[req_id] = reason
