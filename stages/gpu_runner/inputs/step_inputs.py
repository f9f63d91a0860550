"""One step's device inputs, built from the plan and host mirrors with a single host→device copy.

Every index the step needs (token-table writes, block-table writes, input gathers, positions,
slots, decode rows, logits rows, where sampled tokens go) is computed on the host with numpy
from numbers the plan already holds, packed into one int64 array, copied once through pinned
memory without waiting, and split on the device. Input ids are then gathered from the device
token table, so tokens sampled by the previous step are read where the sampler left them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stages.contracts.plan import StepPlan
from stages.gpu_runner.attention.interface import AttentionBackend
from stages.gpu_runner.inputs.input_batch import InputBatch, TableWrites
from stages.gpu_runner.inputs.step_layout import concat_ranges, step_layout, token_slots
from stages.gpu_runner.speculative.spec_inputs import SpecInputs


@dataclass(slots=True)
class WindowTable:
    """What a backend reads of the batch to build the local layers' metadata: their block table."""

    block_table: torch.Tensor


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # int32 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    attention: Any  # the backend's metadata of the step (a tuple, one per KV group, for a model with two)
    logits_index: torch.Tensor  # int64 [m]: flattened index of each sampled row's last token
    sampled_token_index: torch.Tensor  # int64 [m]: where each sampled token goes in the flat token table
    # Host-side numbers for SamplingMetadata.build, in sampled-row order.
    sampled_rows: np.ndarray  # int32 [m]
    sampled_num_tokens: np.ndarray  # int64 [m]: known tokens before the sampled one
    gather_index: torch.Tensor | None = None  # int64 [num_tokens]: where input_ids were read in the flat token table
    spec: SpecInputs | None = None  # a speculative step's extra inputs


def to_device(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """Host → device without a host wait. On CUDA through a fresh pinned buffer: the caching host
    allocator does not hand that buffer out again until the copy recorded on it has run."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if torch.device(device).type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def check_plan(plan: StepPlan, batch: InputBatch) -> None:
    """Refuse a plan the batch cannot run, naming the problem."""
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


def check_budget(plan: StepPlan, max_num_batched_tokens: int) -> None:
    if plan.num_tokens > max_num_batched_tokens:
        raise ValueError(f"step {plan.step} schedules {plan.num_tokens} tokens, "
                         f"more than max_num_batched_tokens {max_num_batched_tokens}")


def prepare_step(plan: StepPlan, batch: InputBatch, max_num_batched_tokens: int,
                 backend: AttentionBackend, lag: torch.Tensor | None = None) -> StepInputs:
    """Apply the plan to the persistent batch and build its inputs on the batch's device. `lag`
    (int64 [max_num_seqs] on the device): each row's rejected drafts of the last step, read for
    the plan's lagged rows."""
    check_budget(plan, max_num_batched_tokens)
    if plan.speculates:
        if lag is None:
            raise ValueError(f"step {plan.step} verifies drafts, but this runner has no speculative config")
        return build_speculative_inputs(plan, batch, batch.apply(plan), batch.device, backend, lag)
    return build_step_inputs(plan, batch, batch.apply(plan), batch.device, backend)


def build_step_inputs(plan: StepPlan, batch: InputBatch, writes: TableWrites, device: torch.device,
                      backend: AttentionBackend) -> StepInputs:
    """Apply the plan's table writes on the device and gather this step's inputs."""
    check_plan(plan, batch)
    width = batch.max_model_len
    layout = step_layout(plan)
    rows, scheduled, cu, context = layout.rows, layout.scheduled, layout.query_start, layout.context

    token_rows = np.repeat(rows, scheduled)
    positions = concat_ranges(layout.computed, scheduled)
    slots = token_slots(batch.block_table_host, batch.block_size, token_rows, positions)
    windowed = batch.window_block_table is not None
    window_slots = token_slots(batch.window_block_table_host, batch.block_size, token_rows, positions) \
        if windowed else np.zeros(0, np.int64)

    sample = plan.sample.astype(bool)
    logits_index = cu[1:][sample] - 1
    sampled_token_index = rows[sample] * width + context[sample]

    backend_parts = backend.host_arrays(layout)
    parts = [writes.token_index, writes.token_ids, writes.block_index, writes.block_ids, writes.window_block_ids,
             token_rows * width + positions, positions, slots, window_slots, logits_index, sampled_token_index,
             *backend_parts]
    packed = to_device(np.concatenate(parts), device)
    cuts = np.cumsum([len(p) for p in parts])[:-1].tolist()
    (token_index, token_ids, block_index, block_ids, window_block_ids, gather_index, positions_dev, slots_dev,
     window_slots_dev, logits_index_dev, sampled_token_index_dev, *backend_dev) = torch.tensor_split(packed, cuts)

    batch.write_tables(token_index, token_ids, block_index, block_ids, window_block_ids)
    attention = backend.step_metadata(layout, backend_dev, slots_dev, batch)
    if windowed:  # the local layers' metadata: the same step over their own block table
        attention = (attention, backend.step_metadata(layout, backend_dev, window_slots_dev,
                                                      WindowTable(batch.window_block_table)))
    return StepInputs(
        input_ids=batch.token_table.view(-1)[gather_index],
        positions=positions_dev,
        attention=attention,
        logits_index=logits_index_dev,
        sampled_token_index=sampled_token_index_dev,
        sampled_rows=plan.rows[sample],
        sampled_num_tokens=context[sample],
    )


def build_speculative_inputs(plan: StepPlan, batch: InputBatch, writes: TableWrites, device: torch.device,
                             backend: AttentionBackend, lag: torch.Tensor) -> StepInputs:
    """As build_step_inputs, for a plan with drafts to verify or lagged rows: positions, slots and
    gathers are computed from the plan's, then moved back on the device by each lagged row's
    rejected drafts (`lag`), so the host never waits for that count. The drafts themselves are
    not in the token table yet: the caller proposes them, then gathers `input_ids` again."""
    check_plan(plan, batch)
    width, bs = batch.max_model_len, batch.block_size
    layout = step_layout(plan)
    rows, scheduled, cu, context = layout.rows, layout.scheduled, layout.query_start, layout.context
    n = len(rows)
    drafts = layout.drafts
    verify = drafts > 0
    sample = plan.sample.astype(bool)
    num_drafts = int(drafts.max()) if verify.any() else 0
    if np.any(verify & ~sample) or np.any(scheduled[verify] != drafts[verify] + 1):
        raise ValueError(f"step {plan.step}: a row verifying drafts must compute them all after its last token "
                         f"and sample")

    token_layout_index = np.repeat(np.arange(n), scheduled)
    positions = concat_ranges(layout.computed, scheduled)
    counts = np.where(sample, 1 + drafts, 0)
    logits_index = concat_ranges(cu[1:] - counts, counts)
    entry_layout_index = np.repeat(np.arange(n), counts)
    plain = sample & ~verify
    plain_entries = np.flatnonzero(plain[entry_layout_index])
    verify_entries = np.flatnonzero(verify[entry_layout_index])
    backend_parts = backend.host_arrays(layout)
    parts = [writes.token_index, writes.token_ids, writes.block_index, writes.block_ids, writes.window_block_ids,
             rows, plan.lagged.astype(np.int64), token_layout_index, positions, logits_index,
             np.flatnonzero(plain), context[plain], np.flatnonzero(verify), layout.computed[verify], drafts[verify],
             *backend_parts]
    packed = to_device(np.concatenate(parts), device)
    cuts = np.cumsum([len(p) for p in parts])[:-1].tolist()
    (token_index, token_ids, block_index, block_ids, window_block_ids, rows_dev, lagged_dev, token_layout_dev,
     positions_dev, logits_index_dev, plain_index_dev, plain_context_dev, verify_index_dev, verify_planned_dev,
     verify_drafts_dev, *backend_dev) = torch.tensor_split(packed, cuts)
    batch.write_tables(token_index, token_ids, block_index, block_ids, window_block_ids)

    shift = lag.index_select(0, rows_dev) * lagged_dev
    token_rows = rows_dev.index_select(0, token_layout_dev)
    positions_dev = positions_dev - shift.index_select(0, token_layout_dev)
    block_number, offset = positions_dev // bs, positions_dev % bs
    slots = batch.block_table[token_rows, block_number].to(torch.int64) * bs + offset
    verify_rows_dev = rows_dev.index_select(0, verify_index_dev)
    plain_rows_dev = rows_dev.index_select(0, plain_index_dev)
    plain_shift = shift.index_select(0, plain_index_dev)
    attention = backend.step_metadata(layout, backend_dev, slots, batch, shift)
    if batch.window_block_table is not None:
        window_slots = batch.window_block_table[token_rows, block_number].to(torch.int64) * bs + offset
        attention = (attention, backend.step_metadata(layout, backend_dev, window_slots,
                                                      WindowTable(batch.window_block_table), shift))
    gather_index = token_rows * width + positions_dev
    spec = SpecInputs(
        shift=shift, num_drafts=num_drafts, plain_entries=plain_entries, plain_shift=plain_shift,
        verify_rows=plan.rows[verify], verify_rows_dev=verify_rows_dev, verify_drafts=drafts[verify],
        verify_drafts_dev=verify_drafts_dev, verify_entries=verify_entries,
        verify_start=verify_planned_dev - shift.index_select(0, verify_index_dev),
        verify_planned_start=layout.computed[verify])
    return StepInputs(
        input_ids=batch.token_table.view(-1)[gather_index],
        positions=positions_dev,
        attention=attention,
        logits_index=logits_index_dev,
        sampled_token_index=plain_rows_dev * width + plain_context_dev - plain_shift,
        sampled_rows=plan.rows[plain],
        sampled_num_tokens=context[plain],
        gather_index=gather_index,
        spec=spec,
    )


def upload_table_writes(batch: InputBatch, writes: TableWrites) -> None:
    """Apply the plan's table writes on the device, in one upload (none when there are none)."""
    parts = [writes.token_index, writes.token_ids, writes.block_index, writes.block_ids, writes.window_block_ids]
    if not sum(len(p) for p in parts):
        return
    packed = to_device(np.concatenate(parts), batch.device)
    batch.write_tables(*torch.tensor_split(packed, np.cumsum([len(p) for p in parts])[:-1].tolist()))
