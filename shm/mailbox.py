"""The token mailbox: K slots where the runner leaves each step's sampled tokens for its consumers.

Step N goes to slot N % K. The runner writes the slot, orders the write (CPU: the slot's
sequence number `N + 1` is stored after the data; CUDA: the slot's IPC event is recorded after
the copy kernel), then announces the step. Each consumer (scheduler, detokenizer) reads the
slot and then releases it by storing "released up to step N" in its own counter; the runner
reuses a slot only once every consumer has released the step before.

A slot may also carry a "ready at" time (CLOCK_MONOTONIC ns, shm/clock.py): its tokens exist
only from then on, and a reader sleeps until it, as it would wait on a device event. Only the
simulated device of the benchmarks sets it (stages/gpu_runner/simulated.py); 0 means ready now.

The segment holds, as int64 slots:

    line 0          magic, num_slots, max_rows, logprob_width, num_consumers, device (0 cpu, 1 cuda),
                    handles ready
    line 1 + s      slot s: sequence (step + 1), num_rows, logprob width used, ready at (ns, 0: now)
    line 1 + K + c  consumer c: released count (steps released), pid
    handles         CUDA only: the device table's and the K events' IPC handles (shm/cuda_ipc.py)
    data            CPU only: per slot token ids int32[R], logprob ids int32[R*W], logprobs float32[R*W]

A slot's data is one row of R * (1 + 2W) int32 words in both places (logprobs as float32 bits).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from shm.clock import sleep_until_ns
from shm.naming import pid_alive, ring_name
from shm.segment import LINE_SLOTS, PeerDied, SharedSegment, unlink_segment

if TYPE_CHECKING:
    import torch

    from shm.cuda_ipc import DeviceSlots, DeviceSlotsReader

MAGIC = 0x31584F424C49414D  # b"MAILBOX1"
DEFAULT_NUM_SLOTS = 8
_NUM_SLOTS, _MAX_ROWS, _WIDTH, _NUM_CONSUMERS, _DEVICE, _HANDLES_READY = range(1, 7)
_SEQ, _ROWS, _USED_WIDTH, _READY_AT_NS = range(4)
_RELEASED, _PID = range(2)
CHECK_EVERY_S = 0.05  # how often a waiting runner looks at its peers
SPIN_S = 50e-6
POLL_S = 0.0002


@dataclass(slots=True)
class SlotData:
    """One step's outputs, copied out of the mailbox (host numpy arrays)."""

    token_ids: np.ndarray  # int32 [rows]
    logprobs: np.ndarray | None  # float32 [rows, width]
    logprob_token_ids: np.ndarray | None  # int32 [rows, width]


@dataclass(slots=True, frozen=True)
class Geometry:
    num_slots: int
    max_rows: int
    logprob_width: int
    num_consumers: int
    cuda: bool

    @property
    def slot_words(self) -> int:
        """int32 words of one slot: token ids, then logprob ids, then logprobs."""
        return self.max_rows * (1 + 2 * self.logprob_width)

    @property
    def logprobs_start(self) -> int:
        """Word offset of the logprob values within a slot."""
        return self.max_rows * (1 + self.logprob_width)

    @property
    def header_bytes(self) -> int:
        return (1 + self.num_slots + self.num_consumers) * LINE_SLOTS * 8

    def data_offset(self, handles_bytes: int) -> int:
        return (self.header_bytes + handles_bytes + 63) & -64


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def unpack_slot(words: np.ndarray, geometry: Geometry, num_rows: int, width: int) -> SlotData:
    """Copies of one slot's outputs from its int32 words (a host slot, or a device slot's copy)."""
    token_ids = words[:num_rows].copy()
    if not width:
        return SlotData(token_ids, None, None)
    rows, flat, start = geometry.max_rows, num_rows * width, geometry.logprobs_start
    logprobs = words[start:start + flat].view(np.float32).reshape(num_rows, width).copy()
    return SlotData(token_ids, logprobs, words[rows:rows + flat].reshape(num_rows, width).copy())


class Mailbox:
    """One mapping of the mailbox segment: what the writer and reader ends share."""

    def __init__(self, segment: SharedSegment) -> None:
        self.segment = segment
        self.name = segment.name
        slots = segment.slots
        self.slots = slots
        self.geometry = Geometry(slots[_NUM_SLOTS], slots[_MAX_ROWS], slots[_WIDTH], slots[_NUM_CONSUMERS],
                                 bool(slots[_DEVICE]))

    @classmethod
    def open(cls, name: str) -> Mailbox:
        return cls(SharedSegment.open(name, MAGIC, "token mailbox"))

    def slot_field(self, slot: int, field: int) -> int:
        return (1 + slot) * LINE_SLOTS + field

    def consumer_field(self, consumer: int, field: int) -> int:
        return (1 + self.geometry.num_slots + consumer) * LINE_SLOTS + field

    def host_words(self, slot: int) -> np.ndarray:
        """CPU path: the int32 words of slot `slot`, a view of the segment."""
        g = self.geometry
        offset = g.data_offset(0) + slot * g.slot_words * 4
        return np.frombuffer(self.segment.mm, np.int32, g.slot_words, offset)

    @property
    def handles_ready(self) -> bool:
        return bool(self.slots[_HANDLES_READY])

    def mark_handles_ready(self) -> None:
        self.slots[_HANDLES_READY] = 1

    def close(self) -> None:
        self.segment.close()


def create_mailbox(instance: str, *, num_slots: int = DEFAULT_NUM_SLOTS, max_rows: int, logprob_width: int,
                   num_consumers: int, cuda: bool) -> str:
    """Make the mailbox segment of `instance`; returns its name for the other processes. The
    creator unlinks it (`unlink_mailbox`) once every end has attached."""
    for name, value in (("num_slots", num_slots), ("max_rows", max_rows), ("logprob_width", logprob_width),
                        ("num_consumers", num_consumers)):
        _check_positive(name, value)
    geometry = Geometry(num_slots, max_rows, logprob_width, num_consumers, cuda)
    if cuda:
        from shm.cuda_ipc import handles_bytes

        size = geometry.data_offset(handles_bytes(num_slots))
    else:
        size = geometry.data_offset(0) + num_slots * geometry.slot_words * 4
    segment = SharedSegment.create(ring_name(instance, "mailbox"), size, MAGIC, {
        _NUM_SLOTS: num_slots, _MAX_ROWS: max_rows, _WIDTH: logprob_width, _NUM_CONSUMERS: num_consumers,
        _DEVICE: int(cuda)})
    segment.close()
    return segment.name


def unlink_mailbox(name: str) -> None:
    """Remove the mailbox's name (its creator does, once every end has attached)."""
    unlink_segment(name)


class MailboxWriter:
    """The runner's end. `device` is the runner's: cpu (host slots) or cuda (device slots)."""

    def __init__(self, name: str, device: str | torch.device = "cpu") -> None:
        self._box = Mailbox.open(name)
        g = self._box.geometry
        self.num_slots = g.num_slots
        self.max_rows = g.max_rows
        self._device_slots: DeviceSlots | None = None
        if g.cuda:
            from shm import cuda_ipc

            self._device_slots = cuda_ipc.DeviceSlots.export(self._box, device)

    def consumer_pid(self, consumer: int) -> int:
        """The pid consumer `consumer` registered when it attached (0 before)."""
        return self._box.slots[self._box.consumer_field(consumer, _PID)]

    def _check_consumers(self) -> None:
        for consumer in range(self._box.geometry.num_consumers):
            pid = self.consumer_pid(consumer)
            if pid and not pid_alive(pid):
                raise PeerDied(f"mailbox {self._box.name!r}: consumer {consumer} (pid {pid}) died")

    def wait_free(self, step: int, timeout_s: float, check: Callable[[], None] = lambda: None) -> int:
        """Wait until slot `step % K` may be rewritten (every consumer released step - K); returns
        the slot. Calls `check` (which may raise) and checks consumers every CHECK_EVERY_S."""
        slot = step % self.num_slots
        need = step - self.num_slots + 1  # released count that frees the slot
        if need <= 0:
            return slot
        box, slots = self._box, self._box.slots
        fields = [box.consumer_field(c, _RELEASED) for c in range(box.geometry.num_consumers)]
        start = time.monotonic()
        next_check = start + CHECK_EVERY_S
        while any(slots[f] < need for f in fields):
            now = time.monotonic()
            if now - start > timeout_s:
                raise TimeoutError(f"mailbox slot {slot} for step {step}: not released within {timeout_s} s")
            if now >= next_check:
                self._check_consumers()
                check()
                next_check = now + CHECK_EVERY_S
            if now - start > SPIN_S:
                time.sleep(POLL_S)  # a polling wait: consumers release within a step's time
        return slot

    def write(self, step: int, token_ids: torch.Tensor | np.ndarray, logprobs: torch.Tensor | None = None,
              logprob_token_ids: torch.Tensor | None = None, *, timeout_s: float = 30.0,
              check: Callable[[], None] = lambda: None, ready_at_ns: int = 0) -> int:
        """Put step `step`'s outputs into its slot (waiting for the slot to be free) and order
        the write; returns the slot. Announce (step, slot, rows) only after this returns. Readers
        of the slot wait until CLOCK_MONOTONIC `ready_at_ns` (0: no wait)."""
        num_rows = int(token_ids.shape[0])
        if num_rows > self.max_rows:
            raise ValueError(f"step {step} has {num_rows} sampled rows; the mailbox holds {self.max_rows}")
        width = 0 if logprobs is None else int(logprobs.shape[1])
        g = self._box.geometry
        if width > g.logprob_width:
            raise ValueError(f"step {step} has {width} logprobs per row; the mailbox holds {g.logprob_width}")
        slot = self.wait_free(step, timeout_s, check)
        box = self._box
        if self._device_slots is not None:
            self._device_slots.write(slot, token_ids, logprobs, logprob_token_ids)
        else:
            words = box.host_words(slot)
            words[:num_rows] = _host(token_ids)
            if width:
                rows, flat, start = g.max_rows, num_rows * width, g.logprobs_start
                words[rows:rows + flat] = _host(logprob_token_ids).reshape(-1)
                words[start:start + flat] = np.ascontiguousarray(_host(logprobs), np.float32).reshape(-1).view(np.int32)
        slots = box.slots
        slots[box.slot_field(slot, _ROWS)] = num_rows
        slots[box.slot_field(slot, _USED_WIDTH)] = width
        slots[box.slot_field(slot, _READY_AT_NS)] = ready_at_ns
        slots[box.slot_field(slot, _SEQ)] = step + 1  # last: data (or the event record) is ordered before it
        return slot

    def close(self) -> None:
        self._box.close()


def _host(values: torch.Tensor | np.ndarray) -> np.ndarray:
    return values if isinstance(values, np.ndarray) else values.numpy()


class MailboxReader:
    """Consumer `index`'s end (one thread uses it). read(step, slot) copies a slot out;
    release(step) lets the runner reuse it."""

    def __init__(self, name: str, index: int) -> None:
        self._box = Mailbox.open(name)
        g = self._box.geometry
        if not 0 <= index < g.num_consumers:
            self._box.close()
            raise ValueError(f"consumer index must be in [0, {g.num_consumers}), got {index}")
        self._index = index
        self._box.slots[self._box.consumer_field(index, _PID)] = os.getpid()
        self._device_slots: DeviceSlotsReader | None = None
        if g.cuda:
            # CUDA is initialised now, at stage start, not in the middle of the first step.
            from shm.cuda_ipc import init_cuda

            init_cuda()

    @property
    def num_slots(self) -> int:
        return self._box.geometry.num_slots

    def read(self, step: int, slot: int | None = None) -> SlotData:
        """Step `step`'s outputs (its slot is `step % num_slots` unless given), once they are
        ready: this sleeps until the slot's ready time, if the runner gave one."""
        box = self._box
        if slot is None:
            slot = step % box.geometry.num_slots
        slots = box.slots
        seq = slots[box.slot_field(slot, _SEQ)]
        if seq != step + 1:
            raise RuntimeError(f"mailbox slot {slot} holds step {seq - 1}, expected step {step}")
        num_rows = slots[box.slot_field(slot, _ROWS)]
        width = slots[box.slot_field(slot, _USED_WIDTH)]
        ready_at_ns = slots[box.slot_field(slot, _READY_AT_NS)]
        if ready_at_ns:
            sleep_until_ns(ready_at_ns)
        if box.geometry.cuda:
            if self._device_slots is None:
                from shm import cuda_ipc

                self._device_slots = cuda_ipc.DeviceSlotsReader.open(box)
            words = self._device_slots.copy_out(slot, num_rows, width)
        else:
            words = box.host_words(slot)
        return unpack_slot(words, box.geometry, num_rows, width)

    def release(self, step: int) -> None:
        """Done with step `step` (and every earlier one)."""
        self._box.slots[self._box.consumer_field(self._index, _RELEASED)] = step + 1

    def close(self) -> None:
        self._device_slots = None
        self._box.close()
