"""Paged attention in Triton: split-KV decode and one-launch ragged prefill over the block table.

Same cache layout and semantics as attention/torch_backend.py ([2, num_blocks, block_size,
num_kv_heads, head_dim], keys at 0, values at 1; this step's K/V already written), but the
kernels read each row's blocks in place through the block table instead of gathering every
row's padded context. Launch shapes depend on host-known sizes only, so both launches can be
captured in a CUDA graph with fixed shapes.

Both attend a sliding window when given one (attention/interface.py: a query at p attends keys
max(0, p - window + 1)..p), passed to the kernels as a runtime scalar; None passes a window
longer than any context, which is full causal attention.
"""
from __future__ import annotations

import math

import torch

from stages.gpu_runner.attention.interface import check_window, window_blocks
from stages.gpu_runner.triton_kernels.loading import cdiv, kernels_for, next_power_of_2

# Decode splits: enough programs to fill the GPU at small batch, never a split shorter than this.
_TARGET_PROGRAMS = 256
_MAX_SPLITS = 32
_MIN_TOKENS_PER_SPLIT = 256
# The kernels' window for full attention: longer than any context, small enough for int32 sums.
_NO_WINDOW = 1 << 30


def decode_num_splits(max_blocks_per_row: int, block_size: int, num_rows: int, num_kv_heads: int) -> int:
    """How many KV splits a decode launch uses, from host-known sizes only (graph-capturable).
    max_blocks_per_row: the blocks a row may read (for a windowed layer, the most its window spans)."""
    by_length = cdiv(max_blocks_per_row * block_size, _MIN_TOKENS_PER_SPLIT)
    by_parallelism = cdiv(_TARGET_PROGRAMS, max(num_rows * num_kv_heads, 1))
    return max(1, min(by_length, by_parallelism, _MAX_SPLITS))


def _check_common(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor) -> tuple[int, int, int]:
    """-> (group, block_size, head_dim), after checking shapes, dtypes and devices."""
    if query.dim() != 3:
        raise ValueError(f"query must be [tokens, num_heads, head_dim], got shape {tuple(query.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(kv_cache.shape)}")
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    if kv_cache.shape[4] != head_dim:
        raise ValueError(f"kv_cache head_dim {kv_cache.shape[4]} differs from query head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16 for the Triton kernels, got {block_size}")
    if query.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("query and kv_cache must be contiguous in head_dim")
    if kv_cache.dtype != query.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} differs from query dtype {query.dtype}")
    for name, tensor in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if tensor.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {tensor.dtype}")
    for name, tensor in (("kv_cache", kv_cache), ("block_tables", block_tables), ("seq_lens", seq_lens)):
        if tensor.device != query.device:
            raise ValueError(f"{name} is on {tensor.device}, query on {query.device}")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be a row-major [rows, max_blocks] table, got shape "
                         f"{tuple(block_tables.shape)} strides {block_tables.stride()}")
    return num_heads // num_kv_heads, block_size, head_dim


def _output(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty_like(query)
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device or out.stride(-1) != 1:
        raise ValueError(f"out must match query ({tuple(query.shape)}, {query.dtype}, contiguous head_dim), "
                         f"got {tuple(out.shape)}, {out.dtype}")
    return out


def _window_arg(window: int | None) -> int:
    """The kernels' runtime window scalar (a fixed value per layer, so graph capture keeps it)."""
    check_window(window)
    return _NO_WINDOW if window is None else min(window, _NO_WINDOW)


def _dot_fp32(query: torch.Tensor) -> bool:
    """Exact float32 dots for float32 inputs and in the interpreter (its dot cannot read bf16)."""
    return query.dtype == torch.float32 or query.device.type == "cpu"


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, *, window: int | None = None,
                           out: torch.Tensor | None = None, num_splits: int | None = None) -> torch.Tensor:
    """One query token per row. query [d, num_heads, head_dim]; block_tables int32 [>= d, max_blocks]
    (row i reads block_tables[i]); seq_lens int32 [d]: row i attends positions 0..seq_lens[i]-1, or
    only the last `window` of them; a row with seq_lens 0 is padding and gets zeros. Returns
    [d, num_heads, head_dim] (or fills `out`). num_splits overrides the split count
    decode_num_splits picks; the splits share out the blocks a window can span."""
    group, block_size, head_dim = _check_common(query, kv_cache, block_tables, seq_lens)
    num_rows, num_heads = query.shape[0], query.shape[1]
    num_kv_heads, max_blocks = kv_cache.shape[3], block_tables.shape[1]
    if seq_lens.shape != (num_rows,) or block_tables.shape[0] < num_rows:
        raise ValueError(f"seq_lens must be [{num_rows}] and block_tables have >= {num_rows} rows, got "
                         f"{tuple(seq_lens.shape)} and {tuple(block_tables.shape)}")
    out = _output(query, out)
    span_blocks = window_blocks(window, block_size, max_blocks)
    if num_rows == 0:
        return out
    if num_splits is None:
        num_splits = decode_num_splits(span_blocks, block_size, num_rows, num_kv_heads)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    jit = kernels_for("attention", query)
    partial_max = torch.empty((num_rows, num_heads, num_splits), dtype=torch.float32, device=query.device)
    partial_sum = torch.empty_like(partial_max)
    partial_acc = torch.empty((num_rows, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
    keys, values = kv_cache[0], kv_cache[1]
    block_d = max(16, next_power_of_2(head_dim))
    jit.decode_partial_kernel[(num_rows, num_kv_heads, num_splits)](
        query, keys, values, block_tables, seq_lens, partial_max, partial_sum, partial_acc,
        query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), block_tables.stride(0),
        scale * math.log2(math.e), num_heads, cdiv(span_blocks, num_splits), _window_arg(window),
        GROUP=group, BLOCK_G=max(16, next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, NUM_SPLITS=num_splits, DOT_FP32=_dot_fp32(query),
    )
    jit.decode_reduce_kernel[(num_rows, num_heads)](
        partial_max, partial_sum, partial_acc, out, out.stride(0), out.stride(1), num_heads,
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits, BLOCK_S=next_power_of_2(num_splits),
    )
    return out


def paged_prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
                            scale: float, *, window: int | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Ragged causal attention of a step's rows in one launch (grid: rows x query tiles x kv heads). query [T, num_heads, head_dim], rows
    back to back; row r's queries are tokens query_start_loc[r]..query_start_loc[r+1]-1 at positions
    seq_lens[r]-q_len_r..seq_lens[r]-1, attending its cached prefix and itself causally (only the
    last `window` positions up to each query, when given). Rows of one token (decodes) may share
    the launch. max_query_len (host int) sizes the grid. Tokens past query_start_loc[-1] (a padded
    buffer's tail) are left unwritten."""
    group, block_size, head_dim = _check_common(query, kv_cache, block_tables, seq_lens)
    window_arg = _window_arg(window)
    num_rows, num_heads = seq_lens.shape[0], query.shape[1]
    if query_start_loc.dtype != torch.int32 or query_start_loc.shape != (num_rows + 1,):
        raise ValueError(f"query_start_loc must be int32 [{num_rows + 1}], got {query_start_loc.dtype} "
                         f"{tuple(query_start_loc.shape)}")
    if query_start_loc.device != query.device:
        raise ValueError(f"query_start_loc is on {query_start_loc.device}, query on {query.device}")
    if block_tables.shape[0] < num_rows:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows, fewer than the {num_rows} rows of seq_lens")
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    out = _output(query, out)
    if num_rows == 0 or query.shape[0] == 0:
        return out
    # A tile is BLOCK_Q tokens x the kv head's query heads: 16 to 64 rows (tl.dot needs >= 16).
    block_g = next_power_of_2(group)
    block_m = max(16, block_g, min(64, next_power_of_2(max_query_len * block_g)))
    block_q = block_m // block_g
    keys, values = kv_cache[0], kv_cache[1]
    kernels_for("attention", query).prefill_kernel[(num_rows, cdiv(max_query_len, block_q), kv_cache.shape[3])](
        query, keys, values, out, block_tables, seq_lens, query_start_loc,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), block_tables.stride(0), scale * math.log2(math.e),
        window_arg, GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=max(16, next_power_of_2(head_dim)),
        BLOCK_Q=block_q, BLOCK_SIZE=block_size, DOT_FP32=_dot_fp32(query),
    )
    return out


def store_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write this step's K and V ([num_tokens, num_kv_heads, head_dim]) into the cache at their slots
    (int64 [num_tokens], block_id * block_size + offset) in one launch; a token with slot -1 (a
    static batch's padding) writes nothing. Same result as attention/torch_backend.write_kv."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(kv_cache.shape)}")
    if key.shape != value.shape or key.shape[1:] != kv_cache.shape[3:]:
        raise ValueError(f"key and value must be [tokens, {kv_cache.shape[3]}, {kv_cache.shape[4]}], "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype:
        raise ValueError(f"key/value dtype {key.dtype}/{value.dtype} differs from kv_cache dtype {kv_cache.dtype}")
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64 [{key.shape[0]}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("key, value and kv_cache must be contiguous in head_dim")
    for name, tensor in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
        if tensor.device != kv_cache.device:
            raise ValueError(f"{name} is on {tensor.device}, kv_cache on {kv_cache.device}")
    if key.shape[0] == 0:
        return
    keys, values = kv_cache[0], kv_cache[1]
    head_dim, num_kv_heads = kv_cache.shape[4], kv_cache.shape[3]
    kernels_for("attention", kv_cache).store_kv_kernel[(key.shape[0],)](
        key, value, keys, values, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_SIZE=kv_cache.shape[2],
    )
