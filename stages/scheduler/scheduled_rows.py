"""The rows one plan schedules and what each computes, as parallel arrays in plan order."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np


@dataclass(slots=True)
class ScheduledRows:
    rows: np.ndarray  # int64
    num_computed: np.ndarray  # int64: the row's tokens computed before this step
    num_new: np.ndarray  # int64: tokens this step computes, drafts included
    sample: np.ndarray  # bool: the step samples the row's next token
    num_new_blocks: np.ndarray  # int64: KV blocks the row gains (a newly admitted row: all it holds)
    drafts: np.ndarray  # int64: drafts the row verifies (0 without speculation)

    def select(self, keep: np.ndarray) -> ScheduledRows:
        """The rows `keep` (a mask or index) picks."""
        return ScheduledRows(*(getattr(self, f.name)[keep] for f in fields(self)))

    @staticmethod
    def concat(parts: Sequence[ScheduledRows]) -> ScheduledRows:
        return ScheduledRows(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(ScheduledRows)))
