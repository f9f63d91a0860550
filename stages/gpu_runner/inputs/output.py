"""What one executed step hands back: sampled tokens that stay on the device until asked for."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shm.clock import sleep_until_ns
from stages.contracts.outputs import HostStepOutput


@dataclass(slots=True)
class StepOutput:
    """Returned by `ModelRunner.execute` before the device has finished the step.

    `token_ids` etc. live on the device. `host_*` are pinned host buffers that an async
    copy fills; `ready` is recorded after that copy (None on CPU, where the step is done
    when execute returns). A runner with `copy_to_host` off (the runner stage, which hands the
    tokens over through the mailbox) leaves `host_*` None. On the simulated device (simulated/) the tokens exist only from
    CLOCK_MONOTONIC `ready_at_ns` on (0 elsewhere). `to_host()` is the only call that waits.
    """

    step: int
    rows: np.ndarray
    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    logprob_token_ids: torch.Tensor | None
    host_token_ids: torch.Tensor | None
    host_logprobs: torch.Tensor | None
    host_logprob_token_ids: torch.Tensor | None
    ready: torch.cuda.Event | None
    ready_at_ns: int = 0

    def to_host(self) -> HostStepOutput:
        if self.host_token_ids is None:
            raise RuntimeError(f"step {self.step} was run without a host copy (the runner's copy_to_host is off)")
        if self.ready is not None:
            self.ready.synchronize()
        if self.ready_at_ns:
            sleep_until_ns(self.ready_at_ns)
        return HostStepOutput(
            step=self.step,
            rows=self.rows,
            token_ids=self.host_token_ids.numpy(),
            logprobs=None if self.host_logprobs is None else self.host_logprobs.numpy(),
            logprob_token_ids=None if self.host_logprob_token_ids is None else self.host_logprob_token_ids.numpy(),
        )
