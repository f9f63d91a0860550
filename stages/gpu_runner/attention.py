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
is sized from host-known numbers, so nothing waits on the device. On the CPU, decode and verify
rows go to the compiled kernel of cpu_kernels/attention.c instead, which reads each row's keys in
place by slot and skips the masked ones (no gathered copy, no padding), where it is built.

Sliding-window layers read the metadata's variant for their window, built on the step's first
layer with that window and kept for the others: decode rows gather only the blocks that can
hold their window's keys (the last `window_blocks` of each row), prefill chunks only the keys
from their first query's window start on, both masked at the exact edge. So a windowed layer
costs O(window) per query, not O(context).

`TorchBackend` is this module as an AttentionBackend (backend.py), with RMSNorm and rotary in
plain torch: the CPU product path.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from stages.gpu_runner import cpu_kernels
from stages.gpu_runner.backend import check_window, window_blocks
from stages.gpu_runner.step_layout import StepLayout, concat_ranges
from stages.gpu_runner.layers.norm import RMSNorm, rms_norm
from stages.gpu_runner.layers.rotary import RotaryEmbedding, apply_rotary

if TYPE_CHECKING:
    from stages.gpu_runner.input_batch import InputBatch
    from stages.gpu_runner.static_decode import StaticDecodeInputs

# The CPU decode path multiplies kv_heads times the needed work (see _spread_decode_attention);
# past this many KV heads the padded SDPA kernel is the cheaper one.
MAX_SPREAD_KV_HEADS = 4


@dataclass(slots=True)
class PrefillChunk:
    """One row's multi-token chunk: flattened tokens [token_start, token_end)."""

    token_start: int
    token_end: int
    first_key: int  # position of key_slots[0]: 0, or the first query's window start
    key_slots: torch.Tensor  # int64 [context_len - first_key]: slots of the row's positions first_key..context_len-1
    mask: torch.Tensor | None  # bool [num_query, len(key_slots)]; None when plainly causal from position 0


@dataclass(slots=True)
class DecodeBatch:
    """Rows with one query token each, attended in one batched call."""

    token_idx: torch.Tensor | None  # int64 [d]: their flattened token index; None when they are all tokens, in order
    key_slots: torch.Tensor  # int64 [d, num_keys]: slots of the positions each row reads, padded
    mask: torch.Tensor  # bool [d, 1, 1, num_keys]: True where a key is in the row's context (and window)
    rows: torch.Tensor  # int64 [d]: their batch rows
    context: torch.Tensor  # int64 [d]: their context lengths, >= 1
    max_context: int  # host-known: the longest of `context`


@dataclass(slots=True)
class VerifyBatch:
    """Rows verifying drafts: `num_queries` query tokens each (the last known token and its
    drafts), attended in one batched call. Their real positions are known on the device only
    (speculative.py in the runner), so the causal mask is built there; keys are padded to the
    longest context the plan allows."""

    token_idx: torch.Tensor  # int64 [d * num_queries]: the rows' flattened token indices, row after row
    key_slots: torch.Tensor  # int64 [d, num_keys]
    mask: torch.Tensor  # bool [d, 1, num_queries, num_keys]
    rows: torch.Tensor  # int64 [d]
    start: torch.Tensor  # int64 [d]: the real position of each row's first query
    num_queries: int
    max_context: int  # host-known upper bound of the rows' contexts


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step, shared by every layer; a window's variant is built by its first layer."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]: where each new token's K/V goes
    decode: DecodeBatch | None
    prefills: list[PrefillChunk]
    block_table: torch.Tensor  # int32 [rows, max_blocks]: the batch's, indexed again by windowed decodes
    block_size: int
    max_context: int  # the step's longest context: a window at least this long is full attention
    windowed: dict[int, AttentionMetadata] = field(default_factory=dict)
    verify: VerifyBatch | None = None

    def for_window(self, window: int | None) -> AttentionMetadata:
        """The metadata of layers that attend `window` keys per query (None: the whole context)."""
        if window is None:
            return self
        variant = self.windowed.get(window)
        if variant is None:
            check_window(window)
            variant = self if window >= self.max_context else _windowed(self, window)
            self.windowed[window] = variant
        return variant


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


def _native(query: torch.Tensor) -> bool:
    """Whether the compiled CPU kernel (cpu_kernels) attends these queries."""
    return (query.device.type == "cpu" and cpu_kernels.supports(query.dtype, query.shape[-1])
            and cpu_kernels.library() is not None)


def _decode_attention(query: torch.Tensor, flat_cache: torch.Tensor, batch: DecodeBatch, scale: float) -> torch.Tensor:
    """query [d, num_heads, head_dim] -> [d, num_heads, head_dim]."""
    if _native(query):
        d, num_keys = batch.key_slots.shape
        return cpu_kernels.paged_attention(query.unsqueeze(1), flat_cache, batch.key_slots,
                                           batch.mask.view(d, 1, num_keys), scale).squeeze(1)
    keys, values = _gather(flat_cache, batch.key_slots)  # [d, ctx, kv_heads, head_dim]
    if query.device.type == "cpu" and keys.shape[2] <= MAX_SPREAD_KV_HEADS:
        return _spread_decode_attention(query, keys, values, batch.mask, scale)
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=batch.mask, scale=scale,
        enable_gqa=keys.shape[2] != query.shape[1],
    )  # [d, heads, 1, head_dim]
    return out.squeeze(2)


def _spread_decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
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


def _prefill_attention(query: torch.Tensor, flat_cache: torch.Tensor, chunk: PrefillChunk, scale: float) -> torch.Tensor:
    """query [q, num_heads, head_dim] of one row -> [q, num_heads, head_dim]."""
    keys, values = _gather(flat_cache, chunk.key_slots)  # [ctx, kv_heads, head_dim]
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
        attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=scale,
        enable_gqa=keys.shape[1] != query.shape[1],
    )  # [1, heads, q, head_dim]
    return out[0].transpose(0, 1)


def _verify_attention(query: torch.Tensor, flat_cache: torch.Tensor, batch: VerifyBatch, scale: float) -> torch.Tensor:
    """query [d * q, num_heads, head_dim] of the verifying rows -> the same shape."""
    d, q = batch.rows.shape[0], batch.num_queries
    if _native(query):
        return cpu_kernels.paged_attention(query.view(d, q, *query.shape[1:]), flat_cache, batch.key_slots,
                                           batch.mask.view(d, q, -1), scale).view(query.shape)
    keys, values = _gather(flat_cache, batch.key_slots)  # [d, ctx, kv_heads, head_dim]
    out = F.scaled_dot_product_attention(
        query.view(d, q, *query.shape[1:]).transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=batch.mask, scale=scale, enable_gqa=keys.shape[2] != query.shape[1],
    )  # [d, heads, q, head_dim]
    return out.transpose(1, 2).reshape(query.shape)


def _verify_batch(block_table: torch.Tensor, rows: torch.Tensor, start: torch.Tensor, num_queries: int,
                  max_context: int, block_size: int, token_idx: torch.Tensor, window: int | None = None) -> VerifyBatch:
    """Rows `rows` with queries at the real positions start..start + num_queries - 1, reading keys
    0..max_context - 1 of their block tables, masked causally (and by `window`)."""
    num_blocks = -(-max_context // block_size)
    key_pos = torch.arange(num_blocks * block_size, device=rows.device)
    query_pos = start.unsqueeze(1) + torch.arange(num_queries, device=rows.device)  # [d, q]
    mask = key_pos.view(1, 1, -1) <= query_pos.unsqueeze(2)
    if window is not None:
        mask &= key_pos.view(1, 1, -1) > query_pos.unsqueeze(2) - window
    return VerifyBatch(token_idx=token_idx, key_slots=_row_key_slots(block_table[rows, :num_blocks], block_size),
                       mask=mask.unsqueeze(1), rows=rows, start=start, num_queries=num_queries,
                       max_context=max_context)


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
    if meta.verify is not None:
        verified = _verify_attention(query[meta.verify.token_idx], flat_cache, meta.verify, scale)
        out.index_copy_(0, meta.verify.token_idx, verified)
    for chunk in meta.prefills:
        out[chunk.token_start:chunk.token_end] = _prefill_attention(
            query[chunk.token_start:chunk.token_end], flat_cache, chunk, scale)
    return out


def _row_key_slots(block_table_rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """int32 block ids [..., num_blocks] -> int64 slots [..., num_blocks * block_size] of their positions."""
    blocks = block_table_rows.to(torch.int64)
    slots = blocks.unsqueeze(-1) * block_size + torch.arange(block_size, device=blocks.device)
    return slots.flatten(-2)


def _decode_batch(block_table: torch.Tensor, rows: torch.Tensor, context: torch.Tensor, max_context: int,
                  block_size: int, token_idx: torch.Tensor | None, window: int | None = None) -> DecodeBatch:
    """The decode rows `rows` (int64 [d]) with `context` keys each (int64 [d], >= 1), each reading
    the same number of blocks: all of the longest row's, or as many as a window can span."""
    num_row_blocks = -(-max_context // block_size)
    num_key_blocks = window_blocks(window, block_size, num_row_blocks)
    key_offsets = torch.arange(num_key_blocks * block_size, device=rows.device)
    if num_key_blocks == num_row_blocks:
        blocks = block_table[rows, :num_key_blocks]
        key_pos = key_offsets
    else:
        # The blocks ending at the row's last one: they hold its window. Short rows start at
        # block 0 and read past their end, masked, as rows shorter than max_context always do.
        first_block = ((context - 1) // block_size - (num_key_blocks - 1)).clamp_min(0).unsqueeze(1)
        blocks = block_table[rows.unsqueeze(1), first_block + torch.arange(num_key_blocks, device=rows.device)]
        key_pos = first_block * block_size + key_offsets
    mask = key_pos < context.unsqueeze(1)
    if window is not None:
        mask &= key_pos >= (context - window).unsqueeze(1)
    return DecodeBatch(token_idx=token_idx, key_slots=_row_key_slots(blocks, block_size),
                       mask=mask.view(len(rows), 1, 1, -1), rows=rows, context=context, max_context=max_context)


def _prefill_chunk(key_slots: torch.Tensor, token_start: int, token_end: int, window: int | None) -> PrefillChunk:
    """A row's chunk of queries, tokens [token_start, token_end), over `key_slots` (its positions
    0..context_len-1): keys from the first query's window start on, masked causally and by window."""
    context_len = key_slots.shape[0]
    start = context_len - (token_end - token_start)
    first_key = 0 if window is None else max(0, start - window + 1)
    mask = None
    if start or (window is not None and window < context_len):
        query_pos = torch.arange(start, context_len, device=key_slots.device).unsqueeze(1)
        key_pos = torch.arange(first_key, context_len, device=key_slots.device)
        mask = key_pos <= query_pos
        if window is not None:
            mask &= key_pos > query_pos - window
    return PrefillChunk(token_start=token_start, token_end=token_end, first_key=first_key,
                        key_slots=key_slots[first_key:], mask=mask)


def _windowed(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """`meta` (full attention) cut to `window`; rows whose context fits in it are shared as they are."""
    decode = meta.decode
    if decode is not None and window < decode.max_context:
        decode = _decode_batch(meta.block_table, decode.rows, decode.context, decode.max_context, meta.block_size,
                               decode.token_idx, window)
    prefills = [chunk if window >= len(chunk.key_slots) else
                _prefill_chunk(chunk.key_slots, chunk.token_start, chunk.token_end, window) for chunk in meta.prefills]
    verify = meta.verify
    if verify is not None and window < verify.max_context:
        verify = _verify_batch(meta.block_table, verify.rows, verify.start, verify.num_queries, verify.max_context,
                               meta.block_size, verify.token_idx, window)
    return AttentionMetadata(slot_mapping=meta.slot_mapping, decode=decode, prefills=prefills,
                             block_table=meta.block_table, block_size=meta.block_size, max_context=meta.max_context,
                             verify=verify)


def _row_kinds(layout: StepLayout) -> tuple[np.ndarray, np.ndarray]:
    """(decode, verify) masks of the layout's rows: one query token; drafts to verify."""
    is_decode = layout.scheduled == 1
    if layout.drafts is None:
        return is_decode, np.zeros_like(is_decode)
    return is_decode, layout.drafts > 0


def step_attention_metadata(layout: StepLayout, arrays: list[torch.Tensor], slot_mapping: torch.Tensor,
                            block_table: torch.Tensor, block_size: int,
                            shift: torch.Tensor | None = None) -> AttentionMetadata:
    """The metadata of a dynamic step, from the device copies of `TorchBackend.host_arrays(layout)`
    and the batch's block table; `shift` as in AttentionBackend.step_metadata."""
    decode_token_idx, decode_rows, decode_context, decode_index, verify_token_idx, verify_rows, verify_start, \
        verify_index = arrays
    is_decode, is_verify = _row_kinds(layout)
    context = layout.context
    decode = verify = None
    if is_decode.any():
        if shift is not None:
            decode_context = decode_context - shift[decode_index]
        decode = _decode_batch(block_table, decode_rows, decode_context, int(context[is_decode].max()), block_size,
                               None if is_decode.all() else decode_token_idx)
    if is_verify.any():
        num_queries = int(layout.scheduled[is_verify][0])
        if np.any(layout.scheduled[is_verify] != num_queries):
            raise ValueError("rows verifying drafts in one step must verify as many each")
        if shift is not None:
            verify_start = verify_start - shift[verify_index]
        verify = _verify_batch(block_table, verify_rows, verify_start, num_queries, int(context[is_verify].max()),
                               block_size, verify_token_idx)
    prefills = []
    for i in np.flatnonzero(~is_decode & ~is_verify).tolist():
        row, ctx = int(layout.rows[i]), int(context[i])
        key_slots = _row_key_slots(block_table[row, :-(-ctx // block_size)], block_size)[:ctx]
        prefills.append(_prefill_chunk(key_slots, int(layout.query_start[i]), int(layout.query_start[i + 1]), None))
    return AttentionMetadata(slot_mapping=slot_mapping, decode=decode, prefills=prefills, block_table=block_table,
                             block_size=block_size, max_context=int(context.max()) if len(context) else 0,
                             verify=verify)


class TorchBackend:
    """Paged attention by gathering each row's keys, and RMSNorm/rotary, in plain torch."""

    name = "torch"

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def host_arrays(self, layout: StepLayout) -> list[np.ndarray]:
        is_decode, is_verify = _row_kinds(layout)
        verify_token_idx = concat_ranges(layout.query_start[:-1][is_verify], layout.scheduled[is_verify])
        return [layout.query_start[:-1][is_decode], layout.rows[is_decode], layout.context[is_decode],
                np.flatnonzero(is_decode), verify_token_idx, layout.rows[is_verify], layout.computed[is_verify],
                np.flatnonzero(is_verify)]

    def step_metadata(self, layout: StepLayout, arrays: list[torch.Tensor], slot_mapping: torch.Tensor,
                      batch: InputBatch, shift: torch.Tensor | None = None) -> AttentionMetadata:
        return step_attention_metadata(layout, arrays, slot_mapping, batch.block_table, self.block_size, shift)

    def decode_metadata(self, rows: torch.Tensor, context: torch.Tensor, max_context: int,
                        slot_mapping: torch.Tensor, block_table: torch.Tensor) -> AttentionMetadata:
        decode = _decode_batch(block_table, rows, context, max_context, self.block_size, None)
        return AttentionMetadata(slot_mapping=slot_mapping, decode=decode, prefills=[], block_table=block_table,
                                 block_size=self.block_size, max_context=max_context)

    def static_decode_metadata(self, inputs: StaticDecodeInputs, num_rows: int, max_context: int) -> AttentionMetadata:
        # Padding rows have context 0; they attend to one (real, finite) key instead, so that no
        # row is fully masked (a softmax over nothing is NaN). Their outputs are discarded. Not
        # captured (runner.py), so its windowed variants are built lazily like a dynamic step's.
        context = inputs.seq_lens[:num_rows].clamp_min(1)
        max_context = max(max_context, 1)
        decode = _decode_batch(inputs.block_table, inputs.rows[:num_rows], context, max_context, self.block_size, None)
        return AttentionMetadata(slot_mapping=inputs.slot_mapping[:num_rows], decode=decode, prefills=[],
                                 block_table=inputs.block_table, block_size=self.block_size, max_context=max_context)

    def rope(self, positions: torch.Tensor, rotary: RotaryEmbedding,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary(positions, dtype)

    def rotary(self, query: torch.Tensor, key: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope
        if cpu_kernels.elementwise_ready(query, key, cos, sin):
            return cpu_kernels.rotary(query, cos, sin), cpu_kernels.rotary(key, cos, sin)
        return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)

    def qk_norm_rotary(self, query: torch.Tensor, key: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm,
                       rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(self.rms_norm(query, q_norm), self.rms_norm(key, k_norm), rope)

    def rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        if cpu_kernels.elementwise_ready(x, norm.weight):
            return cpu_kernels.rms_norm(x, norm.weight, norm.eps, norm.unit_offset)[0]
        return rms_norm(x, norm.weight, norm.eps, norm.unit_offset)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        if cpu_kernels.elementwise_ready(x, residual, norm.weight):
            return cpu_kernels.rms_norm(x, norm.weight, norm.eps, norm.unit_offset, residual)
        residual = x + residual
        return self.rms_norm(residual, norm), residual

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        write_kv(kv_cache, key, value, meta.slot_mapping)
        return paged_attention(query, kv_cache, meta.for_window(window), scale)
