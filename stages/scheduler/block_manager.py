"""KV block pool with reference counts and a prefix cache of full, computed blocks.

A block is in exactly one of three places: held (ref_count > 0), free and uncached
(`_free_plain`), or free but cached (`_evictable`, LRU order, oldest first). Free cached
blocks still serve prefix hits until an allocation evicts them.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from stages.contracts.config import check_positive


def hash_block(parent_hash: bytes | None, token_ids: np.ndarray) -> bytes:
    """Chained hash of one full block: equal hashes mean equal whole prefixes.

    A 128-bit keyed digest, not Python's hash(): a collision would silently serve another
    prompt's KV, so the key space must make that practically impossible."""
    digest = hashlib.blake2b(digest_size=16)
    if parent_hash is not None:
        digest.update(parent_hash)
    digest.update(np.ascontiguousarray(token_ids, dtype=np.int32).tobytes())
    return digest.digest()


def extend_hashes(hashes: list[bytes], token_ids: np.ndarray, num_blocks: int, block_size: int) -> list[bytes]:
    """`hashes`, a request's chain of block hashes over `token_ids`, extended in place to at
    least `num_blocks` entries."""
    for index in range(len(hashes), num_blocks):
        block = token_ids[index * block_size:(index + 1) * block_size]
        hashes.append(hash_block(hashes[-1] if hashes else None, block))
    return hashes


class OutOfBlocks(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = check_positive("num_kv_blocks", num_blocks)
        self.block_size = check_positive("block_size", block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_count = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}
        # Popped from the end: low block ids are handed out first, which keeps tests readable.
        self._free_plain: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    def ref_count(self, block_id: int) -> int:
        return self._ref_count[block_id]

    def match_prefix(self, block_hashes: list[bytes]) -> list[int]:
        """Cached blocks for the longest prefix of `block_hashes`; takes nothing."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for block_hash in block_hashes:
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def num_free_after_taking(self, block_ids: list[int]) -> int:
        """Free blocks left once `block_ids` (cache hits) are taken: idle hits leave the free pool."""
        return self.num_free_blocks - sum(1 for b in block_ids if self._ref_count[b] == 0)

    def take(self, block_ids: list[int]) -> None:
        """Add a reference to each (prefix hits, or a pin while a copy reads the block)."""
        for block_id in block_ids:
            if self._ref_count[block_id] == 0:
                del self._evictable[block_id]
            self._ref_count[block_id] += 1

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > self.num_free_blocks:
            raise OutOfBlocks(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        num_plain = min(num_blocks, len(self._free_plain))
        if num_plain:
            block_ids = self._free_plain[-num_plain:][::-1]
            del self._free_plain[-num_plain:]
        else:
            block_ids = []
        for _ in range(num_blocks - num_plain):
            block_id, _ = self._evictable.popitem(last=False)
            del self._hash_to_block[self._block_hash[block_id]]
            self._block_hash[block_id] = None
            block_ids.append(block_id)
        for block_id in block_ids:
            self._ref_count[block_id] = 1
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference each. Callers pass a request's blocks last-first, so a prefix's
        tail is evicted before its head (heads are the most shared)."""
        for block_id in block_ids:
            count = self._ref_count[block_id] - 1
            if count < 0:
                raise RuntimeError(f"block {block_id} freed more often than taken")
            self._ref_count[block_id] = count
            if count == 0:
                if self._block_hash[block_id] is None:
                    self._free_plain.append(block_id)
                else:
                    self._evictable[block_id] = None

    def commit(self, block_id: int, block_hash: bytes) -> bool:
        """Register a full, computed block under its hash. If another block already holds
        that prefix (two requests computed it in the same step), the first stays canonical and
        this one stays uncached, so it returns to the plain pool when freed. True if registered."""
        if not self.enable_prefix_caching or block_hash in self._hash_to_block:
            return False
        if self._block_hash[block_id] is not None:
            return False
        self._hash_to_block[block_hash] = block_id
        self._block_hash[block_id] = block_hash
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every free cached block (held blocks keep their hash). Returns how many."""
        num_dropped = len(self._evictable)
        for block_id in self._evictable:
            del self._hash_to_block[self._block_hash[block_id]]
            self._block_hash[block_id] = None
            self._free_plain.append(block_id)
        self._evictable.clear()
        return num_dropped
