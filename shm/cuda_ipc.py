"""The token mailbox's device side: one device table of K slots and K interprocess events, over CUDA IPC.

The runner allocates the table with cudaMalloc (an allocation of its own, so its IPC handle
exposes nothing else, and no torch IPC ref-counter file appears in /dev/shm) and K events created
interprocess and timing-disabled, and writes their raw 64-byte IPC handles into the mailbox
segment once. Each consumer opens them once, at its start (a handle cannot be opened in the
process that made it). Torch tensors stay views over the shared allocation.

Per read a consumer makes a private stream wait on the slot's event, copies the slot to pinned
memory and records a local event; it then polls that event (cudaEventQuery) with a deadline,
checking between polls that the runner lives. It never blocks in a synchronize: a runner that
dies with the step unfinished would leave such a call hanging.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from shm import cuda_runtime as cuda
from shm.mailbox_layout import DeviceHandles, Mailbox
from shm.polling import poll_until

if TYPE_CHECKING:
    import torch


class Queryable(Protocol):
    def query(self) -> bool:
        """Whether the awaited device work is complete; never blocks."""


def wait_device(event: Queryable, what: str, timeout_s: float, check: Callable[[], None]) -> None:
    """Poll `event` until its work is complete, calling `check` (which raises when the producer
    died) between polls; TimeoutError naming `what` once `timeout_s` has passed."""
    poll_until(event.query, f"{what}: the device work was not complete", timeout_s, check)


class DeviceSlots:
    """The runner's device table and slot events, exported once into the mailbox segment."""

    def __init__(self, box: Mailbox, device: torch.device, pointer: int, table: torch.Tensor,
                 events: list[cuda.Event]) -> None:
        self.geometry = box.geometry
        self.device = device
        self._pointer = pointer
        self.table = table
        self.events = events

    @classmethod
    def export(cls, box: Mailbox, device: str | torch.device) -> DeviceSlots:
        import torch

        g = box.geometry
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"mailbox {box.name!r} was made for CUDA but the runner's device is {device}")
        index = torch.cuda.current_device() if device.index is None else device.index
        device = torch.device("cuda", index)
        with torch.cuda.device(device):
            cuda.set_device(index)
            pointer = cuda.malloc(g.slots_bytes)
            table = cuda.int32_tensor(pointer, (g.num_slots, g.slot_words), device)
            events = [cuda.Event.create(interprocess=True) for _ in range(g.num_slots)]
            handles = DeviceHandles(index, g.slots_bytes, cuda.ipc_mem_handle(pointer),
                                    tuple(event.ipc_handle() for event in events))
            table.zero_()
            torch.cuda.synchronize(device)  # the zeroed table is complete before any consumer copies it
        box.publish_handles(handles)
        return cls(box, device, pointer, table, events)

    def write(self, slot: int, token_ids: torch.Tensor, logprobs: torch.Tensor | None,
              logprob_token_ids: torch.Tensor | None) -> None:
        """Copy a step's outputs into `slot` on the current stream, then record the slot's event on it."""
        import torch

        g = self.geometry
        row = self.table[slot]
        num_rows = token_ids.shape[0]
        row[:num_rows].copy_(token_ids, non_blocking=True)
        if logprobs is not None:
            rows, flat, start = g.max_rows, num_rows * logprobs.shape[1], g.logprobs_start
            row[rows:rows + flat].copy_(logprob_token_ids.reshape(-1), non_blocking=True)
            row[start:start + flat].copy_(logprobs.reshape(-1).to(torch.float32).view(torch.int32), non_blocking=True)
        self.events[slot].record(torch.cuda.current_stream(self.device).cuda_stream)

    def close(self) -> None:
        """Free the table and the events, once the runner's own work on them is done."""
        import torch

        torch.cuda.synchronize(self.device)  # the runner's own stream only: no consumer is waited on
        self.table = None
        for event in self.events:
            event.destroy()
        self.events = []
        cuda.free(self._pointer)


class DeviceSlotsReader:
    """A consumer's imported table and events, a private copy stream, a local event, pinned staging."""

    def __init__(self, box: Mailbox, pointer: int, table: torch.Tensor, events: list[cuda.Event]) -> None:
        import torch

        self.geometry = box.geometry
        self._pointer = pointer
        self.table = table
        self.events = events
        with torch.cuda.device(table.device):
            self.stream = torch.cuda.Stream(table.device)
            self.copied = cuda.Event.create()  # local: polled, never synchronised
            self.staging = torch.empty(box.geometry.slot_words, dtype=torch.int32, pin_memory=True)

    @classmethod
    def open(cls, box: Mailbox) -> DeviceSlotsReader:
        """Import the runner's table and events (it must have published them)."""
        import torch

        g = box.geometry
        handles = box.device_handles()
        device = torch.device("cuda", handles.device_index)
        torch.cuda.init()
        with torch.cuda.device(device):
            cuda.set_device(handles.device_index)
            pointer = cuda.open_ipc_mem_handle(handles.table)
            table = cuda.int32_tensor(pointer, (g.num_slots, g.slot_words), device)
            events = [cuda.Event.open_ipc(handle) for handle in handles.events]
        return cls(box, pointer, table, events)

    def copy_out(self, slot: int, num_rows: int, width: int, *, what: str, timeout_s: float,
                 check: Callable[[], None]) -> np.ndarray:
        """Slot `slot`'s words on the host, once the runner's writes to it are complete (awaited
        as `wait_device` does). The returned array views the staging buffer: valid until the
        next copy_out."""
        import torch

        g = self.geometry
        rows, flat, start = g.max_rows, num_rows * width, g.logprobs_start
        row, staging, stream = self.table[slot], self.staging, self.stream
        cuda.stream_wait_event(stream.cuda_stream, self.events[slot])
        with torch.cuda.stream(stream):
            staging[:num_rows].copy_(row[:num_rows], non_blocking=True)
            if width:
                staging[rows:rows + flat].copy_(row[rows:rows + flat], non_blocking=True)
                staging[start:start + flat].copy_(row[start:start + flat], non_blocking=True)
        self.copied.record(stream.cuda_stream)
        wait_device(self.copied, what, timeout_s, check)
        return staging.numpy()

    def close(self) -> None:
        """Release the imports. If a copy may still wait on the runner (a wait was abandoned, or the
        runner died mid-step), they are left to the process's end rather than waited for."""
        try:
            idle = self.copied.query()
        except cuda.CudaError:  # the context is failing
            idle = False
        self.table = None
        events, self.events = self.events, []
        if not idle:
            return
        for event in events:
            event.destroy()
        self.copied.destroy()
        cuda.close_ipc_mem_handle(self._pointer)
