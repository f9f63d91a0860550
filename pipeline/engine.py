"""The one-process engine loop: scheduler, runner and detokenization driven in one thread.

Async mode overlaps host work with the device: launch step N, then post-process step N-1
(whose tokens are ready or nearly so) while step N runs. Sync mode waits for each step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tokenizers import Tokenizer

from pipeline.sampling_params import SamplingParams
from stages.detokenizer.incremental import IncrementalDetokenizer, stop_token_reason
from stages.gpu_runner.output import HostStepOutput
from stages.scheduler.connector import KVConnectorWorker
from stages.scheduler.plan import StepPlan
from stages.scheduler.request import FinishReason
from stages.scheduler.scheduler import Scheduler


class StepResult(Protocol):
    def to_host(self) -> HostStepOutput: ...


class RunnerLike(Protocol):
    """What the engine needs of a runner (the real ModelRunner, or a benchmark harness)."""

    def execute(self, plan: StepPlan) -> StepResult: ...


@dataclass(slots=True)
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it; None for EOS
    # Per output token: {token_id: logprob}, the sampled token first, then the top `logprobs`.
    logprobs: list[dict[int, float]] | None = None


@dataclass(slots=True)
class _Tracked:
    output: RequestOutput
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None


class Engine:
    def __init__(self, runner: RunnerLike, scheduler: Scheduler, *, async_scheduling: bool = True,
                 tokenizer: Tokenizer | None = None, connector_worker: KVConnectorWorker | None = None) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.async_scheduling = async_scheduling
        self.tokenizer = tokenizer
        self.connector_worker = connector_worker
        self._tracked: dict[int, _Tracked] = {}
        self.num_steps = 0

    def add_request(self, req_id: int, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.scheduler.add_request(req_id, prompt_token_ids, params)
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
        output = RequestOutput(req_id, list(prompt_token_ids), logprobs=[] if params.logprobs is not None else None)
        self._tracked[req_id] = _Tracked(output, params, detokenizer)

    def run(self) -> list[RequestOutput]:
        """Run until every added request has finished; returns them in the order added."""
        in_flight: tuple[StepPlan, StepResult] | None = None
        while self.scheduler.has_unfinished() or in_flight is not None:
            plan = self.scheduler.schedule()
            result = None if plan is None else self.runner.execute(plan)
            if plan is not None:
                self.num_steps += 1
            processed = False
            if not self.async_scheduling:
                if plan is not None:
                    self._process(plan, result.to_host())
                    processed = True
            else:
                if in_flight is not None:
                    self._process(in_flight[0], in_flight[1].to_host())
                    processed = True
                in_flight = None if plan is None else (plan, result)
            if plan is None and not processed and self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with no step in flight")
        meta = self.scheduler.flush_connector()
        if meta is not None and self.connector_worker is not None:
            self.connector_worker.save(meta)
        outputs = [tracked.output for tracked in self._tracked.values()]
        self._tracked.clear()
        return outputs

    def _process(self, plan: StepPlan, host: HostStepOutput) -> None:
        update = self.scheduler.update(plan, host)
        tracked = self._tracked
        for i, (req_id, token_id) in enumerate(zip(update.req_ids.tolist(), update.token_ids.tolist())):
            request = tracked[req_id]
            output = request.output
            output.token_ids.append(token_id)
            if output.logprobs is not None and host.logprobs is not None:
                index = int(update.output_index[i])
                width = 1 + request.params.logprobs
                output.logprobs.append(dict(zip(host.logprob_token_ids[index, :width].tolist(),
                                                host.logprobs[index, :width].tolist())))
            if request.detokenizer is not None and request.detokenizer.add([token_id]).stopped:
                output.finish_reason = FinishReason.STOP.value
                output.stop_reason = request.detokenizer.stop_string
                self.scheduler.finish(req_id, FinishReason.STOP)
                self._finalize(request)
        for req_id, reason in update.finished:
            request = tracked[req_id]
            output = request.output
            if output.finish_reason is None:
                output.finish_reason = reason.value
                if reason == FinishReason.STOP and output.token_ids:
                    output.stop_reason = stop_token_reason(request.params, output.token_ids[-1])
                self._finalize(request)

    def _finalize(self, request: _Tracked) -> None:
        if request.detokenizer is not None:
            request.detokenizer.flush()
            request.output.text = request.detokenizer.text
