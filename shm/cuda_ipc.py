"""The token mailbox's device side: one device table of K slots and K interprocess events.

The runner allocates the table as one allocation of its own (so its IPC handle exposes nothing
else) and K events created interprocess and timing-disabled, and writes their raw IPC handles
into the mailbox segment once. Each consumer opens them once (a handle cannot be opened in the
process that made it); per read it makes a private stream wait on the slot's event, copies the
slot to pinned memory and synchronises a local blocking event (an imported IPC event spins in
synchronize()). torch tensors stay views over the shared allocation.
"""
from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from shm.mailbox import Mailbox

HANDLE_FIELD_BYTES = 512  # room for one raw handle (CUDA IPC handles are 64 bytes)
_HANDLE_INTS = struct.Struct("<qqqqq")  # device, size, offset, ref counter offset, event sync required


def handles_bytes(num_slots: int) -> int:
    """Bytes the handles take in the segment: the table's, then one per slot event."""
    return _HANDLE_INTS.size + 3 * HANDLE_FIELD_BYTES + num_slots * HANDLE_FIELD_BYTES


def init_cuda() -> None:
    """Initialise CUDA in this process now (a consumer does at start, not in its first read)."""
    import torch

    torch.cuda.init()


def _put_bytes(mm: object, offset: int, data: bytes) -> None:
    if len(data) > HANDLE_FIELD_BYTES - 8:
        raise ValueError(f"a {len(data)}-byte IPC handle does not fit the mailbox's {HANDLE_FIELD_BYTES}-byte field")
    mm[offset:offset + 8] = len(data).to_bytes(8, "little")
    mm[offset + 8:offset + 8 + len(data)] = data


def _get_bytes(mm: object, offset: int) -> bytes:
    length = int.from_bytes(mm[offset:offset + 8], "little")
    return bytes(mm[offset + 8:offset + 8 + length])


class DeviceSlots:
    """The runner's device table and slot events, exported once into the mailbox segment."""

    def __init__(self, table: torch.Tensor, events: list, box: Mailbox) -> None:
        self.table = table
        self.events = events
        self.geometry = box.geometry

    @classmethod
    def export(cls, box: Mailbox, device: str | torch.device) -> DeviceSlots:
        import torch

        g = box.geometry
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"mailbox {box.name!r} was made for CUDA but the runner's device is {device}")
        table = torch.zeros((g.num_slots, g.slot_words), dtype=torch.int32, device=device)
        events = [torch.cuda.Event(enable_timing=False, interprocess=True) for _ in range(g.num_slots)]
        (device_index, handle, size, offset, ref_handle, ref_offset, event_handle,
         event_sync) = table.untyped_storage()._share_cuda_()
        mm, base = box.segment.mm, g.header_bytes
        mm[base:base + _HANDLE_INTS.size] = _HANDLE_INTS.pack(device_index, size, offset, ref_offset, int(event_sync))
        fields = base + _HANDLE_INTS.size
        for index, data in enumerate((handle, ref_handle, event_handle or b"")):
            _put_bytes(mm, fields + index * HANDLE_FIELD_BYTES, bytes(data))
        events_base = fields + 3 * HANDLE_FIELD_BYTES
        for slot, event in enumerate(events):
            _put_bytes(mm, events_base + slot * HANDLE_FIELD_BYTES, bytes(event.ipc_handle()))
        torch.cuda.synchronize(device)  # the zeroed table is complete before any consumer copies it
        box.mark_handles_ready()
        return cls(table, events, box)

    def write(self, slot: int, token_ids: torch.Tensor, logprobs: torch.Tensor | None,
              logprob_token_ids: torch.Tensor | None) -> None:
        import torch

        g = self.geometry
        row = self.table[slot]
        num_rows = token_ids.shape[0]
        row[:num_rows].copy_(token_ids, non_blocking=True)
        if logprobs is not None:
            rows, flat, start = g.max_rows, num_rows * logprobs.shape[1], g.logprobs_start
            row[rows:rows + flat].copy_(logprob_token_ids.reshape(-1), non_blocking=True)
            row[start:start + flat].copy_(logprobs.reshape(-1).to(torch.float32).view(torch.int32), non_blocking=True)
        self.events[slot].record()  # on the runner's stream, after the copies


class DeviceSlotsReader:
    """A consumer's imported table and events, a private copy stream and pinned staging."""

    def __init__(self, table: torch.Tensor, events: list, box: Mailbox) -> None:
        import torch

        self.table = table
        self.events = events
        self.geometry = box.geometry
        self.stream = torch.cuda.Stream(table.device)
        self.copied = torch.cuda.Event(blocking=True)  # a local event: synchronize() sleeps, not spins
        self.staging = torch.empty(box.geometry.slot_words, dtype=torch.int32, pin_memory=True)

    @classmethod
    def open(cls, box: Mailbox) -> DeviceSlotsReader:
        import torch

        g = box.geometry
        if not box.handles_ready:
            raise RuntimeError(f"mailbox {box.name!r}: the runner has not exported its CUDA handles yet")
        mm, base = box.segment.mm, g.header_bytes
        device_index, size, offset, ref_offset, event_sync = _HANDLE_INTS.unpack_from(mm, base)
        fields = base + _HANDLE_INTS.size
        handle, ref_handle, event_handle = (_get_bytes(mm, fields + i * HANDLE_FIELD_BYTES) for i in range(3))
        storage = torch.UntypedStorage._new_shared_cuda(device_index, handle, size, offset, ref_handle, ref_offset,
                                                        event_handle or None, bool(event_sync))
        device = torch.device("cuda", device_index)
        table = torch.empty(0, dtype=torch.int32, device=device).set_(
            storage, 0, (g.num_slots, g.slot_words), (g.slot_words, 1))
        events_base = fields + 3 * HANDLE_FIELD_BYTES
        events = [torch.cuda.Event.from_ipc_handle(device, _get_bytes(mm, events_base + slot * HANDLE_FIELD_BYTES))
                  for slot in range(g.num_slots)]
        return cls(table, events, box)

    def copy_out(self, slot: int, num_rows: int, width: int) -> np.ndarray:
        """Slot `slot`'s words on the host, once the runner's writes to it are complete. The
        returned array views the staging buffer: valid until the next copy_out."""
        import torch

        g = self.geometry
        rows, flat, start = g.max_rows, num_rows * width, g.logprobs_start
        row, staging = self.table[slot], self.staging
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.events[slot])
            staging[:num_rows].copy_(row[:num_rows], non_blocking=True)
            if width:
                staging[rows:rows + flat].copy_(row[rows:rows + flat], non_blocking=True)
                staging[start:start + flat].copy_(row[start:start + flat], non_blocking=True)
            self.copied.record(self.stream)
        self.copied.synchronize()
        return staging.numpy()
