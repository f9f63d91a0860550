"""The engine in the daemon's own process: a Backend stepped by one thread, no rings, no stages.

The same scheduler, runner and output processor as the stage processes, driven by the one-process
engine loop (`Engine`) in a thread: the daemon cannot tell the difference, requests go in and
`OutputEvent`s come out. `pipeline start --in-process` serves with it; it suits debugging and
small deployments, and gives up only the overlap of host work across processes.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.engine.llm import LLM
from pipeline.errors import StageFailed
from pipeline.engine.backend import BackendStats, StageHealth
from stages.contracts.config import EngineConfig
from stages.contracts.outputs import OutputEvent
from stages.contracts.params import SamplingParams
from stages.tokenizer.prompt_check import check_prompt

IDLE_WAIT_S = 0.1  # how long the idle engine thread blocks for a request before it beats again


@dataclass(slots=True)
class _Submit:
    req_id: int
    prompt: str | list[int]
    params: SamplingParams
    output_token_ids: Sequence[int]


@dataclass(slots=True)
class _Abort:
    req_id: int


class _IntakeFailed(Exception):
    """Taking in a request (tokenizing, checking, adding it) failed: the tokenizer's part of the work."""


class InProcessBackend:
    def __init__(self, config: EngineConfig, instance: str) -> None:
        self.instance = instance
        self.llm = LLM(config.model, **{name: value for name, value in config.to_dict().items() if name != "model"})
        self._engine = self.llm.engine
        self.limits = self.llm.limits
        self._inbox: queue.SimpleQueue[_Submit | _Abort | None] = queue.SimpleQueue()
        self._events: list[OutputEvent] = []
        self._events_ready = threading.Condition()
        self._failure: str | None = None
        self._failed_stage = "engine"  # the part of the engine's work that failed, as a stage name
        self._closing = threading.Event()
        self._num_generated = 0
        self._started_at = time.monotonic()
        self._heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="pipeline-engine", daemon=True)
        self._thread.start()

    # ---- the Backend protocol

    def submit(self, req_id: int, prompt: str | list[int], params: SamplingParams,
               output_token_ids: Sequence[int] = ()) -> None:
        if self._failure is not None:
            raise StageFailed(self._failure, stage=self._failed_stage)
        self._inbox.put(_Submit(req_id, prompt, params, output_token_ids))

    def abort(self, req_id: int) -> None:
        self._inbox.put(_Abort(req_id))

    def read_events(self, timeout_s: float) -> list[OutputEvent]:
        with self._events_ready:
            self._events_ready.wait_for(lambda: self._events or self._failure is not None, timeout=timeout_s)
            if self._failure is not None:
                raise StageFailed(self._failure, stage=self._failed_stage)
            events, self._events = self._events, []
        return events

    def health(self) -> list[StageHealth]:
        return [StageHealth("engine", os.getpid(), self._thread.is_alive(), time.monotonic() - self._heartbeat)]

    def stats(self) -> BackendStats:
        elapsed_s = max(time.monotonic() - self._started_at, 1e-9)
        return BackendStats(self.llm.scheduler.stats(), self._num_generated / elapsed_s)

    def start_profile(self, directory: str) -> None:
        raise StageFailed("the in-process engine has no stage processes to profile; profile the daemon itself")

    def stop_profile(self) -> list[str]:
        raise StageFailed("the in-process engine has no stage processes to profile")

    def close(self, timeout_s: float = 5.0) -> None:
        self._closing.set()
        self._inbox.put(None)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.llm.close()  # the other tensor-parallel ranks, if any

    # ---- the engine thread

    def _run(self) -> None:
        try:
            while not self._closing.is_set():
                self._take_inbox(block=not self._engine.busy)
                self._heartbeat = time.monotonic()
                if self._engine.busy:
                    self._emit(self._engine.step())
        except _IntakeFailed as exc:  # the tokenizer's work: the daemon's poison guard suspects fewer requests
            cause = exc.__cause__
            self._fail("tokenizer", f"the engine thread died taking in a request: {type(cause).__name__}: {cause}")
        except Exception as exc:  # noqa: BLE001 - a dead engine, as the daemon will see it
            self._fail("engine", f"the engine thread died: {type(exc).__name__}: {exc}")

    def _fail(self, stage: str, message: str) -> None:
        with self._events_ready:
            self._failed_stage = stage
            self._failure = message
            self._events_ready.notify_all()

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        events: list[OutputEvent] = []
        while item is not None:
            if isinstance(item, _Submit):
                try:
                    events.extend(self.add(item.req_id, item.prompt, item.params, item.output_token_ids))
                except Exception as exc:
                    raise _IntakeFailed from exc
            else:
                event = self._engine.abort(item.req_id)
                if event is not None:
                    events.append(event)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
        self._emit(events)

    def add(self, req_id: int, prompt: str | list[int], params: SamplingParams,
            output_token_ids: Sequence[int] = ()) -> list[OutputEvent]:
        """Tokenizes and checks the prompt, then hands the request to the engine (a resumed one
        with the outputs it already delivered); a refused prompt gives its one error event."""
        token_ids = prompt
        if isinstance(prompt, str):
            token_ids = self.llm.prompt_encoder.encode(prompt)
        problem = check_prompt(token_ids, self.llm.vocab_size, self.llm.max_model_len,
                               num_output_tokens=len(output_token_ids))
        if problem is not None:
            return [self._engine.outputs.reject(req_id, problem.code, problem.message, problem.field or None)]
        self._engine.add_request(req_id, token_ids, params, output_token_ids)
        return []

    def _emit(self, events: list[OutputEvent]) -> None:
        if not events:
            return
        self._num_generated += sum(len(event.token_ids) for event in events)
        with self._events_ready:
            self._events.extend(events)
            self._events_ready.notify_all()

