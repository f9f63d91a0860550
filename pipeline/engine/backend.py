"""What the daemon needs of an engine: the `Backend` protocol, and the health and stats it reports.

Two backends serve it: `StageBackend` (pipeline/engine/multiprocess.py), the stage processes
joined by rings, and `InProcessBackend` (pipeline/engine/inprocess.py), the same engine stepped
by a thread of the daemon's own process. The daemon and the stage supervisor see only this.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from stages.contracts.config import EngineConfig, ModelLimits
from stages.contracts.counters import SchedulerCounters
from stages.contracts.outputs import OutputEvent
from stages.contracts.params import SamplingParams

# How often a backend's stages are looked at (exit codes, a stage that died): by read_events
# while it waits, or by the supervisor's thread calling check_stages while the loop reads.
LIVENESS_CHECK_S = 0.1


@dataclass(slots=True)
class StageHealth:
    name: str
    pid: int
    alive: bool
    heartbeat_age_s: float  # seconds since the stage's loop last went round


@dataclass(slots=True)
class BackendStats:
    scheduler: SchedulerCounters = field(default_factory=SchedulerCounters)  # totals since the engine started
    generated_tokens_per_s: float = 0.0


class Backend(Protocol):
    """The engine behind the daemon. `read_events` is called by one thread (the supervisor's);
    the other methods may be called from another (the event loop's)."""

    instance: str
    limits: ModelLimits  # what the loaded model allows (the same after a restart)

    def submit(self, req_id: int, prompt: str | list[int], params: SamplingParams,
               output_token_ids: Sequence[int] = ()) -> None:
        """Queue a request without waiting; Overloaded when there is no room now, StageFailed
        when the engine is down. A request resumed after a restart gives the outputs it already
        delivered (`prompt` is then its prompt's token ids): it continues after them, with the
        same params, as if it had not stopped."""

    def abort(self, req_id: int) -> None:
        """Stop a request; its last event has finish_reason "abort". Unknown ids are ignored."""

    def read_events(self, timeout_s: float) -> list[OutputEvent]:
        """Output events, waiting up to timeout_s for some; StageFailed (its `stage` naming the
        stage, where one died) when the engine died. A backend may also offer `read_outputs`,
        the same with each step's plain events as one `TokenTexts` (StageBackend does): the
        supervisor reads that where it exists. A backend that offers `events_fd`, `arm_events`,
        `poll_outputs` and `check_stages` (StageBackend does) is read on the event loop instead,
        as its events descriptor turns readable, and its stages watched by the supervisor's thread."""

    def health(self) -> list[StageHealth]: ...

    def stats(self) -> BackendStats: ...

    def start_profile(self, directory: str) -> None: ...

    def stop_profile(self) -> list[str]: ...

    def close(self, timeout_s: float = 5.0) -> None: ...


BackendFactory = Callable[[EngineConfig, str], Backend]  # (config, instance id) -> a started backend
