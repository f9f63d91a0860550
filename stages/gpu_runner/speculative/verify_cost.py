"""What verifying drafts costs on the device in use, measured once at start-up.

A step of N tokens costs about c0 + c1 * N: reading the weights (c0) does not grow with the
tokens, the arithmetic (c1 per token) does. The runner times the model over B decode rows of one
token each, then over B * (1 + K) (the same rows with K drafts each), and reports F = c0 / c1:
how many extra tokens cost as much as the step itself. The scheduler weighs each row's drafts
against it (stages/scheduler/speculation.py). Where reading the weights dominates a step (a GPU,
a quantized model) F is large and drafts are nearly free; where the arithmetic does, it is small.
The figure covers the target's forward and logits only: a draft model's own decoding, the
proposer and the sampling of each verified position are not in it.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

# Set, F is not measured: "none" takes drafts as free (the scheduler's not-measured case), a number
# is F itself. For runs whose draft decisions must not depend on the machine's timing (tests).
FIXED_VARIABLE = "PIPELINE_VERIFY_FREE_TOKENS"
MAX_FREE_TOKENS = 1e6  # what a step whose cost did not grow measurably with its tokens reports
REPEATS = 3


def measure_free_tokens(step: Callable[[int], None], rows: int, k: int, device: torch.device) -> float | None:
    """F = c0 / c1 from timing `step(n)` (the model over n single-token rows, logits included) at
    n = rows and n = rows * (1 + k); the fastest of REPEATS runs each, after one to warm up. None
    when the timings contradict the model (more than (1 + k) times the cost for (1 + k) times the
    tokens: a busy machine's noise), which the scheduler reads as not measured."""
    small, large = rows, rows * (1 + k)

    def timed(n: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step(n)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    timed(small), timed(large)
    t_small = min(timed(small) for _ in range(REPEATS))
    t_large = min(timed(large) for _ in range(REPEATS))
    c1 = (t_large - t_small) / (large - small)
    c0 = t_small - c1 * small
    if c1 <= 0:
        return MAX_FREE_TOKENS
    if c0 <= 0:
        return None
    return min(c0 / c1, MAX_FREE_TOKENS)


def start_up_free_tokens(step: Callable[[int], None], rows: int, k: int, device: torch.device) -> float | None:
    """F for the scheduler: PIPELINE_VERIFY_FREE_TOKENS where it is set, else measured."""
    fixed = os.environ.get(FIXED_VARIABLE)
    if fixed is None:
        return measure_free_tokens(step, rows, k, device)
    if fixed.strip().lower() == "none":
        return None
    try:
        value = float(fixed)
    except ValueError:
        raise ValueError(f"{FIXED_VARIABLE} must be 'none' or a number of tokens, not {fixed!r}") from None
    if not value >= 0:
        raise ValueError(f"{FIXED_VARIABLE} must be 'none' or a number of tokens >= 0, not {fixed!r}")
    return value
