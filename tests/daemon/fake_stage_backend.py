"""FakeBackend: a TEST DOUBLE of the `Backend` protocol (pipeline/serve/backend.py) with no processes, for the supervisor's tests.

It serves nothing: submitted requests stay in flight until the test makes the "stages" fail
with `fail(reason, stage)`, which read_events then raises as StageFailed, as a real backend does
when a stage dies. `FakeFactory` makes them, or raises what the test lines up (a restart that fails).
"""
from __future__ import annotations

import os
import threading
from collections.abc import Sequence

from pipeline.engine.backend import BackendStats, StageHealth
from stages.contracts.config import EngineConfig, ModelLimits
from stages.contracts.counters import SchedulerCounters
from stages.contracts.outputs import OutputEvent
from pipeline.errors import Overloaded, StageFailed
from pipeline.protocol import Delta
from stages.contracts.params import SamplingParams


class FakeBackend:
    def __init__(self, config: EngineConfig, instance: str) -> None:
        self.instance = instance
        self.limits = ModelLimits(num_kv_blocks=64, max_model_len=2048, vocab_size=1024, eos_token_ids=[1])
        self.submitted: list[int] = []
        self.room: int | None = None  # requests the request ring holds (submit raises Overloaded beyond)
        self.aborted: list[int] = []
        self.closed = False
        self._failure: str | None = None
        self._failed_stage: str | None = None
        self._failed = threading.Event()

    def fail(self, reason: str, stage: str | None = None) -> None:
        self._failure = reason
        self._failed_stage = stage
        self._failed.set()

    def submit(self, req_id: int, prompt: str | list[int], params: SamplingParams,
               output_token_ids: Sequence[int] = ()) -> None:
        if self.room is not None and len(self.submitted) >= self.room:
            raise Overloaded(f"the fake request ring holds {self.room} requests")
        self.submitted.append(req_id)

    def abort(self, req_id: int) -> None:
        self.aborted.append(req_id)

    def read_events(self, timeout_s: float) -> list[OutputEvent]:
        if self._failed.wait(timeout_s):
            raise StageFailed(str(self._failure), stage=self._failed_stage)
        return []

    def health(self) -> list[StageHealth]:
        return [StageHealth("fake", os.getpid(), not self._failed.is_set(), 0.0)]

    def stats(self) -> BackendStats:
        return BackendStats(SchedulerCounters(num_running=len(self.submitted), kv_blocks_free=16))

    def close(self, timeout_s: float = 5.0) -> None:
        self.closed = True


class FakeFactory:
    """Makes FakeBackends; each call first waits for `allow_start`, then raises the next queued
    exception, if any."""

    def __init__(self) -> None:
        self.made: list[FakeBackend] = []
        self.failures: list[Exception] = []
        self.allow_start = threading.Event()
        self.allow_start.set()

    def __call__(self, config: EngineConfig, instance: str) -> FakeBackend:
        if not self.allow_start.wait(10):
            raise TimeoutError("the test never let the fake stages start")
        if self.failures:
            raise self.failures.pop(0)
        backend = FakeBackend(config, instance)
        self.made.append(backend)
        return backend


class RecordingConnection:
    """Stands in for a client connection of DaemonServer: records what the daemon sends it."""

    def __init__(self) -> None:
        self.requests: dict[str, object] = {}
        self.sent: list[object] = []

    def send(self, message: object) -> None:
        self.sent.append(message)

    def send_text(self, request_id: str, text: str, token_ids: list[int]) -> None:
        self.sent.append(Delta(request_id, text, token_ids))
