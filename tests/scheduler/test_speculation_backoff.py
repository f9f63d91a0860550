"""Drafts must pay for themselves: a row whose drafts are rarely accepted verifies fewer and fewer
of them, the more so in a larger batch; a row whose drafts are accepted keeps verifying them."""
from __future__ import annotations

import numpy as np

from stages.contracts.params import SamplingParams
from stages.contracts.speculative import SpeculativeConfig
from stages.scheduler.speculation import FREE_TOKENS, MAX_COOLDOWN, Speculation


def _choose(spec: Speculation, rows: np.ndarray, batch: int | None = None) -> np.ndarray:
    n = len(rows)
    decode = np.ones(n, bool) if batch is None else np.arange(n) < batch
    ones = np.ones(n, np.int64)
    return spec.choose(rows, decode, ones, np.full(n, 10), np.full(n, 5), np.zeros(n, np.int64), 1000)


def _speculation(num_rows: int, k: int = 4, **config) -> Speculation:
    spec = Speculation(SpeculativeConfig("ngram", k, **config), max_num_seqs=num_rows, max_model_len=100)
    for row in range(num_rows):
        spec.assign(row, SamplingParams())
    return spec


def test_rows_whose_drafts_do_not_pay_back_off_exponentially_and_probe_again() -> None:
    spec = _speculation(2)
    rows = np.array([0, 1])
    gaps, gap = [], 0
    for _ in range(160):  # row 0's drafts are never accepted, row 1 gets 3 of 4
        drafts = _choose(spec, rows)
        assert drafts[1] == 4
        if drafts[0]:
            gaps.append(gap)
            gap = 0
        else:
            gap += 1
        spec.scheduled(rows, drafts)
        spec.verified(rows, drafts, np.array([0, 3]))  # a row without drafts counts nothing
    # hopeful at first (a mean of K / 2), then 3, 15, 63 decode steps apart
    assert gaps[:5] == [0, 0, 3, 15, 63]
    spec.verified(np.array([0]), np.array([4]), np.array([4]))  # its text turned repetitive
    assert _choose(spec, rows)[0] == 4
    spec.misses[0], spec.accepted[0] = 40, 0.0
    spec.verified(np.array([0]), np.array([4]), np.array([0]))
    assert spec.cooldown[0] == MAX_COOLDOWN


def test_the_bar_rises_with_the_batch() -> None:
    """One accepted draft of four per verification pays in a batch of 2 rows, not in one of 16."""
    k = 4
    for batch, pays in ((2, True), (16, False)):
        assert (1.0 >= k * batch / (FREE_TOKENS + batch)) == pays
        spec = _speculation(batch, k, disable_by_batch_size=64)
        spec.accepted[:] = 1.0
        rows = np.arange(batch)
        assert (_choose(spec, rows) == k).all()  # a verification tells
        spec.verified(rows, np.full(batch, k), np.ones(batch, np.int64))
        assert (_choose(spec, rows) == k).all() == pays


def test_a_large_batch_and_requests_that_opt_out_get_no_drafts() -> None:
    spec = Speculation(SpeculativeConfig("ngram", 2, disable_by_batch_size=2), max_num_seqs=4, max_model_len=100)
    spec.assign(0, SamplingParams())
    spec.assign(1, SamplingParams(speculative=False))
    spec.assign(2, SamplingParams(logit_bias={5: 1.0}))
    spec.assign(3, SamplingParams(regex="[ab]+"))  # a grammar row drafts: the runner checks its drafts
    assert _choose(spec, np.array([0, 1, 2])).tolist() == [0, 0, 0]  # three decoding rows > 2
    assert _choose(spec, np.array([0, 1])).tolist() == [2, 0]
    assert _choose(spec, np.array([2, 3])).tolist() == [0, 2]
