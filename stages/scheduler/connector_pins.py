"""The scheduler's KV connector, with the blocks its pending saves will read held until the copy runs."""
from __future__ import annotations

from stages.contracts.connector import KVConnectorScheduler
from stages.scheduler.block_manager import BlockManager


class PinnedConnector:
    def __init__(self, connector: KVConnectorScheduler, manager: BlockManager) -> None:
        self.connector = connector
        self.manager = manager
        self._pins: list[int] = []  # blocks a pending save will read

    def committed(self, block_hash: bytes, block_id: int) -> None:
        """A block entered the prefix cache; one the connector will save stays held until saved."""
        if self.connector.on_commit(block_hash, block_id):
            self.manager.take([block_id])
            self._pins.append(block_id)

    def build_meta(self) -> object | None:
        """The copies for the next step (or None); the blocks they read are let go."""
        meta, read_blocks = self.connector.build_meta()
        for block_id in read_blocks:
            self._pins.remove(block_id)
        self.manager.free(read_blocks)
        return meta
