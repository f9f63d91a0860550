"""The torch backend's attention metadata: which keys each query reads, as slots of the paged cache.

Built once per step from host-known numbers (nothing waits on the device) and shared by every
layer. Rows with one query token (decodes, one-token prefill chunks) form one `DecodeBatch`, padded
to the longest context among them and masked; rows verifying drafts form one `VerifyBatch` per
number of drafts (rows verify different numbers in one step); longer
prefill chunks are one `PrefillChunk` each, over the row's cached prefix plus itself.

Sliding-window layers read the metadata's variant for their window, built on the step's first
layer with that window and kept for the others: decode rows gather only the blocks that can hold
their window's keys (the last `window_blocks` of each row), prefill chunks only the keys from
their first query's window start on, both masked at the exact edge. So a windowed layer costs
O(window) per query, not O(context).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from stages.gpu_runner.attention.interface import check_window, window_blocks
from stages.gpu_runner.inputs.step_layout import StepLayout


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
    (the speculative step's inputs), so the causal mask is built there; keys are padded to the
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
    verify: list[VerifyBatch] = field(default_factory=list)  # one per number of query tokens

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


def row_key_slots(block_table_rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """int32 block ids [..., num_blocks] -> int64 slots [..., num_blocks * block_size] of their positions."""
    blocks = block_table_rows.to(torch.int64)
    slots = blocks.unsqueeze(-1) * block_size + torch.arange(block_size, device=blocks.device)
    return slots.flatten(-2)


def decode_batch(block_table: torch.Tensor, rows: torch.Tensor, context: torch.Tensor, max_context: int,
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
    return DecodeBatch(token_idx=token_idx, key_slots=row_key_slots(blocks, block_size),
                       mask=mask.view(len(rows), 1, 1, -1), rows=rows, context=context, max_context=max_context)


def verify_batch(block_table: torch.Tensor, rows: torch.Tensor, start: torch.Tensor, num_queries: int,
                  max_context: int, block_size: int, token_idx: torch.Tensor, window: int | None = None) -> VerifyBatch:
    """Rows `rows` with queries at the real positions start..start + num_queries - 1, reading keys
    0..max_context - 1 of their block tables, masked causally (and by `window`)."""
    num_blocks = -(-max_context // block_size)
    key_pos = torch.arange(num_blocks * block_size, device=rows.device)
    query_pos = start.unsqueeze(1) + torch.arange(num_queries, device=rows.device)  # [d, q]
    mask = key_pos.view(1, 1, -1) <= query_pos.unsqueeze(2)
    if window is not None:
        mask &= key_pos.view(1, 1, -1) > query_pos.unsqueeze(2) - window
    return VerifyBatch(token_idx=token_idx, key_slots=row_key_slots(block_table[rows, :num_blocks], block_size),
                       mask=mask.unsqueeze(1), rows=rows, start=start, num_queries=num_queries,
                       max_context=max_context)


def prefill_chunk(key_slots: torch.Tensor, token_start: int, token_end: int, window: int | None) -> PrefillChunk:
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
        decode = decode_batch(meta.block_table, decode.rows, decode.context, decode.max_context, meta.block_size,
                               decode.token_idx, window)
    prefills = [chunk if window >= len(chunk.key_slots) else
                prefill_chunk(chunk.key_slots, chunk.token_start, chunk.token_end, window) for chunk in meta.prefills]
    verify = [batch if window >= batch.max_context else
              verify_batch(meta.block_table, batch.rows, batch.start, batch.num_queries, batch.max_context,
                           meta.block_size, batch.token_idx, window) for batch in meta.verify]
    return AttentionMetadata(slot_mapping=meta.slot_mapping, decode=decode, prefills=prefills,
                             block_table=meta.block_table, block_size=meta.block_size, max_context=meta.max_context,
                             verify=verify)


def row_kinds(layout: StepLayout) -> tuple[np.ndarray, np.ndarray]:
    """(decode, verify) masks of the layout's rows: one query token; drafts to verify."""
    is_decode = layout.scheduled == 1
    if layout.drafts is None:
        return is_decode, np.zeros_like(is_decode)
    return is_decode, layout.drafts > 0


def verify_order(layout: StepLayout, is_verify: np.ndarray) -> np.ndarray:
    """The verifying rows' layout indices, by number of query tokens (stable): each group of rows
    verifying as many drafts is one contiguous slice of the verify arrays."""
    verifying = np.flatnonzero(is_verify)
    return verifying[np.argsort(layout.scheduled[verifying], kind="stable")]


def step_attention_metadata(layout: StepLayout, arrays: list[torch.Tensor], slot_mapping: torch.Tensor,
                            block_table: torch.Tensor, block_size: int,
                            shift: torch.Tensor | None = None) -> AttentionMetadata:
    """The metadata of a dynamic step, from the device copies of `TorchBackend.host_arrays(layout)`
    and the batch's block table; `shift` as in AttentionBackend.step_metadata."""
    decode_token_idx, decode_rows, decode_context, decode_index, verify_token_idx, verify_rows, verify_start, \
        verify_index = arrays
    is_decode, is_verify = row_kinds(layout)
    context = layout.context
    decode = None
    if is_decode.any():
        if shift is not None:
            decode_context = decode_context - shift[decode_index]
        decode = decode_batch(block_table, decode_rows, decode_context, int(context[is_decode].max()), block_size,
                               None if is_decode.all() else decode_token_idx)
    verify = []
    if is_verify.any():
        if shift is not None:
            verify_start = verify_start - shift[verify_index]
        order = verify_order(layout, is_verify)
        queries = layout.scheduled[order]
        row_end = 0
        for num_queries in np.unique(queries).tolist():
            row_start, row_end = row_end, row_end + int((queries == num_queries).sum())
            token_start = int(queries[:row_start].sum())
            token_end = token_start + (row_end - row_start) * num_queries
            verify.append(verify_batch(block_table, verify_rows[row_start:row_end], verify_start[row_start:row_end],
                                       num_queries, int(context[order[row_start:row_end]].max()), block_size,
                                       verify_token_idx[token_start:token_end]))
    prefills = []
    for i in np.flatnonzero(~is_decode & ~is_verify).tolist():
        row, ctx = int(layout.rows[i]), int(context[i])
        key_slots = row_key_slots(block_table[row, :-(-ctx // block_size)], block_size)[:ctx]
        prefills.append(prefill_chunk(key_slots, int(layout.query_start[i]), int(layout.query_start[i + 1]), None))
    return AttentionMetadata(slot_mapping=slot_mapping, decode=decode, prefills=prefills, block_table=block_table,
                             block_size=block_size, max_context=int(context.max()) if len(context) else 0,
                             verify=verify)
