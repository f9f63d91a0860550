"""Persistent batch rows: prompts land in the device token table, blocks in the block table,
freed rows are reusable, and bad plans are refused with the row named."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from stages.contracts.params import SamplingParams
from stages.contracts.plan import NewRequest, StepPlan
from stages.gpu_runner.inputs.input_batch import InputBatch

pytestmark = pytest.mark.timeout(10)


def plan(new=(), rows=(), blocks=(), freed=(), step=0) -> StepPlan:
    """rows: (row, num_computed, num_scheduled); blocks: per row, its new block ids."""
    rows = list(rows)
    return StepPlan(
        step=step,
        new_requests=[NewRequest(req_id=r, row=r, token_ids=np.asarray(t, np.int32), num_prompt_tokens=len(t),
                                 params=SamplingParams(temperature=0.0)) for r, t in new],
        rows=np.asarray([r for r, _, _ in rows], np.int32),
        num_computed_tokens=np.asarray([c for _, c, _ in rows], np.int32),
        num_scheduled_tokens=np.asarray([s for _, _, s in rows], np.int32),
        sample=np.ones(len(rows), bool),
        num_new_blocks=np.asarray([len(b) for b in blocks], np.int32),
        new_block_ids=np.asarray([b for bl in blocks for b in bl], np.int32),
        freed_rows=np.asarray(freed, np.int32),
    )


def apply(batch: InputBatch, p: StepPlan) -> None:
    w = batch.apply(p)
    batch.write_tables(*(torch.from_numpy(a) for a in (w.token_index, w.token_ids, w.block_index, w.block_ids)))


def test_prompts_and_blocks_land_in_their_rows():
    batch = InputBatch(max_num_seqs=4, max_model_len=64, block_size=4, device=torch.device("cpu"))
    apply(batch, plan(new=[(2, [5, 6, 7, 8, 9]), (0, [3])], rows=[(2, 0, 5), (0, 0, 1)], blocks=[[7, 3], [1]]))
    assert batch.token_table[2, :5].tolist() == [5, 6, 7, 8, 9]
    assert batch.token_table[0, :1].tolist() == [3]
    assert batch.block_table[2, :2].tolist() == [7, 3] and batch.block_table[0, :1].tolist() == [1]
    # A later step appends after the row's existing blocks.
    apply(batch, plan(rows=[(2, 5, 4), (0, 1, 1)], blocks=[[9], []], step=1))
    assert batch.block_table[2, :3].tolist() == [7, 3, 9]
    assert batch.block_table_host[2, :3].tolist() == [7, 3, 9]
    assert batch.num_prompt_tokens[2] == 5 and batch.params[2].temperature == 0.0


def test_a_freed_row_takes_a_new_request_in_the_same_plan():
    batch = InputBatch(max_num_seqs=2, max_model_len=32, block_size=4, device=torch.device("cpu"))
    apply(batch, plan(new=[(1, [5, 6])], rows=[(1, 0, 2)], blocks=[[4]]))
    with pytest.raises(ValueError, match="row 1 is still held by request 1"):
        batch.apply(plan(new=[(1, [8])]))
    apply(batch, plan(new=[(1, [8, 9, 10])], rows=[(1, 0, 3)], blocks=[[6]], freed=[1]))
    assert batch.token_table[1, :3].tolist() == [8, 9, 10]
    assert batch.block_table[1, :1].tolist() == [6] and batch.num_blocks[1] == 1


def test_bad_rows_and_block_overflow_are_named():
    batch = InputBatch(max_num_seqs=2, max_model_len=8, block_size=4, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"row 5 is outside \[0, max_num_seqs=2\)"):
        batch.apply(plan(new=[(5, [1])]))
    with pytest.raises(ValueError, match="more than max_model_len 8"):
        batch.apply(plan(new=[(0, list(range(9)))]))
    with pytest.raises(ValueError, match="row 1 would exceed 2 blocks"):
        batch.apply(plan(new=[(1, [1])], rows=[(1, 0, 1)], blocks=[[1, 2, 3]]))
