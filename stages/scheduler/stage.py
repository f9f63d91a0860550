"""The scheduler process: admit requests, send one plan per step, apply each step's tokens.

Async mode keeps at most one plan ahead, like `Engine.run`: plan N+1 goes to the runner before
step N's tokens are applied. Sync mode waits for each step. Every step's tokens are read from
the token mailbox after the runner's done record and turned into a manifest for the
detokenizer (which entries are real outputs, which requests finished).
"""
from __future__ import annotations

from collections import deque

import numpy as np

from pipeline.llm import build_scheduler
from shm.ring import Record, RingReader, RingWriter
from stages import messages as msg
from stages.gpu_runner.mailbox import MailboxReader
from stages.gpu_runner.output import HostStepOutput
from stages.process import TICK_S, StageContext, run_stage
from stages.scheduler.plan import StepPlan
from stages.scheduler.request import FinishReason
from stages.scheduler.scheduler import Scheduler
from stages.status import SchedulerCounters

MAILBOX_CONSUMER = 0
DONE_READER = 0
# Requests that ended here and may still be aborted by a daemon that has not yet seen their end.
RECENTLY_ENDED = 4096


def main(spec_json: str) -> None:
    run_stage(spec_json, serve)


def serve(ctx: StageContext) -> None:
    spec, config = ctx.spec, ctx.spec["config"]
    rings = spec["rings"]
    limits = ctx.wait_limits(spec["start_timeout_s"])
    scheduler = build_scheduler(
        max_num_seqs=config["max_num_seqs"], max_num_batched_tokens=config["max_num_batched_tokens"],
        max_model_len=limits.max_model_len, enable_prefix_caching=config["enable_prefix_caching"],
        num_kv_blocks=limits.num_kv_blocks, block_size=config["block_size"], eos_token_ids=limits.eos_token_ids,
        num_host_blocks=limits.num_host_blocks if config["kv_connector"] == "offload" else None)
    loop = SchedulerLoop(
        ctx, scheduler, async_scheduling=config["async_scheduling"],
        inboxes=[RingReader.attach(name) for name in rings["tokenized"]],
        aborts=RingReader.attach(rings["abort"]), stop_strings=RingReader.attach(rings["stop_strings"]),
        plans=RingWriter.attach(rings["plan"]), done=RingReader.attach(rings["done"], DONE_READER),
        to_detokenizer=RingWriter.attach(rings["manifest"]),
        mailbox=MailboxReader(spec["mailbox"], MAILBOX_CONSUMER))
    ctx.ready()
    loop.run()


class SchedulerLoop:
    """Each ring end here is used by this one thread only."""

    def __init__(self, ctx: StageContext, scheduler: Scheduler, *, async_scheduling: bool,
                 inboxes: list[RingReader], aborts: RingReader, stop_strings: RingReader, plans: RingWriter,
                 done: RingReader, to_detokenizer: RingWriter, mailbox: MailboxReader) -> None:
        self.ctx = ctx
        self.scheduler = scheduler
        self.max_in_flight = 2 if async_scheduling else 1
        self.inboxes = inboxes
        self.aborts = aborts
        self.stop_strings = stop_strings
        self.plans = plans
        self.done = done
        self.to_detokenizer = to_detokenizer
        self.mailbox = mailbox
        self.in_flight: deque[StepPlan] = deque()
        self.live: set[int] = set()
        self.recently_ended: deque[int] = deque()
        self.recently_ended_set: set[int] = set()
        # Aborts that overtook their request (still in a tokenizer): applied when it arrives.
        self.early_aborts: set[int] = set()
        self.tokens_generated = 0

    def run(self) -> None:
        drain_range, schedule_range = self.ctx.range("drain_inputs"), self.ctx.range("schedule")
        write_plan_range, apply_range = self.ctx.range("write_plan"), self.ctx.range("apply_step")
        while True:
            self.ctx.tick()
            with drain_range:
                took_input = self.drain_inputs()
            if len(self.in_flight) < self.max_in_flight:
                with schedule_range:
                    plan = self.scheduler.schedule()
                if plan is not None:
                    with write_plan_range:
                        self.ctx.write(self.plans, msg.Kind.PLAN, *msg.encode_plan(plan))
                    self.in_flight.append(plan)
                    continue
                if not self.in_flight:
                    self.flush_connector()
            if self.in_flight:
                record = self.done.read(timeout=TICK_S)
                if record is not None:
                    with apply_range:
                        self.apply_step(record)
            elif not took_input:
                self.wait_for_input()
            self.publish_counters()

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
            self.ended(req_id)
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
            self.ended(msg.decode_reject(record.payload).req_id)
            self.ctx.write(self.to_detokenizer, msg.Kind.REJECT, record.payload)
            return
        new = msg.decode_new_request(record.payload)
        # The detokenizer hears of the request before any manifest that names it.
        self.ctx.write(self.to_detokenizer, msg.Kind.NEW_REQUEST, record.payload)
        if new.req_id in self.early_aborts:
            self.early_aborts.discard(new.req_id)
            self.ended(new.req_id)
            self.ctx.write(self.to_detokenizer, msg.Kind.FINISHED, msg.encode_req_id(new.req_id, FinishReason.ABORT))
            return
        self.scheduler.add_request(new.req_id, new.prompt_ids, new.params)
        self.live.add(new.req_id)

    def on_abort(self, req_id: int) -> None:
        if req_id not in self.live:
            if req_id not in self.recently_ended_set:
                self.early_aborts.add(req_id)
            return
        self.scheduler.abort(req_id)
        self.ended(req_id)
        self.ctx.write(self.to_detokenizer, msg.Kind.FINISHED, msg.encode_req_id(req_id, FinishReason.ABORT))

    def ended(self, req_id: int) -> None:
        self.live.discard(req_id)
        self.recently_ended.append(req_id)
        self.recently_ended_set.add(req_id)
        if len(self.recently_ended) > RECENTLY_ENDED:
            self.recently_ended_set.discard(self.recently_ended.popleft())

    # ---- steps

    def apply_step(self, record: Record) -> None:
        step, slot, _ = msg.decode_done(record.payload)
        plan = self.in_flight.popleft()
        if step != plan.step:
            raise RuntimeError(f"runner finished step {step}, expected step {plan.step}")
        data = self.mailbox.read(step, slot)
        self.mailbox.release(step)
        host = HostStepOutput(step, plan.sampled_rows, data.token_ids, data.logprobs, data.logprob_token_ids)
        update = self.scheduler.update(plan, host)
        for req_id, _ in update.finished:
            self.ended(req_id)
        self.tokens_generated += update.num_tokens
        manifest = msg.Manifest(step, update.req_ids.astype(np.int64), update.output_index.astype(np.int32),
                                update.finished)
        self.ctx.write(self.to_detokenizer, msg.Kind.MANIFEST, msg.encode_manifest(manifest))

    def flush_connector(self) -> None:
        """Idle with no step in flight: run the connector's pending copies without a step."""
        meta = self.scheduler.flush_connector()
        if meta is not None:
            self.ctx.write(self.plans, msg.Kind.CONNECTOR_FLUSH, *msg.encode_connector_flush(meta))

    def publish_counters(self) -> None:
        stats = self.scheduler.stats()
        # A draining request (finished or preempted, a step still in flight) still holds its row.
        self.ctx.board.publish_counters(SchedulerCounters(
            stats.num_waiting, stats.num_running + stats.num_draining, stats.num_used_blocks, stats.num_free_blocks,
            self.tokens_generated, stats.num_preemptions, stats.num_prefix_queried_tokens,
            stats.num_prefix_hit_tokens))
