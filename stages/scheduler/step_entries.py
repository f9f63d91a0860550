"""A processed step's tokens as entries of their requests: where each goes, and which ends a request.

A plain step has one entry per sampled row. A speculative step has 1 + K per row that verified K
drafts: its accepted tokens, then -1 for each rejected draft; reading it also rolls the row's
`num_computed` back by its rejected drafts (speculation.py says why).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from stages.contracts.outputs import HostStepOutput
from stages.contracts.plan import StepPlan
from stages.scheduler.request import Request
from stages.scheduler.row_table import RowTable
from stages.scheduler.speculation import Speculation

StopOf = Callable[[np.ndarray, np.ndarray], np.ndarray]


class StopTokens:
    """Which tokens sampled for rows are an EOS their request heeds, or one of its stop ids."""

    def __init__(self, eos_token_ids: list[int], rows_t: RowTable, row_request: list[Request | None]) -> None:
        self.eos_token_ids = sorted(set(int(t) for t in eos_token_ids))
        self.rows_t = rows_t
        self.row_request = row_request  # the scheduler's, row -> request

    def __call__(self, rows: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
        rows_t = self.rows_t
        stop = np.zeros(token_ids.shape[0], np.bool_)
        for eos_token_id in self.eos_token_ids:  # one or two ids: cheaper than np.isin
            stop |= token_ids == eos_token_id
        stop &= ~rows_t.ignore_eos[rows]
        for i in np.flatnonzero(rows_t.has_stop_ids[rows]).tolist():
            stop[i] |= int(token_ids[i]) in self.row_request[rows[i]].params.stop_token_ids
        return stop


@dataclass(slots=True)
class Entries:
    """The output entries a processed step adds to its requests, in order (several per row for a
    row that verified drafts), already written into the row table, and the outcome of the last
    one of each row."""

    index: np.ndarray  # int64: index into the step's output arrays
    rows: np.ndarray  # int64: each entry's row
    token_ids: np.ndarray  # int32
    position: np.ndarray  # int64: the token's position in its row
    stop: np.ndarray  # bool: a stop token (only ever an entry that ends its row's run)
    length: np.ndarray  # bool: max_tokens or max_model_len reached (likewise)


def speculative_entries(rows_t: RowTable, spec: Speculation, plan: StepPlan, output: HostStepOutput, stop_of: StopOf,
                        max_model_len: int) -> Entries:
    """Read a step whose sampled rows (each once) verified plan.num_draft_tokens each: row i has
    1 + drafts[i] entries in `output`, its accepted tokens then -1. Rolls each row's num_computed
    back by its rejected drafts and counts them; `stop_of(rows, token_ids)` marks stop tokens.
    Entries after the first that ends a row, and those of finished rows, are dropped."""
    sample_rows, drafts, token_ids = plan.sampled_rows.astype(np.int64), plan.draft_counts[plan.sample], output.token_ids
    counts = 1 + drafts
    rows_t.num_placeholders[sample_rows] -= counts
    group = np.repeat(np.arange(len(sample_rows)), counts)
    starts = np.cumsum(counts) - counts
    rank = np.arange(group.shape[0]) - starts[group]
    entry_rows = sample_rows[group]
    token_ids = np.asarray(token_ids, np.int32)
    valid = token_ids >= 0
    produced = np.bincount(group, weights=valid, minlength=len(sample_rows)).astype(np.int64)
    rows_t.num_computed[sample_rows] -= counts - produced  # rejected drafts were computed for nothing
    spec.verified(sample_rows, drafts, produced - 1)

    valid &= ~rows_t.finished[entry_rows]
    position = rows_t.num_known[entry_rows] + rank
    num_outputs = position + 1 - rows_t.num_prompt[entry_rows]
    stop = stop_of(entry_rows, token_ids) & (num_outputs >= rows_t.min_tokens[entry_rows])
    length = (num_outputs >= rows_t.max_tokens[entry_rows]) | (position + 1 >= max_model_len)
    ends = (stop | length) & valid
    ends_before = np.cumsum(ends) - ends  # over the whole step, then within each row's own entries
    ends_before -= ends_before[starts][group]
    keep = valid & (ends_before == 0)
    index = np.flatnonzero(keep)
    kept_rows, kept_position, kept_tokens = entry_rows[index], position[index], token_ids[index]
    rows_t.token_ids[kept_rows, kept_position] = kept_tokens
    rows_t.num_known[sample_rows] += np.bincount(group[index], minlength=len(sample_rows))
    return Entries(index, kept_rows, kept_tokens, kept_position, stop[index], length[index])


def plain_entries(rows_t: RowTable, spec: Speculation | None, plan: StepPlan, output: HostStepOutput, stop_of: StopOf,
                  max_model_len: int) -> Entries:
    """Read a step whose sampled rows got one token each; the entries of finished rows are dropped."""
    sampled, token_ids = output.rows.astype(np.int64), output.token_ids
    rows_t.num_placeholders[sampled] -= 1
    index = np.flatnonzero(~rows_t.finished[sampled])
    live = sampled[index]
    token_ids = np.asarray(token_ids, dtype=np.int32)[index]
    position = rows_t.num_known[live]
    rows_t.token_ids[live, position] = token_ids
    rows_t.num_known[live] = position + 1
    num_outputs = position + 1 - rows_t.num_prompt[live]
    stop = stop_of(live, token_ids) & (num_outputs >= rows_t.min_tokens[live])
    length = (num_outputs >= rows_t.max_tokens[live]) | (position + 1 >= max_model_len)
    return Entries(index, live, token_ids, position, stop, length)
