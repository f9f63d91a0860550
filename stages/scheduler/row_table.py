"""Per-row counters of the requests holding batch rows, as arrays indexed by row.

The scheduler's per-step work (what to compute, what was sampled, who stops) is a handful of
numpy operations over these arrays rather than a Python loop over requests.
"""
from __future__ import annotations

import numpy as np

from stages.contracts.params import SamplingParams


class RowTable:
    def __init__(self, max_num_seqs: int, max_model_len: int) -> None:
        def zeros(dtype: type = np.int64) -> np.ndarray:
            return np.zeros(max_num_seqs, dtype)

        self.req_id = zeros()
        self.num_prompt = zeros()
        self.num_known = zeros()  # prompt + outputs known on the host
        self.num_computed = zeros()  # advanced when scheduled (optimistic under async)
        self.num_in_flight = zeros()  # scheduled tokens whose step is not yet processed
        self.num_placeholders = zeros()  # sampled tokens whose value is not yet known
        self.num_steps_in_flight = zeros()
        self.num_blocks = zeros()
        self.num_committed_blocks = zeros()  # leading blocks already offered to the prefix cache
        self.max_tokens = zeros()
        self.min_tokens = zeros()
        self.ignore_eos = zeros(np.bool_)
        self.has_stop_ids = zeros(np.bool_)
        self.finished = zeros(np.bool_)  # sampled tokens are discarded
        self.draining = zeros(np.bool_)  # finished or preempted; released once no step is in flight
        # Host copy of every known token: the source of prefix hashes and re-admission ids.
        self.token_ids = np.zeros((max_num_seqs, max_model_len), np.int32)

    def assign(self, row: int, req_id: int, token_ids: np.ndarray, num_prompt: int, params: SamplingParams) -> None:
        num_tokens = token_ids.shape[0]
        self.token_ids[row, :num_tokens] = token_ids
        self.req_id[row] = req_id
        self.num_prompt[row] = num_prompt
        self.num_known[row] = num_tokens
        self.max_tokens[row] = params.max_tokens
        self.min_tokens[row] = params.min_tokens_held
        self.ignore_eos[row] = params.eos_ignored
        self.has_stop_ids[row] = bool(params.stop_token_ids)

    def clear(self, row: int) -> None:
        for counter in (self.num_known, self.num_computed, self.num_in_flight, self.num_placeholders,
                        self.num_steps_in_flight, self.num_blocks, self.num_committed_blocks):
            counter[row] = 0
        self.req_id[row] = -1
        self.finished[row] = False
        self.draining[row] = False
