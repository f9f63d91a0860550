"""Attention on the CPU: the compiled kernel of cpu_ops/attention.c for decode and verify rows, and
decode in two batched matmuls for models with few KV heads where that kernel is not built.

The compiled kernel reads each row's keys in place by slot and skips the masked ones (no gathered
copy, no padding). The torch backend (torch_backend.py) sends its CPU decode and verify rows here.
"""
from __future__ import annotations

import torch

from stages.gpu_runner import cpu_ops
from stages.gpu_runner.attention.torch_metadata import DecodeBatch, VerifyBatch

# Spread decode multiplies kv_heads times the needed work (see spread_decode_attention); past
# this many KV heads the padded SDPA kernel is the cheaper one.
MAX_SPREAD_KV_HEADS = 4


def native_attends(query: torch.Tensor, flat_cache: torch.Tensor) -> bool:
    """Whether the compiled CPU kernel (cpu_ops) attends these queries over this cache (of the
    query's dtype or another the kernel reads: kv_cache_dtype)."""
    return (query.device.type == "cpu" and cpu_ops.supports(query.dtype, query.shape[-1])
            and flat_cache.dtype in cpu_ops.SUPPORTED and cpu_ops.library() is not None)


def spread_decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """Decode attention on the CPU in two batched matmuls per step, the scores and softmax in float32.

    Each head's query is spread into a zero row as wide as all KV heads (its own KV head's
    columns hold it), so one [heads, kv_width] x [kv_width, ctx] product per row scores every head
    against its own KV head straight from the gathered keys: no padded flash kernel, no copy of the
    keys into a per-head layout. The zeros cost kv_heads times the (small) multiply work."""
    d, num_keys, num_kv_heads, head_dim = keys.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    width = num_kv_heads * head_dim
    spread = query.new_zeros(d, num_kv_heads, group, num_kv_heads, head_dim)
    spread.diagonal(dim1=1, dim2=3).copy_(query.view(d, num_kv_heads, group, head_dim).permute(0, 2, 3, 1))
    scores = torch.bmm(spread.view(d, num_heads, width), keys.view(d, num_keys, width).transpose(1, 2)).float()
    scores.mul_(scale).masked_fill_(~mask.view(d, 1, num_keys), float("-inf"))
    probs = scores.softmax(dim=-1).to(values.dtype)
    out = torch.bmm(probs, values.view(d, num_keys, width)).view(d, num_kv_heads, group, num_kv_heads, head_dim)
    return out.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(d, num_heads, head_dim)


def native_decode_attention(query: torch.Tensor, flat_cache: torch.Tensor, batch: DecodeBatch,
                            scale: float) -> torch.Tensor:
    """query [d, num_heads, head_dim] -> the same shape, through the compiled kernel."""
    d, num_keys = batch.key_slots.shape
    return cpu_ops.paged_attention(query.unsqueeze(1), flat_cache, batch.key_slots, batch.mask.view(d, 1, num_keys),
                                   scale).squeeze(1)


def native_verify_attention(query: torch.Tensor, flat_cache: torch.Tensor, batch: VerifyBatch,
                            scale: float) -> torch.Tensor:
    """query [d * q, num_heads, head_dim] of the verifying rows -> the same shape, through the compiled kernel."""
    d, q = batch.rows.shape[0], batch.num_queries
    return cpu_ops.paged_attention(query.view(d, q, *query.shape[1:]), flat_cache, batch.key_slots,
                                   batch.mask.view(d, q, -1), scale).view(query.shape)
