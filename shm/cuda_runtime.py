"""The CUDA runtime calls the project makes itself, through cuda-python's `cuda.bindings.runtime`,
each checked: device buffers and their IPC handles, events (interprocess ones too), stream waits,
host-memory registration, and a torch tensor viewing a raw device pointer.

Importing this module needs no GPU and no driver; a call without one raises CudaError. Every
call runs in the primary context of the current device, the one torch uses, so pointers,
streams and events pass freely between torch and these calls. Torch is imported lazily.
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

from cuda.bindings import runtime as _rt

from shm.mailbox_layout import IPC_HANDLE_BYTES

if TYPE_CHECKING:
    import torch

_SUCCESS = _rt.cudaError_t.cudaSuccess
_NOT_READY = _rt.cudaError_t.cudaErrorNotReady


class CudaError(RuntimeError):
    """A CUDA runtime call failed; the message names the call and CUDA's error."""


def _error_text(error: _rt.cudaError_t) -> str:
    name, text = _rt.cudaGetErrorName(error)[1], _rt.cudaGetErrorString(error)[1]
    return f"{name.decode()} ({text.decode()})"


def _check(result: tuple, what: str) -> object:
    """The value of a cuda.bindings call's `(error, value)` or `(error,)` result; raises unless success."""
    error = result[0]
    if error != _SUCCESS:
        raise CudaError(f"{what} failed: {_error_text(error)}")
    return result[1] if len(result) > 1 else None


def _handle_bytes(handle: object) -> bytes:
    """The 64 raw bytes of an IPC handle struct (read through its address: cuda.bindings does not
    expose the `reserved` array in every version)."""
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)


def _handle_from(cls: type, data: bytes) -> object:
    if len(data) != IPC_HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC handle is {IPC_HANDLE_BYTES} bytes, got {len(data)}")
    handle = cls()
    ctypes.memmove(handle.getPtr(), data, IPC_HANDLE_BYTES)
    return handle


def set_device(index: int) -> None:
    """Make device `index` (its primary context) current for this thread's runtime calls."""
    _check(_rt.cudaSetDevice(index), f"cudaSetDevice({index})")


def malloc(num_bytes: int) -> int:
    """A device allocation of its own (not a caching allocator's block): its IPC handle exposes
    nothing else."""
    return int(_check(_rt.cudaMalloc(num_bytes), f"cudaMalloc({num_bytes})"))


def free(pointer: int) -> None:
    _check(_rt.cudaFree(pointer), "cudaFree")


def ipc_mem_handle(pointer: int) -> bytes:
    """The raw IPC handle of the allocation `pointer` starts."""
    return _handle_bytes(_check(_rt.cudaIpcGetMemHandle(pointer), "cudaIpcGetMemHandle"))


def open_ipc_mem_handle(handle: bytes) -> int:
    """Map another process's allocation here (never in the process that made the handle)."""
    opened = _rt.cudaIpcOpenMemHandle(_handle_from(_rt.cudaIpcMemHandle_t, handle), _rt.cudaIpcMemLazyEnablePeerAccess)
    return int(_check(opened, "cudaIpcOpenMemHandle"))


def close_ipc_mem_handle(pointer: int) -> None:
    _check(_rt.cudaIpcCloseMemHandle(pointer), "cudaIpcCloseMemHandle")


def host_register(pointer: int, num_bytes: int) -> None:
    """Page-lock existing host memory in place (no copy, no rounding of its size)."""
    _check(_rt.cudaHostRegister(pointer, num_bytes, _rt.cudaHostRegisterDefault),
           f"cudaHostRegister of {num_bytes} bytes")


def host_unregister(pointer: int) -> None:
    _check(_rt.cudaHostUnregister(pointer), "cudaHostUnregister")


def stream_wait_event(stream: int, event: Event) -> None:
    """Work queued on `stream` from now on runs after `event`'s recorded work (no host wait)."""
    _check(_rt.cudaStreamWaitEvent(stream, event.handle, 0), "cudaStreamWaitEvent")


class Event:
    """A CUDA event, timing disabled. query() never blocks; nothing here synchronises on it."""

    __slots__ = ("handle",)

    def __init__(self, handle: object) -> None:
        self.handle = handle

    @classmethod
    def create(cls, *, interprocess: bool = False) -> Event:
        """A new event on the current device; `interprocess` ones can be exported (ipc_handle)."""
        flags = _rt.cudaEventDisableTiming | (_rt.cudaEventInterprocess if interprocess else 0)
        return cls(_check(_rt.cudaEventCreateWithFlags(flags), "cudaEventCreateWithFlags"))

    @classmethod
    def open_ipc(cls, handle: bytes) -> Event:
        """Another process's interprocess event (never open one in the process that made it)."""
        return cls(_check(_rt.cudaIpcOpenEventHandle(_handle_from(_rt.cudaIpcEventHandle_t, handle)),
                          "cudaIpcOpenEventHandle"))

    def ipc_handle(self) -> bytes:
        return _handle_bytes(_check(_rt.cudaIpcGetEventHandle(self.handle), "cudaIpcGetEventHandle"))

    def record(self, stream: int) -> None:
        """Capture the work queued on `stream` (a cudaStream_t as an int: torch's `cuda_stream`)."""
        _check(_rt.cudaEventRecord(self.handle, stream), "cudaEventRecord")

    def query(self) -> bool:
        """Whether the captured work is complete (cudaErrorNotReady: not yet; any other error raises)."""
        error = _rt.cudaEventQuery(self.handle)[0]
        if error == _NOT_READY:
            return False
        if error != _SUCCESS:
            raise CudaError(f"cudaEventQuery failed: {_error_text(error)}")
        return True

    def destroy(self) -> None:
        _check(_rt.cudaEventDestroy(self.handle), "cudaEventDestroy")


class _DeviceArray:
    """A raw device pointer seen as a C-contiguous int32 array through `__cuda_array_interface__`;
    a torch tensor made from it keeps it referenced, not the memory: its owner frees that."""

    def __init__(self, pointer: int, shape: tuple[int, ...]) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "<i4", "data": (pointer, False),
                                         "strides": None, "version": 3}


def int32_tensor(pointer: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A torch int32 tensor viewing `shape` words at device `pointer` (no copy). It must not
    outlive the memory."""
    import torch

    return torch.as_tensor(_DeviceArray(pointer, shape), device=device)
