"""Sizing and allocation of the paged KV cache (layout: see torch_backend.py)."""
from __future__ import annotations

import torch

from stages.contracts.config import EngineConfig
from stages.gpu_runner.models.config import ModelConfig

# Host memory given to the KV cache on CPU when neither num_kv_blocks nor a budget is set.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
# Share of the device memory free after loading the weights given to the KV cache on CUDA.
DEFAULT_GPU_MEMORY_FRACTION = 0.85


def resolve_kv_dtype(name: str, dtype: torch.dtype, backend: str) -> torch.dtype:
    """The KV cache's dtype for kv_cache_dtype `name` (one of KV_CACHE_DTYPES, as EngineConfig
    checked): auto is the dense parts' `dtype`. One that differs from it is read by the torch
    backend only (its CPU kernel and its torch paths widen what they read); the triton kernels
    read the cache in the model's dtype."""
    if name == "auto":
        return dtype
    kv_dtype = getattr(torch, name)
    if kv_dtype != dtype and backend != "torch":
        raise ValueError(f"kv_cache_dtype {name} with a {str(dtype).removeprefix('torch.')} model needs "
                         f"attention_backend 'torch': the {backend} kernels read the KV cache in the model's dtype")
    return kv_dtype


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (keys and values)."""
    element_bytes = torch.empty(0, dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.kv_size * element_bytes


def num_blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                          memory_bytes: int | None, extra_block_bytes: int = 0) -> int:
    """How many blocks fit in `memory_bytes` (default: 1 GiB on CPU, a share of free memory on CUDA),
    each also taking `extra_block_bytes` (a draft model's KV of the same block)."""
    if memory_bytes is None:
        if device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(device)
            memory_bytes = int(free_bytes * DEFAULT_GPU_MEMORY_FRACTION)
        else:
            memory_bytes = DEFAULT_CPU_KV_CACHE_BYTES
    num_blocks = memory_bytes // (kv_block_bytes(config, block_size, dtype) + extra_block_bytes)
    if num_blocks < 1:
        raise ValueError(f"KV cache budget of {memory_bytes} bytes holds no block of "
                         f"{kv_block_bytes(config, block_size, dtype)} bytes")
    return int(num_blocks)


def kv_pool_sizes(config: ModelConfig, engine: EngineConfig, dtype: torch.dtype,
                  device: torch.device, extra_block_bytes: int = 0) -> tuple[int, int]:
    """(blocks of KV group 0, blocks of group 1): the local layers of a model that mixes them with
    global ones (0 for any other). A local layer holds a window's blocks per row, so its pool is
    sized for what the rows can hold at once, and the rest of the memory goes to group 0."""
    windows = config.kv_group_windows
    bs = engine.block_size
    window_need = 0
    if len(windows) == 2:
        # Per row: the window's blocks, a partial block each side, and two steps' chunks in flight.
        window_need = engine.max_num_seqs * (-(-windows[1] // bs) + 2) + 2 * -(-engine.max_num_batched_tokens // bs)
    if engine.num_kv_blocks is not None:
        return engine.num_kv_blocks, min(engine.num_kv_blocks, window_need)
    total = num_blocks_for_budget(config, bs, dtype, device, engine.kv_cache_memory_bytes, extra_block_bytes)
    if not window_need:
        return total, 0
    num_local = sum(config.kv_group(i) for i in range(config.num_layers))
    num_window = min(window_need, total)
    return max(1, (total * config.num_layers - num_window * num_local) // (config.num_layers - num_local)), num_window


def allocate_kv_caches(config: ModelConfig, num_blocks: int | list[int], block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer (`num_blocks`
    may differ per layer)."""
    per_layer = num_blocks if isinstance(num_blocks, list) else [num_blocks] * config.num_layers
    return [torch.zeros((2, n, block_size, config.num_kv_heads, config.head_dim), dtype=dtype, device=device)
            for n in per_layer]
