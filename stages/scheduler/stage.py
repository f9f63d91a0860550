"""The scheduler process: admit requests, send one plan per step, apply each step's tokens.

It turns the one-ahead step loop (stages/scheduler/step_loop.py) with the runner in another
process: plans go out on the plan ring, and each step's tokens come back as a done record and a
mailbox slot. Every applied step becomes a manifest for the detokenizer (which entries are real
outputs, which requests finished). New requests and rejections reach the detokenizer through
here too, so it hears of a request before any manifest names it.

When the daemon restarts the frontend group (a tokenizer worker or the detokenizer died) this
stage runs on: it ends every request (their KV blocks stay in the prefix cache), lets the steps
in flight drain, releases their mailbox slots for the dead detokenizer, and moves its ends onto
the fresh links. The daemon then resumes each request as prompt plus delivered tokens, and its
replay finds those blocks again.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from shm.mailbox import MailboxReader
from shm.ring import Record, RingWriter
from shm.ring_reader import RingReader
from stages import messages as msg
from stages.contracts.outputs import FinishReason, HostStepOutput, StepUpdate
from stages.contracts.plan import StepPlan
from stages.process import TICK_S, StageContext, run_stage
from stages.scheduler.build import build_scheduler
from stages.scheduler.registry import RequestRegistry
from stages.scheduler.scheduler import Scheduler
from stages.scheduler.step_loop import StepLoop


def main(spec_json: str) -> None:
    run_stage(spec_json, serve)


def serve(ctx: StageContext) -> None:
    limits = ctx.wait_limits()
    scheduler = build_scheduler(ctx.config, limits)
    executor = RingExecutor(ctx, ctx.writer("plan"), ctx.reader("done"), ctx.mailbox())
    loop = SchedulerLoop(ctx, scheduler, executor, inboxes=ctx.readers("tokenized{i}"), aborts=ctx.reader("abort"),
                         stop_strings=ctx.reader("stop_strings"), to_detokenizer=ctx.writer("manifest"))
    ctx.ready()
    loop.run()


class RingExecutor:
    """The runner in its own process: plans go out on the plan ring; a step's tokens come back
    as the runner's done record, then are read from the step's mailbox slot."""

    def __init__(self, ctx: StageContext, plans: RingWriter, done: RingReader, mailbox: MailboxReader) -> None:
        self.ctx = ctx
        self.plans = plans
        self.done = done
        self.mailbox = mailbox
        self.last_slot = -1  # the mailbox slot of the step `poll` returned last
        self._sampled_rows: deque[np.ndarray] = deque()
        self._write_range = ctx.range("write_plan")

    def launch(self, plan: StepPlan) -> None:
        with self._write_range:
            self.ctx.write(self.plans, msg.Kind.PLAN, *msg.encode_plan(plan))
        self._sampled_rows.append(plan.output_rows)

    def poll(self, timeout_s: float | None) -> HostStepOutput | None:
        record = self.done.read(timeout=timeout_s)
        if record is None:
            return None
        step, slot, _ = msg.decode_done(record.payload)
        data = self.mailbox.read(step, slot, check=self.ctx.tick)
        self.mailbox.release(step)
        self.last_slot = slot
        return HostStepOutput(step, self._sampled_rows.popleft(), data.token_ids, data.logprobs,
                              data.logprob_token_ids)

    def flush_connector(self, meta: object) -> None:
        """Connector copies to run with no step (the engine is idle)."""
        self.ctx.write(self.plans, msg.Kind.CONNECTOR_FLUSH, *msg.encode_connector_flush(meta))


class SchedulerLoop:
    """Each ring end here is used by this one thread only."""

    def __init__(self, ctx: StageContext, scheduler: Scheduler, executor: RingExecutor, *,
                 inboxes: list[RingReader], aborts: RingReader, stop_strings: RingReader,
                 to_detokenizer: RingWriter) -> None:
        self.ctx = ctx
        self.scheduler = scheduler
        self.executor = executor
        self.steps = StepLoop(scheduler, executor, async_scheduling=ctx.config.async_scheduling)
        self.steps.phase = ctx.range
        self.inboxes = inboxes
        self.aborts = aborts
        self.stop_strings = stop_strings
        self.to_detokenizer = to_detokenizer
        self.requests = RequestRegistry()
        self.frontend_generation = ctx.frontend_generation()

    def run(self) -> None:
        drain_range, manifest_range = self.ctx.range("drain_inputs"), self.ctx.range("write_manifest")
        while True:
            self.ctx.tick()
            if self.frontend_restarted():
                self.take_up_frontend(self.ctx.frontend_generation())
            with drain_range:
                took_input = self.drain_inputs()
            update = self.steps.turn(wait_s=TICK_S)
            if update is not None:
                with manifest_range:
                    self.on_update(update)
            elif not self.scheduler.num_steps_in_flight:
                meta = self.scheduler.flush_connector()
                if meta is not None:
                    self.executor.flush_connector(meta)
                if not took_input:
                    self.wait_for_input()
            self.publish_counters()

    # ---- the frontend group's restart

    def frontend_restarted(self) -> bool:
        return self.ctx.frontend_generation() != self.frontend_generation

    def take_up_frontend(self, generation: int) -> None:
        """Ends every request, drains the steps in flight, and moves onto `generation`'s links."""
        for req_id in list(self.requests.live):
            self.scheduler.abort(req_id)
        self.requests = RequestRegistry()
        mailbox = self.executor.mailbox
        while self.scheduler.num_steps_in_flight:  # their outputs go to no one: each request resumes
            for consumer in self.ctx.frontend_consumers():
                mailbox.cover_for(consumer)
            self.steps.turn(wait_s=TICK_S)
            self.ctx.tick()
        for consumer in self.ctx.frontend_consumers():
            mailbox.cover_for(consumer)
        while self.aborts.try_read() is not None:
            pass  # for requests of the dead frontend: the daemon resubmits only those still wanted
        for end in [*self.inboxes, self.stop_strings, self.to_detokenizer]:
            end.close()
        self.ctx.relink(generation)
        self.inboxes = self.ctx.readers("tokenized{i}")
        self.stop_strings = self.ctx.reader("stop_strings")
        self.to_detokenizer = self.ctx.writer("manifest")
        self.frontend_generation = generation
        self.ctx.board.stages.take_up_frontend(self.ctx.index, generation)

    def to_frontend(self, kind: int, *parts: object) -> None:
        """Writes one record to the detokenizer; one that a dead detokenizer left no room for is
        dropped once the frontend restarts (every request resumes on the fresh one)."""
        self.ctx.write(self.to_detokenizer, kind, *parts, give_up=self.frontend_restarted)

    # ---- inputs

    def drain_inputs(self) -> bool:
        took = False
        for inbox in self.inboxes:
            while (record := inbox.try_read()) is not None:
                self.on_request(record)
                took = True
        while (record := self.aborts.try_read()) is not None:
            self.on_abort(msg.decode_req_id(record.payload)[0])
            took = True
        while (record := self.stop_strings.try_read()) is not None:
            req_id = msg.decode_req_id(record.payload)[0]
            self.scheduler.finish(req_id, FinishReason.STOP)
            self.requests.ended(req_id)
            took = True
        return took

    def wait_for_input(self) -> None:
        """Nothing runs: block (bounded) on the request rings in turn."""
        for inbox in self.inboxes:
            record = self.ctx.read_input(inbox, share=len(self.inboxes))
            if record is not None:
                self.on_request(record)
                return

    def on_request(self, record: Record) -> None:
        if record.kind == msg.Kind.REJECT:
            self.requests.ended(msg.decode_reject(record.payload).req_id)
            self.to_frontend(msg.Kind.REJECT, record.payload)
            return
        new = msg.decode_new_request(record.payload)
        # The detokenizer hears of the request before any manifest that names it.
        self.to_frontend(msg.Kind.NEW_REQUEST, record.payload)
        if not self.requests.admit(new.req_id):
            self.to_frontend(msg.Kind.FINISHED, msg.encode_req_id(new.req_id, FinishReason.ABORT))
            return
        self.scheduler.add_request(new.req_id, new.prompt_ids, new.params, new.output_ids)

    def on_abort(self, req_id: int) -> None:
        if self.requests.abort(req_id):
            self.scheduler.abort(req_id)
            self.to_frontend(msg.Kind.FINISHED, msg.encode_req_id(req_id, FinishReason.ABORT))

    # ---- steps

    def on_update(self, update: StepUpdate) -> None:
        for req_id, _ in update.finished:
            self.requests.ended(req_id)
        manifest = msg.Manifest.for_update(update, self.executor.last_slot)
        self.to_frontend(msg.Kind.MANIFEST, msg.encode_manifest(manifest))

    def publish_counters(self) -> None:
        self.ctx.board.counters.publish(self.scheduler.stats())
