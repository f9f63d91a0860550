"""The token mailbox: a slot is rewritten only after every consumer released it; a dead consumer
is reported instead of waited for; slot data (tokens, logprobs) arrive intact."""
from __future__ import annotations

import glob
import multiprocessing as mp
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from stage_procs import consume, hold_forever, produce_then_hang

from shm.naming import list_entries, new_instance_id, unlink_instance
from shm.ring import RingWriter
from shm.ring_reader import RingReader
from shm.segment import PeerDied, RingSegment
from shm.mailbox import MailboxReader, MailboxWriter, create_mailbox
from stages import messages as msg

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def instance() -> Iterator[str]:
    instance_id = new_instance_id()
    yield instance_id
    unlink_instance(instance_id)
    assert not [e for e in list_entries() if instance_id in e]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, needs_cuda])])
def test_slot_reuse_waits_for_release(instance: str, device: str) -> None:
    """On CUDA the consumer is another process: it opens the table and events by IPC handle, at
    its start (before it reports ready), so its reads pay for no CUDA initialisation."""
    ctx = mp.get_context("spawn")
    name = create_mailbox(instance, num_slots=2, max_rows=4, logprob_width=4, num_consumers=1, cuda=device == "cuda")
    done = RingWriter(RingSegment.create(instance, "done", 4096))
    out = ctx.Array("q", 3 * 8 + 1)
    gate, ready = ctx.Event(), ctx.Event()
    torch_files = set(glob.glob("/dev/shm/torch_*"))
    writer = MailboxWriter(name, device)  # exports the device handles before the consumer starts
    # The table is an allocation of its own, shared by raw handle: no torch IPC ref-counter file.
    assert set(glob.glob("/dev/shm/torch_*")) == torch_files
    child = ctx.Process(target=consume, args=(name, done.name, 3, out, gate, ready), daemon=True)
    child.start()
    try:
        assert ready.wait(20.0), "the consumer did not attach"
        assert out[24] == (device == "cuda")  # the device side was opened at the consumer's start
        steps = [
            (torch.tensor([11, 12, 13], dtype=torch.int32, device=device), None, None),
            (torch.tensor([21, 22], dtype=torch.int32, device=device),
             torch.tensor([[-0.5, -0.1], [-1.5, -0.2]], device=device),
             torch.tensor([[21, 3], [22, 4]], dtype=torch.int32, device=device)),
            (torch.tensor([31, 32, 33, 34], dtype=torch.int32, device=device), None, None),
        ]
        for step in (0, 1):
            slot = writer.write(step, *steps[step])
            done.write(msg.Kind.DONE, msg.encode_done(step, slot, steps[step][0].shape[0]))
        # Slot 0 still holds step 0: the consumer has read it but not released it.
        with pytest.raises(TimeoutError, match="slot 0 for step 2"):
            writer.wait_free(2, timeout_s=0.3)
        gate.set()
        start = time.monotonic()
        slot = writer.write(2, *steps[2], timeout_s=10.0)
        assert slot == 0 and time.monotonic() - start < 5.0
        done.write(msg.Kind.DONE, msg.encode_done(2, slot, 4))
        child.join(10)
        assert child.exitcode == 0
        values = list(out)
        assert values[0:3] == [11, 12, 13]  # read before step 2 overwrote the slot
        assert values[8:10] == [21, 22] and values[12:14] == [-500, -1500]
        assert values[16:20] == [31, 32, 33, 34]
        writer.close()
    finally:
        if child.exitcode is None:
            child.kill()
        child.join(5)
        done.close()


@pytest.mark.cuda
@needs_cuda
def test_a_consumer_waiting_on_a_runner_that_dies_mid_step_gets_an_error_not_a_hang(instance: str) -> None:
    """The runner is killed while the kernel ahead of step 0's copies still runs: the consumer's
    read, which polls its copy's event, raises (PeerDied, or the CUDA error of the torn-down
    context) instead of blocking in a synchronize."""
    from shm.cuda_runtime import CudaError

    ctx = mp.get_context("spawn")
    name = create_mailbox(instance, num_slots=2, max_rows=4, logprob_width=4, num_consumers=1, cuda=True)
    done = RingReader(RingSegment.create(instance, "done", 4096))
    exported, go = ctx.Event(), ctx.Event()
    child = ctx.Process(target=produce_then_hang, args=(name, done.name, exported, go), daemon=True)
    child.start()
    try:
        assert exported.wait(20.0), "the runner did not export its handles"
        reader = MailboxReader(name, 0)
        assert reader.device_ready
        go.set()
        record = done.read(timeout=10.0)
        assert record is not None, "the runner did not announce step 0"
        step, slot, _ = msg.decode_done(record.payload)
        child.kill()
        child.join(5)
        with pytest.raises((PeerDied, CudaError)):  # a TimeoutError would mean the death went unseen
            reader.read(step, slot, timeout_s=20.0)
        reader.close()
    finally:
        if child.exitcode is None:
            child.kill()
        child.join(5)
        done.close()


def test_dead_consumer_raises_peer_died(instance: str) -> None:
    ctx = mp.get_context("spawn")
    name = create_mailbox(instance, num_slots=2, max_rows=4, logprob_width=4, num_consumers=1, cuda=False)
    child = ctx.Process(target=hold_forever, args=(name,), daemon=True)
    child.start()
    try:
        writer = MailboxWriter(name)
        writer.write(0, np.array([1], np.int32))
        writer.write(1, np.array([2], np.int32))
        deadline = time.monotonic() + 20
        while not writer.consumer_pid(0):  # the child registers its pid when it attaches
            assert time.monotonic() < deadline
            time.sleep(0.01)
        child.kill()
        child.join(5)
        start = time.monotonic()
        with pytest.raises(PeerDied, match="consumer 0"):
            writer.wait_free(2, timeout_s=10.0)
        assert time.monotonic() - start < 1.0
        writer.close()
    finally:
        if child.exitcode is None:
            child.kill()
        child.join(5)



def test_reader_refuses_a_slot_holding_another_step(instance: str) -> None:
    name = create_mailbox(instance, num_slots=2, max_rows=4, logprob_width=4, num_consumers=1, cuda=False)
    writer = MailboxWriter(name)
    reader = MailboxReader(name, 0)
    writer.write(0, np.array([5, 6], np.int32))
    assert reader.read(0, 0).token_ids.tolist() == [5, 6]
    with pytest.raises(RuntimeError, match="holds step 0, expected step 2"):
        reader.read(2, 0)
    with pytest.raises(ValueError, match="5 sampled rows; the mailbox holds 4"):
        writer.write(1, np.arange(5, dtype=np.int32))
    reader.close()
    writer.close()


def test_a_slot_is_not_readable_before_its_ready_time_and_the_wait_burns_no_cpu(instance: str) -> None:
    name = create_mailbox(instance, num_slots=2, max_rows=4, logprob_width=4, num_consumers=1, cuda=False)
    writer = MailboxWriter(name)
    reader = MailboxReader(name, 0)
    ready_at_ns = time.monotonic_ns() + 200_000_000
    writer.write(0, np.array([5, 6], np.int32), ready_at_ns=ready_at_ns)
    assert time.monotonic_ns() < ready_at_ns  # the writer never waits for the device
    cpu_before_s = time.thread_time()
    assert reader.read(0).token_ids.tolist() == [5, 6]
    assert time.monotonic_ns() >= ready_at_ns
    assert time.thread_time() - cpu_before_s < 0.05  # slept, did not spin, for about 0.2 s
    reader.release(0)
    writer.write(1, np.array([7], np.int32))  # no ready time: ready as soon as it is announced
    assert reader.read(1).token_ids.tolist() == [7]
    reader.close()
    writer.close()
