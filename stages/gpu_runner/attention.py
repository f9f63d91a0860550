"""Paged attention in plain torch: KV written by slot, read back by gathering a row's blocks.

KV cache layout, one tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 = keys, 1 = values). Token position p of a row lives in block
block_table[row, p // block_size] at offset p % block_size; its *slot* is
block_id * block_size + offset, an index into the cache viewed as
[2, num_blocks * block_size, num_kv_heads, head_dim].

A step's tokens are flattened ([num_tokens, ...], no padding between rows). Rows with one
query token (decodes, and one-token prefill chunks) are attended together in one batched call,
their keys padded to the longest context among them and masked (one fused SDPA call, GQA
without repeating keys); longer prefill chunks are
attended row by row, each against its own cached prefix plus itself, causally. Everything here
is sized from host-known numbers, so nothing waits on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillChunk:
    """One row's multi-token chunk: flattened tokens [token_start, token_end)."""

    token_start: int
    token_end: int
    key_slots: torch.Tensor  # int64 [context_len]: slots of the row's positions 0..context_len-1
    mask: torch.Tensor | None  # bool [num_query, context_len], None when the chunk starts at 0 (plain causal)


@dataclass(slots=True)
class DecodeBatch:
    """Rows with one query token each, attended in one batched call."""

    token_idx: torch.Tensor | None  # int64 [d]: their flattened token index; None when they are all tokens, in order
    key_slots: torch.Tensor  # int64 [d, max_context]: slots of each row's positions, padded
    mask: torch.Tensor  # bool [d, 1, 1, max_context]: True where a key is in the row's context


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step, shared by every layer."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]: where each new token's K/V goes
    decode: DecodeBatch | None
    prefills: list[PrefillChunk]


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V ([num_tokens, num_kv_heads, head_dim]) into the paged cache."""
    flat = kv_cache.flatten(1, 2)
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def _gather(flat_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values at `slots` ([...] int64) -> each [..., num_kv_heads, head_dim].

    index_select on the flat slot axis, then a view: cheaper than advanced indexing with a
    multi-dimensional index, and the result feeds attention without another copy."""
    flat_slots = slots.reshape(-1)
    shape = (*slots.shape, *flat_cache.shape[2:])
    return (flat_cache[0].index_select(0, flat_slots).view(shape),
            flat_cache[1].index_select(0, flat_slots).view(shape))


def _decode_attention(query: torch.Tensor, flat_cache: torch.Tensor, batch: DecodeBatch, scale: float) -> torch.Tensor:
    """query [d, num_heads, head_dim] -> [d, num_heads, head_dim]."""
    keys, values = _gather(flat_cache, batch.key_slots)  # [d, ctx, kv_heads, head_dim]
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=batch.mask, scale=scale,
        enable_gqa=keys.shape[2] != query.shape[1],
    )  # [d, heads, 1, head_dim]
    return out.squeeze(2)


def _prefill_attention(query: torch.Tensor, flat_cache: torch.Tensor, chunk: PrefillChunk, scale: float) -> torch.Tensor:
    """query [q, num_heads, head_dim] of one row -> [q, num_heads, head_dim]."""
    keys, values = _gather(flat_cache, chunk.key_slots)  # [ctx, kv_heads, head_dim]
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
        attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=scale,
        enable_gqa=keys.shape[1] != query.shape[1],
    )  # [1, heads, q, head_dim]
    return out[0].transpose(0, 1)


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Attention of every flattened query token over its row's cached keys (this step's included).

    query [num_tokens, num_heads, head_dim]; the step's K/V must already be written.
    """
    flat_cache = kv_cache.flatten(1, 2)
    if meta.decode is not None and meta.decode.token_idx is None:
        return _decode_attention(query, flat_cache, meta.decode, scale)
    out = torch.empty_like(query)
    if meta.decode is not None:
        decoded = _decode_attention(query[meta.decode.token_idx], flat_cache, meta.decode, scale)
        out.index_copy_(0, meta.decode.token_idx, decoded)
    for chunk in meta.prefills:
        out[chunk.token_start:chunk.token_end] = _prefill_attention(
            query[chunk.token_start:chunk.token_end], flat_cache, chunk, scale)
    return out
