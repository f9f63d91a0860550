"""Sizing and allocation of the paged KV cache (layout: see attention.py)."""
from __future__ import annotations

import torch

from stages.gpu_runner.model_config import ModelConfig

# Host memory given to the KV cache on CPU when neither num_kv_blocks nor a budget is set.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
# Share of the device memory free after loading the weights given to the KV cache on CUDA.
DEFAULT_GPU_MEMORY_FRACTION = 0.85


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (keys and values)."""
    element_bytes = torch.empty(0, dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.kv_size * element_bytes


def num_blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                          memory_bytes: int | None) -> int:
    """How many blocks fit in `memory_bytes` (default: 1 GiB on CPU, a share of free memory on CUDA)."""
    if memory_bytes is None:
        if device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(device)
            memory_bytes = int(free_bytes * DEFAULT_GPU_MEMORY_FRACTION)
        else:
            memory_bytes = DEFAULT_CPU_KV_CACHE_BYTES
    num_blocks = memory_bytes // kv_block_bytes(config, block_size, dtype)
    if num_blocks < 1:
        raise ValueError(f"KV cache budget of {memory_bytes} bytes holds no block of "
                         f"{kv_block_bytes(config, block_size, dtype)} bytes")
    return int(num_blocks)


def allocate_kv_caches(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer."""
    shape = (2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
