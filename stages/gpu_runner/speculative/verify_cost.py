"""What verifying drafts costs on the device in use, measured once at start-up.

A step of N tokens costs about c0 + c1 * N: reading the weights (c0) does not grow with the
tokens, the arithmetic (c1 per token) does. The runner times the model over B decode rows of one
token each, then over B * (1 + K) (the same rows with K drafts each), and reports F = c0 / c1:
how many extra tokens cost as much as the step itself. The scheduler weighs each row's drafts
against it (stages/scheduler/speculation.py). Where reading the weights dominates a step (a GPU,
a quantized model) F is large and drafts are nearly free; where the arithmetic does, it is small.

F covers the target's forward, logits and a greedy draw at each position. A draft model also decodes each draft, one step per
draft position over the rows that draft: the runner times its steps the same way (e0 + e1 * n
for n rows) and reports them in the target's tokens, (e0 / c1, e1 / c1), so that the scheduler
adds what a draft costs to decode to what it costs to verify. The proposers without weights (a
lookup, suffix tries) and what sampling costs beyond a greedy draw are not in it.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Set, F is not measured: "none" takes drafts as free (the scheduler's not-measured case), a number
# is F itself; a draft model's decoding is then taken as free too. For runs whose draft decisions
# must not depend on the machine's timing (tests).
FIXED_VARIABLE = "PIPELINE_VERIFY_FREE_TOKENS"
MAX_FREE_TOKENS = 1e6  # what a step whose cost did not grow measurably with its tokens reports
REPEATS = 3
FITS = 3  # fits taken before contradicting timings are believed

Step = Callable[[int], None]  # the model over n single-token rows, logits and a greedy draw included


@dataclass(frozen=True, slots=True)
class StepCosts:
    """What the scheduler weighs drafts by, in units of c1 (a target token's share of a step)."""

    free_tokens: float | None  # F = c0 / c1 (None: not measured, drafts are taken as free)
    draft_step: tuple[float, float] = (0.0, 0.0)  # a draft model's decode step over n rows: (e0, e1) / c1

    @property
    def draft_pays(self) -> bool:
        """Whether a draft model's drafts can pay at any batch: decoding a draft for one row must cost
        less than F (the scheduler's bar, (B + e0 + e1 * B) / (F + B), is then below 1 for some
        acceptance; where e0 + e1 >= F it is 1 or more for every B)."""
        return self.free_tokens is None or sum(self.draft_step) < self.free_tokens


def measure(step: Step, rows: int, k: int, device: torch.device, draft_step: Step | None = None) -> StepCosts:
    """F = c0 / c1 from timing `step(n)` at n = rows and n = rows * (1 + k), the fastest of REPEATS
    runs each after one to warm up; and, given a draft model's `draft_step`, its (e0, e1) / c1 timed
    the same way. Timings that contradict the model (more than (1 + k) times the cost for (1 + k)
    times the tokens: a busy machine's noise, or a step with no fixed cost to share) are taken again,
    FITS times in all; if every fit says so, F is 0: extra tokens cost at least their share of the
    step, so no draft pays (never "free": drafts taken as free on a busy machine slow it down)."""
    small, large = rows, rows * (1 + k)
    for _ in range(FITS):
        # the two models' timings interleaved: a machine whose load changes meanwhile weighs both alike
        fits = _fit([step] if draft_step is None else [step, draft_step], small, large, device)
        c0, c1 = fits[0]
        if c1 <= 0:
            return StepCosts(MAX_FREE_TOKENS)
        if c0 > 0:
            break
    else:
        return StepCosts(0.0)
    free = min(c0 / c1, MAX_FREE_TOKENS)
    if draft_step is None:
        return StepCosts(free)
    e0, e1 = fits[1]
    if e0 < 0:  # noise: the whole of the smaller step is taken as fixed
        e0, e1 = e0 + e1 * small, 0.0
    return StepCosts(free, (e0 / c1, max(e1, 0.0) / c1))


def start_up_costs(step: Step, rows: int, k: int, device: torch.device, draft_step: Step | None = None) -> StepCosts:
    """The costs for the scheduler: F from PIPELINE_VERIFY_FREE_TOKENS where it is set, else measured."""
    fixed = os.environ.get(FIXED_VARIABLE)
    if fixed is None:
        return measure(step, rows, k, device, draft_step)
    if fixed.strip().lower() == "none":
        return StepCosts(None)
    try:
        value = float(fixed)
    except ValueError:
        raise ValueError(f"{FIXED_VARIABLE} must be 'none' or a number of tokens, not {fixed!r}") from None
    if not value >= 0:
        raise ValueError(f"{FIXED_VARIABLE} must be 'none' or a number of tokens >= 0, not {fixed!r}")
    return StepCosts(value)


def _fit(steps: list[Step], small: int, large: int, device: torch.device) -> list[tuple[float, float]]:
    """(c0, c1) of each step costing c0 + c1 * n, from timing it at n = small and n = large: the
    fastest of REPEATS runs each, the steps taking turns."""

    def timed(step: Step, n: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step(n)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    for step in steps:  # warm-up
        timed(step, small), timed(step, large)
    best = [[float("inf"), float("inf")] for _ in steps]
    for _ in range(REPEATS):
        for i, step in enumerate(steps):
            best[i][0] = min(best[i][0], timed(step, small))
            best[i][1] = min(best[i][1], timed(step, large))
    fits = []
    for t_small, t_large in best:
        c1 = (t_large - t_small) / (large - small)
        fits.append((t_small - c1 * small, c1))
    return fits
