"""Drafts must pay for themselves: each row drafts as many as its acceptance rate pays for at the
step's batch and the device's measured cost, rows with nothing to copy draft none, backed-off
rows that start copying draft again within a few steps, and /metrics learns why rows did not draft."""
from __future__ import annotations

import numpy as np
import pytest

from stages.contracts.params import SamplingParams
from stages.contracts.speculative import SpeculativeConfig
from stages.scheduler.speculation import HOPEFUL_RATE, MAX_COOLDOWN, PRIOR_DRIFT, Speculation, recurs

REPEATING = np.array([5, 6, 7, 8] * 10, np.int32)  # every suffix occurred before
FRESH = np.arange(100, 140, dtype=np.int32)  # no token occurred before


def _speculation(num_rows: int, k: int = 4, method: str = "ngram", free_tokens: float | None = 6.0,
                 **config) -> Speculation:
    spec = Speculation(SpeculativeConfig(method, k, **config), max_num_seqs=num_rows, max_model_len=100,
                       free_tokens=free_tokens)
    for row in range(num_rows):
        spec.assign(row, SamplingParams())
    return spec


def _table(*texts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    table = np.zeros((len(texts), 100), np.int32)
    for row, text in enumerate(texts):
        table[row, :len(text)] = text
    return table, np.array([len(t) for t in texts])


def _choose(spec: Speculation, rows: np.ndarray, table: np.ndarray, known: np.ndarray) -> np.ndarray:
    n = len(rows)
    ones = np.ones(n, np.int64)
    return spec.choose(rows, np.ones(n, bool), ones, known[rows], np.full(n, 5), np.zeros(n, np.int64), 1000,
                       table, known[rows])


def test_host_side_lookup_finds_earlier_occurrences_only() -> None:
    assert recurs(np.array([1, 2, 3, 1, 2]), 2)
    assert not recurs(np.array([1, 2, 3, 2, 1]), 2)
    assert not recurs(np.array([1, 2]), 2)
    assert recurs(np.array([4, 4]), 1)  # followed by the last token itself


def test_rows_draft_as_many_as_their_rate_pays_for_and_the_bar_rises_with_the_batch() -> None:
    """a^j > B / (F + B): at F = 6 a row accepting 85% drafts all four alone and one in a batch of
    16; one accepting 50% drafts two alone and none in the batch of 16."""
    spec = _speculation(16)
    table, known = _table(*[REPEATING] * 16)
    spec.hits[:], spec.trials[:] = 0.85, 1.0
    spec.hits[1] = 0.5
    assert _choose(spec, np.array([0]), table, known).tolist() == [4]  # bar 1/7
    assert _choose(spec, np.array([1]), table, known).tolist() == [2]
    drafts = _choose(spec, np.arange(16), table, known)  # bar 16/22 = 0.727: 0.85^2 = 0.7225 is below it
    assert drafts[0] == 1 and drafts[1] == 0
    assert spec.counts.num_rows_off_batch == 1  # row 1 would draft alone: the batch made it too dear


def test_unmeasured_cost_or_a_gpu_like_one_lets_every_row_draft() -> None:
    for free_tokens in (None, 500.0):
        spec = _speculation(16, free_tokens=free_tokens)
        spec.hits[:], spec.trials[:] = 0.5, 1.0
        table, known = _table(*[REPEATING] * 16)
        assert (_choose(spec, np.arange(16), table, known) >= 3).all()


def test_a_row_with_nothing_to_copy_drafts_none() -> None:
    spec = _speculation(2, prompt_lookup_min=2, prompt_lookup_max=3)
    table, known = _table(REPEATING, FRESH)
    assert _choose(spec, np.array([0, 1]), table, known).tolist() == [4, 0]
    assert spec.counts.num_rows_off_no_match == 1


def test_a_backed_off_ngram_row_drafts_again_within_a_few_steps_of_copying() -> None:
    spec = _speculation(1, prompt_lookup_min=1)
    rows = np.array([0])
    table, known = _table(FRESH[:20])
    table[0, 19] = table[0, 3]  # one token matches: enough to draft, not a copy
    for _ in range(6):  # its drafts are rejected
        drafts = _choose(spec, rows, table, known)
        if drafts[0]:
            spec.scheduled(rows, drafts)
            spec.verified(rows, drafts, np.array([0]))
    assert _choose(spec, rows, table, known).tolist() == [0]
    assert spec.counts.num_rows_off_backoff > 0
    # The text starts copying an earlier passage: three tokens in, the row drafts again.
    steps = 0
    while not _choose(spec, rows, table, known)[0]:
        table[0, known[0]] = table[0, 4 + steps]
        known[0] += 1
        steps += 1
    assert steps <= 3 and spec.counts.num_revivals == 1


def test_a_backed_off_draft_model_row_probes_with_one_draft_after_a_growing_cooldown() -> None:
    spec = _speculation(1, method="draft_model", model="draft")
    rows = np.array([0])
    table, known = _table(FRESH)
    gaps, gap = [], 0
    for _ in range(120):
        drafts = _choose(spec, rows, table, known)
        if drafts[0]:
            gaps.append((gap, int(drafts[0])))
            gap = 0
            spec.scheduled(rows, drafts)
            spec.verified(rows, drafts, np.array([0]))
        else:
            gap += 1
    # hopeful at first (all four, then fewer as its rate falls), then single probes 3, 15, 31 steps apart
    probes = [g for g, n in gaps if n == 1]
    assert gaps[0] == (0, 4) and {3, 15} <= set(probes) and probes[-2:] == [MAX_COOLDOWN, MAX_COOLDOWN]


def test_rows_that_cannot_draft_neither_draft_nor_count_toward_the_batch() -> None:
    spec = _speculation(4, disable_by_batch_size=2)
    spec.assign(1, SamplingParams(speculative=False))
    spec.assign(2, SamplingParams(logit_bias={5: 1.0}))
    spec.assign(3, SamplingParams(regex="[ab]+"))  # a grammar row drafts: the runner checks its drafts
    table, known = _table(*[REPEATING] * 4)
    # Rows 0 and 3 can draft: two, not more than disable_by_batch_size.
    assert _choose(spec, np.arange(4), table, known).tolist() == [4, 0, 0, 4]
    assert spec.counts.num_rows_off_logit_bias == 1
    spec.assign(1, SamplingParams())
    assert _choose(spec, np.arange(4), table, known).tolist() == [0, 0, 0, 0]  # three now: over the limit
    assert spec.counts.num_rows_off_batch == 3


def test_under_async_scheduling_a_probe_is_verified_once() -> None:
    """The plan after a probe is made before the probe's result: it must not probe again."""
    spec = _speculation(1, method="draft_model", model="draft")
    rows = np.array([0])
    table, known = _table(FRESH)
    in_flight: list[np.ndarray] = []  # the previous step's drafts, verified after the next is planned
    drafted = []
    for _ in range(120):
        drafts = _choose(spec, rows, table, known)
        spec.scheduled(rows, drafts)
        if in_flight:
            spec.verified(rows, in_flight.pop(), np.array([0]))
        in_flight.append(drafts)
        drafted.append(int(drafts[0]))
    backed_off = drafted.index(0)  # hopeful drafts first (4, 4, then fewer), then probes alone
    probes = [step for step, n in enumerate(drafted) if n and step > backed_off]
    assert all(drafted[step] == 1 and drafted[step + 1] == 0 for step in probes[:-1])
    # each probe waits for the previous one's result, then for its cooldown (ever longer, at most MAX_COOLDOWN)
    gaps = np.diff(probes).tolist()
    assert len(probes) >= 4 and gaps == sorted(gaps) and gaps[-1] == MAX_COOLDOWN + 2
    assert spec.counts.num_verifications == sum(1 for n in drafted[:-1] if n)  # the last step is in flight


def _choose_ahead(spec: Speculation, table: np.ndarray, known: int, ahead: int, num_prompt: int = 0) -> int:
    """Drafts of row 0 with `ahead` tokens of the step in flight not known yet."""
    one = np.ones(1, np.int64)
    return int(spec.choose(np.array([0]), np.ones(1, bool), one, np.array([known - 1 + ahead]),
                           np.array([known - num_prompt]), np.zeros(1, np.int64), 1000, table,
                           np.array([known]))[0])


def test_a_suffix_row_drafts_what_its_tries_propose_and_none_without_a_match() -> None:
    spec = _speculation(1, method="suffix", free_tokens=None)
    table, known = _table(FRESH)
    assert _choose_ahead(spec, table, int(known[0]), 0) == 0
    assert spec.counts.num_rows_off_no_match == 1
    # "7 8" occurred before, followed by 9 1 2 7 8: a match of two tokens proposes two drafts
    table, _ = _table(np.array([7, 8, 9, 1, 2, 7, 8]))
    assert _choose_ahead(spec, table, 7, 0) == 2
    # with tokens in flight the tries are read that far ahead: what is left of the copy after them
    assert [_choose_ahead(spec, table, 7, ahead) for ahead in (4, 5)] == [1, 0]
    assert spec.counts.num_rows_off_no_match == 2


def test_a_suffix_row_finds_what_earlier_requests_wrote() -> None:
    spec = _speculation(1, method="suffix", free_tokens=None)
    answer = np.arange(200, 230)
    spec.release(0, np.concatenate([FRESH[:5], answer]), num_prompt=5)  # a request leaves with its answer
    spec.assign(0, SamplingParams())
    text = np.concatenate([FRESH[10:15], answer[:6]])  # a new one starts the same answer
    table, _ = _table(text)
    assert _choose_ahead(spec, table, len(text), 0, num_prompt=5) == 4
    assert spec.counts.num_rows_off_no_match == 0


def test_a_draft_models_decoding_counts_in_what_its_drafts_cost() -> None:
    """F = 20. A draft step over n rows costing 8 + 0.5 n target tokens: alone, a row drafts while
    a^j > (1 + 8 + 0.5) / 21 = 0.452 (two drafts at a = 0.7, not four); at 16 rows the bar is
    (16 + 8 + 8) / 36 = 0.889 and no row drafts; a draft as dear as the target never drafts, nor probes."""
    free = _speculation(16, method="draft_model", model="draft", free_tokens=20.0)
    dear = Speculation(SpeculativeConfig("draft_model", 4, model="draft"), max_num_seqs=16, max_model_len=100,
                       free_tokens=20.0, draft_step=(8.0, 0.5))
    for spec in (free, dear):
        for row in range(16):
            spec.assign(row, SamplingParams())
        spec.hits[:], spec.trials[:] = 0.7, 1.0
    table, known = _table(*[FRESH] * 16)
    assert _choose(free, np.array([0]), table, known).tolist() == [4]
    assert _choose(dear, np.array([0]), table, known).tolist() == [2]
    assert (_choose(free, np.arange(16), table, known) == 2).all()
    assert (_choose(dear, np.arange(16), table, known) == 0).all() and dear.counts.num_rows_off_batch == 16
    same = Speculation(SpeculativeConfig("draft_model", 4, model="draft"), max_num_seqs=1, max_model_len=100,
                       free_tokens=20.0, draft_step=(20.0, 1.0))  # the target drafting for itself
    same.assign(0, SamplingParams())
    assert sum(int(_choose(same, np.array([0]), table, known)[0]) for _ in range(100)) == 0
    assert same.counts.num_rows_off_backoff == 100


def test_the_bar_follows_the_cost_measured_at_the_steps_batch() -> None:
    """F fitted at 1, 4 and 16 rows (80, 20, 6; a step bound by memory at one row, by arithmetic at
    many): one row drafts while a^j > 1 / 81, four rows while a^j > 4 / 24, and two rows take F
    between the fits at 1 and 4 (on log rows: 40 at 2 rows); beyond 16 rows F stays 6."""
    spec = Speculation(SpeculativeConfig("ngram", 4), max_num_seqs=64, max_model_len=100, free_tokens=6.0,
                       by_batch=((1, 80.0, 0.0, 0.0), (4, 20.0, 0.0, 0.0), (16, 6.0, 0.0, 0.0)))
    assert spec._bar(1) == pytest.approx(1 / 81)
    assert spec._bar(4) == pytest.approx(4 / 24)
    assert spec._bar(2) == pytest.approx(2 / (50 + 2))
    assert spec._bar(16) == pytest.approx(16 / 22) and spec._bar(64) == pytest.approx(64 / 70)
    assert Speculation(SpeculativeConfig("ngram", 4), max_num_seqs=64, max_model_len=100,
                       by_batch=((1, 80.0, 0.0, 0.0),))._bar(1) == 0.0  # not measured: drafts are free


def _first_verifications(spec: Speculation, rows: np.ndarray, table: np.ndarray, known: np.ndarray,
                         accepted: int | None) -> None:
    """Each of `rows` starts afresh, drafts, and has `accepted` of its drafts accepted (None: all)."""
    for row in rows.tolist():
        spec.assign(row, SamplingParams())
    drafts = _choose(spec, rows, table, known)
    assert (drafts > 0).all()
    spec.scheduled(rows, drafts)
    spec.verified(rows, drafts, drafts if accepted is None else np.full(len(rows), accepted))


def test_new_rows_start_from_what_first_verifications_had_and_draft_only_where_that_pays() -> None:
    """At F = 6 a hopeful row (0.8) drafts one at 16 rows (bar 16/22 = 0.73). After first drafts
    that were all rejected, new rows start from the learned rate: none at 16 rows, and the copy
    checks that could only revive them at that rate are skipped; alone (bar 1/7) they still draft."""
    spec = _speculation(16)
    table, known = _table(*[REPEATING] * 16)
    assert spec.prior_rate == HOPEFUL_RATE
    assert (_choose(spec, np.arange(16), table, known) == 1).all()
    _first_verifications(spec, np.arange(1), table, known, accepted=0)  # one bad first verification
    rate = spec.prior_rate
    assert rate < HOPEFUL_RATE
    _first_verifications(spec, np.arange(1, 2), table, known, accepted=0)
    assert spec.prior_rate < rate < spec._bar(16)
    for row in range(16):
        spec.assign(row, SamplingParams())
    assert spec.hits[5] / spec.trials[5] == pytest.approx(spec.prior_rate)
    revivals = spec.counts.num_revivals
    assert (_choose(spec, np.arange(16), table, known) == 0).all()
    assert spec.counts.num_revivals == revivals  # nothing to gain from a revival at this batch
    assert _choose(spec, np.array([0]), table, known)[0] > 0  # alone the same rate pays


def test_first_verifications_that_are_accepted_keep_new_rows_hopeful() -> None:
    spec = _speculation(16)
    table, known = _table(*[REPEATING] * 16)
    _first_verifications(spec, np.arange(8), table, known, accepted=None)  # every draft accepted
    assert spec.prior_rate > HOPEFUL_RATE
    for row in range(16):
        spec.assign(row, SamplingParams())
    assert (_choose(spec, np.arange(16), table, known) >= 1).all()


def test_the_prior_drifts_back_to_hopeful_so_a_workload_that_starts_copying_is_tried_again() -> None:
    spec = _speculation(16)
    table, known = _table(*[REPEATING] * 16)
    _first_verifications(spec, np.arange(16), table, known, accepted=0)
    low = spec.prior_rate
    for row in range(16):
        spec.assign(row, SamplingParams())
    steps = 0
    while not _choose(spec, np.arange(16), table, known).any():
        for row in range(16):  # rows come and go: each new one starts from the prior
            spec.assign(row, SamplingParams())
        steps += 1
        assert steps < 2000
    gap = np.log((HOPEFUL_RATE - low) / (HOPEFUL_RATE - spec._bar(16))) / PRIOR_DRIFT
    assert steps == pytest.approx(gap, rel=0.1)
