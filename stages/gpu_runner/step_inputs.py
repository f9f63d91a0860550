"""One step's device inputs, built from the plan and host mirrors with a single host→device copy.

Every index the step needs (token-table writes, block-table writes, input gathers, positions,
slots, decode rows, logits rows, where sampled tokens go) is computed on the host with numpy
from numbers the plan already holds, packed into one int64 array, copied once through pinned
memory without waiting, and split on the device. Input ids are then gathered from the device
token table, so tokens sampled by the previous step are read where the sampler left them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stages.gpu_runner.attention import AttentionMetadata, DecodeBatch, PrefillChunk
from stages.gpu_runner.input_batch import InputBatch, TableWrites
from stages.contracts.plan import StepPlan


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # int32 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    attention: AttentionMetadata
    logits_index: torch.Tensor  # int64 [m]: flattened index of each sampled row's last token
    sampled_token_index: torch.Tensor  # int64 [m]: where each sampled token goes in the flat token table
    # Host-side numbers for SamplingMetadata.build, in sampled-row order.
    sampled_rows: np.ndarray  # int32 [m]
    sampled_num_tokens: np.ndarray  # int64 [m]: known tokens before the sampled one


def to_device(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """Host → device without a host wait. On CUDA through a fresh pinned buffer: the caching host
    allocator does not hand that buffer out again until the copy recorded on it has run."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if torch.device(device).type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def _check_plan(plan: StepPlan, batch: InputBatch) -> None:
    n = plan.num_rows
    for name in ("num_computed_tokens", "num_scheduled_tokens", "sample", "num_new_blocks"):
        if getattr(plan, name).shape != (n,):
            raise ValueError(f"plan.{name} must have shape ({n},), got {getattr(plan, name).shape}")
    if n and int(plan.num_scheduled_tokens.min()) < 1:
        raise ValueError("every scheduled row must compute at least one token")
    end = plan.num_computed_tokens.astype(np.int64) + plan.num_scheduled_tokens
    if n and int(end.max()) > batch.max_model_len:
        raise ValueError(f"a row reaches position {int(end.max())}, beyond max_model_len {batch.max_model_len}")
    if np.any(end[plan.sample] >= batch.max_model_len):
        raise ValueError(f"a sampled row has no room for a new token within max_model_len {batch.max_model_len}")
    if np.any(-(-end // batch.block_size) > batch.num_blocks[plan.rows]):
        bad = int(plan.rows[np.argmax(-(-end // batch.block_size) > batch.num_blocks[plan.rows])])
        raise ValueError(f"row {bad} schedules tokens beyond its {int(batch.num_blocks[bad])} allocated blocks")


def prepare_step(plan: StepPlan, batch: InputBatch, max_num_batched_tokens: int) -> StepInputs:
    """Apply the plan to the persistent batch and build its inputs on the batch's device."""
    if plan.num_tokens > max_num_batched_tokens:
        raise ValueError(f"step {plan.step} schedules {plan.num_tokens} tokens, "
                         f"more than max_num_batched_tokens {max_num_batched_tokens}")
    return build_step_inputs(plan, batch, batch.apply(plan), batch.device)


def build_step_inputs(plan: StepPlan, batch: InputBatch, writes: TableWrites, device: torch.device) -> StepInputs:
    """Apply the plan's table writes on the device and gather this step's inputs."""
    _check_plan(plan, batch)
    bs, width = batch.block_size, batch.max_model_len
    rows = plan.rows.astype(np.int64)
    computed = plan.num_computed_tokens.astype(np.int64)
    scheduled = plan.num_scheduled_tokens.astype(np.int64)
    context = computed + scheduled
    cu = np.concatenate(([0], np.cumsum(scheduled)))
    num_tokens = int(cu[-1])

    token_rows = np.repeat(rows, scheduled)
    positions = np.repeat(computed - cu[:-1], scheduled) + np.arange(num_tokens, dtype=np.int64)
    slots = batch.block_table_host[token_rows, positions // bs].astype(np.int64) * bs + positions % bs

    is_decode = scheduled == 1
    decode_rows, decode_context = rows[is_decode], context[is_decode]
    sample = plan.sample.astype(bool)
    logits_index = cu[1:][sample] - 1
    sampled_token_index = rows[sample] * width + context[sample]

    parts = [writes.token_index, writes.token_ids, writes.block_index, writes.block_ids,
             token_rows * width + positions, positions, slots, cu[:-1][is_decode], decode_rows, decode_context,
             logits_index, sampled_token_index]
    packed = to_device(np.concatenate(parts), device)
    cuts = np.cumsum([len(p) for p in parts])[:-1].tolist()
    (token_index, token_ids, block_index, block_ids, gather_index, positions_dev, slots_dev, decode_token_idx,
     decode_rows_dev, decode_context_dev, logits_index_dev, sampled_token_index_dev) = torch.tensor_split(packed, cuts)

    batch.write_tables(token_index, token_ids, block_index, block_ids)
    input_ids = batch.token_table.view(-1)[gather_index]

    decode = None
    if decode_rows.size:
        num_key_blocks = -(-int(decode_context.max()) // bs)
        max_context = num_key_blocks * bs
        key_blocks = batch.block_table[decode_rows_dev, :num_key_blocks].to(torch.int64)
        key_slots = (key_blocks.unsqueeze(-1) * bs + torch.arange(bs, device=device)).view(-1, max_context)
        mask = torch.arange(max_context, device=device) < decode_context_dev.unsqueeze(1)
        all_decode = bool(is_decode.all())
        decode = DecodeBatch(token_idx=None if all_decode else decode_token_idx, key_slots=key_slots,
                             mask=mask.view(-1, 1, 1, max_context))

    prefills = []
    for i in np.flatnonzero(~is_decode).tolist():
        row, ctx, start = int(rows[i]), int(context[i]), int(computed[i])
        num_key_blocks = -(-ctx // bs)
        key_blocks = batch.block_table[row, :num_key_blocks].to(torch.int64)
        key_slots = (key_blocks.unsqueeze(-1) * bs + torch.arange(bs, device=device)).view(-1)[:ctx]
        mask = None
        if start:
            query_pos = torch.arange(start, ctx, device=device)
            mask = torch.arange(ctx, device=device).unsqueeze(0) <= query_pos.unsqueeze(1)
        prefills.append(PrefillChunk(token_start=int(cu[i]), token_end=int(cu[i + 1]), key_slots=key_slots, mask=mask))

    return StepInputs(
        input_ids=input_ids,
        positions=positions_dev,
        attention=AttentionMetadata(slot_mapping=slots_dev, decode=decode, prefills=prefills),
        logits_index=logits_index_dev,
        sampled_token_index=sampled_token_index_dev,
        sampled_rows=plan.rows[sample],
        sampled_num_tokens=context[sample],
    )
