"""A fake model runner for scheduler tests: no model, but a KV cache it really reads.

Each step writes the token at every computed position into its paged "KV cache" through the
row's block table; a sampled token is a hash of the whole sequence read back from that cache.
So a wrong block, a stale prefix hit or a skipped position changes the output, and the
outputs of a correct scheduler equal `reference_tokens`, whatever batching it chose.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from stages.contracts.outputs import HostStepOutput
from stages.contracts.plan import KVCopyMeta, StepPlan

VOCAB = 1000


def next_token(sequence: np.ndarray) -> int:
    weights = np.arange(1, sequence.shape[0] + 1, dtype=np.int64)
    return int((int((sequence.astype(np.int64) * weights).sum()) * 2654435761 + sequence.shape[0]) % VOCAB)


def reference_tokens(prompt: list[int], max_tokens: int, stop_ids: tuple[int, ...] = ()) -> list[int]:
    sequence = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        token = next_token(np.asarray(sequence))
        out.append(token)
        sequence.append(token)
        if token in stop_ids:
            break
    return out


@dataclass
class _Row:
    token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0) -> None:
        self.block_size = block_size
        self.kv = np.full((num_blocks, block_size), -1, np.int64)
        self.host_kv = np.full((max(num_host_blocks, 1), block_size), -1, np.int64)
        self.rows: dict[int, _Row] = {}
        self.steps: list[StepPlan] = []
        self.num_loaded_blocks = 0

    def execute(self, plan: StepPlan) -> HostStepOutput:
        self.steps.append(plan)
        for row in plan.freed_rows.tolist():
            del self.rows[row]
        new_rows = {new.row for new in plan.new_requests}
        for new in plan.new_requests:
            if new.row in self.rows:
                raise AssertionError(f"row {new.row} taken twice")
            self.rows[new.row] = _Row(new.token_ids.tolist())
        meta = plan.connector_meta
        if isinstance(meta, KVCopyMeta):
            for slot, block in zip(meta.load_host_slots.tolist(), meta.load_block_ids.tolist()):
                self.kv[block] = self.host_kv[slot]
                self.num_loaded_blocks += 1
        offsets = np.concatenate([[0], np.cumsum(plan.num_new_blocks)])
        sampled: list[int] = []
        for i, row_id in enumerate(plan.rows.tolist()):
            row = self.rows[row_id]
            row.block_ids.extend(plan.new_block_ids[offsets[i]:offsets[i + 1]].tolist())
            start, count = int(plan.num_computed_tokens[i]), int(plan.num_scheduled_tokens[i])
            if row_id not in new_rows and start != row.num_computed:
                raise AssertionError(f"row {row_id}: continues at {start}, computed {row.num_computed}")
            end = start + count
            if end > len(row.token_ids):
                raise AssertionError(f"row {row_id}: computes position {end - 1} of {len(row.token_ids)} known")
            if len(row.block_ids) * self.block_size < end:
                raise AssertionError(f"row {row_id}: {len(row.block_ids)} blocks for {end} tokens")
            for pos in range(start, end):
                self.kv[row.block_ids[pos // self.block_size], pos % self.block_size] = row.token_ids[pos]
            row.num_computed = end
            if plan.sample[i]:
                if end != len(row.token_ids):
                    raise AssertionError(f"row {row_id}: samples before its last known token")
                sequence = np.array([self.kv[row.block_ids[p // self.block_size], p % self.block_size]
                                     for p in range(end)])
                token = next_token(sequence)
                row.token_ids.append(token)
                sampled.append(token)
        if isinstance(meta, KVCopyMeta):
            for block, slot in zip(meta.save_block_ids.tolist(), meta.save_host_slots.tolist()):
                self.host_kv[slot] = self.kv[block]
        return HostStepOutput(plan.step, plan.sampled_rows.copy(), np.asarray(sampled, np.int32), None, None)

    def save(self, meta: KVCopyMeta) -> None:
        for block, slot in zip(meta.save_block_ids.tolist(), meta.save_host_slots.tolist()):
            self.host_kv[slot] = self.kv[block]
