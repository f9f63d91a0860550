"""The token mailbox's device side, on CPU: its IPC handles round-trip through the segment; a
consumer opens the device side at its start; its wait for device work polls a fake event and ends
with the work, with a clear error at its deadline, or with PeerDied when the runner dies."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from shm import cuda_ipc, cuda_runtime
from shm.mailbox import MailboxReader, create_mailbox
from shm.mailbox_layout import IPC_HANDLE_BYTES, ROWS, SEQ, WRITER_PID, DeviceHandles, Mailbox
from shm.polling import POLL_S, poll_until
from shm.segment import PeerDied

pytestmark = pytest.mark.timeout(30)
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


class FakeEvent:
    """Device work that completes after `ready_after` queries (never, if None)."""

    def __init__(self, ready_after: int | None) -> None:
        self.ready_after = ready_after
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.ready_after is not None and self.queries > self.ready_after


class FakeClock:
    """A clock that moves 10 us per reading (a poll's own cost) and by each sleep."""

    def __init__(self) -> None:
        self.now_s = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        self.now_s += 10e-6
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now_s += seconds


class FakeDeviceSlots:
    """What DeviceSlotsReader does around its wait, minus the device: the slot's words after
    the real wait on a fake event."""

    def __init__(self, box: Mailbox, event: FakeEvent) -> None:
        self.handles = box.device_handles()
        self.event = event
        self.words = np.zeros(box.geometry.slot_words, np.int32)
        self.closed = False

    def copy_out(self, slot: int, num_rows: int, width: int, *, what: str, timeout_s: float,
                 check: object) -> np.ndarray:
        cuda_ipc.wait_device(self.event, what, timeout_s, check)
        self.words[:num_rows] = 100 + np.arange(num_rows)
        return self.words

    def close(self) -> None:
        self.closed = True


def handles(num_slots: int, max_rows: int = 4, logprob_width: int = 2) -> DeviceHandles:
    return DeviceHandles(device_index=1, table_bytes=num_slots * max_rows * (1 + 2 * logprob_width) * 4,
                         table=bytes(range(64)),
                         events=tuple(bytes([slot]) * IPC_HANDLE_BYTES for slot in range(num_slots)))


@pytest.fixture
def device_mailbox(instance: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, dict]]:
    """A CUDA mailbox whose handles are published, a runner pid registered (this process), and
    consumers whose device side is a FakeDeviceSlots over `opened["event"]`."""
    name = create_mailbox(instance, num_slots=2, max_rows=4, logprob_width=2, num_consumers=1, cuda=True)
    box = Mailbox.open(name)
    box.publish_handles(handles(2))
    box.slots[WRITER_PID] = os.getpid()
    opened: dict = {"event": FakeEvent(3)}

    def fake_open(cls: type, mailbox: Mailbox) -> FakeDeviceSlots:
        opened["slots"] = FakeDeviceSlots(mailbox, opened["event"])
        return opened["slots"]

    monkeypatch.setattr(cuda_ipc.DeviceSlotsReader, "open", classmethod(fake_open))
    yield name, opened
    box.close()


def announce(name: str, step: int, num_rows: int) -> None:
    """What MailboxWriter.write stores for a device slot once its copies are queued."""
    box = Mailbox.open(name)
    slot = step % box.geometry.num_slots
    box.slots[box.slot_field(slot, ROWS)] = num_rows
    box.slots[box.slot_field(slot, SEQ)] = step + 1  # last
    box.close()


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# ---- handles

def test_handles_round_trip_through_the_segment(instance: str) -> None:
    name = create_mailbox(instance, num_slots=3, max_rows=4, logprob_width=2, num_consumers=2, cuda=True)
    writer_end, reader_end = Mailbox.open(name), Mailbox.open(name)
    with pytest.raises(RuntimeError, match="not exported its CUDA handles yet"):
        reader_end.device_handles()
    writer_end.publish_handles(handles(3))
    assert reader_end.handles_ready and reader_end.device_handles() == handles(3)
    with pytest.raises(ValueError, match="room for 272 bytes of handles, got 208"):
        writer_end.publish_handles(handles(2))  # another geometry's handles never land in this segment
    writer_end.publish_handles(handles(3, max_rows=8))
    with pytest.raises(ValueError, match="device table has 480 bytes, its geometry needs 240"):
        reader_end.device_handles()
    writer_end.close()
    reader_end.close()


def test_handles_refuse_a_handle_of_the_wrong_size() -> None:
    with pytest.raises(ValueError, match="64 bytes, got 63"):
        DeviceHandles(0, 64, bytes(63), ()).pack()
    with pytest.raises(ValueError, match="take 144 bytes, got 143"):
        DeviceHandles.unpack(bytes(143), 1)


def test_a_cpu_mailbox_has_no_handles_area(instance: str) -> None:
    cpu = Mailbox.open(create_mailbox(instance, num_slots=2, max_rows=4, logprob_width=2, num_consumers=1,
                                      cuda=False))
    assert cpu.geometry.handles_bytes == 0 and cpu.geometry.data_offset == cpu.geometry.header_bytes
    assert cpu.segment.size_bytes == cpu.geometry.data_offset + 2 * cpu.geometry.slot_words * 4 == 64 * 4 + 2 * 80  # the header lines, then the slots
    cpu.close()


def test_ipc_handle_bytes_round_trip_through_cuda_bindings_structs() -> None:
    from cuda.bindings import runtime

    data = bytes(range(7, 7 + IPC_HANDLE_BYTES))
    for struct_type in (runtime.cudaIpcMemHandle_t, runtime.cudaIpcEventHandle_t):
        assert cuda_runtime._handle_bytes(cuda_runtime._handle_from(struct_type, data)) == data
    with pytest.raises(ValueError, match="64 bytes, got 8"):
        cuda_runtime._handle_from(runtime.cudaIpcMemHandle_t, bytes(8))


@no_cuda
def test_runtime_calls_without_a_device_raise_naming_the_call() -> None:
    with pytest.raises(cuda_runtime.CudaError, match=r"cudaMalloc\(16\) failed: cudaError"):
        cuda_runtime.malloc(16)
    with pytest.raises(cuda_runtime.CudaError, match="cudaEventCreateWithFlags failed"):
        cuda_runtime.Event.create(interprocess=True)


# ---- the wait

def test_poll_until_returns_once_done_spinning_first_then_sleeping() -> None:
    clock, event, checks = FakeClock(), FakeEvent(20), []
    poll_until(event.query, "fake work", 1.0, lambda: checks.append(clock()), clock=clock, sleep=clock.sleep)
    assert event.queries == 21  # twenty not-ready answers, then ready
    assert set(clock.sleeps) == {POLL_S} and len(clock.sleeps) == 15  # the first 50 us (5 polls) spin
    assert checks == []  # done before the first CHECK_EVERY_S


def test_poll_until_raises_at_its_deadline_naming_what_it_waited_for() -> None:
    clock, event, checks = FakeClock(), FakeEvent(None), []
    with pytest.raises(TimeoutError, match=r"^step 7 \(slot 3\): the device work was not complete within 0.5 s$"):
        poll_until(event.query, "step 7 (slot 3): the device work was not complete", 0.5,
                   lambda: checks.append(clock()), clock=clock, sleep=clock.sleep)
    assert 0.5 < clock.now_s < 0.5 + 2 * POLL_S
    assert 9 <= len(checks) <= 11  # about every CHECK_EVERY_S (0.05 s) of the 0.5 s


def test_a_failing_check_ends_the_wait_with_its_error() -> None:
    def producer_gone() -> None:
        raise PeerDied("the producer died")

    clock = FakeClock()
    with pytest.raises(PeerDied, match="the producer died"):
        poll_until(FakeEvent(None).query, "never", 10.0, producer_gone, clock=clock, sleep=clock.sleep)
    assert clock.now_s < 0.1


def test_consumer_opens_the_device_side_at_start_once_handles_are_published(instance: str,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    opened = []
    monkeypatch.setattr(cuda_ipc.DeviceSlotsReader, "open",
                        classmethod(lambda cls, box: opened.append(box.device_handles()) or FakeDeviceSlots(
                            box, FakeEvent(0))))
    name = create_mailbox(instance, num_slots=2, max_rows=4, logprob_width=2, num_consumers=2, cuda=True)
    early = MailboxReader(name, 0)
    assert not early.device_ready and opened == []  # nothing to open yet: opened at its first read
    box = Mailbox.open(name)
    box.publish_handles(handles(2))
    reader = MailboxReader(name, 1)
    assert reader.device_ready and opened == [handles(2)]
    for end in (early, reader, box):
        end.close()


def test_read_polls_the_device_work_then_returns_the_slot(device_mailbox: tuple[str, dict]) -> None:
    name, opened = device_mailbox
    reader = MailboxReader(name, 0)
    announce(name, 0, 3)
    ticks = []
    data = reader.read(0, check=lambda: ticks.append(1))
    assert data.token_ids.tolist() == [100, 101, 102] and data.logprobs is None
    assert opened["event"].queries == 4  # not ready three times, then ready
    reader.close()
    assert opened["slots"].closed


def test_read_raises_at_its_deadline_naming_the_step_and_slot(device_mailbox: tuple[str, dict]) -> None:
    name, opened = device_mailbox
    opened["event"] = FakeEvent(None)
    reader = MailboxReader(name, 0)
    announce(name, 1, 2)
    ticks = []
    with pytest.raises(TimeoutError, match=r"step 1 \(slot 1\) of mailbox .*: the device work was not complete "
                                           r"within 0.2 s"):
        reader.read(1, timeout_s=0.2, check=lambda: ticks.append(1))
    assert ticks  # the stage's own check (its heartbeat) ran while it waited
    reader.close()


def test_read_raises_peer_died_when_the_runner_dies_while_it_waits(device_mailbox: tuple[str, dict]) -> None:
    name, opened = device_mailbox
    opened["event"] = FakeEvent(None)
    reader = MailboxReader(name, 0)
    announce(name, 0, 2)
    box = Mailbox.open(name)
    box.slots[WRITER_PID] = dead_pid()
    with pytest.raises(PeerDied, match=r"the runner \(pid \d+\) died while a consumer waited for step 0 \(slot 0\)"):
        reader.read(0, timeout_s=10.0)  # the check sees it within CHECK_EVERY_S, long before the deadline
    box.close()
    reader.close()


def test_read_raises_peer_died_when_the_wait_ends_but_the_runner_is_gone(device_mailbox: tuple[str, dict]) -> None:
    """A wait that a dying runner's torn-down context let through carries no tokens."""
    name, opened = device_mailbox
    opened["event"] = FakeEvent(0)
    reader = MailboxReader(name, 0)
    announce(name, 0, 2)
    box = Mailbox.open(name)
    box.slots[WRITER_PID] = dead_pid()
    with pytest.raises(PeerDied, match="died while a consumer waited for step 0"):
        reader.read(0)
    box.close()
    reader.close()
