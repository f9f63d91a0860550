"""What verifying drafts costs on the device in use, measured once at start-up.

A step of N tokens costs about c0 + c1 * N: reading the weights (c0) does not grow with the
tokens, the arithmetic (c1 per token) does. The runner times the model over B decode rows of one
token each, then over B * (1 + K) (the same rows with K drafts each), and reports F = c0 / c1:
how many extra tokens cost as much as the step itself, for each B of COST_BATCHES. The scheduler
weighs each row's drafts against F at its step's batch (stages/scheduler/speculation.py). Where reading the weights dominates a step (a GPU,
a quantized model) F is large and drafts are nearly free; where the arithmetic does, it is small.

F covers the target's forward, logits and a greedy draw at each position. A draft model also
decodes each draft, one step per draft position over the rows that draft: the runner times its
steps the same way (e0 + e1 * n for n rows) and reports them in the target's tokens, (e0 / c1,
e1 / c1), so that the scheduler adds what a draft costs to decode to what it costs to verify. The proposers without weights (a
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
# Decode rows of the steps timed, each against the same rows with K drafts each: one stream, a few,
# a batch, a larger one. A CPU's step is bound by reading the weights at one row and by arithmetic at
# many, and its kernels change with the rows (stages/gpu_runner/layers/quantization/gguf.py), so one
# fit does not carry from 16 rows to one, nor to 32 (Gemma-3's n-gram drafts at 32 chat streams,
# priced by the 16-row fit held beyond it, ran at 0.87x of none: tools/bench/bench_spec.py); the
# scheduler interpolates between these, and holds the last beyond it.
COST_BATCHES = (1, 4, 16, 32)
FITS = 3  # fits taken before contradicting timings are believed

Step = Callable[[int], None]  # the model over n single-token rows, logits and a greedy draw included


@dataclass(frozen=True, slots=True)
class StepCosts:
    """What the scheduler weighs drafts by, in units of c1 (a target token's share of a step)."""

    free_tokens: float | None  # F = c0 / c1 (None: not measured, drafts are taken as free)
    draft_step: tuple[float, float] = (0.0, 0.0)  # a draft model's decode step over n rows: (e0, e1) / c1
    # The same, fitted at each of COST_BATCHES: (rows, F, e0, e1), fewest rows first (free_tokens and
    # draft_step are the last one's). Empty where not measured.
    by_batch: tuple[tuple[int, float, float, float], ...] = ()

    @property
    def draft_pays(self) -> bool:
        """Whether a draft model's drafts can pay at some batch B: decoding a draft for B rows must cost
        less than F (the scheduler's bar, (B + e0 + e1 * B) / (F + B), is then below 1), at one of
        the batches measured."""
        if self.free_tokens is None:
            return True
        fits = self.by_batch or ((1, self.free_tokens, *self.draft_step),)
        return any(e0 + e1 * rows < free for rows, free, e0, e1 in fits)


def measure(step: Step, rows: int, k: int, device: torch.device, draft_step: Step | None = None) -> StepCosts:
    """F = c0 / c1 from timing `step(n)` at n = rows and n = rows * (1 + k), the fastest of REPEATS
    runs each after one to warm up; and, given a draft model's `draft_step`, its (e0, e1) / c1 timed
    the same way. Timings that contradict the model (more than (1 + k) times the cost for (1 + k)
    times the tokens: a busy machine's noise, or a step with no fixed cost to share) are taken again,
    FITS times in all; if every fit says so, F is 0: extra tokens cost at least their share of the
    step, so no draft pays (never "free": drafts taken as free on a busy machine slow it down); a
    draft model's decoding is then still measured against the last fit's c1. A step whose extra
    tokens cost nothing measurable has F = MAX_FREE_TOKENS, and a draft model's decoding is measured
    in the c1 that F implies (never free either)."""
    small, large = rows, rows * (1 + k)
    for _ in range(FITS):
        # the two models' timings interleaved: a machine whose load changes meanwhile weighs both alike
        fits = _fit([step] if draft_step is None else [step, draft_step], small, large, device)
        c0, c1 = fits[0]
        if c1 <= 0:  # extra tokens cost nothing measurable: F is the cap, and c1 the small step's
            c1 = (c0 + c1 * small) / (MAX_FREE_TOKENS + small)  # share at that F (a draft's unit)
            free = MAX_FREE_TOKENS
            break
        if c0 > 0:
            free = min(c0 / c1, MAX_FREE_TOKENS)
            break
    else:
        free = 0.0  # no draft pays; a draft model's decoding is still reported, in the last fit's c1
    if draft_step is None:
        return StepCosts(free)
    e0, e1 = fits[1]
    if e0 < 0:  # noise: the whole of the smaller step is taken as fixed
        e0, e1 = e0 + e1 * small, 0.0
    return StepCosts(free, (e0 / c1, max(e1, 0.0) / c1))


def measure_by_batch(step: Step, max_rows: int, k: int, device: torch.device,
                     draft_step: Step | None = None) -> StepCosts:
    """`measure` at each of COST_BATCHES rows (at most max_rows)."""
    table = []
    for rows in sorted({min(batch, max_rows) for batch in COST_BATCHES}):
        costs = measure(step, rows, k, device, draft_step)
        table.append((rows, costs.free_tokens, *costs.draft_step))
    return StepCosts(costs.free_tokens, costs.draft_step, tuple(table))


def start_up_costs(step: Step, max_rows: int, k: int, device: torch.device,
                   draft_step: Step | None = None) -> StepCosts:
    """The costs for the scheduler: F from PIPELINE_VERIFY_FREE_TOKENS where it is set, else measured
    at each of COST_BATCHES rows, at most max_rows (the batch's)."""
    fixed = os.environ.get(FIXED_VARIABLE)
    if fixed is None:
        return measure_by_batch(step, max_rows, k, device, draft_step)
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
