"""The stage loops' own logic in one process, records in and records out, with no ring between:
the scheduler stage relays requests and applies early aborts; the detokenizer turns manifests
and mailbox slots into events; event batches fit a record."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import pytest
from tokenizers import Tokenizer

from pipeline.models.tiny_model import train_tokenizer
from shm.mailbox import MailboxReader, MailboxWriter, create_mailbox
from shm.naming import new_instance_id, unlink_instance
from shm.ring import Record
from stages import messages as msg
from stages.contracts.config import EngineConfig, ModelLimits
from stages.contracts.outputs import FinishReason, HostStepOutput, OutputEvent, StepUpdate
from stages.contracts.params import SamplingParams
from stages.detokenizer.output_processor import OutputProcessor
from stages.detokenizer.stage import DetokenizerLoop
from stages.events import decode_events, encode_events, event_batches
from stages.scheduler.scheduler import Scheduler
from stages.scheduler.stage import SchedulerLoop

pytestmark = pytest.mark.timeout(30)


@dataclass
class StubContext:
    """What a stage loop asks of its process context, with every record it writes kept."""

    config: EngineConfig = field(default_factory=EngineConfig)
    written: list[tuple[str, int, bytes]] = field(default_factory=list)

    def range(self, name: str) -> nullcontext:
        return nullcontext()

    def tick(self) -> None:
        """A loop's heartbeat (called while it waits on the mailbox): nothing to stop here."""

    def write(self, writer: str, kind: int, *parts: object, give_up: object = None) -> bool:
        self.written.append((writer, kind, b"".join(bytes(part) for part in parts)))
        return True

    def frontend_generation(self) -> int:
        return 0

    def kinds(self, writer: str) -> list[int]:
        return [kind for name, kind, _ in self.written if name == writer]


def record(kind: int, *parts: object) -> Record:
    return Record(kind, memoryview(b"".join(bytes(part) for part in parts)))


@pytest.fixture
def mailbox() -> Iterator[tuple[MailboxWriter, MailboxReader]]:
    instance = new_instance_id()
    name = create_mailbox(instance, num_slots=4, max_rows=8, logprob_width=3, num_consumers=1, cuda=False)
    writer, reader = MailboxWriter(name), MailboxReader(name, 0)
    yield writer, reader
    reader.close()
    writer.close()
    unlink_instance(instance)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_tokenizer(512)


def test_detokenizer_loop_turns_manifests_and_slots_into_events(mailbox, tokenizer: Tokenizer) -> None:
    writer, reader = mailbox
    ctx = StubContext()
    loop = DetokenizerLoop(ctx, OutputProcessor(tokenizer), reader, inbox=None, events="events",
                           stop_strings="stop_strings")
    prompt = np.array(tokenizer.encode("the cat", add_special_tokens=False).ids, np.int32)
    out: list[OutputEvent] = []
    loop.handle(record(msg.Kind.NEW_REQUEST, *msg.encode_new_request(7, prompt, SamplingParams())), out)
    loop.handle(record(msg.Kind.NEW_REQUEST, *msg.encode_new_request(8, prompt, SamplingParams(stop=["s"]))), out)
    assert out == []
    token = tokenizer.encode(" sat", add_special_tokens=False).ids[0]
    slot = writer.write(0, np.array([token, token], np.int32))
    manifest = msg.Manifest(0, np.array([8, 7], np.int64), np.array([0, 1], np.int32), [], slot)
    loop.handle(record(msg.Kind.MANIFEST, msg.encode_manifest(manifest)), out)
    assert [(e.req_id, e.token_ids.tolist()) for e in out] == [(8, [token]), (7, [token])]
    assert out[0].finish_reason == "stop" and out[0].stop_reason == "s"  # " s" matched the stop string
    assert ctx.kinds("stop_strings") == [msg.Kind.STOP_STRING]
    out.clear()
    loop.handle(record(msg.Kind.FINISHED, msg.encode_req_id(7, FinishReason.ABORT)), out)
    loop.handle(record(msg.Kind.FINISHED, msg.encode_req_id(8, FinishReason.ABORT)), out)  # ended already
    loop.handle(record(msg.Kind.REJECT, msg.encode_reject(msg.Rejection(9, "invalid_params", "prompt", "empty"))), out)
    assert [(e.req_id, e.finish_reason, e.error_code) for e in out] == [(7, "abort", None), (9, None, "invalid_params")]


def scheduler_loop() -> tuple[SchedulerLoop, StubContext]:
    ctx = StubContext()
    scheduler = Scheduler(EngineConfig(block_size=4), ModelLimits(num_kv_blocks=32, max_model_len=64, vocab_size=100))

    class Executor:
        last_slot = 3

    loop = SchedulerLoop(ctx, scheduler, Executor(), inboxes=[], aborts=None, stop_strings=None,
                         to_detokenizer="manifest")
    return loop, ctx


def new_request(req_id: int) -> Record:
    return record(msg.Kind.NEW_REQUEST, *msg.encode_new_request(req_id, np.array([5, 6, 7], np.int32),
                                                                 SamplingParams(max_tokens=4)))


def test_scheduler_loop_applies_an_abort_that_overtook_its_request() -> None:
    loop, ctx = scheduler_loop()
    loop.on_abort(5)
    assert ctx.written == []  # nothing to end yet
    loop.on_request(new_request(5))
    assert ctx.kinds("manifest") == [msg.Kind.NEW_REQUEST, msg.Kind.FINISHED]
    assert msg.decode_req_id(ctx.written[-1][2]) == (5, FinishReason.ABORT)
    assert not loop.scheduler.has_unfinished()


def test_scheduler_loop_sends_one_manifest_per_step_naming_the_slot_and_drops_late_aborts() -> None:
    loop, ctx = scheduler_loop()
    loop.on_request(new_request(1))
    plan = loop.scheduler.schedule()
    update = loop.scheduler.update(HostStepOutput(plan.step, plan.sampled_rows, np.array([42], np.int32), None, None))
    loop.on_update(update)
    manifest = msg.decode_manifest(ctx.written[-1][2])
    assert (manifest.step, manifest.slot, manifest.req_ids.tolist(), manifest.output_index.tolist()) == (0, 3, [1], [0])
    loop.on_abort(1)  # live: ended now
    assert ctx.kinds("manifest")[-1] == msg.Kind.FINISHED
    count = len(ctx.written)
    loop.on_abort(1)  # late: it ended here already, nothing more to say
    assert len(ctx.written) == count and loop.requests.early_aborts == set()


def test_manifest_of_an_update_keeps_its_entries_and_finishes() -> None:
    output = HostStepOutput(4, np.array([0, 2], np.int32), np.array([7, 8], np.int32), None, None)
    update = StepUpdate(4, np.array([11, 12], np.int64), np.array([7, 8], np.int32), np.array([0, 1]),
                        [(12, FinishReason.LENGTH)], output)
    manifest = msg.decode_manifest(msg.encode_manifest(msg.Manifest.for_update(update, slot=0)))
    assert (manifest.step, manifest.slot, manifest.req_ids.tolist(), manifest.finished) == (
        4, 0, [11, 12], [(12, FinishReason.LENGTH)])


def test_event_batches_fit_a_record_and_keep_the_order() -> None:
    events = [OutputEvent(i, "x" * 100, np.arange(10, dtype=np.int32)) for i in range(50)]
    batches = event_batches(events, max_bytes=2000)
    assert len(batches) > 1 and [e.req_id for b in batches for e in b] == list(range(50))
    assert all(len(encode_events(batch)) <= 2000 for batch in batches)
    huge = OutputEvent(99, "y" * 5000, np.zeros(0, np.int32))
    assert [len(b) for b in event_batches([huge, *events[:2]], max_bytes=2000)] == [1, 2]  # alone, not dropped
    assert [e.req_id for e in decode_events(encode_events(batches[0]))] == [e.req_id for e in batches[0]]
