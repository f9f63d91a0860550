"""The KV cache's groups of layers as the scheduler keeps them: a block pool each, and a request's
block list in each, all of the same length (one entry per block of its tokens).

A model whose layers all attend everything has one group. A sliding window makes its group
release every block wholly behind the window: such an entry becomes NULL_BLOCK and its block
goes back to the pool (still in the prefix cache if committed). Gemma 3 has two groups, its
global layers (0) and its local ones (1). A prefix hit needs, in a windowed group, only the
blocks the first new token's window reaches; the entries before them are NULL_BLOCK.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stages.contracts.config import ModelLimits
from stages.scheduler.block_manager import BlockManager
from stages.scheduler.request import Request

NULL_BLOCK = -1


@dataclass(slots=True)
class KVGroup:
    manager: BlockManager
    window: int | None  # tokens a query attends back to, itself included; None: all


def _held(block_ids: list[int]) -> list[int]:
    return [b for b in block_ids if b != NULL_BLOCK]


class KVGroups:
    def __init__(self, limits: ModelLimits, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.groups = [KVGroup(BlockManager(limits.num_kv_blocks, block_size, enable_prefix_caching),
                               limits.window or None)]
        if limits.num_window_blocks:
            self.groups.append(KVGroup(BlockManager(limits.num_window_blocks, block_size, enable_prefix_caching),
                                       limits.local_window))
        self.windowed = [i for i, group in enumerate(self.groups) if group.window is not None]

    @staticmethod
    def lists(request: Request) -> list[list[int]]:
        return [request.block_ids, request.window_block_ids]

    @property
    def num_free_blocks(self) -> int:
        """New table entries every group can still back (each new entry takes a block in each)."""
        return min(group.manager.num_free_blocks for group in self.groups)

    def _first_needed_block(self, window: int | None, position: int) -> int:
        """The first block a query at `position` reads in a group of this window."""
        return 0 if window is None else max(0, position - window + 1) // self.block_size

    def match_prefix(self, block_hashes: list[bytes]) -> list[list[int]]:
        """Per group, the cached blocks of the longest prefix every group can serve (a windowed
        group: only those the next token's window reaches, NULL_BLOCK before them); takes nothing."""
        num_hits = len(self.groups[0].manager.match_prefix(block_hashes)) if self.groups[0].window is None \
            else len(block_hashes)
        while num_hits:
            hits = [self._group_hits(group, block_hashes, num_hits) for group in self.groups]
            if all(h is not None for h in hits):
                return hits
            num_hits -= 1
        return [[] for _ in self.groups]

    def _group_hits(self, group: KVGroup, block_hashes: list[bytes], num_hits: int) -> list[int] | None:
        first = self._first_needed_block(group.window, num_hits * self.block_size)
        found = group.manager.match_prefix(block_hashes[first:num_hits])
        return [NULL_BLOCK] * first + found if len(found) == num_hits - first else None

    def num_free_after_taking(self, hits: list[list[int]]) -> int:
        return min(group.manager.num_free_after_taking(_held(h)) for group, h in zip(self.groups, hits))

    def take(self, hits: list[list[int]]) -> None:
        for group, group_hits in zip(self.groups, hits):
            group.manager.take(_held(group_hits))

    def allocate(self, num_blocks: int) -> list[list[int]]:
        return [group.manager.allocate(num_blocks) for group in self.groups]

    def commit(self, request: Request, index: int, block_hash: bytes) -> None:
        for group, block_ids in zip(self.groups, self.lists(request)):
            if block_ids[index] != NULL_BLOCK:
                group.manager.commit(block_ids[index], block_hash)

    def release_behind_window(self, request: Request, next_position: int) -> None:
        """Free the windowed groups' blocks that no query from `next_position` on reads.
        `next_position` is the first token no processed step has computed: steps in flight read
        from there, so nothing they read is freed."""
        for index in self.windowed:
            group, block_ids = self.groups[index], self.lists(request)[index]
            end = min(self._first_needed_block(group.window, next_position), len(block_ids))
            for i in range(request.num_released_blocks, end):
                if block_ids[i] != NULL_BLOCK:
                    group.manager.free([block_ids[i]])
                    block_ids[i] = NULL_BLOCK
            request.num_released_blocks = max(request.num_released_blocks, end)

    def free(self, request: Request) -> None:
        """Drop every block the request holds, last first (a prefix's tail is evicted before its head)."""
        for group, block_ids in zip(self.groups, self.lists(request)):
            group.manager.free(_held(block_ids)[::-1])
            block_ids.clear()
        request.num_released_blocks = 0

    def num_held(self, request: Request) -> int:
        """Blocks freed in every group once the request is released."""
        return min(len(_held(block_ids)) for block_ids, _ in zip(self.lists(request), self.groups))

    def plan_ids(self, new_ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """A plan's new table entries of group 0 and group 1 (empty without one); a NULL_BLOCK
        entry is never read, and block 0 stands for it."""
        arrays = [np.maximum(np.asarray(ids, dtype=np.int32), 0) for ids in new_ids]
        return arrays[0], arrays[1] if len(arrays) > 1 else np.zeros(0, np.int32)
