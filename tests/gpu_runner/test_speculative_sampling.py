"""Verification of drafts keeps the target distribution, and prompt lookup proposes what it should."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stages.contracts.params import SamplingParams
from stages.gpu_runner.sampling.metadata import SamplingMetadata
from stages.gpu_runner.sampling.sampler import Sampler
from stages.gpu_runner.speculative.ngram import NgramProposer
from stages.gpu_runner.speculative.rejection import verify

VOCAB = 7
LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3, -0.5],
                       [0.1, -0.4, 1.5, 0.9, 0.0, -2.0, 0.7],
                       [1.2, 0.3, -0.3, 0.8, 0.2, 0.0, -1.0]])  # positions 0..K of every row
NUM_SAMPLES = 20_000


def _meta(params: SamplingParams, n: int, output_pos: np.ndarray | None = None) -> SamplingMetadata:
    table = torch.zeros(1, 16, dtype=torch.int32)
    output_pos = np.zeros(n, np.int64) if output_pos is None else output_pos
    return SamplingMetadata.build([params] * n, output_pos, np.zeros(n, np.int64), np.full(n, 4, np.int64),
                                  np.zeros(n, np.int64), table, [], torch.device("cpu"))


def _target(params: SamplingParams, position: int) -> np.ndarray:
    logits = LOGITS[position] / (params.temperature or 1.0)
    if params.top_k > 0:
        kth = logits.topk(params.top_k).values[-1]
        logits = torch.where(logits < kth, float("-inf"), logits)
    return logits.softmax(-1).numpy().astype(np.float64)


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Survival function of Pearson's statistic; the cells with probability 0 must be empty."""
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was drawn"
    expected = counts.sum() * probs[support]
    x = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    if df % 2:  # one more cell keeps the closed form for even degrees of freedom; bound it from above
        df += 1
    half = x / 2
    return math.exp(-half) * sum(half ** i / math.factorial(i) for i in range(df // 2))


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3)],
                         ids=["plain", "temperature-top-k"])
def test_wrong_drafts_still_give_the_target_distribution(params: SamplingParams) -> None:
    k = LOGITS.shape[0] - 1
    drafts = torch.tensor([[4, 3]] * NUM_SAMPLES)  # token 4 is unlikely (or outside top-k) at position 0
    logits = LOGITS.repeat(NUM_SAMPLES, 1)
    sampler = Sampler(torch.Generator().manual_seed(0))
    tokens, accepted = verify(logits, drafts, _meta(params, NUM_SAMPLES * (k + 1)), sampler)
    tokens = tokens.numpy()
    first = np.bincount(tokens[:, 0], minlength=VOCAB)
    assert _chi_square_p(first, _target(params, 0)) > 0.001
    # A run goes on past draft 1 only when it is accepted; then its next token follows position 1.
    assert np.array_equal(accepted.numpy() >= 1, tokens[:, 0] == 4)
    assert np.all((tokens[:, 1] >= 0) == (accepted.numpy() >= 1))

    drafts = torch.tensor([[0, 3]] * NUM_SAMPLES)  # token 0 is the likeliest: many runs continue
    tokens, accepted = verify(logits, drafts, _meta(params, NUM_SAMPLES * (k + 1)), sampler)
    tokens = tokens.numpy()
    continued = tokens[accepted.numpy() >= 1]
    assert len(continued) > 2000
    second = np.bincount(continued[:, 1], minlength=VOCAB)
    assert _chi_square_p(second, _target(params, 1)) > 0.001
    assert np.all(tokens[accepted.numpy() == 0][:, 1:] == -1)


def test_greedy_rows_accept_exactly_the_argmax_run() -> None:
    params = SamplingParams(temperature=0.0)
    drafts = torch.tensor([[0, 2], [0, 3], [1, 2]])
    logits = LOGITS.repeat(3, 1)
    tokens, accepted = verify(logits, drafts, _meta(params, 9), Sampler())
    assert accepted.tolist() == [2, 1, 0]
    assert tokens.tolist() == [[0, 2, 0], [0, 2, -1], [0, -1, -1]]


def test_seeded_rows_are_reproducible_and_depend_on_their_position() -> None:
    params = SamplingParams(temperature=1.0, seed=77)
    drafts = torch.tensor([[4, 3]] * 64)
    logits = LOGITS.repeat(64, 1)
    positions = np.tile(np.arange(3), 64) + np.repeat(np.arange(64) * 3, 3)
    runs = [verify(logits, drafts, _meta(params, 64 * 3, positions), Sampler(torch.Generator().manual_seed(s)))[0]
            for s in (1, 2)]
    assert torch.equal(runs[0], runs[1])  # the generator is not read for seeded rows
    assert len({tuple(row) for row in runs[0].tolist()}) > 1  # each output position has its own draws


def test_prompt_lookup_proposes_what_followed_the_latest_match() -> None:
    table = torch.zeros(3, 32, dtype=torch.int32)
    table[0, :10] = torch.tensor([5, 6, 7, 8, 9, 1, 5, 6, 7, 2])  # ... 6 7 -> "8 9 1" followed before
    table[0, 10:12] = torch.tensor([6, 7])
    table[1, :6] = torch.tensor([3, 4, 3, 4, 3, 4])  # a period of 2 runs on past the known tokens
    table[2, :4] = torch.tensor([1, 2, 3, 4])  # no earlier occurrence: the last token repeated
    proposer = NgramProposer(3, 1, 3)
    drafts = proposer.propose(table, torch.tensor([0, 1, 2]), torch.tensor([12, 6, 4]), 12, 3)
    assert drafts.tolist() == [[2, 6, 7], [3, 4, 3], [4, 4, 4]]


def test_seeded_verification_emits_the_plain_samplers_draw_at_every_position() -> None:
    """A seeded row's verified tokens are the tokens the plain sampler draws at those positions,
    with penalties, top-p and temperature: accepted while they equal the drafts, the first
    mismatch's draw after them."""
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, repetition_penalty=1.2, presence_penalty=0.3)
    rows, k = 64, LOGITS.shape[0] - 1
    logits = LOGITS.repeat(rows, 1)
    positions = np.tile(np.arange(k + 1), rows) + np.repeat(np.arange(rows) * (k + 1), k + 1)
    plain = Sampler()(logits.clone(), _meta(params, rows * (k + 1), positions)).token_ids.view(rows, k + 1)
    # Rows 0..31 draft what the target draws there, the others a token it does not draw first.
    drafts = plain[:, :k].to(torch.int64).clone()
    drafts[32:, 0] = (drafts[32:, 0] + 1) % VOCAB
    tokens, accepted = verify(logits, drafts, _meta(params, rows * (k + 1), positions), Sampler())
    assert accepted[:32].tolist() == [k] * 32 and accepted[32:].tolist() == [0] * 32
    for row in range(rows):
        n = int(accepted[row]) + 1
        assert tokens[row, :n].tolist() == plain[row, :n].tolist()
        assert tokens[row, n:].tolist() == [-1] * (k + 1 - n)


def test_rows_verify_different_numbers_of_drafts_packed_without_padding() -> None:
    """Rows of 2, 0+1 and 1 drafts: the logits hold 3 + 1 + 2 positions, one after another, and each
    row reads only its own drafts."""
    params = SamplingParams(temperature=0.0)
    logits = torch.cat([LOGITS, LOGITS[:1], LOGITS[:2]])  # argmax: 0, 2, 0 | 0 | 0, 2
    drafts = torch.tensor([[0, 2], [5, 5], [0, 6]])
    tokens, accepted = verify(logits, drafts, _meta(params, 6), Sampler(), torch.tensor([2, 0, 1]))
    assert accepted.tolist() == [2, 0, 1]
    assert tokens.tolist() == [[0, 2, 0], [0, -1, -1], [0, 2, -1]]
