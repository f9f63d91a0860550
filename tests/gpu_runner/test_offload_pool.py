"""The offload connector's host pool is sized from a host-memory budget, never from the device pool
alone, and allocated at exactly its size."""
from __future__ import annotations

import pytest
import torch

from stages.gpu_runner.attention.kv_offload import (HOST_POOL_FRACTION, OffloadConnectorWorker, default_host_blocks,
                                       physical_memory_bytes)

NUM_LAYERS, BLOCK_SIZE, HEADS, HEAD_DIM = 3, 16, 2, 8
BLOCK_BYTES = NUM_LAYERS * 2 * BLOCK_SIZE * HEADS * HEAD_DIM * 4  # float32, over all layers


def kv_caches(num_device_blocks: int) -> list[torch.Tensor]:
    return [torch.zeros(2, num_device_blocks, BLOCK_SIZE, HEADS, HEAD_DIM) for _ in range(NUM_LAYERS)]


def test_default_pool_takes_what_the_budget_holds_at_most_the_device_pool() -> None:
    assert default_host_blocks(100, 1000, 10_999) == 10  # the budget binds
    assert default_host_blocks(16, 1000, 10**9) == 16  # the device pool binds
    with pytest.raises(ValueError, match="host budget of 999 bytes holds no KV block .1000 bytes.*"
                                         "set kv_offload_num_blocks"):
        default_host_blocks(16, 1000, 999)


def test_bound_pool_is_exactly_its_blocks_with_no_rounding_up() -> None:
    worker = OffloadConnectorWorker(host_budget_bytes=5 * BLOCK_BYTES + 7)
    worker.bind(kv_caches(64), BLOCK_SIZE)
    assert worker.num_host_blocks == 5
    assert worker.host_pool_bytes == 5 * BLOCK_BYTES  # 5 blocks, not rounded to a power of two
    worker.close()
    assert worker.host_pool_bytes == 0


def test_a_given_number_of_blocks_is_kept() -> None:
    worker = OffloadConnectorWorker(7, host_budget_bytes=BLOCK_BYTES)
    worker.bind(kv_caches(4), BLOCK_SIZE)
    assert worker.num_host_blocks == 7 and worker.host_pool_bytes == 7 * BLOCK_BYTES


def test_without_a_budget_the_pool_is_bounded_by_physical_memory() -> None:
    budget = int(physical_memory_bytes() * HOST_POOL_FRACTION)
    assert 0 < budget < physical_memory_bytes()
    worker = OffloadConnectorWorker()
    worker.bind(kv_caches(8), BLOCK_SIZE)  # 8 small blocks: far below the budget, so the device pool binds
    assert worker.num_host_blocks == min(8, budget // BLOCK_BYTES) == 8


def test_bad_sizes_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="host_budget_bytes must be a positive integer, got 0"):
        OffloadConnectorWorker(host_budget_bytes=0)
    with pytest.raises(ValueError, match="num_host_blocks must be a positive integer, got -1"):
        OffloadConnectorWorker(-1)
