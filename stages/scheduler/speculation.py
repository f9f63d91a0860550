"""The scheduler's side of speculative decoding: which rows verify drafts, how many, and reading their results.

A decoding row that speculates computes its last token plus k drafts in one step (the runner
proposes the drafts on the device) and yields up to k + 1 tokens. Under async scheduling the
next plan is made before that step's tokens are known, so the row is planned as if every
draft were accepted: `num_computed` advances by k + 1 and k + 1 placeholders are counted. When
the step's tokens arrive, `num_computed` is rolled back by the drafts that were rejected; the
plan made in between is `lagged` for that row and the runner corrects its positions itself.

A row may draft only when nothing makes its output depend on host-side state a draft would
bypass: the request allows it (`SamplingParams.speculative`), has no logit_bias, has its
min_tokens behind it, and its drafts fit in max_model_len (a grammar row drafts: the runner checks
its drafts against its grammar, sampling/constraints.py). A step with more rows that could draft
than the config's `disable_by_batch_size` (if it sets one) verifies none.

Drafts must also pay for themselves, on the device in use. A step of N tokens costs about
c0 + c1 * N: reading the weights (c0) does not grow with the tokens, the arithmetic (c1 per
token) does. The runner measures both at start-up (ModelLimits.verify_free_tokens = c0 / c1,
F below), at a few batch sizes (a CPU's step is bound by memory at one row and by arithmetic at
many), and the scheduler takes F at the step's batch, interpolated between them. With B rows
that can draft in the step, a draft token adds c1 to a step that yields about B tokens in
c0 + c1 * B, so it pays when the chance it is accepted exceeds B / (F + B).
A draft model also decodes each draft: one decode step per draft position over the rows that
draft, costing (e0 + e1 * B) c1 as the runner measured it (ModelLimits.draft_step_tokens), a
row's share e0 / B + e1. Its drafts pay when their chance exceeds (B + e0 + e1 * B) / (F + B),
never where that is 1 or more (a draft model as slow as the target).
Each row keeps a running estimate of the chance that one of its drafts is accepted, a (accepted
drafts over drafts read up to the first rejection); its j-th draft is accepted with chance a^j,
so the row drafts the k <= K drafts with a^k above the bar, and rows verify different numbers.

N-gram and suffix drafts are copies of text the host knows, so the host judges them. With n-gram
drafts a row whose last tokens have no earlier occurrence at all drafts none (no match). With
suffix drafts the scheduler keeps the runner's tries (stages/suffix_tree.py) over the tokens it
knows and plans a row no more drafts than they propose, none where nothing good matches (no
match); under async scheduling the tokens of the step in flight are not known yet, so the tries
are asked for drafts that far ahead.

A row drafting none for its rate backs off. Where the host judges the drafts it checks each step
whether the row is copying again (its last tokens occurred before in its text; for suffix, its
tries propose several drafts), and if so lets it draft at once.
A new row, and a row revived so, starts from the rate that first verifications of such rows have
had (a running mean over all rows, from HOPEFUL_RATE): where that rate cannot pay at the step's
batch (open chat at many rows, whose chance copies are rarely accepted) they do not draft, and
the copy checks are skipped. The prior drifts back towards HOPEFUL_RATE (PRIOR_DRIFT of the gap
a step), so a workload that starts copying is tried again. A draft model cannot be judged on
the host: a backed-off row verifies one draft after a cooldown that grows 4x with each miss, at
most MAX_COOLDOWN steps, and only once its previous probe was verified.
SpeculativeCounts counts the decoding rows that drafted nothing, by reason.
"""
from __future__ import annotations

import numpy as np

from stages.contracts.params import SamplingParams
from stages.contracts.counters import SpeculativeCounts
from stages.contracts.speculative import SpeculativeConfig
from stages.suffix_tree import SuffixDrafter

MAX_COOLDOWN = 31  # decode steps a backed-off row of a proposer the host cannot judge waits at most
MEAN_WEIGHT = 0.3  # of the latest verification in a row's running rate: one lucky run does not reset it
HOPEFUL_RATE = 0.8  # the acceptance rate a row starts from, and returns to when it is seen copying
MIN_COPY = 3  # tokens that must recur together before a backed-off n-gram row drafts again
PRIOR_WEIGHT = 0.2  # of one first verification in the prior of new and revived rows
PRIOR_DRIFT = 0.002  # of the gap to HOPEFUL_RATE the prior closes each step


def allows_speculation(params: SamplingParams) -> bool:
    """Whether a request's drafts may be verified at all (the rest is decided per step)."""
    return params.speculative and not params.logit_bias


def recurs(tokens: np.ndarray, n: int) -> bool:
    """Whether the last n of `tokens` occurred earlier, followed by at least one token."""
    length = tokens.shape[0]
    if length <= n:
        return False
    suffix = tokens[length - n:]
    starts = np.flatnonzero(tokens[:length - n] == suffix[0])
    for i in range(1, n):
        starts = starts[tokens[starts + i] == suffix[i]]
    return starts.shape[0] > 0


class Speculation:
    """Per-row speculation state of one scheduler, as arrays indexed by row, and its counts. The
    scheduler tells it what each step scheduled (`scheduled`) and what each verified (`verified`).
    `free_tokens`: the runner's measured c0 / c1 (None: not measured, drafts are taken as free);
    `draft_step`: a draft model's decode step over n rows, (e0, e1) in c1; `by_batch`: both fitted
    at a few batch sizes, (rows, F, e0, e1) (ModelLimits.verify_costs_by_batch), used instead where given."""

    def __init__(self, config: SpeculativeConfig, max_num_seqs: int, max_model_len: int,
                 free_tokens: float | None = None, draft_step: tuple[float, float] = (0.0, 0.0),
                 by_batch: tuple[tuple[float, float, float, float], ...] = ()) -> None:
        self.k = config.num_speculative_tokens
        self.max_batch = config.disable_by_batch_size
        self.max_model_len = max_model_len
        self.free_tokens = free_tokens
        # (rows, F, e0, e1) fitted at a few batch sizes, fewest rows first (one fit holds for every
        # batch): F, e0 and e1 at a batch in between are interpolated on log(rows), held beyond the ends.
        fits = by_batch or ((1, free_tokens, *draft_step),)
        self.by_batch = np.asarray(fits if free_tokens is not None else (), np.float64).reshape(-1, 4)
        # n-gram drafts are copies of the row's own text: whether it has any is known on the host.
        self.lookup = config.prompt_lookup_min if config.method == "ngram" else 0
        self.copy_length = max(MIN_COPY, self.lookup + 1)
        # suffix drafts: the host keeps the runner's tries over the tokens it knows.
        self.suffix = SuffixDrafter(config) if config.method == "suffix" else None
        self.judged = bool(self.lookup) or self.suffix is not None  # whether the host judges the drafts
        self.allowed = np.zeros(max_num_seqs, np.bool_)
        self.guided = np.zeros(max_num_seqs, np.bool_)  # would draft, but its logit_bias forbids it
        self.drafts_in_flight = np.zeros(max_num_seqs, np.int64)  # drafts of steps not yet processed
        self.hits = np.zeros(max_num_seqs)  # running sums: accepted drafts, and drafts read
        self.trials = np.zeros(max_num_seqs)
        self.misses = np.zeros(max_num_seqs, np.int64)  # verifications in a row that did not pay
        self.cooldown = np.zeros(max_num_seqs, np.int64)  # decode steps to go before a probe
        self.revived_at = np.zeros(max_num_seqs, np.int64)  # num_known when a copy last revived the row
        self.fresh = np.zeros(max_num_seqs, np.bool_)  # new or revived: its next verification informs the prior
        self.prior = np.array([HOPEFUL_RATE, 1.0])  # running sums (hits, trials) of first verifications
        self.bar = 0.0  # the chance of acceptance a draft needs to pay, at the last step's batch
        self.counts = SpeculativeCounts()

    def assign(self, row: int, params: SamplingParams) -> None:
        self.allowed[row] = allows_speculation(params)
        self.guided[row] = params.speculative and not self.allowed[row]
        self.drafts_in_flight[row] = self.misses[row] = self.cooldown[row] = self.revived_at[row] = 0
        self._start_from_prior(row)  # until its own drafts say otherwise
        if self.suffix is not None:
            self.suffix.forget(row)

    def release(self, row: int, tokens: np.ndarray, num_prompt: int) -> None:
        """The row's request leaves with `tokens` (prompt, then outputs): suffix decoding caches its outputs."""
        if self.suffix is not None:
            self.suffix.leave(row, tokens[num_prompt:])

    def choose(self, rows: np.ndarray, is_decode: np.ndarray, num_new: np.ndarray, num_computed: np.ndarray,
               num_outputs: np.ndarray, min_tokens: np.ndarray, budget: int, token_ids: np.ndarray,
               num_known: np.ndarray) -> np.ndarray:
        """Drafts (0..K) for each of the running `rows` this step. `is_decode` rows that got their
        one token (`num_new`) may speculate; num_computed and num_outputs are before this step;
        `budget` is the step's token budget left once every decode row has its token; token_ids
        [max_num_seqs, L] holds each row's first num_known (of `rows`) tokens."""
        decoding = is_decode & (num_new == 1)
        counts = self.counts
        counts.num_rows_off_logit_bias += int((decoding & self.guided[rows]).sum())
        capable = decoding & self.allowed[rows] & (num_outputs >= min_tokens)
        batch = int(capable.sum())
        if self.max_batch is not None and batch > self.max_batch:
            counts.num_rows_off_batch += batch
            return np.zeros(len(rows), np.int64)
        if not batch:
            return np.zeros(len(rows), np.int64)
        self.bar = self._bar(batch)
        self.prior[0] += PRIOR_DRIFT * (HOPEFUL_RATE * self.prior[1] - self.prior[0])
        num_prompt = num_known - num_outputs
        if self.judged and self.prior_rate > self.bar:  # a revived row could draft at this batch
            self._revive(rows, capable, token_ids, num_known, num_prompt)
        rate = self.hits[rows] / self.trials[rows]
        drafts = _lengths(rate, self.bar, self.k)
        alone = _lengths(rate, self._alone_bar, self.k)
        off = capable & (drafts == 0)
        counts.num_rows_off_batch += int((off & (alone > 0)).sum())
        backed_off = off & (alone == 0)
        # probes: a backed-off row verifies one draft once its cooldown is over (where one can pay at all)
        if not self.judged and self._alone_bar < 1:
            cooling = backed_off & (self.cooldown[rows] > 0)
            self.cooldown[rows[cooling]] -= 1
            # and once its last probe was verified: under async scheduling the plan after a probe is
            # made before the probe's result, which would otherwise find the cooldown still over
            waiting = backed_off & (self.drafts_in_flight[rows] > 0)
            drafts = np.where(backed_off & ~cooling & ~waiting, 1, drafts)
        counts.num_rows_off_backoff += int((backed_off & (drafts == 0)).sum())
        drafts = np.where(capable, np.minimum(drafts, self.max_model_len - 1 - num_computed - 1), 0).clip(0)
        if self.judged:
            # tokens the step in flight computes past the known ones, for suffix drafts that far ahead
            ahead = num_computed + 1 - num_known
            for i in np.flatnonzero(drafts).tolist():
                row, known = rows[i], num_known[i]
                if self.suffix is None:
                    found = drafts[i] if recurs(token_ids[row, :known], self.lookup) else 0
                else:
                    tree = self.suffix.grow(row, token_ids[row, :known], num_prompt[i])
                    found = len(self.suffix.draft(tree, drafts[i], int(ahead[i])))
                counts.num_rows_off_no_match += int(found == 0)
                drafts[i] = found
        fits = np.cumsum(drafts) <= max(budget, 0)
        return np.where(fits, drafts, 0)

    def _bar(self, batch: int) -> float:
        """The chance of acceptance a draft needs to pay in a step of `batch` rows that can draft."""
        if self.free_tokens is None:
            return 0.0
        at, rows = np.log(batch), np.log(self.by_batch[:, 0])
        free, fixed, per_row = (float(np.interp(at, rows, self.by_batch[:, i])) for i in (1, 2, 3))
        return (batch + fixed + per_row * batch) / (free + batch)

    @property
    def _alone_bar(self) -> float:
        """The bar of a row drafting alone: below it, a row backs off whatever the batch."""
        return self._bar(1)

    def _revive(self, rows: np.ndarray, capable: np.ndarray, token_ids: np.ndarray, num_known: np.ndarray,
                num_prompt: np.ndarray) -> None:
        """Backed-off rows seen copying draft again at once: their last copy_length tokens occurred
        before (n-gram), their tries propose that many drafts (suffix). A row revived for nothing
        waits copy_length more known tokens per miss since."""
        low = capable & (_lengths(self.hits[rows] / self.trials[rows], self._alone_bar, self.k) == 0)
        for i in np.flatnonzero(low).tolist():
            row, known = rows[i], int(num_known[i])
            spacing = self.copy_length * (1 + int(self.misses[row]))
            if known - self.revived_at[row] >= spacing and self._copying(row, token_ids[row, :known], num_prompt[i]):
                self.revived_at[row] = known
                self._start_from_prior(row)
                self.counts.num_revivals += 1

    @property
    def prior_rate(self) -> float:
        """The chance that a new or revived row's draft is accepted, as first verifications had it."""
        return float(self.prior[0] / self.prior[1])

    def _start_from_prior(self, row: int) -> None:
        self.hits[row], self.trials[row] = self.prior_rate, 1.0
        self.fresh[row] = True

    def _copying(self, row: int, tokens: np.ndarray, num_prompt: int) -> bool:
        if self.suffix is None:
            return recurs(tokens, self.copy_length)
        want = min(self.copy_length, self.k)
        return len(self.suffix.draft(self.suffix.grow(row, tokens, num_prompt), want)) >= want

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
        # drafts read: up to and including the first rejected one
        read = accepted + (accepted < drafts[speculated])
        self.hits[rows] = (1 - MEAN_WEIGHT) * self.hits[rows] + accepted
        self.trials[rows] = (1 - MEAN_WEIGHT) * self.trials[rows] + read
        self._learn_prior(rows, accepted, read)
        paying = self.hits[rows] / self.trials[rows] > self.bar
        self.misses[rows] = np.where(paying, 0, self.misses[rows] + 1)
        self.cooldown[rows] = np.where(paying, 0,
                                       np.minimum((1 << 2 * np.minimum(self.misses[rows], 8)) - 1, MAX_COOLDOWN))


    def _learn_prior(self, rows: np.ndarray, accepted: np.ndarray, read: np.ndarray) -> None:
        """First verifications of new or revived `rows` move the prior."""
        first = self.fresh[rows]
        self.fresh[rows] = False
        for hits, trials in zip(accepted[first].tolist(), read[first].tolist()):
            self.prior = (1 - PRIOR_WEIGHT) * self.prior + (hits, trials)


def _lengths(rate: np.ndarray, bar: float, k: int) -> np.ndarray:
    """How many drafts each row's acceptance `rate` pays for: the j <= k with rate^j above `bar`."""
    return (rate[:, None] ** np.arange(1, k + 1) > bar).sum(axis=1)
