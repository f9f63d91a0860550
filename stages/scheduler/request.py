"""One request as the scheduler sees it: its tokens, its blocks, where it is in its life."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from stages.contracts.outputs import FinishReason
from stages.contracts.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # no row, no blocks; queued for admission (fresh or preempted)
    RUNNING = "running"  # holds a row and blocks; scheduled every step it has work
    DRAINING = "draining"  # preempted or finished, but a step that used its row is still in flight
    FINISHED = "finished"  # row and blocks released


@dataclass(slots=True)
class Request:
    """Host-side record of a request. While it holds a row, its counters live in the
    scheduler's row arrays (array-oriented hot path); this record keeps what outlives a row."""

    req_id: int
    prompt_token_ids: np.ndarray  # int32
    params: SamplingParams
    status: RequestStatus = RequestStatus.WAITING
    row: int = -1
    block_ids: list[int] = field(default_factory=list)
    window_block_ids: list[int] = field(default_factory=list)  # the local layers' (KV group 1), when a model has them
    num_released_blocks: int = 0  # leading entries a sliding window has released
    # Chained hashes of full blocks of host-known tokens, computed lazily, index = block index.
    block_hashes: list[bytes] = field(default_factory=list)
    # Outputs known on the host when the request last gave up its row (preemption).
    output_token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    finish_reason: FinishReason | None = None
    preempted: bool = False  # set while draining after preemption: re-admit, do not finish
    admitted: bool = False  # has held a row at least once
    num_preemptions: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return int(self.prompt_token_ids.shape[0])

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None
