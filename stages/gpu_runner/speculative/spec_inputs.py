"""What a speculative step adds to the step's inputs (inputs/step_inputs.py builds it): which rows
verify drafts, where their output entries are, and how far each row's real positions trail the plan's."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class SpecInputs:
    """What a speculative step adds (the plan's `num_draft_tokens` / `lagged`).

    Output entries are the sampled rows in plan order, each once, or 1 + k times for a row that
    verifies k drafts (rows verify different numbers, packed one after another: no padding);
    `logits_index` has one entry each. `positions`, the slots, the input gather
    and `sampled_token_index` of the StepInputs that holds this are already moved back by `shift`."""

    shift: torch.Tensor  # int64 [n]: how far each row's real positions trail the plan's
    num_drafts: int  # the most drafts a row verifies (0: none verifies)
    plain_entries: np.ndarray  # int64: entries of sampled rows that verify nothing
    plain_shift: torch.Tensor  # int64 [len(plain_entries)]: their rows' shift
    verify_rows: np.ndarray  # int32 [d]: rows that verify drafts
    verify_rows_dev: torch.Tensor  # int64 [d]
    verify_drafts: np.ndarray  # int64 [d]: how many drafts each verifies, 1..num_drafts
    verify_drafts_dev: torch.Tensor  # int64 [d]
    verify_entries: np.ndarray  # int64 [sum(verify_drafts + 1)]: their entries, row after row
    verify_start: torch.Tensor  # int64 [d]: the real position of each one's last known token
    verify_planned_start: np.ndarray  # int64 [d]: the plan's (an upper bound)
