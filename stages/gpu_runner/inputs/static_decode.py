"""Decode steps over persistent input buffers padded to a batch-size bucket: what a CUDA graph replays.

The buffers are sized to max_num_seqs and allocated once; a decode-only step (every row computes
one token and samples it) fills them in place with one host→device copy and runs over the first
`bucket` rows, the smallest bucket holding its batch (1, 2, 4, 8, 16, then steps of 16 up to
max_num_seqs). Rows past the batch are padding: they read the token table's scratch row, write
their KV into the scratch slot (a block no request owns), have context 0 and write their sampled
token into the scratch row; their outputs are discarded. Input ids are gathered from the device
token table, so the previous step's sampled tokens never pass through the host.
"""
from __future__ import annotations

import bisect

import numpy as np
import torch

from stages.contracts.plan import StepPlan
from stages.gpu_runner.inputs.input_batch import InputBatch
from stages.gpu_runner.inputs.step_layout import StepLayout, token_slots


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, then steps of 16, the last always max_num_seqs."""
    return [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16)) + [max_num_seqs]


def is_decode_only(plan: StepPlan) -> bool:
    """Every row computes one token and samples it (the step a bucket can run)."""
    return (plan.num_rows > 0 and bool(np.all(plan.num_scheduled_tokens == 1)) and bool(np.all(plan.sample))
            and not plan.speculates)  # a lagged row's positions are known on the device only


class StaticDecodeInputs:
    """The persistent int64 input buffers of a decode step, one row of `packed` per field.

    rows: batch rows (token- and block-table rows); positions: the position computed now;
    gather_index: where its input id is in the flat token table; slot_mapping: where its KV
    goes; seq_lens: its context once this step's token is written (0 on padding rows);
    sampled_index: where its sampled token goes in the flat token table.
    """

    FIELDS = ("rows", "positions", "gather_index", "slot_mapping", "seq_lens", "sampled_index")

    def __init__(self, batch: InputBatch, scratch_slot: int) -> None:
        self.batch = batch
        self.max_rows = batch.max_num_seqs
        self.buckets = decode_buckets(self.max_rows)
        self.device = batch.device
        self._padding = np.array([batch.scratch_row, 0, batch.scratch_read, scratch_slot, 0, batch.scratch_sample],
                                 np.int64)
        self.packed = torch.from_numpy(self._host_inputs()).to(self.device)
        self.rows, self.positions, self.gather_index, self.slot_mapping, self.seq_lens, self.sampled_index = (
            self.packed.unbind(0))
        self.token_table = batch.padded_token_table  # [max_num_seqs + 1, max_model_len]: scratch row last
        self.block_table = batch.padded_block_table

    def bucket(self, num_rows: int) -> int:
        """The smallest bucket that holds `num_rows` rows."""
        if not 0 < num_rows <= self.max_rows:
            raise ValueError(f"a decode step of {num_rows} rows does not fit a bucket of at most {self.max_rows}")
        return self.buckets[bisect.bisect_left(self.buckets, num_rows)]

    def _host_inputs(self) -> np.ndarray:
        """[len(FIELDS), max_rows], every row padding. A fresh array each call: on CUDA the last
        one may still be copying from its pinned twin."""
        return np.repeat(self._padding[:, None], self.max_rows, axis=1)

    def fill(self, layout: StepLayout) -> None:
        """Write the step's rows (a decode-only step of the batch) into the buffers, padding the rest."""
        n, width = len(layout.rows), self.batch.max_model_len
        rows, positions = layout.rows, layout.computed
        host = self._host_inputs()
        slots = token_slots(self.batch.block_table_host, self.batch.block_size, rows, positions)
        host[:, :n] = (rows, positions, rows * width + positions, slots,
                       positions + 1, rows * width + positions + 1)
        source = torch.from_numpy(host)
        if self.device.type == "cpu":
            self.packed.copy_(source)
        else:
            # Pinned, so the copy does not wait; the caching host allocator keeps the pinned block
            # until the copy recorded on it has run.
            self.packed.copy_(source.pin_memory(), non_blocking=True)
