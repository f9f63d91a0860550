"""The detokenizer process: step tokens from the mailbox to text deltas for the daemon.

The scheduler tells it about each request before its first step (prompt ids and params), then
sends one manifest per step naming the step's mailbox slot and the valid entries in it. The
output processor turns them into events; a stop-string match ends the request at once for the
client and is reported back to the scheduler, whose later tokens for it are dropped.
"""
from __future__ import annotations

import os

from tokenizers import Tokenizer

from shm.mailbox import MailboxReader
from shm.ring import Record, RingWriter
from shm.ring_reader import RingReader
from stages import messages as msg
from stages.contracts.outputs import OutputEvent, TokenTexts
from stages.detokenizer.output_processor import OutputProcessor
from stages.events import coalesce_outputs, encode_events, encode_token_texts, event_batches, token_texts_batches
from stages.process import StageContext, run_stage

# The device waits only on the scheduler and the runner; this stage's work is off that path. Where
# the CPUs are too few for every stage at once, it yields to them (nice 5: about a third of their
# weight) rather than delay the next launch; its time per step is unchanged.
NICE = 5
MAX_EVENTS_PER_SEND = 1024  # bounds one batch: well under the events ring's capacity


def main(spec_json: str) -> None:
    run_stage(spec_json, serve)


def serve(ctx: StageContext) -> None:
    os.nice(NICE)
    tokenizer = Tokenizer.from_file(str(ctx.config.tokenizer_path))
    inbox, events, stop_strings = ctx.reader("manifest"), ctx.writer("events"), ctx.writer("stop_strings")
    ctx.wait_limits()  # the runner makes the mailbox before publishing them
    loop = DetokenizerLoop(ctx, OutputProcessor(tokenizer), ctx.mailbox(), inbox=inbox, events=events,
                           stop_strings=stop_strings)
    ctx.ready()
    loop.run()


class DetokenizerLoop:
    """Each ring end here is used by this one thread only."""

    def __init__(self, ctx: StageContext, outputs: OutputProcessor, mailbox: MailboxReader, *, inbox: RingReader,
                 events: RingWriter, stop_strings: RingWriter) -> None:
        self.ctx = ctx
        self.outputs = outputs
        self.mailbox = mailbox
        self.inbox = inbox
        self.events = events
        self.stop_strings = stop_strings
        self.manifest_range, self.detokenize_range, self.emit_range = (
            ctx.range(name) for name in ("manifest", "detokenize", "emit"))

    def run(self) -> None:
        while True:
            self.ctx.tick()
            record = self.ctx.read_input(self.inbox)
            if record is None:
                continue
            out: list[OutputEvent | TokenTexts] = []
            self.handle(record, out)
            while (sum(len(item) if isinstance(item, TokenTexts) else 1 for item in out) < MAX_EVENTS_PER_SEND
                   and (record := self.inbox.try_read()) is not None):
                self.handle(record, out)
            with self.emit_range:
                self.send(out)

    def handle(self, record: Record, out: list[OutputEvent | TokenTexts]) -> None:
        kind = record.kind
        if kind == msg.Kind.MANIFEST:
            self.on_step(msg.decode_manifest(record.payload), out)
        elif kind == msg.Kind.NEW_REQUEST:
            new = msg.decode_new_request(record.payload)
            self.outputs.add(new.req_id, new.prompt_ids, new.params, new.output_ids)
        elif kind == msg.Kind.FINISHED:
            req_id, reason = msg.decode_req_id(record.payload)
            event = self.outputs.finish(req_id, reason)
            if event is not None:  # else it already ended here (a stop string)
                out.append(event)
        elif kind == msg.Kind.REJECT:
            rejection = msg.decode_reject(record.payload)
            out.append(self.outputs.reject(rejection.req_id, rejection.code, rejection.message,
                                           rejection.field or None))
        else:
            raise ValueError(f"unexpected record kind {kind} on the scheduler's ring")

    def on_step(self, manifest: msg.Manifest, out: list[OutputEvent | TokenTexts]) -> None:
        with self.manifest_range:
            tokens = self.mailbox.read(manifest.step, manifest.slot, check=self.ctx.tick)
            self.mailbox.release(manifest.step)
        with self.detokenize_range:
            step = self.outputs.on_step_batch(manifest, tokens)
        if step.plain is not None:
            out.append(step.plain)
        out.extend(step.events)
        for req_id in step.stopped:
            self.ctx.write(self.stop_strings, msg.Kind.STOP_STRING, msg.encode_req_id(req_id))

    def send(self, out: list[OutputEvent | TokenTexts]) -> None:
        """Write `out` with one entry per request (several steps' when this stage fell behind):
        the plain ones as TOKEN_TEXTS records, the events as few EVENTS records as fit the ring
        (a first event carries its prompt)."""
        max_bytes = self.events.max_payload_bytes // 2
        events: list[OutputEvent] = []
        for item in coalesce_outputs(out):
            if isinstance(item, OutputEvent):
                events.append(item)
                continue
            for batch in token_texts_batches(item, max_bytes):
                self.ctx.write(self.events, msg.Kind.TOKEN_TEXTS, encode_token_texts(batch))
        for batch in event_batches(events, max_bytes):
            self.ctx.write(self.events, msg.Kind.EVENTS, encode_events(batch))
