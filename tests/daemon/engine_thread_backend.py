"""EngineThreadBackend: a TEST DOUBLE of `pipeline.backend.Backend`, for daemon tests.

It serves the Backend interface with the offline engine's parts (scheduler, model runner,
incremental detokenizer, as built by `pipeline.LLM`) stepped by one thread in this process,
instead of stage processes joined by rings. The daemon cannot tell the difference: requests in,
`OutputEvent`s out. A text prompt containing FAIL_PROMPT makes the engine thread die, which
the daemon sees as a stage failure.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np

from pipeline.backend import BackendStats, EngineConfig, OutputEvent, StageHealth
from pipeline.errors import StageFailed
from pipeline.llm import LLM
from pipeline.sampling_params import SamplingParams
from stages.detokenizer.incremental import IncrementalDetokenizer
from stages.scheduler.plan import StepPlan
from stages.scheduler.request import FinishReason

FAIL_PROMPT = "<<kill the engine>>"


@dataclass(slots=True)
class _Tracked:
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    sent_prompt: bool = False


class EngineThreadBackend:
    def __init__(self, config: EngineConfig, instance: str) -> None:
        self._llm = LLM(config.model, device="cpu", dtype=config.dtype, async_scheduling=config.async_scheduling,
                        enable_prefix_caching=config.enable_prefix_caching, block_size=config.block_size,
                        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                        max_model_len=config.max_model_len, num_kv_blocks=config.num_kv_blocks,
                        kv_connector=config.kv_connector)
        self._num_kv_blocks = self._llm.runner.num_kv_blocks
        self._inbox: queue.SimpleQueue[tuple[str, int, object, SamplingParams | None]] = queue.SimpleQueue()
        self._events: list[OutputEvent] = []
        self._events_ready = threading.Condition()
        self._tracked: dict[int, _Tracked] = {}
        self._failure: str | None = None
        self._closing = threading.Event()
        self._num_generated = 0
        self._started_at = time.monotonic()
        self._heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="engine-thread-backend", daemon=True)
        self._thread.start()

    # ---- the Backend interface

    def submit(self, req_id: int, prompt: str | list[int], params: SamplingParams) -> None:
        self._inbox.put(("submit", req_id, prompt, params))

    def abort(self, req_id: int) -> None:
        self._inbox.put(("abort", req_id, None, None))

    def read_events(self, timeout_s: float) -> list[OutputEvent]:
        with self._events_ready:
            self._events_ready.wait_for(lambda: self._events or self._failure is not None, timeout=timeout_s)
            if self._failure is not None:
                raise StageFailed(self._failure)
            events, self._events = self._events, []
        return events

    def health(self) -> list[StageHealth]:
        return [StageHealth("engine", os.getpid(), self._thread.is_alive(), time.monotonic() - self._heartbeat)]

    def stats(self) -> BackendStats:
        stats = self._llm.scheduler.stats()
        elapsed_s = max(time.monotonic() - self._started_at, 1e-9)
        return BackendStats(stats.num_waiting, stats.num_running + stats.num_draining, stats.num_used_blocks,
                            self._num_kv_blocks - stats.num_used_blocks, self._num_generated / elapsed_s, 0)

    def close(self, timeout_s: float = 5.0) -> None:
        self._closing.set()
        self._inbox.put(("close", -1, None, None))
        self._thread.join(timeout_s)

    # ---- the engine thread

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # noqa: BLE001 - a dead stage, as the daemon will see it
            with self._events_ready:
                self._failure = f"engine thread died: {exc}"
                self._events_ready.notify_all()

    def _loop(self) -> None:
        scheduler, runner = self._llm.scheduler, self._llm.runner
        in_flight: tuple[StepPlan, object] | None = None
        while not self._closing.is_set():
            idle = in_flight is None and not scheduler.has_unfinished()
            self._take_inbox(block=idle)
            self._heartbeat = time.monotonic()
            plan = scheduler.schedule()
            result = None if plan is None else runner.execute(plan)
            if not self._llm.engine.async_scheduling:
                if plan is not None:
                    self._process(plan, result.to_host())
            else:
                if in_flight is not None:
                    self._process(in_flight[0], in_flight[1].to_host())
                in_flight = None if plan is None else (plan, result)

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, req_id, prompt, params = item
            if kind == "submit":
                self._add(req_id, prompt, params)
            elif kind == "abort" and self._tracked.pop(req_id, None) is not None:
                self._llm.scheduler.abort(req_id)
                self._emit([OutputEvent(req_id, "", np.zeros(0, np.int32), finish_reason="abort")])
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, req_id: int, prompt: str | list[int], params: SamplingParams) -> None:
        if isinstance(prompt, str) and FAIL_PROMPT in prompt:
            raise RuntimeError("asked to fail by the test prompt")
        try:
            token_ids = self._llm._tokenize(0, prompt)
        except ValueError as exc:
            code = "prompt_too_long" if "max_model_len" in str(exc) else "invalid_params"
            self._emit([OutputEvent(req_id, "", np.zeros(0, np.int32), error_code=code, error_message=str(exc),
                                    error_field=None if code == "prompt_too_long" else "prompt")])
            return
        self._llm.scheduler.add_request(req_id, token_ids, params)
        detokenizer = IncrementalDetokenizer(self._llm.tokenizer, token_ids, params)
        self._tracked[req_id] = _Tracked(token_ids, params, detokenizer)

    def _process(self, plan: StepPlan, host: object) -> None:
        update = self._llm.scheduler.update(plan, host)
        new_tokens: dict[int, list[int]] = {}
        new_text: dict[int, list[str]] = {}
        rows: dict[int, list[int]] = {}
        finished: dict[int, str] = {}
        for i, (req_id, token_id) in enumerate(zip(update.req_ids.tolist(), update.token_ids.tolist())):
            request = self._tracked.get(req_id)
            if request is None or req_id in finished:
                continue
            new_tokens.setdefault(req_id, []).append(token_id)
            rows.setdefault(req_id, []).append(int(update.output_index[i]))
            delta = request.detokenizer.add([token_id])
            new_text.setdefault(req_id, []).append(delta.text)
            if delta.stopped:
                finished[req_id] = FinishReason.STOP.value
                self._llm.scheduler.finish(req_id, FinishReason.STOP)
        for req_id, reason in update.finished:
            if req_id in self._tracked and req_id not in finished:
                finished[req_id] = reason.value
        events = []
        for req_id in new_tokens.keys() | finished.keys():
            request = self._tracked[req_id]
            text = "".join(new_text.get(req_id, []))
            if req_id in finished:
                text += request.detokenizer.flush()
                del self._tracked[req_id]
            event = OutputEvent(req_id, text, np.asarray(new_tokens.get(req_id, []), np.int32),
                                finish_reason=finished.get(req_id))
            if not request.sent_prompt:
                event.prompt_token_ids = np.asarray(request.prompt_token_ids, np.int32)
                request.sent_prompt = True
            if request.params.logprobs is not None and host.logprobs is not None and req_id in rows:
                width = 1 + request.params.logprobs
                event.logprobs = host.logprobs[rows[req_id], :width].copy()
                event.logprob_token_ids = host.logprob_token_ids[rows[req_id], :width].copy()
            events.append(event)
        self._num_generated += update.num_tokens
        self._emit(events)

    def _emit(self, events: list[OutputEvent]) -> None:
        if events:
            with self._events_ready:
                self._events.extend(events)
                self._events_ready.notify_all()
