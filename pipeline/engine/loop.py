"""The one-process engine: scheduler, runner and output processor stepped by one thread.

Async mode overlaps host work with the device: launch step N, then post-process step N-1
(whose tokens are ready or nearly so) while step N runs. Sync mode waits for each step.
`LLM` runs it to completion; the in-process backend steps it for the daemon.
"""
from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

from stages.contracts.connector import KVConnectorWorker
from stages.contracts.outputs import FinishReason, OutputEvent
from stages.contracts.params import SamplingParams
from stages.detokenizer.output_processor import OutputProcessor
from stages.scheduler.scheduler import Scheduler
from stages.scheduler.step_loop import LocalExecutor, RunnerLike, StepLoop


class Engine:
    def __init__(self, runner: RunnerLike, scheduler: Scheduler, *, async_scheduling: bool = True,
                 tokenizer: Tokenizer | None = None, connector_worker: KVConnectorWorker | None = None) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.async_scheduling = async_scheduling
        self.connector_worker = connector_worker
        self.loop = StepLoop(scheduler, LocalExecutor(runner), async_scheduling=async_scheduling)
        self.outputs = OutputProcessor(tokenizer)

    @property
    def num_steps(self) -> int:
        return self.loop.num_steps

    @property
    def busy(self) -> bool:
        return self.loop.busy

    def add_request(self, req_id: int, prompt_token_ids: list[int], params: SamplingParams,
                    output_token_ids: Sequence[int] = ()) -> None:
        """`output_token_ids`: outputs a resumed request already delivered; it continues after them."""
        self.scheduler.add_request(req_id, prompt_token_ids, params, output_token_ids)
        self.outputs.add(req_id, prompt_token_ids, params, output_token_ids)

    def abort(self, req_id: int) -> OutputEvent | None:
        """Ends a request now; its last event (finish_reason "abort"), or None if it had ended."""
        self.scheduler.abort(req_id)
        return self.outputs.finish(req_id, FinishReason.ABORT)

    def step(self) -> list[OutputEvent]:
        """One turn of the step loop; the output events of the step it applied, if any."""
        update = self.loop.turn()
        if update is None:
            if self.loop.stuck:
                raise RuntimeError("the scheduler made no progress with no step in flight")
            return []
        out = self.outputs.on_step(update, update.output)
        for req_id in out.stopped:
            self.scheduler.finish(req_id, FinishReason.STOP)
        return out.events

    def flush_connector(self) -> None:
        """Idle with no step in flight: run the KV connector's pending copies without a step."""
        meta = self.scheduler.flush_connector()
        if meta is not None and self.connector_worker is not None:
            self.connector_worker.save(meta)
