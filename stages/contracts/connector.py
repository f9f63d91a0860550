"""KV connector interfaces: an external KV store beside the device prefix cache.

The scheduler side decides (which blocks the store can supply, which to copy where) and
writes it into each plan's `connector_meta`; the runner side only executes that metadata.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class KVConnectorScheduler(ABC):
    """Scheduler side. Every block named here is a full block of host-known tokens."""

    @abstractmethod
    def num_hit_blocks(self, block_hashes: list[bytes]) -> int:
        """How many leading blocks of `block_hashes` the store can supply now."""

    @abstractmethod
    def on_load(self, block_hashes: list[bytes], block_ids: list[int]) -> None:
        """This step must fill device `block_ids` from the store (hits just counted)."""

    @abstractmethod
    def on_commit(self, block_hash: bytes, block_id: int) -> bool:
        """Device block `block_id` now holds computed KV for `block_hash`. True if the next
        plan's metadata will read it: the scheduler then keeps the block from being
        reallocated until that plan has been built (its forward runs before any later one)."""

    @abstractmethod
    def build_meta(self) -> tuple[object | None, list[int]]:
        """Metadata for the plan being built, and the device blocks whose reads it carries
        (the scheduler unpins them once the plan is built). (None, []) when there is nothing."""

    @abstractmethod
    def cancel_pending(self) -> list[int]:
        """Forget copies not yet put in a plan (no plan will carry them); returns the
        device blocks to unpin."""


class KVConnectorWorker(Protocol):
    """Runner side: the runner calls bind once, then load before and save after each
    forward whose plan carries metadata."""

    def bind(self, kv_caches: list[torch.Tensor], block_size: int) -> None: ...

    def load(self, meta: object) -> None: ...

    def save(self, meta: object) -> None: ...
