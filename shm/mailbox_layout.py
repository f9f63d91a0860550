"""The token mailbox segment's layout: its geometry, header fields, and the CUDA IPC handles area.

Both the mailbox's ends (shm/mailbox.py) and its device side (shm/cuda_ipc.py) build on this
module; it imports neither. The segment holds, as int64 slots:

    line 0          magic, num_slots, max_rows, logprob_width, num_consumers, device (0 cpu, 1 cuda),
                    handles ready, writer pid
    line 1 + s      slot s: sequence (step + 1), num_rows, logprob width used, ready at (ns, 0: now)
    line 1 + K + c  consumer c: released count (steps released), pid, replaceable (its death makes the
                    runner wait for a replacement: shm/mailbox.py)
    handles         CUDA only: device index, table bytes, the table's 64-byte IPC memory handle,
                    then one 64-byte IPC event handle per slot
    data            CPU only: per slot token ids int32[R], logprob ids int32[R*W], logprobs float32[R*W]

A slot's data is one row of R * (1 + 2W) int32 words in both places (logprobs as float32 bits).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from shm.naming import pid_alive
from shm.segment import LINE_SLOTS, PeerDied, SharedSegment

MAGIC = 0x31584F424C49414D  # b"MAILBOX1"
NUM_SLOTS, MAX_ROWS, WIDTH, NUM_CONSUMERS, DEVICE, HANDLES_READY, WRITER_PID = range(1, 8)
SEQ, ROWS, USED_WIDTH, READY_AT_NS = range(4)
RELEASED, PID, REPLACEABLE = range(3)
IPC_HANDLE_BYTES = 64  # cudaIpcMemHandle_t and cudaIpcEventHandle_t alike
_HANDLES_HEAD = struct.Struct("<qq")  # device index, table bytes


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
    def slots_bytes(self) -> int:
        """Bytes of all K slots: the CPU path's data area, the CUDA path's device table."""
        return self.num_slots * self.slot_words * 4

    @property
    def logprobs_start(self) -> int:
        """Word offset of the logprob values within a slot."""
        return self.max_rows * (1 + self.logprob_width)

    @property
    def header_bytes(self) -> int:
        return (1 + self.num_slots + self.num_consumers) * LINE_SLOTS * 8

    @property
    def handles_bytes(self) -> int:
        """Bytes of the CUDA handles area (none on the CPU path)."""
        return _HANDLES_HEAD.size + (1 + self.num_slots) * IPC_HANDLE_BYTES if self.cuda else 0

    @property
    def data_offset(self) -> int:
        return (self.header_bytes + self.handles_bytes + 63) & -64

    @property
    def segment_bytes(self) -> int:
        return self.data_offset + (0 if self.cuda else self.slots_bytes)


@dataclass(slots=True, frozen=True)
class DeviceHandles:
    """What a consumer needs to open the runner's device slots: raw 64-byte IPC handles."""

    device_index: int
    table_bytes: int
    table: bytes  # cudaIpcMemHandle_t of the table's own allocation
    events: tuple[bytes, ...]  # cudaIpcEventHandle_t of each slot's event

    def pack(self) -> bytes:
        for handle in (self.table, *self.events):
            if len(handle) != IPC_HANDLE_BYTES:
                raise ValueError(f"a CUDA IPC handle is {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
        return _HANDLES_HEAD.pack(self.device_index, self.table_bytes) + self.table + b"".join(self.events)

    @classmethod
    def unpack(cls, data: bytes, num_slots: int) -> DeviceHandles:
        expected = _HANDLES_HEAD.size + (1 + num_slots) * IPC_HANDLE_BYTES
        if len(data) != expected:
            raise ValueError(f"the handles of {num_slots} slots take {expected} bytes, got {len(data)}")
        device_index, table_bytes = _HANDLES_HEAD.unpack_from(data)
        handles = [data[i:i + IPC_HANDLE_BYTES] for i in range(_HANDLES_HEAD.size, len(data), IPC_HANDLE_BYTES)]
        return cls(device_index, table_bytes, handles[0], tuple(handles[1:]))


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
        self.geometry = Geometry(slots[NUM_SLOTS], slots[MAX_ROWS], slots[WIDTH], slots[NUM_CONSUMERS],
                                 bool(slots[DEVICE]))

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
        offset = g.data_offset + slot * g.slot_words * 4
        return np.frombuffer(self.segment.mm, np.int32, g.slot_words, offset)

    @property
    def writer_pid(self) -> int:
        """The runner's pid (0 before it attached)."""
        return self.slots[WRITER_PID]

    def check_writer(self, waiting_for: str) -> None:
        """Raise PeerDied naming `waiting_for` if the runner attached and has died since."""
        pid = self.writer_pid
        if pid and not pid_alive(pid):
            raise PeerDied(f"mailbox {self.name!r}: the runner (pid {pid}) died while a consumer waited for "
                           f"{waiting_for}")

    @property
    def handles_ready(self) -> bool:
        return bool(self.slots[HANDLES_READY])

    def publish_handles(self, handles: DeviceHandles) -> None:
        """Write the runner's device handles into the segment, then mark them ready (last)."""
        data = handles.pack()
        if len(data) != self.geometry.handles_bytes:
            raise ValueError(f"mailbox {self.name!r} has room for {self.geometry.handles_bytes} bytes of handles, "
                             f"got {len(data)}")
        start = self.geometry.header_bytes
        self.segment.mm[start:start + len(data)] = data
        self.slots[HANDLES_READY] = 1

    def device_handles(self) -> DeviceHandles:
        """The runner's device handles, once it published them."""
        if not self.handles_ready:
            raise RuntimeError(f"mailbox {self.name!r}: the runner has not exported its CUDA handles yet")
        g = self.geometry
        handles = DeviceHandles.unpack(bytes(self.segment.mm[g.header_bytes:g.header_bytes + g.handles_bytes]),
                                       g.num_slots)
        if handles.table_bytes != g.slots_bytes:
            raise ValueError(f"mailbox {self.name!r}: the runner's device table has {handles.table_bytes} bytes, "
                             f"its geometry needs {g.slots_bytes}")
        return handles

    def close(self) -> None:
        self.segment.close()
