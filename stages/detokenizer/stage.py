"""The detokenizer process: step tokens from the mailbox to text deltas for the daemon.

The scheduler tells it about each request before its first step (prompt ids and params), then
sends one manifest per step naming the valid entries of that step's mailbox slot. Stop strings
are matched here; a match ends the request at once for the client and is reported back to the
scheduler, whose later tokens for that request are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from pipeline.backend import OutputEvent
from pipeline.sampling_params import SamplingParams
from shm.ring import Record, RingReader, RingWriter
from stages import messages as msg
from stages.detokenizer.incremental import IncrementalDetokenizer, stop_token_reason
from stages.gpu_runner.mailbox import MailboxReader, SlotData
from stages.process import TICK_S, StageContext, run_stage
from stages.scheduler.request import FinishReason

MAILBOX_CONSUMER = 1
DONE_READER = 1
MAX_EVENTS_PER_SEND = 1024  # bounds one record: well under the events ring's capacity
_NO_TOKENS = np.zeros(0, np.int32)


def main(spec_json: str) -> None:
    run_stage(spec_json, serve)


def serve(ctx: StageContext) -> None:
    spec = ctx.spec
    rings = spec["rings"]
    tokenizer = Tokenizer.from_file(spec["tokenizer_path"])
    loop = DetokenizerLoop(ctx, tokenizer, inbox=RingReader.attach(rings["manifest"]),
                           done=RingReader.attach(rings["done"], DONE_READER),
                           events=RingWriter.attach(rings["events"]),
                           stop_strings=RingWriter.attach(rings["stop_strings"]))
    ctx.wait_limits(spec["start_timeout_s"])  # the runner makes the mailbox before publishing them
    loop.mailbox = MailboxReader(spec["mailbox"], MAILBOX_CONSUMER)
    ctx.ready()
    loop.run()


@dataclass(slots=True)
class _Stream:
    detokenizer: IncrementalDetokenizer
    prompt_token_ids: np.ndarray | None  # sent with the request's first event, then None
    params: SamplingParams


class DetokenizerLoop:
    """Each ring end here is used by this one thread only."""

    def __init__(self, ctx: StageContext, tokenizer: Tokenizer, *, inbox: RingReader, done: RingReader,
                 events: RingWriter, stop_strings: RingWriter) -> None:
        self.ctx = ctx
        self.tokenizer = tokenizer
        self.inbox = inbox
        self.done = done
        self.events = events
        self.stop_strings = stop_strings
        self.mailbox: MailboxReader | None = None
        self.streams: dict[int, _Stream] = {}
        self.done_slots: dict[int, int] = {}
        self.last_done_step = -1
        self.manifest_range, self.detokenize_range, self.emit_range = (
            ctx.range(name) for name in ("manifest", "detokenize", "emit"))

    def run(self) -> None:
        while True:
            self.ctx.tick()
            record = self.ctx.read_input(self.inbox)
            if record is None:
                continue
            out: list[OutputEvent] = []
            self.handle(record, out)
            while len(out) < MAX_EVENTS_PER_SEND and (record := self.inbox.try_read()) is not None:
                self.handle(record, out)
            with self.emit_range:
                self.send(out)

    def handle(self, record: Record, out: list[OutputEvent]) -> None:
        kind = record.kind
        if kind == msg.Kind.MANIFEST:
            self.on_step(msg.decode_manifest(record.payload), out)
        elif kind == msg.Kind.NEW_REQUEST:
            new = msg.decode_new_request(record.payload)
            detokenizer = IncrementalDetokenizer(self.tokenizer, new.prompt_ids.tolist(), new.params)
            self.streams[new.req_id] = _Stream(detokenizer, new.prompt_ids, new.params)
        elif kind == msg.Kind.FINISHED:
            req_id, reason = msg.decode_req_id(record.payload)
            stream = self.streams.pop(req_id, None)
            if stream is not None:  # else it already ended here (a stop string)
                event = self.event(req_id, stream)
                event.text = stream.detokenizer.flush()
                event.finish_reason = reason.value
                out.append(event)
        elif kind == msg.Kind.REJECT:
            rejection = msg.decode_reject(record.payload)
            out.append(OutputEvent(rejection.req_id, "", _NO_TOKENS, error_code=rejection.code,
                                   error_message=rejection.message, error_field=rejection.field or None))
        else:
            raise ValueError(f"unexpected record kind {kind} on the scheduler's ring")

    def event(self, req_id: int, stream: _Stream) -> OutputEvent:
        event = OutputEvent(req_id, "", _NO_TOKENS, prompt_token_ids=stream.prompt_token_ids)
        stream.prompt_token_ids = None
        return event

    def on_step(self, manifest: msg.Manifest, out: list[OutputEvent]) -> None:
        step = manifest.step
        with self.manifest_range:
            data = self.mailbox.read(step, self.await_done(step))
            self.mailbox.release(step)
        with self.detokenize_range:
            self.detokenize(manifest, data, out)

    def detokenize(self, manifest: msg.Manifest, data: SlotData, out: list[OutputEvent]) -> None:
        by_request: dict[int, OutputEvent] = {}
        for req_id, index in zip(manifest.req_ids.tolist(), manifest.output_index.tolist()):
            stream = self.streams.get(req_id)
            if stream is None:
                continue  # ended here by a stop string; the scheduler has not heard yet
            token_id = int(data.token_ids[index])
            event = self.event(req_id, stream)
            event.token_ids = np.array([token_id], np.int32)
            if stream.params.logprobs is not None and data.logprobs is not None:
                width = 1 + stream.params.logprobs
                event.logprobs = data.logprobs[index:index + 1, :width].copy()
                event.logprob_token_ids = data.logprob_token_ids[index:index + 1, :width].copy()
            delta = stream.detokenizer.add([token_id])
            event.text = delta.text
            by_request[req_id] = event
            out.append(event)
            if delta.stopped:
                event.finish_reason = FinishReason.STOP.value
                event.stop_reason = stream.detokenizer.stop_string
                del self.streams[req_id]
                self.ctx.write(self.stop_strings, msg.Kind.STOP_STRING, msg.encode_req_id(req_id))
        for req_id, reason in manifest.finished:
            stream = self.streams.pop(req_id, None)
            if stream is None:
                continue
            event = by_request.get(req_id)
            if event is None:
                event = self.event(req_id, stream)
                out.append(event)
            event.text += stream.detokenizer.flush()
            event.finish_reason = reason.value
            if reason == FinishReason.STOP and len(event.token_ids):
                event.stop_reason = stop_token_reason(stream.params, int(event.token_ids[-1]))

    def await_done(self, step: int) -> int:
        """The mailbox slot of `step`, once the runner's done record for it has been read."""
        while self.last_done_step < step:
            record = self.done.read(timeout=TICK_S)
            if record is None:
                self.ctx.tick()
                continue
            done_step, slot, _ = msg.decode_done(record.payload)
            self.done_slots[done_step] = slot
            self.last_done_step = done_step
        return self.done_slots.pop(step)

    def send(self, out: list[OutputEvent]) -> None:
        """Write `out` as few EVENTS records as fit the ring (a first event carries its prompt)."""
        limit = self.events.max_payload_bytes // 2
        start, size = 0, 0
        for index, event in enumerate(out):
            num_bytes = _event_bytes(event)
            if index > start and size + num_bytes > limit:
                self.ctx.write(self.events, msg.Kind.EVENTS, msg.encode_events(out[start:index]))
                start, size = index, 0
            size += num_bytes
        if start < len(out):
            self.ctx.write(self.events, msg.Kind.EVENTS, msg.encode_events(out[start:]))


def _event_bytes(event: OutputEvent) -> int:
    """An upper bound of the encoded size of one event."""
    size = 64 + 4 * len(event.text) + 4 * len(event.token_ids)
    if event.prompt_token_ids is not None:
        size += 4 * len(event.prompt_token_ids)
    if event.logprobs is not None:
        size += 8 * event.logprobs.size
    if event.error_message is not None:
        size += 4 * len(event.error_message) + 64
    if isinstance(event.stop_reason, str):
        size += 4 * len(event.stop_reason) + 8
    return size
