"""Paged attention in plain torch: KV written by slot, read back by gathering a row's blocks.

KV cache layout, one tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 = keys, 1 = values). Token position p of a row lives in block
block_table[row, p // block_size] at offset p % block_size; its *slot* is
block_id * block_size + offset, an index into the cache viewed as
[2, num_blocks * block_size, num_kv_heads, head_dim].

A step's tokens are flattened ([num_tokens, ...], no padding between rows). Rows with one
query token (decodes, and one-token prefill chunks) are attended together in one batched call,
their keys padded to the longest context among them and masked (one fused SDPA call, GQA
without repeating keys); longer prefill chunks are attended row by row, each against its own
cached prefix plus itself, causally. Which keys each query reads is the metadata of
torch_metadata.py, sized from host-known numbers, so nothing waits on the device. On the CPU,
decode and verify rows go to cpu_attention.py instead.

A layer with attention sinks (gpt-oss) attends every kind of row by sinks.py's plain torch
(SDPA and the compiled CPU kernel of cpu_ops have no sink term in their softmax).

`TorchBackend` is this module as an AttentionBackend (interface.py): the CPU product path.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from stages.gpu_runner.attention.cpu_attention import (
    MAX_SPREAD_KV_HEADS, native_attends, native_decode_attention, native_verify_attention, spread_decode_attention,
)
from stages.gpu_runner.attention.sinks import sink_attention
from stages.gpu_runner.attention.torch_metadata import (
    AttentionMetadata, DecodeBatch, PrefillChunk, VerifyBatch, decode_batch, row_kinds, step_attention_metadata,
    verify_order,
)
from stages.gpu_runner.inputs.step_layout import StepLayout, concat_ranges

if TYPE_CHECKING:
    from stages.gpu_runner.inputs.input_batch import InputBatch
    from stages.gpu_runner.inputs.static_decode import StaticDecodeInputs


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V ([num_tokens, num_kv_heads, head_dim]) into the paged cache, in
    the cache's dtype (rounded to nearest even where it is narrower: kv_cache_dtype)."""
    flat = kv_cache.flatten(1, 2)
    flat[0].index_copy_(0, slot_mapping, key.to(flat.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(flat.dtype))


def _gather(flat_cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values at `slots` ([...] int64) -> each [..., num_kv_heads, head_dim] in `dtype`
    (the query's: a cache of another kv_cache_dtype is widened or narrowed as it is read).

    index_select on the flat slot axis, then a view: cheaper than advanced indexing with a
    multi-dimensional index, and the result feeds attention without another copy."""
    flat_slots = slots.reshape(-1)
    shape = (*slots.shape, *flat_cache.shape[2:])
    return (flat_cache[0].index_select(0, flat_slots).view(shape).to(dtype),
            flat_cache[1].index_select(0, flat_slots).view(shape).to(dtype))


def _sdpa(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float,
          sinks: torch.Tensor | None, is_causal: bool = False) -> torch.Tensor:
    """SDPA over [B, H, Q, D] queries and [B, Hkv, K, D] keys/values, with the sinks' term when given."""
    if sinks is not None:
        return sink_attention(query, keys, values, mask, scale, sinks, is_causal)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=keys.shape[1] != query.shape[1])


def _decode_attention(query: torch.Tensor, flat_cache: torch.Tensor, batch: DecodeBatch, scale: float,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query [d, num_heads, head_dim] -> [d, num_heads, head_dim]."""
    # Sink layers skip the compiled CPU kernel and spread decode: their softmax has no sink term.
    if sinks is None and native_attends(query, flat_cache):
        return native_decode_attention(query, flat_cache, batch, scale)
    keys, values = _gather(flat_cache, batch.key_slots, query.dtype)  # [d, ctx, kv_heads, head_dim]
    if sinks is None and query.device.type == "cpu" and keys.shape[2] <= MAX_SPREAD_KV_HEADS:
        return spread_decode_attention(query, keys, values, batch.mask, scale)
    out = _sdpa(query.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), batch.mask, scale,
                sinks)  # [d, heads, 1, head_dim]
    return out.squeeze(2)


def _prefill_attention(query: torch.Tensor, flat_cache: torch.Tensor, chunk: PrefillChunk, scale: float,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query [q, num_heads, head_dim] of one row -> [q, num_heads, head_dim]."""
    keys, values = _gather(flat_cache, chunk.key_slots, query.dtype)  # [ctx, kv_heads, head_dim]
    out = _sdpa(query.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0), chunk.mask, scale, sinks,
                is_causal=chunk.mask is None)  # [1, heads, q, head_dim]
    return out[0].transpose(0, 1)


def _verify_attention(query: torch.Tensor, flat_cache: torch.Tensor, batch: VerifyBatch, scale: float,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query [d * q, num_heads, head_dim] of the verifying rows -> the same shape."""
    if sinks is None and native_attends(query, flat_cache):
        return native_verify_attention(query, flat_cache, batch, scale)
    d, q = batch.rows.shape[0], batch.num_queries
    keys, values = _gather(flat_cache, batch.key_slots, query.dtype)  # [d, ctx, kv_heads, head_dim]
    out = _sdpa(query.view(d, q, *query.shape[1:]).transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                batch.mask, scale, sinks)  # [d, heads, q, head_dim]
    return out.transpose(1, 2).reshape(query.shape)


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every flattened query token over its row's cached keys (this step's included).

    query [num_tokens, num_heads, head_dim]; the step's K/V must already be written; `sinks`
    [num_heads]: each head's sink logit (see sinks.py), None for plain attention.
    """
    flat_cache = kv_cache.flatten(1, 2)
    if meta.decode is not None and meta.decode.token_idx is None:
        return _decode_attention(query, flat_cache, meta.decode, scale, sinks)
    out = torch.empty_like(query)
    if meta.decode is not None:
        decoded = _decode_attention(query[meta.decode.token_idx], flat_cache, meta.decode, scale, sinks)
        out.index_copy_(0, meta.decode.token_idx, decoded)
    for batch in meta.verify:
        verified = _verify_attention(query[batch.token_idx], flat_cache, batch, scale, sinks)
        out.index_copy_(0, batch.token_idx, verified)
    for chunk in meta.prefills:
        out[chunk.token_start:chunk.token_end] = _prefill_attention(
            query[chunk.token_start:chunk.token_end], flat_cache, chunk, scale, sinks)
    return out


class TorchBackend:
    """Paged attention by gathering each row's keys, in plain torch (on the CPU, cpu_attention.py)."""

    name = "torch"

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def host_arrays(self, layout: StepLayout) -> list[np.ndarray]:
        is_decode, is_verify = row_kinds(layout)
        order = verify_order(layout, is_verify)
        verify_token_idx = concat_ranges(layout.query_start[:-1][order], layout.scheduled[order])
        return [layout.query_start[:-1][is_decode], layout.rows[is_decode], layout.context[is_decode],
                np.flatnonzero(is_decode), verify_token_idx, layout.rows[order], layout.computed[order], order]

    def step_metadata(self, layout: StepLayout, arrays: list[torch.Tensor], slot_mapping: torch.Tensor,
                      batch: InputBatch, shift: torch.Tensor | None = None) -> AttentionMetadata:
        return step_attention_metadata(layout, arrays, slot_mapping, batch.block_table, self.block_size, shift)

    def decode_metadata(self, rows: torch.Tensor, context: torch.Tensor, max_context: int,
                        slot_mapping: torch.Tensor, block_table: torch.Tensor) -> AttentionMetadata:
        decode = decode_batch(block_table, rows, context, max_context, self.block_size, None)
        return AttentionMetadata(slot_mapping=slot_mapping, decode=decode, prefills=[], block_table=block_table,
                                 block_size=self.block_size, max_context=max_context)

    def static_decode_metadata(self, inputs: StaticDecodeInputs, num_rows: int, max_context: int) -> AttentionMetadata:
        # Padding rows have context 0; they attend to one (real, finite) key instead, so that no
        # row is fully masked (a softmax over nothing is NaN). Their outputs are discarded. Not
        # captured (runner.py), so its windowed variants are built lazily like a dynamic step's.
        context = inputs.seq_lens[:num_rows].clamp_min(1)
        max_context = max(max_context, 1)
        decode = decode_batch(inputs.block_table, inputs.rows[:num_rows], context, max_context, self.block_size, None)
        return AttentionMetadata(slot_mapping=inputs.slot_mapping[:num_rows], decode=decode, prefills=[],
                                 block_table=inputs.block_table, block_size=self.block_size, max_context=max_context)

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, window: int | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        write_kv(kv_cache, key, value, meta.slot_mapping)
        return paged_attention(query, kv_cache, meta.for_window(window), scale, sinks)
