"""The scheduler's side of speculative decoding: which rows verify drafts, and reading their results.

A decoding row that speculates computes its last token plus K drafts in one step (the runner
proposes the drafts on the device) and yields up to K + 1 tokens. Under async scheduling the
next plan is made before that step's tokens are known, so the row is planned as if every
draft were accepted: `num_computed` advances by K + 1 and K + 1 placeholders are counted. When
the step's tokens arrive, `num_computed` is rolled back by the drafts that were rejected; the
plan made in between is `lagged` for that row and the runner corrects its positions itself.

A row speculates only when nothing makes its output depend on host-side state a draft would
bypass: the request allows it (`SamplingParams.speculative`), has no logit_bias, has
its min_tokens behind it, and K + 1 more positions fit in max_model_len (a grammar row's drafts
are checked against its grammar in the runner: sampling/constraints.py). A step with more
decoding rows than `disable_by_batch_size` verifies no drafts.

Drafts must also pay for themselves. A step of B decoding rows costs about c0 + c1 * B: reading
the weights (c0) does not grow with the tokens, the arithmetic (c1 per token) does. K drafts of
one row add K * c1 and bring the drafts it gets accepted, so they pay when the row's accepted
drafts per verification exceed K * B / (FREE_TOKENS + B), with FREE_TOKENS = c0 / c1: a row
needs more accepted drafts the larger the batch. Each row keeps a running mean of its accepted
drafts; below the bar it backs off (after n such verifications in a row it skips 4^n - 1 decode
steps, at most MAX_COOLDOWN) and then verifies once more to see whether its text has turned
repetitive.
"""
from __future__ import annotations

import numpy as np

from stages.contracts.params import SamplingParams
from stages.contracts.counters import SpeculativeCounts
from stages.contracts.speculative import SpeculativeConfig

MAX_COOLDOWN = 127  # decode steps a row skips after its drafts did not pay several times in a row
# c0 / c1 above: how many tokens a decode step computes for about the price of reading the weights.
# On the 2-core AVX-512 machine a SmolLM2-135M step of 5 tokens costs about 1.35x one of 1 (10),
# but tools/bench/bench_spec.py finds rows of 4 streams accepting 1.2-1.6 of 4 drafts losing: 6.
FREE_TOKENS = 6.0
MEAN_WEIGHT = 0.3  # of the latest verification in a row's running mean: one lucky run does not reset it


def allows_speculation(params: SamplingParams) -> bool:
    """Whether a request's drafts may be verified at all (the rest is decided per step)."""
    return params.speculative and not params.logit_bias


class Speculation:
    """Per-row speculation state of one scheduler, as arrays indexed by row, and its counts. The
    scheduler tells it what each step scheduled (`scheduled`) and what each verified (`verified`)."""

    def __init__(self, config: SpeculativeConfig, max_num_seqs: int, max_model_len: int) -> None:
        self.k = config.num_speculative_tokens
        self.max_batch = config.disable_by_batch_size
        self.max_model_len = max_model_len
        self.allowed = np.zeros(max_num_seqs, np.bool_)
        self.drafts_in_flight = np.zeros(max_num_seqs, np.int64)  # drafts of steps not yet processed
        self.accepted = np.zeros(max_num_seqs)  # running mean of accepted drafts per verification
        self.misses = np.zeros(max_num_seqs, np.int64)  # verifications in a row below the bar
        self.cooldown = np.zeros(max_num_seqs, np.int64)  # decode steps to go without drafts
        self.bar = 0.0  # accepted drafts a verification needs to pay, at the last step's batch
        self.counts = SpeculativeCounts()

    def assign(self, row: int, params: SamplingParams) -> None:
        self.allowed[row] = allows_speculation(params)
        self.drafts_in_flight[row] = self.misses[row] = self.cooldown[row] = 0
        self.accepted[row] = self.k / 2  # hopeful until its drafts say otherwise

    def choose(self, rows: np.ndarray, is_decode: np.ndarray, num_new: np.ndarray, num_computed: np.ndarray,
               num_outputs: np.ndarray, min_tokens: np.ndarray, budget: int) -> np.ndarray:
        """Drafts (0 or K) for each of the running `rows` this step. `is_decode` rows that got their
        one token (`num_new`) may speculate; num_computed and num_outputs are before this step;
        `budget` is the step's token budget left once every decode row has its token."""
        batch = int(is_decode.sum())
        if batch > self.max_batch:
            return np.zeros(len(rows), np.int64)
        self.bar = self.k * batch / (FREE_TOKENS + batch)
        decoding = is_decode & (num_new == 1)
        paying = self.accepted[rows] >= self.bar
        cooling = decoding & ~paying & (self.cooldown[rows] > 0)
        self.cooldown[rows[cooling]] -= 1
        eligible = (decoding & ~cooling & self.allowed[rows] & (num_outputs >= min_tokens)
                    & (num_computed + self.k + 1 < self.max_model_len))
        drafts = np.where(eligible, self.k, 0)
        fits = np.cumsum(drafts) <= max(budget, 0)
        return np.where(fits, drafts, 0)

    def scheduled(self, rows: np.ndarray, drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A plan of `rows` verifying `drafts` each: its num_draft_tokens (int32) and lagged rows
        (whose previous speculative step is still unprocessed)."""
        lagged = self.drafts_in_flight[rows] > 0
        self.drafts_in_flight[rows] += drafts
        return drafts.astype(np.int32), lagged

    def verified(self, rows: np.ndarray, drafts: np.ndarray, accepted: np.ndarray) -> None:
        """A processed step: `rows` verified `drafts` each and had `accepted` of them accepted
        (rows with no drafts count nothing). Count them; rows whose drafts do not pay back off."""
        self.drafts_in_flight[rows] -= drafts
        speculated = drafts > 0
        rows, accepted = rows[speculated], accepted[speculated]
        counts = self.counts
        counts.num_draft_tokens += int(drafts.sum())
        counts.num_accepted_tokens += int(accepted.sum())
        counts.num_verifications += int(speculated.sum())
        mean = self.accepted[rows] = (1 - MEAN_WEIGHT) * self.accepted[rows] + MEAN_WEIGHT * accepted
        paying = mean >= self.bar
        self.misses[rows] = np.where(paying, 0, self.misses[rows] + 1)
        self.cooldown[rows] = np.where(paying, 0,
                                       np.minimum((1 << 2 * np.minimum(self.misses[rows], 8)) - 1, MAX_COOLDOWN))
