"""Runner side of the offload connector: a bounded host-memory pool of KV blocks.

Executes the copies the scheduler listed in `KVCopyMeta` (stages/scheduler/offload.py keeps
the index). Every copy is enqueued on the current stream and the host pool is never read or
written by the CPU, so a save still in flight can never be overtaken by a later load.
"""
from __future__ import annotations

import torch

from stages.contracts.config import check_positive
from stages.contracts.plan import KVCopyMeta


class OffloadConnectorWorker:
    """Host pool layout: [num_host_blocks, num_layers, 2, block_size, num_kv_heads, head_dim],
    one contiguous slot per block (one copy per block each way). The device caches are the
    runner's per-layer [2, num_kv_blocks, block_size, num_kv_heads, head_dim] tensors."""

    def __init__(self, num_host_blocks: int | None = None) -> None:
        """num_host_blocks None: as many as the device pool (known at bind)."""
        if num_host_blocks is not None:
            check_positive("num_host_blocks", num_host_blocks)
        self.num_host_blocks = num_host_blocks
        self._kv_caches: list[torch.Tensor] = []
        self._host: torch.Tensor | None = None

    def bind(self, kv_caches: list[torch.Tensor], block_size: int) -> None:
        first = kv_caches[0]
        if first.dim() != 5 or first.shape[0] != 2 or first.shape[2] != block_size:
            raise ValueError(f"expected per-layer KV caches [2, blocks, {block_size}, heads, head_dim], "
                             f"got {tuple(first.shape)}")
        self._kv_caches = list(kv_caches)
        self._device = first.device
        if self.num_host_blocks is None:
            self.num_host_blocks = int(first.shape[1])
        shape = (self.num_host_blocks, len(kv_caches), 2, *first.shape[2:])
        self._host = torch.zeros(shape, dtype=first.dtype, pin_memory=first.device.type == "cuda")

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
