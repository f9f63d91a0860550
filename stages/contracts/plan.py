"""The step plan: everything the runner needs to execute one step, and nothing else.

A plan names batch rows, not request ids. A row belongs to one request from the plan that
admits it (a `NewRequest`) until the plan that lists it in `freed_rows`. Token ids cross only
once, when a request is admitted; every later input token is read by the runner from its own
device token table, so a placeholder for a not-yet-known token never appears here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from stages.contracts.params import SamplingParams


@dataclass(slots=True)
class NewRequest:
    """A request taking a batch row: fresh, or re-admitted after preemption."""

    req_id: int
    row: int
    token_ids: np.ndarray  # int32: the prompt, plus the outputs so far when re-admitted
    num_prompt_tokens: int  # the first num_prompt_tokens of token_ids are the prompt
    params: SamplingParams


@dataclass(slots=True)
class StepPlan:
    """Step `step`: the rows to run, in batch order, and how many tokens each computes.

    For scheduled row i: its tokens at positions
    [num_computed_tokens[i], num_computed_tokens[i] + num_scheduled_tokens[i]) are computed;
    their KV goes to the row's blocks. `new_block_ids` holds, row after row, the blocks
    appended to each row's block table this step (`num_new_blocks[i]` of them; a new
    request's first plan lists all its blocks, prefix-cache hits included).
    `sample[i]` says whether the row's last scheduled token yields a new token.
    A model with local layers (ModelLimits.num_window_blocks) has a second block table per row
    of the same length: `window_block_ids` holds its new entries, `num_new_blocks[i]` per row too.

    Speculative decoding: a row with `num_draft_tokens[i]` = k > 0 computes its last known token
    and k drafts the runner proposes on the device (num_scheduled_tokens[i] = 1 + k) and yields
    1 + k output entries, its accepted drafts and one token more, then -1 for each rejected
    draft. The scheduler learns how many were accepted one step late, so a plan made while a
    row's speculative step is still unprocessed counts positions as if every draft were accepted:
    such a row is `lagged`, and the runner moves its positions back by that step's rejected
    count, which only the device knows. Both arrays are empty in a plan without speculation.
    """

    step: int
    new_requests: list[NewRequest]
    rows: np.ndarray  # int32 [n]
    num_computed_tokens: np.ndarray  # int32 [n]: tokens already in the KV cache before this step
    num_scheduled_tokens: np.ndarray  # int32 [n]
    sample: np.ndarray  # bool [n]
    num_new_blocks: np.ndarray  # int32 [n]
    new_block_ids: np.ndarray  # int32 [sum(num_new_blocks)]
    freed_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # int32
    # int32, as freed_rows: each freed row's known tokens (prompt and outputs), for the runner's
    # per-row state that keeps the row's text (suffix decoding caches the outputs of a leaving row)
    freed_num_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    connector_meta: object | None = None  # KV connector metadata, when a connector is set
    window_block_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # int32, or empty
    num_draft_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # int32 [n], or empty
    lagged: np.ndarray = field(default_factory=lambda: np.zeros(0, np.bool_))  # bool [n], or empty

    @property
    def num_rows(self) -> int:
        return int(self.rows.shape[0])

    @property
    def speculates(self) -> bool:
        """Whether some row verifies drafts or trails its planned positions."""
        return bool(self.num_draft_tokens.shape[0] and (self.num_draft_tokens.any() or self.lagged.any()))

    @property
    def draft_counts(self) -> np.ndarray:
        """int64 [n]: drafts each row verifies (zeros without speculation)."""
        if self.num_draft_tokens.shape[0]:
            return self.num_draft_tokens.astype(np.int64)
        return np.zeros(self.num_rows, np.int64)

    @property
    def output_rows(self) -> np.ndarray:
        """int32: the row of each output entry, in order (a sampled row once, or 1 + its drafts times)."""
        if not self.num_draft_tokens.shape[0]:
            return self.sampled_rows
        return np.repeat(self.sampled_rows, 1 + self.num_draft_tokens[self.sample].astype(np.int64))

    @property
    def num_tokens(self) -> int:
        return int(self.num_scheduled_tokens.sum())

    @property
    def sampled_rows(self) -> np.ndarray:
        return self.rows[self.sample]


@dataclass(slots=True)
class KVCopyMeta:
    """Offload connector metadata for one step: explicit block copies, in order.

    Loads (host slot → device block) run before the step's forward, saves (device block →
    host slot) after it; a slot loaded and re-saved in one step is read before it is written.
    """

    load_host_slots: np.ndarray  # int32 [l]
    load_block_ids: np.ndarray  # int32 [l]
    save_block_ids: np.ndarray  # int32 [s]
    save_host_slots: np.ndarray  # int32 [s]

    @property
    def is_empty(self) -> bool:
        return self.load_block_ids.shape[0] == 0 and self.save_block_ids.shape[0] == 0
