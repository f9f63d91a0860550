"""The token mailbox: K slots where the runner leaves each step's sampled tokens for its consumers.

Step N goes to slot N % K. The runner writes the slot, orders the write (CPU: the slot's
sequence number `N + 1` is stored after the data; CUDA: the slot's IPC event is recorded after
the copy kernel), then publishes (N, slot, rows) on the done ring. Each consumer (scheduler,
detokenizer) reads the slot and then releases it by storing "released up to step N" in its own
counter; the runner reuses a slot only once every consumer has released the step before.

The host segment (posix_ipc, made by the daemon) holds, as int64 slots:

    line 0          magic, num_slots, max_rows, logprob_width, num_consumers, device (0 cpu, 1 cuda),
                    handles ready
    line 1 + s      slot s: sequence (step + 1), num_rows, logprob width used
    line 1 + K + c  consumer c: released count (steps released), pid
    handles         CUDA only: the table's storage handle and the K event handles (raw bytes)
    data            CPU only: per slot token ids int32[R], logprob ids int32[R*W], logprobs float32[R*W]

On CUDA the table is one device allocation [K, R + 2*R*W] int32 (logprobs stored as float32
bits), exported once with `_share_cuda_()`; consumers open it and the events once, then per
read make a private stream wait on the slot's event, copy to pinned memory and synchronise a
local event (an imported IPC event spins in synchronize()).
"""
from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import posix_ipc

from pipeline.sampling_params import MAX_LOGPROBS
from shm.naming import pid_alive, ring_name
from shm.segment import PeerDied

if TYPE_CHECKING:
    import torch

MAGIC = 0x31584F424C49414D  # b"MAILBOX1"
DEFAULT_NUM_SLOTS = 8
LOGPROB_WIDTH = 1 + MAX_LOGPROBS
LINE = 8  # int64 slots per 64-byte line
_MAGIC, _NUM_SLOTS, _MAX_ROWS, _WIDTH, _NUM_CONSUMERS, _DEVICE, _HANDLES_READY = range(7)
_SEQ, _ROWS, _USED_WIDTH = range(3)
_RELEASED, _PID = range(2)
HANDLE_FIELD_BYTES = 512  # room for one raw handle (CUDA IPC handles are 64 bytes)
_HANDLE_INTS = struct.Struct("<qqqqq")  # device, size, offset, ref counter offset, event sync required
CHECK_EVERY_S = 0.05  # how often a waiting runner looks at its peers
SPIN_S = 50e-6


@dataclass(slots=True)
class SlotData:
    """One step's outputs, copied out of the mailbox (host numpy arrays)."""

    token_ids: np.ndarray  # int32 [rows]
    logprobs: np.ndarray | None  # float32 [rows, width]
    logprob_token_ids: np.ndarray | None  # int32 [rows, width]


@dataclass(slots=True, frozen=True)
class _Geometry:
    num_slots: int
    max_rows: int
    num_consumers: int
    cuda: bool

    @property
    def slot_words(self) -> int:
        return self.max_rows * (1 + 2 * LOGPROB_WIDTH)

    @property
    def header_bytes(self) -> int:
        return (1 + self.num_slots + self.num_consumers) * LINE * 8

    @property
    def handles_bytes(self) -> int:
        return (_HANDLE_INTS.size + 3 * HANDLE_FIELD_BYTES + self.num_slots * HANDLE_FIELD_BYTES) if self.cuda else 0

    @property
    def data_offset(self) -> int:
        return (self.header_bytes + self.handles_bytes + 63) & -64

    @property
    def size_bytes(self) -> int:
        data = 0 if self.cuda else self.num_slots * self.slot_words * 4
        return self.data_offset + data


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


class _Mapping:
    """The host segment, mapped; shared by the writer and reader ends."""

    def __init__(self, name: str, mm: mmap.mmap) -> None:
        self.name = name
        self.mm = mm
        self.slots = memoryview(mm).cast("q")
        if self.slots[_MAGIC] != MAGIC:
            raise ValueError(f"{name!r} is not a token mailbox")
        self.geometry = _Geometry(self.slots[_NUM_SLOTS], self.slots[_MAX_ROWS], self.slots[_NUM_CONSUMERS],
                                  bool(self.slots[_DEVICE]))

    def slot_field(self, slot: int, field: int) -> int:
        return (1 + slot) * LINE + field

    def consumer_field(self, consumer: int, field: int) -> int:
        return (1 + self.geometry.num_slots + consumer) * LINE + field

    def host_slot(self, slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """CPU path: (token ids [R], logprob ids [R*W], logprobs [R*W]) views of slot `slot`."""
        g = self.geometry
        offset = g.data_offset + slot * g.slot_words * 4
        rows, flat = g.max_rows, g.max_rows * LOGPROB_WIDTH
        token_ids = np.frombuffer(self.mm, np.int32, rows, offset)
        logprob_ids = np.frombuffer(self.mm, np.int32, flat, offset + rows * 4)
        logprobs = np.frombuffer(self.mm, np.float32, flat, offset + (rows + flat) * 4)
        return token_ids, logprob_ids, logprobs

    def close(self) -> None:
        self.slots.release()
        try:
            self.mm.close()
        except BufferError:
            pass  # a numpy view still holds the mapping; it goes when the view does


def create_mailbox(instance: str, *, num_slots: int = DEFAULT_NUM_SLOTS, max_rows: int, num_consumers: int,
                   cuda: bool) -> str:
    """Make the mailbox segment of `instance` (in the daemon); returns its name for the stages.
    The caller unlinks it (`unlink_mailbox`) once every end has attached."""
    _check_positive("num_slots", num_slots)
    _check_positive("max_rows", max_rows)
    _check_positive("num_consumers", num_consumers)
    geometry = _Geometry(num_slots, max_rows, num_consumers, cuda)
    name = ring_name(instance, "mailbox")
    shared = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=geometry.size_bytes)
    try:
        mm = mmap.mmap(shared.fd, geometry.size_bytes)
    finally:
        shared.close_fd()
    slots = memoryview(mm).cast("q")
    slots[_NUM_SLOTS], slots[_MAX_ROWS], slots[_NUM_CONSUMERS] = num_slots, max_rows, num_consumers
    slots[_WIDTH], slots[_DEVICE] = LOGPROB_WIDTH, int(cuda)
    slots[_MAGIC] = MAGIC
    slots.release()
    mm.close()
    return name


def unlink_mailbox(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


def _open(name: str) -> _Mapping:
    shared = posix_ipc.SharedMemory(name)
    try:
        mm = mmap.mmap(shared.fd, shared.size)
    finally:
        shared.close_fd()
    return _Mapping(name, mm)


class MailboxWriter:
    """The runner's end. `device` is the runner's: cpu (host slots) or cuda (device slots)."""

    def __init__(self, name: str, device: str | torch.device = "cpu") -> None:
        self._map = _open(name)
        g = self._map.geometry
        self.num_slots = g.num_slots
        self.max_rows = g.max_rows
        self._cuda = _CudaSlots.export(self._map, device) if g.cuda else None

    def _check_consumers(self) -> None:
        for consumer in range(self._map.geometry.num_consumers):
            pid = self._map.slots[self._map.consumer_field(consumer, _PID)]
            if pid and not pid_alive(pid):
                raise PeerDied(f"mailbox {self._map.name!r}: consumer {consumer} (pid {pid}) died")

    def wait_free(self, step: int, timeout_s: float, check: Callable[[], None] = lambda: None) -> int:
        """Wait until slot `step % K` may be rewritten (every consumer released step - K); returns
        the slot. Calls `check` (which may raise) and checks consumers every CHECK_EVERY_S."""
        slot = step % self.num_slots
        need = step - self.num_slots + 1  # released count that frees the slot
        if need <= 0:
            return slot
        slots, m = self._map.slots, self._map
        fields = [m.consumer_field(c, _RELEASED) for c in range(m.geometry.num_consumers)]
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
                time.sleep(0.0002)  # a polling wait: consumers release within a step's time
        return slot

    def write(self, step: int, token_ids: torch.Tensor | np.ndarray, logprobs: torch.Tensor | None = None,
              logprob_token_ids: torch.Tensor | None = None, *, timeout_s: float = 30.0,
              check: Callable[[], None] = lambda: None) -> int:
        """Put step `step`'s outputs into its slot (waiting for the slot to be free) and order
        the write; returns the slot. Publish (step, slot, rows) only after this returns."""
        num_rows = int(token_ids.shape[0])
        if num_rows > self.max_rows:
            raise ValueError(f"step {step} has {num_rows} sampled rows; the mailbox holds {self.max_rows}")
        width = 0 if logprobs is None else int(logprobs.shape[1])
        slot = self.wait_free(step, timeout_s, check)
        m = self._map
        if self._cuda is not None:
            self._cuda.write(slot, token_ids, logprobs, logprob_token_ids)
        else:
            tokens, ids, values = m.host_slot(slot)
            tokens[:num_rows] = _host(token_ids)
            if width:
                ids[:num_rows * width] = _host(logprob_token_ids).reshape(-1)
                values[:num_rows * width] = _host(logprobs).reshape(-1)
        slots = m.slots
        slots[m.slot_field(slot, _ROWS)] = num_rows
        slots[m.slot_field(slot, _USED_WIDTH)] = width
        slots[m.slot_field(slot, _SEQ)] = step + 1  # last: data (or the event record) is ordered before it
        return slot

    def close(self) -> None:
        self._map.close()


def _host(values: torch.Tensor | np.ndarray) -> np.ndarray:
    return values if isinstance(values, np.ndarray) else values.numpy()


class MailboxReader:
    """Consumer `index`'s end (one thread uses it). read(step, slot) copies a slot out;
    release(step) lets the runner reuse it."""

    def __init__(self, name: str, index: int) -> None:
        self._map = _open(name)
        g = self._map.geometry
        if not 0 <= index < g.num_consumers:
            raise ValueError(f"consumer index must be in [0, {g.num_consumers}), got {index}")
        self._index = index
        self._map.slots[self._map.consumer_field(index, _PID)] = os.getpid()
        self._cuda: _CudaReader | None = None

    def read(self, step: int, slot: int) -> SlotData:
        m = self._map
        slots = m.slots
        seq = slots[m.slot_field(slot, _SEQ)]
        if seq != step + 1:
            raise RuntimeError(f"mailbox slot {slot} holds step {seq - 1}, expected step {step}")
        num_rows = slots[m.slot_field(slot, _ROWS)]
        width = slots[m.slot_field(slot, _USED_WIDTH)]
        if m.geometry.cuda:
            if self._cuda is None:
                self._cuda = _CudaReader(m)
            return self._cuda.read(slot, num_rows, width)
        tokens, ids, values = m.host_slot(slot)
        if not width:
            return SlotData(tokens[:num_rows].copy(), None, None)
        return SlotData(tokens[:num_rows].copy(), values[:num_rows * width].reshape(num_rows, width).copy(),
                        ids[:num_rows * width].reshape(num_rows, width).copy())

    def release(self, step: int) -> None:
        """Done with step `step` (and every earlier one)."""
        self._map.slots[self._map.consumer_field(self._index, _RELEASED)] = step + 1

    def close(self) -> None:
        self._cuda = None
        self._map.close()


# ---- CUDA path

def _put_bytes(mm: mmap.mmap, offset: int, data: bytes) -> None:
    if len(data) > HANDLE_FIELD_BYTES - 8:
        raise ValueError(f"a {len(data)}-byte IPC handle does not fit the mailbox's {HANDLE_FIELD_BYTES}-byte field")
    mm[offset:offset + 8] = len(data).to_bytes(8, "little")
    mm[offset + 8:offset + 8 + len(data)] = data


def _get_bytes(mm: mmap.mmap, offset: int) -> bytes:
    length = int.from_bytes(mm[offset:offset + 8], "little")
    return bytes(mm[offset + 8:offset + 8 + length])


class _CudaSlots:
    """The runner's device table and slot events, exported once into the host segment."""

    def __init__(self, table: torch.Tensor, events: list, max_rows: int) -> None:
        self.table = table
        self.events = events
        self.max_rows = max_rows

    @classmethod
    def export(cls, m: _Mapping, device: str | torch.device) -> _CudaSlots:
        import torch

        g = m.geometry
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"mailbox {m.name!r} was made for CUDA but the runner's device is {device}")
        # One allocation of its own for the whole table, so its IPC handle exposes nothing else.
        table = torch.zeros((g.num_slots, g.slot_words), dtype=torch.int32, device=device)
        events = [torch.cuda.Event(enable_timing=False, interprocess=True) for _ in range(g.num_slots)]
        (device_index, handle, size, offset, ref_handle, ref_offset, event_handle,
         event_sync) = table.untyped_storage()._share_cuda_()
        base = g.header_bytes
        m.mm[base:base + _HANDLE_INTS.size] = _HANDLE_INTS.pack(device_index, size, offset, ref_offset, int(event_sync))
        fields = base + _HANDLE_INTS.size
        for index, data in enumerate((handle, ref_handle, event_handle or b"")):
            _put_bytes(m.mm, fields + index * HANDLE_FIELD_BYTES, bytes(data))
        events_base = fields + 3 * HANDLE_FIELD_BYTES
        for slot, event in enumerate(events):
            _put_bytes(m.mm, events_base + slot * HANDLE_FIELD_BYTES, bytes(event.ipc_handle()))
        torch.cuda.synchronize(device)  # the zeroed table is complete before any consumer copies it
        m.slots[_HANDLES_READY] = 1
        return cls(table, events, g.max_rows)

    def write(self, slot: int, token_ids: torch.Tensor, logprobs: torch.Tensor | None,
              logprob_token_ids: torch.Tensor | None) -> None:
        rows = self.max_rows
        row = self.table[slot]
        num_rows = token_ids.shape[0]
        row[:num_rows].copy_(token_ids, non_blocking=True)
        if logprobs is not None:
            flat = num_rows * logprobs.shape[1]
            row[rows:rows + flat].copy_(logprob_token_ids.reshape(-1), non_blocking=True)
            start = rows * (1 + LOGPROB_WIDTH)
            row[start:start + flat].copy_(logprobs.reshape(-1).view(torch.int32), non_blocking=True)
        self.events[slot].record()  # on the runner's stream, after the copies


class _CudaReader:
    """A consumer's imported table and events, a private copy stream and pinned staging."""

    def __init__(self, m: _Mapping) -> None:
        import torch

        g = m.geometry
        if not m.slots[_HANDLES_READY]:
            raise RuntimeError(f"mailbox {m.name!r}: the runner has not exported its CUDA handles yet")
        base = g.header_bytes
        device_index, size, offset, ref_offset, event_sync = _HANDLE_INTS.unpack_from(m.mm, base)
        fields = base + _HANDLE_INTS.size
        handle, ref_handle, event_handle = (_get_bytes(m.mm, fields + i * HANDLE_FIELD_BYTES) for i in range(3))
        torch.cuda._lazy_init()  # opening a handle is the process's first CUDA call
        storage = torch.UntypedStorage._new_shared_cuda(device_index, handle, size, offset, ref_handle, ref_offset,
                                                        event_handle or None, bool(event_sync))
        self.device = torch.device("cuda", device_index)
        self.table = torch.empty(0, dtype=torch.int32, device=self.device).set_(
            storage, 0, (g.num_slots, g.slot_words), (g.slot_words, 1))
        events_base = fields + 3 * HANDLE_FIELD_BYTES
        self.events = [
            torch.cuda.Event.from_ipc_handle(self.device, _get_bytes(m.mm, events_base + slot * HANDLE_FIELD_BYTES))
            for slot in range(g.num_slots)]
        self.stream = torch.cuda.Stream(self.device)
        self.copied = torch.cuda.Event(blocking=True)  # a local event: synchronize() sleeps, not spins
        self.staging = torch.empty(g.slot_words, dtype=torch.int32, pin_memory=True)
        self.max_rows = g.max_rows

    def read(self, slot: int, num_rows: int, width: int) -> SlotData:
        import torch

        rows, flat = self.max_rows, num_rows * width
        row, staging = self.table[slot], self.staging
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.events[slot])
            staging[:num_rows].copy_(row[:num_rows], non_blocking=True)
            if width:
                staging[rows:rows + flat].copy_(row[rows:rows + flat], non_blocking=True)
                start = rows * (1 + LOGPROB_WIDTH)
                staging[start:start + flat].copy_(row[start:start + flat], non_blocking=True)
            self.copied.record(self.stream)
        self.copied.synchronize()
        host = staging.numpy()
        if not width:
            return SlotData(host[:num_rows].copy(), None, None)
        start = rows * (1 + LOGPROB_WIDTH)
        logprobs = host[start:start + flat].view(np.float32).reshape(num_rows, width)
        return SlotData(host[:num_rows].copy(), logprobs.copy(), host[rows:rows + flat].reshape(num_rows, width).copy())
