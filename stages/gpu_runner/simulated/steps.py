"""What the simulated device emits and records: step-named tokens and the per-step timeline file.

numpy only, so a benchmark's clients read them without importing torch (whose hundred thousand
objects would make every full garbage collection in the client a pause of 100 ms).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

FIRST_TOKEN_ID = 2  # below it: BOS and EOS in the checkpoints this project makes
TIMELINE_FIELDS = ("step", "plan_ns", "launch_ns", "start_ns", "ready_ns", "num_sampled")
TIMELINE_CAPACITY = 1 << 16  # steps a timeline file holds; step s is at s % capacity


class SimulatedTokens:
    """Step s's token: the (s mod period)-th id of the vocabulary from FIRST_TOKEN_ID on, EOS ids skipped."""

    def __init__(self, vocab_size: int, eos_token_ids: list[int]) -> None:
        ids = np.arange(FIRST_TOKEN_ID, vocab_size, dtype=np.int32)
        self.ids = ids[~np.isin(ids, eos_token_ids)]
        if not len(self.ids):
            raise ValueError(f"a vocabulary of {vocab_size} ids with EOS {eos_token_ids} leaves no token to emit")
        self._index_of = {int(token_id): index for index, token_id in enumerate(self.ids.tolist())}

    @property
    def period(self) -> int:
        """Steps s and s + period emit the same token."""
        return len(self.ids)

    def for_step(self, step: int) -> int:
        return int(self.ids[step % self.period])

    def step_residue(self, token_id: int) -> int:
        """s mod period for the steps s that emit `token_id`; KeyError for an id no step emits."""
        return self._index_of[token_id]


class StepTimeline:
    """Per step, CLOCK_MONOTONIC ns of: the plan reaching the runner, the launch (host work done),
    the start on the device and the tokens being ready; and how many rows it sampled. A file that
    another process may read while this one writes (`read_timeline`)."""

    def __init__(self, path: str | Path, capacity: int = TIMELINE_CAPACITY) -> None:
        self._records = np.lib.format.open_memmap(path, mode="w+", dtype=np.int64,
                                                  shape=(capacity, len(TIMELINE_FIELDS)))
        self._records[:, 0] = -1  # no step recorded yet

    def record(self, step: int, plan_ns: int, launch_ns: int, start_ns: int, ready_ns: int, num_sampled: int) -> None:
        # The step column last: a reader skips a row whose step is not the one it wants.
        row = self._records[step % len(self._records)]
        row[1:] = (plan_ns, launch_ns, start_ns, ready_ns, num_sampled)
        row[0] = step


def read_timeline(path: str | Path) -> dict[str, np.ndarray]:
    """The steps recorded so far, in step order: one int64 array per TIMELINE_FIELDS name."""
    records = np.load(path, mmap_mode="r")
    records = np.array(records[records[:, 0] >= 0])
    records = records[np.argsort(records[:, 0], kind="stable")]
    return {name: records[:, index] for index, name in enumerate(TIMELINE_FIELDS)}
