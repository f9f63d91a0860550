"""Scheduler side of the offload connector: the index of a bounded host-memory KV pool.

Maps block hash → host slot in LRU order. A slot becomes loadable only once the plan that
carries its save has been built: plans run in order, so any later plan's load sees the data.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from stages.contracts.config import check_positive
from stages.contracts.connector import KVConnectorScheduler
from stages.contracts.plan import KVCopyMeta


def _i32(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


class OffloadConnectorScheduler(KVConnectorScheduler):
    def __init__(self, num_host_blocks: int) -> None:
        self.num_host_blocks = check_positive("num_host_blocks", num_host_blocks)
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # loadable, oldest first
        self._pending: dict[bytes, int] = {}  # saves not yet in a plan
        self._free_slots = list(range(num_host_blocks - 1, -1, -1))
        self._loads: list[tuple[int, int]] = []  # (host slot, device block)
        self._saves: list[tuple[int, int]] = []  # (device block, host slot)
        self._loaded_slots: set[int] = set()
        self.num_loaded_blocks = 0
        self.num_saved_blocks = 0

    @property
    def num_stored_blocks(self) -> int:
        return len(self._slots)

    def num_hit_blocks(self, block_hashes: list[bytes]) -> int:
        num_hits = 0
        for block_hash in block_hashes:
            if block_hash not in self._slots:
                break
            num_hits += 1
        return num_hits

    def on_load(self, block_hashes: list[bytes], block_ids: list[int]) -> None:
        for block_hash, block_id in zip(block_hashes, block_ids):
            slot = self._slots[block_hash]
            self._slots.move_to_end(block_hash)
            self._loads.append((slot, block_id))
            self._loaded_slots.add(slot)

    def on_commit(self, block_hash: bytes, block_id: int) -> bool:
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return False
        if block_hash in self._pending:
            return False
        slot = self._take_slot()
        if slot is None:
            return False
        self._pending[block_hash] = slot
        self._saves.append((block_id, slot))
        return True

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        # Evict the least recently used slot that this step does not load from; loads run
        # before saves, so reusing a loaded slot would be safe, but it would waste the hit.
        for block_hash, slot in self._slots.items():
            if slot not in self._loaded_slots:
                del self._slots[block_hash]
                return slot
        return None

    def build_meta(self) -> tuple[KVCopyMeta | None, list[int]]:
        if not self._loads and not self._saves:
            return None, []
        meta = KVCopyMeta(
            load_host_slots=_i32([slot for slot, _ in self._loads]),
            load_block_ids=_i32([block for _, block in self._loads]),
            save_block_ids=_i32([block for block, _ in self._saves]),
            save_host_slots=_i32([slot for _, slot in self._saves]),
        )
        pinned = [block for block, _ in self._saves]
        self.num_loaded_blocks += len(self._loads)
        self.num_saved_blocks += len(self._saves)
        self._slots.update(self._pending)
        self._pending.clear()
        self._loads.clear()
        self._saves.clear()
        self._loaded_slots.clear()
        return meta, pinned

    def cancel_pending(self) -> list[int]:
        pinned = [block for block, _ in self._saves]
        self._free_slots.extend(self._pending.values())
        self._pending.clear()
        self._saves.clear()
        return pinned
