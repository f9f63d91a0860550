"""The one-ahead step loop: launch step N, then apply step N-1's tokens while step N runs.

Every driver of the engine turns this one loop: the offline engine and the in-process backend
(the runner in the same process), the scheduler stage (the runner in another process), tests and
benchmarks. What differs is only where a step runs and how its tokens come back: the executor.
Sync mode keeps one step in flight, so each step's tokens are applied before the next is planned.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

from stages.contracts.outputs import HostStepOutput, StepUpdate
from stages.contracts.plan import StepPlan


class Planner(Protocol):
    """What the loop needs of a scheduler (the Scheduler, or a test's plan maker)."""

    @property
    def num_steps_in_flight(self) -> int: ...

    def schedule(self) -> StepPlan | None: ...

    def update(self, output: HostStepOutput) -> StepUpdate | None: ...

    def has_unfinished(self) -> bool: ...


class StepExecutor(Protocol):
    """Runs plans in order and hands their tokens back in the same order."""

    def launch(self, plan: StepPlan) -> None: ...

    def poll(self, timeout_s: float | None) -> HostStepOutput | None:
        """The oldest launched step's tokens once they are ready; None if they are not within
        `timeout_s` (None: wait as long as it takes)."""


class StepResult(Protocol):
    def to_host(self) -> HostStepOutput: ...


class RunnerLike(Protocol):
    """What a local executor needs of a runner (the ModelRunner, or a test or benchmark stand-in)."""

    def execute(self, plan: StepPlan) -> StepResult: ...


class LocalExecutor:
    """A runner in this process: `execute` returns before the device is done; `poll` waits."""

    def __init__(self, runner: RunnerLike) -> None:
        self.runner = runner
        self._results: deque[StepResult] = deque()

    def launch(self, plan: StepPlan) -> None:
        self._results.append(self.runner.execute(plan))

    def poll(self, timeout_s: float | None) -> HostStepOutput | None:
        return self._results.popleft().to_host()


class StepLoop:
    def __init__(self, scheduler: Planner, executor: StepExecutor, *, async_scheduling: bool) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.max_in_flight = 2 if async_scheduling else 1
        self.num_steps = 0
        self._launched = False
        # Marks the phases of a turn (a stage process sets its NVTX/profiler ranges here).
        self.phase: Callable[[str], AbstractContextManager] = nullcontext

    @property
    def busy(self) -> bool:
        """Requests are unfinished, or a step is still in flight."""
        return self.scheduler.has_unfinished() or self.scheduler.num_steps_in_flight > 0

    @property
    def stuck(self) -> bool:
        """Requests wait, yet the last turn launched nothing and no step is in flight."""
        scheduler = self.scheduler
        return not self._launched and not scheduler.num_steps_in_flight and scheduler.has_unfinished()

    def turn(self, wait_s: float | None = None) -> StepUpdate | None:
        """Launch the next plan if one more may be in flight; then, unless there is room to plan
        yet another first, apply the oldest step once its tokens are ready (waiting up to
        `wait_s`). Returns that step's update, or None."""
        scheduler = self.scheduler
        self._launched = False
        if scheduler.num_steps_in_flight < self.max_in_flight:
            with self.phase("schedule"):
                plan = scheduler.schedule()
            if plan is not None:
                self.executor.launch(plan)
                self.num_steps += 1
                self._launched = True
                if scheduler.num_steps_in_flight < self.max_in_flight:
                    return None
        if not scheduler.num_steps_in_flight:
            return None
        output = self.executor.poll(wait_s)
        if output is None:
            return None
        with self.phase("apply_step"):
            return scheduler.update(output)
