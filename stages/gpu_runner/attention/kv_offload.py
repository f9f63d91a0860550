"""Runner side of the offload connector: a bounded host-memory pool of KV blocks.

Executes the copies the scheduler listed in `KVCopyMeta` (stages/scheduler/offload.py keeps
the index). Every copy is enqueued on the current stream and the host pool is never read or
written by the CPU, so a save still in flight can never be overtaken by a later load.

The pool is sized from a host-memory budget, not from the device pool: unless told its number
of blocks, it takes as many as HOST_POOL_FRACTION of the machine's physical memory holds, at
most as many as the device pool has. On CUDA it is a plain host allocation page-locked in place
(cudaHostRegister): torch's pinned allocator would round its size up to a power of two, nearly
doubling a pool of tens of GiB.
"""
from __future__ import annotations

import os
import weakref

import torch

from shm import cuda_runtime
from stages.contracts.config import check_positive
from stages.contracts.plan import KVCopyMeta

HOST_POOL_FRACTION = 0.25  # of physical memory, for a pool whose number of blocks is not given


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_host_blocks(num_device_blocks: int, block_bytes: int, host_budget_bytes: int) -> int:
    """As many blocks of `block_bytes` as `host_budget_bytes` holds, at most `num_device_blocks`."""
    fits = host_budget_bytes // block_bytes
    if fits < 1:
        raise ValueError(f"the offload connector's host budget of {host_budget_bytes} bytes holds no KV block "
                         f"({block_bytes} bytes over all layers); set kv_offload_num_blocks")
    return min(num_device_blocks, fits)


class OffloadConnectorWorker:
    """Host pool layout: [num_host_blocks, num_layers, 2, block_size, num_kv_heads, head_dim],
    one contiguous slot per block (one copy per block each way). The device caches are the
    runner's per-layer [2, num_kv_blocks, block_size, num_kv_heads, head_dim] tensors."""

    def __init__(self, num_host_blocks: int | None = None, *, host_budget_bytes: int | None = None) -> None:
        """num_host_blocks None: as many as `host_budget_bytes` (default HOST_POOL_FRACTION of
        physical memory) holds, at most the device pool's (known at bind)."""
        if num_host_blocks is not None:
            check_positive("num_host_blocks", num_host_blocks)
        if host_budget_bytes is not None:
            check_positive("host_budget_bytes", host_budget_bytes)
        self.num_host_blocks = num_host_blocks
        self.host_budget_bytes = host_budget_bytes
        self._kv_caches: list[torch.Tensor] = []
        self._host: torch.Tensor | None = None
        self._unregister: weakref.finalize | None = None

    def bind(self, kv_caches: list[torch.Tensor], block_size: int) -> None:
        first = kv_caches[0]
        if first.dim() != 5 or first.shape[0] != 2 or first.shape[2] != block_size:
            raise ValueError(f"expected per-layer KV caches [2, blocks, {block_size}, heads, head_dim], "
                             f"got {tuple(first.shape)}")
        self._kv_caches = list(kv_caches)
        self._device = first.device
        block_shape = (len(kv_caches), 2, *first.shape[2:])
        if self.num_host_blocks is None:
            block_bytes = first[:, 0].numel() * len(kv_caches) * first.element_size()
            budget = self.host_budget_bytes or int(physical_memory_bytes() * HOST_POOL_FRACTION)
            self.num_host_blocks = default_host_blocks(int(first.shape[1]), block_bytes, budget)
        self._host = torch.empty((self.num_host_blocks, *block_shape), dtype=first.dtype)
        if first.device.type == "cuda":
            cuda_runtime.set_device(first.device.index)
            pointer = self._host.data_ptr()
            cuda_runtime.host_register(pointer, self._host.nbytes)
            self._unregister = weakref.finalize(self, cuda_runtime.host_unregister, pointer)
            self._unregister.atexit = False  # at exit the process's memory goes anyway

    @property
    def host_pool_bytes(self) -> int:
        return 0 if self._host is None else self._host.nbytes

    def close(self) -> None:
        """Unregister and drop the host pool, once the copies queued on it are done."""
        if self._unregister is not None:
            torch.cuda.synchronize(self._device)
            self._unregister()
            self._unregister = None
        self._host = None

    def load(self, meta: KVCopyMeta) -> None:
        """Host slot → device block, before the step's forward."""
        num_blocks = meta.load_block_ids.shape[0]
        if num_blocks == 0:
            return
        staging = torch.empty((num_blocks, *self._host.shape[1:]), dtype=self._host.dtype, device=self._device)
        for i, slot in enumerate(meta.load_host_slots.tolist()):
            staging[i].copy_(self._host[slot], non_blocking=True)
        block_ids = torch.from_numpy(meta.load_block_ids).to(self._device, torch.long, non_blocking=True)
        for layer, kv in enumerate(self._kv_caches):
            kv.index_copy_(1, block_ids, staging[:, layer].transpose(0, 1))

    def save(self, meta: KVCopyMeta) -> None:
        """Device block → host slot, after the step's forward."""
        num_blocks = meta.save_block_ids.shape[0]
        if num_blocks == 0:
            return
        block_ids = torch.from_numpy(meta.save_block_ids).to(self._device, torch.long, non_blocking=True)
        # [layers, 2, n, ...] → [n, layers, 2, ...]: one contiguous source per host slot.
        staging = torch.stack([kv.index_select(1, block_ids) for kv in self._kv_caches]).permute(2, 0, 1, 3, 4, 5)
        staging = staging.contiguous()
        for i, slot in enumerate(meta.save_host_slots.tolist()):
            self._host[slot].copy_(staging[i], non_blocking=True)
