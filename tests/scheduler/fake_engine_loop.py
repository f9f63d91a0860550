"""The engine loop of the offline engine, reduced to scheduler + fake runner, for tests."""
from __future__ import annotations

from collections import defaultdict
from typing import Callable

from stages.gpu_runner.output import HostStepOutput
from stages.scheduler.plan import StepPlan
from stages.scheduler.request import FinishReason
from stages.scheduler.scheduler import Scheduler
from fake_step_runner import FakeRunner


class Driver:
    def __init__(self, scheduler: Scheduler, runner: FakeRunner, async_mode: bool) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.async_mode = async_mode
        self.outputs: dict[int, list[int]] = defaultdict(list)
        self.finished: dict[int, FinishReason] = {}
        self.plans: list[StepPlan] = []
        self._in_flight: tuple[StepPlan, HostStepOutput] | None = None

    def step(self) -> bool:
        """One loop turn: launch step N, then process step N-1 (async) or step N (sync)."""
        had_in_flight = self._in_flight is not None
        plan = self.scheduler.schedule()
        output = None if plan is None else self.runner.execute(plan)
        if plan is not None:
            self.plans.append(plan)
        if self.async_mode:
            if self._in_flight is not None:
                self._apply(*self._in_flight)
            self._in_flight = None if plan is None else (plan, output)
        elif plan is not None:
            self._apply(plan, output)
        if plan is None and not had_in_flight and self.scheduler.has_unfinished():
            raise AssertionError("scheduler stalled: nothing scheduled, nothing in flight")
        return self.scheduler.has_unfinished() or self._in_flight is not None

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

    def _apply(self, plan: StepPlan, output: HostStepOutput) -> None:
        update = self.scheduler.update(plan, output)
        for req_id, token_id in zip(update.req_ids.tolist(), update.token_ids.tolist()):
            if req_id in self.finished:
                raise AssertionError(f"token {token_id} reported for finished request {req_id}")
            self.outputs[req_id].append(token_id)
        for req_id, reason in update.finished:
            self.finished[req_id] = reason

    def finish_externally(self, req_id: int, reason: FinishReason) -> None:
        self.finished[req_id] = reason
