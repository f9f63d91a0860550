"""A row whose drafts keep being rejected verifies fewer and fewer of them; one hit resets it."""
from __future__ import annotations

import numpy as np

from stages.contracts.params import SamplingParams
from stages.contracts.speculative import SpeculativeConfig
from stages.scheduler.speculation import MAX_COOLDOWN, Speculation


def _choose(spec: Speculation, rows: np.ndarray) -> np.ndarray:
    n = len(rows)
    ones = np.ones(n, np.int64)
    return spec.choose(rows, np.ones(n, bool), ones, np.full(n, 10), np.full(n, 5), np.zeros(n, np.int64), 1000)


def test_rejected_rows_back_off_exponentially_and_a_hit_resets_them() -> None:
    spec = Speculation(SpeculativeConfig("ngram", 3), max_num_seqs=2, max_model_len=100)
    rows = np.array([0, 1])
    for row in rows:
        spec.assign(int(row), SamplingParams())
    skipped = []
    for _ in range(6):  # row 0 misses every time; row 1 always has a draft accepted
        drafts = _choose(spec, rows)
        assert drafts[1] == 3
        if drafts[0]:
            spec.verified(np.array([0, 1]), np.array([0, 2]))
            skipped.append(0)
        else:
            skipped[-1] += 1
            spec.verified(np.array([1]), np.array([2]))
    assert skipped[:2] == [1, 3]  # 2^n - 1 decode steps without drafts after n misses in a row
    while not _choose(spec, rows)[0]:
        pass
    spec.verified(np.array([0]), np.array([1]))
    assert _choose(spec, rows)[0] == 3  # the hit ended the back-off
    spec.misses[0] = 40
    spec.verified(np.array([0]), np.array([0]))
    assert spec.cooldown[0] == MAX_COOLDOWN


def test_a_large_batch_and_requests_that_opt_out_get_no_drafts() -> None:
    spec = Speculation(SpeculativeConfig("ngram", 2, disable_by_batch_size=2), max_num_seqs=3, max_model_len=100)
    spec.assign(0, SamplingParams())
    spec.assign(1, SamplingParams(speculative=False))
    spec.assign(2, SamplingParams(regex="[ab]+"))
    assert _choose(spec, np.array([0, 1, 2])).tolist() == [0, 0, 0]  # three decoding rows > 2
    assert _choose(spec, np.array([0, 1])).tolist() == [2, 0]
    assert _choose(spec, np.array([2])).tolist() == [0]
