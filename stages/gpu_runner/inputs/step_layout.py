"""A step's host-known shape (rows and their token counts) and the KV slots of its tokens, from
the plan and the host mirror of the block table: what the dynamic inputs, the static decode
buffers and the attention backends all read."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stages.contracts.plan import StepPlan


@dataclass(slots=True)
class StepLayout:
    """The host-known shape of a step: its rows in batch order and their token counts."""

    rows: np.ndarray  # int64 [n]: batch rows
    computed: np.ndarray  # int64 [n]: tokens of each row already in the KV cache
    scheduled: np.ndarray  # int64 [n]: tokens computed now
    query_start: np.ndarray  # int64 [n + 1]: where each row's tokens start among the step's, then the total
    drafts: np.ndarray | None = None  # int64 [n]: drafts each row verifies (None: no row does)

    @property
    def context(self) -> np.ndarray:
        """int64 [n]: each row's tokens once this step's are written."""
        return self.computed + self.scheduled


def step_layout(plan: StepPlan) -> StepLayout:
    scheduled = plan.num_scheduled_tokens.astype(np.int64)
    drafts = plan.draft_counts if plan.speculates else None
    return StepLayout(rows=plan.rows.astype(np.int64), computed=plan.num_computed_tokens.astype(np.int64),
                      scheduled=scheduled, query_start=np.concatenate(([0], np.cumsum(scheduled))), drafts=drafts)


def concat_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """int64: range(starts[i], starts[i] + counts[i]) for each i, one after another."""
    counts = np.asarray(counts, np.int64)
    return np.repeat(np.asarray(starts, np.int64) - (np.cumsum(counts) - counts), counts) \
        + np.arange(int(counts.sum()), dtype=np.int64)


def token_slots(block_table_host: np.ndarray, block_size: int, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """int64 KV slots of (row, position) pairs, from a host mirror of a block table."""
    bs = block_size
    return block_table_host[rows, positions // bs].astype(np.int64) * bs + positions % bs
