"""What the scheduler reports after applying one step's sampled tokens."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stages.scheduler.request import FinishReason


@dataclass(slots=True)
class StepUpdate:
    """Tokens that became part of a request's output this step, in plan order.

    Tokens sampled for a request that had already finished (or was aborted) are dropped
    here and never appear. A request in `finished` got its last token in this same update
    (a stop token is reported, then the request ends)."""

    step: int
    req_ids: np.ndarray  # int64 [m]
    token_ids: np.ndarray  # int32 [m]
    output_index: np.ndarray  # int64 [m]: index into the step's HostStepOutput arrays (logprobs)
    finished: list[tuple[int, FinishReason]]

    @property
    def num_tokens(self) -> int:
        return int(self.req_ids.shape[0])
