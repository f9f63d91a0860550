"""The token mailbox: K slots where the runner leaves each step's sampled tokens for its consumers.

Step N goes to slot N % K. The runner writes the slot, orders the write (CPU: the slot's
sequence number `N + 1` is stored after the data; CUDA: the slot's IPC event is recorded after
the copy kernel), then announces the step. Each consumer (scheduler, detokenizer) reads the
slot and then releases it by storing "released up to step N" in its own counter; the runner
reuses a slot only once every consumer has released the step before.

A consumer that attaches as replaceable is one the daemon restarts when it dies: the runner then
waits for the replacement instead of failing. The replacement starts at a step that another
consumer, which covered for it meanwhile, hands it (`MailboxReader.cover_for`).

A slot may also carry a "ready at" time (CLOCK_MONOTONIC ns, shm/clock.py): its tokens exist
only from then on, and a reader sleeps until it, as it would wait on a device event. Only the
simulated device of the benchmarks sets it (stages/gpu_runner/simulated/); 0 means ready now.

The segment's layout is in shm/mailbox_layout.py; the device side (CUDA IPC) in shm/cuda_ipc.py,
imported only for a CUDA mailbox.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from shm.clock import sleep_until_ns
from shm.mailbox_layout import (DEVICE, MAGIC, MAX_ROWS, NUM_CONSUMERS, NUM_SLOTS, PID, READY_AT_NS, RELEASED,
                                REPLACEABLE, ROWS,
                                SEQ, USED_WIDTH, WIDTH, WRITER_PID, Geometry, Mailbox, SlotData, unpack_slot)
from shm.naming import pid_alive, ring_name
from shm.polling import poll_until
from shm.segment import PeerDied, SharedSegment, unlink_segment

if TYPE_CHECKING:
    import torch

    from shm.cuda_ipc import DeviceSlots, DeviceSlotsReader

__all__ = ["MailboxReader", "MailboxWriter", "SlotData", "create_mailbox", "unlink_mailbox"]

DEFAULT_NUM_SLOTS = 8
READ_TIMEOUT_S = 60.0  # a consumer's longest wait for a step's device work (a long prefill takes seconds)


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def create_mailbox(instance: str, *, num_slots: int = DEFAULT_NUM_SLOTS, max_rows: int, logprob_width: int,
                   num_consumers: int, cuda: bool) -> str:
    """Make the mailbox segment of `instance`; returns its name for the other processes. The
    creator unlinks it (`unlink_mailbox`) once every end has attached."""
    for name, value in (("num_slots", num_slots), ("max_rows", max_rows), ("logprob_width", logprob_width),
                        ("num_consumers", num_consumers)):
        _check_positive(name, value)
    geometry = Geometry(num_slots, max_rows, logprob_width, num_consumers, cuda)
    segment = SharedSegment.create(ring_name(instance, "mailbox"), geometry.segment_bytes, MAGIC, {
        NUM_SLOTS: num_slots, MAX_ROWS: max_rows, WIDTH: logprob_width, NUM_CONSUMERS: num_consumers,
        DEVICE: int(cuda)})
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
        self._box.slots[WRITER_PID] = os.getpid()
        self._device_slots: DeviceSlots | None = None
        if g.cuda:
            from shm.cuda_ipc import DeviceSlots

            self._device_slots = DeviceSlots.export(self._box, device)

    def consumer_pid(self, consumer: int) -> int:
        """The pid consumer `consumer` registered when it attached (0 before)."""
        return self._box.slots[self._box.consumer_field(consumer, PID)]

    def _check_consumers(self) -> None:
        slots = self._box.slots
        for consumer in range(self._box.geometry.num_consumers):
            pid = self.consumer_pid(consumer)
            if pid and not pid_alive(pid) and not slots[self._box.consumer_field(consumer, REPLACEABLE)]:
                raise PeerDied(f"mailbox {self._box.name!r}: consumer {consumer} (pid {pid}) died")

    def wait_free(self, step: int, timeout_s: float, check: Callable[[], None] = lambda: None) -> int:
        """Wait until slot `step % K` may be rewritten (every consumer released step - K); returns
        the slot. Checks the consumers, and calls `check` (which may raise), as it polls."""
        slot = step % self.num_slots
        need = step - self.num_slots + 1  # released count that frees the slot
        if need <= 0:
            return slot
        box, slots = self._box, self._box.slots
        fields = [box.consumer_field(c, RELEASED) for c in range(box.geometry.num_consumers)]

        def check_peers() -> None:
            self._check_consumers()
            check()

        poll_until(lambda: all(slots[f] >= need for f in fields), f"mailbox slot {slot} for step {step}: not released",
                   timeout_s, check_peers)
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
        slots[box.slot_field(slot, ROWS)] = num_rows
        slots[box.slot_field(slot, USED_WIDTH)] = width
        slots[box.slot_field(slot, READY_AT_NS)] = ready_at_ns
        slots[box.slot_field(slot, SEQ)] = step + 1  # last: data (or the event record) is ordered before it
        return slot

    def close(self) -> None:
        if self._device_slots is not None:
            self._device_slots.close()
            self._device_slots = None
        self._box.close()


def _host(values: torch.Tensor | np.ndarray) -> np.ndarray:
    return values if isinstance(values, np.ndarray) else values.numpy()


class MailboxReader:
    """Consumer `index`'s end (one thread uses it). read(step, slot) copies a slot out;
    release(step) lets the runner reuse it.

    On a CUDA mailbox the runner's table and events are opened here, at the consumer's start
    (not in its first read), when the runner has published them, as it has by the time the
    stages build their consumers; else at the first read."""

    def __init__(self, name: str, index: int, *, replaceable: bool = False) -> None:
        self._box = Mailbox.open(name)
        g = self._box.geometry
        if not 0 <= index < g.num_consumers:
            self._box.close()
            raise ValueError(f"consumer index must be in [0, {g.num_consumers}), got {index}")
        self._index = index
        self._box.slots[self._box.consumer_field(index, REPLACEABLE)] = int(replaceable)
        self._box.slots[self._box.consumer_field(index, PID)] = os.getpid()
        self._device_slots: DeviceSlotsReader | None = None
        if g.cuda and self._box.handles_ready:
            self._open_device_slots()

    def _open_device_slots(self) -> DeviceSlotsReader:
        if self._device_slots is None:
            from shm.cuda_ipc import DeviceSlotsReader

            self._device_slots = DeviceSlotsReader.open(self._box)
        return self._device_slots

    @property
    def num_slots(self) -> int:
        return self._box.geometry.num_slots

    @property
    def device_ready(self) -> bool:
        """Whether this end has opened the runner's device slots (always false on the CPU path)."""
        return self._device_slots is not None

    def read(self, step: int, slot: int | None = None, *, timeout_s: float = READ_TIMEOUT_S,
             check: Callable[[], None] = lambda: None) -> SlotData:
        """Step `step`'s outputs (its slot is `step % num_slots` unless given), once they are
        ready: this sleeps until the slot's ready time, if the runner gave one. On CUDA it polls
        for the runner's device work, calling `check` (which may raise) and raising PeerDied if
        the runner dies, TimeoutError after `timeout_s`."""
        box = self._box
        if slot is None:
            slot = step % box.geometry.num_slots
        slots = box.slots
        seq = slots[box.slot_field(slot, SEQ)]
        if seq != step + 1:
            raise RuntimeError(f"mailbox slot {slot} holds step {seq - 1}, expected step {step}")
        num_rows = slots[box.slot_field(slot, ROWS)]
        width = slots[box.slot_field(slot, USED_WIDTH)]
        ready_at_ns = slots[box.slot_field(slot, READY_AT_NS)]
        if ready_at_ns:
            sleep_until_ns(ready_at_ns)
        if box.geometry.cuda:
            what = f"step {step} (slot {slot}) of mailbox {box.name!r}"

            def check_runner() -> None:
                box.check_writer(what)
                check()

            words = self._open_device_slots().copy_out(slot, num_rows, width, what=what, timeout_s=timeout_s,
                                                       check=check_runner)
            box.check_writer(what)  # a runner that died mid-step may have let the wait through with no tokens
        else:
            words = box.host_words(slot)
        return unpack_slot(words, box.geometry, num_rows, width)

    def release(self, step: int) -> None:
        """Done with step `step` (and every earlier one)."""
        self._box.slots[self._box.consumer_field(self._index, RELEASED)] = step + 1

    def cover_for(self, consumer: int) -> int:
        """Releases, for `consumer` (dead; a replacement attaches later), every step this end has
        released, so that the runner goes on; returns that count. The replacement reads from the
        next step on. Raises RuntimeError if the consumer runs."""
        box = self._box
        pid = box.slots[box.consumer_field(consumer, PID)]
        if pid and pid_alive(pid):
            raise RuntimeError(f"mailbox {box.name!r}: consumer {consumer} (pid {pid}) runs; only a dead one's "
                               "steps may be released for it")
        released = box.slots[box.consumer_field(self._index, RELEASED)]
        field = box.consumer_field(consumer, RELEASED)
        box.slots[field] = max(box.slots[field], released)
        return released

    def close(self) -> None:
        if self._device_slots is not None:
            self._device_slots.close()
            self._device_slots = None
        self._box.close()
