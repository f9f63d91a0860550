"""The on-device sampler: filters, seeds, penalties, min_tokens and logprobs, on CPU."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stages.contracts.params import SamplingParams
from stages.gpu_runner.sampling.metadata import SamplingMetadata
from stages.gpu_runner.sampling.sampler import Sampler

EOS = 2
CPU = torch.device("cpu")
pytestmark = pytest.mark.timeout(30)


def build(params: list[SamplingParams], *, output_pos: list[int] | None = None,
          histories: list[list[int]] | None = None, num_prompt_tokens: list[int] | None = None,
          table: torch.Tensor | None = None, device: torch.device = CPU) -> SamplingMetadata:
    """Metadata for rows 0..n-1 of a synthetic token table holding `histories` (default: one
    prompt token each). Slots past each history hold garbage, as a runner's table may."""
    n = len(params)
    histories = histories if histories is not None else [[1]] * n
    num_prompt_tokens = num_prompt_tokens if num_prompt_tokens is not None else [len(h) for h in histories]
    if table is None:
        width = max(len(h) for h in histories) + 4
        table = torch.full((n, width), -1, dtype=torch.int32)
        for row, history in enumerate(histories):
            table[row, :len(history)] = torch.tensor(history, dtype=torch.int32)
    return SamplingMetadata.build(
        params,
        output_pos=np.array(output_pos if output_pos is not None else [0] * n, dtype=np.int64),
        rows=np.arange(n, dtype=np.int32),
        num_tokens=np.array([len(h) for h in histories], dtype=np.int32),
        num_prompt_tokens=np.array(num_prompt_tokens, dtype=np.int32),
        token_table=table.to(device),
        eos_token_ids=[EOS],
        device=device,
    )


def sample_many(logits_row: list[float], params: SamplingParams, num_draws: int, *, seed: int = 0) -> np.ndarray:
    """num_draws independent draws from one distribution, as one batch of identical rows."""
    logits = torch.tensor(logits_row, dtype=torch.float32).repeat(num_draws, 1)
    generator = torch.Generator().manual_seed(seed)
    out = Sampler(generator)(logits, build([params] * num_draws))
    return out.token_ids.numpy()


def logits_for(probs: list[float]) -> list[float]:
    return [math.log(p) for p in probs]


def test_greedy_is_argmax_of_the_logits():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(1))
    out = Sampler()(logits, build([SamplingParams(temperature=0.0)] * 6))
    assert out.token_ids.dtype == torch.int32
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.logprob_token_ids is None


def test_greedy_rows_stay_argmax_beside_random_rows():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=5.0)
              for i in range(8)]
    out = Sampler(torch.Generator().manual_seed(0))(logits, build(params))
    assert out.token_ids[0::2].tolist() == logits[0::2].argmax(-1).tolist()


def test_top_k_never_leaves_the_k_best():
    logits = torch.randn(40, generator=torch.Generator().manual_seed(3))
    best = set(logits.topk(5).indices.tolist())
    drawn = sample_many(logits.tolist(), SamplingParams(temperature=2.0, top_k=5), 4000)
    assert set(drawn.tolist()) == best  # all of them drawn, nothing else


@pytest.mark.parametrize("off", [0, -1])
def test_top_k_off_draws_the_whole_vocabulary(off: int):
    drawn = sample_many([0.0] * 10, SamplingParams(top_k=off), 2000)
    assert set(drawn.tolist()) == set(range(10))


def test_top_p_draws_only_the_nucleus_with_renormalised_frequencies():
    probs = [0.05, 0.4, 0.1, 0.3, 0.15]
    # nucleus for 0.8: 0.4 + 0.3 = 0.7 < 0.8, so 0.15 joins; 0.85 >= 0.8, so 0.1 and 0.05 stay out
    drawn = sample_many(logits_for(probs), SamplingParams(top_p=0.8), 20000)
    frequencies = np.bincount(drawn, minlength=5) / len(drawn)
    assert frequencies[0] == 0 and frequencies[2] == 0
    for token, p in ((1, 0.4), (3, 0.3), (4, 0.15)):
        assert frequencies[token] == pytest.approx(p / 0.85, abs=0.02)


def test_top_k_and_top_p_together_take_the_nucleus_of_the_top_k():
    probs = [0.3, 0.25, 0.2, 0.15, 0.1]
    # top_k 3 leaves 0.3, 0.25, 0.2 (renormalised 0.4, 0.333, 0.267); top_p 0.6 keeps the first two
    drawn = sample_many(logits_for(probs), SamplingParams(top_k=3, top_p=0.6), 6000)
    frequencies = np.bincount(drawn, minlength=5) / len(drawn)
    assert set(drawn.tolist()) == {0, 1}
    assert frequencies[0] == pytest.approx(0.3 / 0.55, abs=0.03)


def test_min_p_drops_tokens_below_its_share_of_the_best():
    probs = [0.5, 0.3, 0.12, 0.08]
    # threshold 0.2 * 0.5 = 0.1: only the 0.08 token goes
    drawn = sample_many(logits_for(probs), SamplingParams(min_p=0.2), 6000)
    frequencies = np.bincount(drawn, minlength=4) / len(drawn)
    assert frequencies[3] == 0
    assert frequencies[2] == pytest.approx(0.12 / 0.92, abs=0.02)


def test_temperature_sharpens_and_flattens():
    probs = [0.6, 0.3, 0.1]
    cold = np.bincount(sample_many(logits_for(probs), SamplingParams(temperature=0.5), 6000), minlength=3) / 6000
    hot = np.bincount(sample_many(logits_for(probs), SamplingParams(temperature=2.0), 6000), minlength=3) / 6000
    sharpened = np.array(probs) ** 2 / np.sum(np.array(probs) ** 2)
    flattened = np.sqrt(probs) / np.sum(np.sqrt(probs))
    np.testing.assert_allclose(cold, sharpened, atol=0.02)
    np.testing.assert_allclose(hot, flattened, atol=0.02)


def test_rows_with_different_settings_in_one_batch():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(4)).repeat(200, 1)
    params = [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(temperature=0.0),
              SamplingParams(min_p=1.0), SamplingParams(temperature=3.0)] * 200
    tokens = Sampler(torch.Generator().manual_seed(0))(logits, build(params)).token_ids.view(200, 5)
    argmax = logits[:5].argmax(-1)
    for column in range(4):  # each filter alone leaves only the argmax
        assert (tokens[:, column] == argmax[column]).all()
    assert len(set(tokens[:, 4].tolist())) > 10  # the unfiltered row really samples


def seeded_sequence(seed: int, batch: list[tuple[SamplingParams, torch.Tensor]], at: int,
                    positions: range, generator_seed: int) -> list[int]:
    """The tokens that row `at` of `batch` gets at each output position."""
    logits = torch.stack([row_logits for _, row_logits in batch])
    params = [p for p, _ in batch]
    sampler = Sampler(torch.Generator().manual_seed(generator_seed))
    tokens = []
    for pos in positions:
        meta = build(params, output_pos=[pos] * len(batch))
        tokens.append(int(sampler(logits, meta).token_ids[at]))
    return tokens


def test_same_seed_same_tokens_whatever_else_is_in_the_batch():
    vocab = 1000
    flat = torch.zeros(vocab)
    seeded = (SamplingParams(seed=1234), flat)
    noise = torch.Generator().manual_seed(5)
    others = [(SamplingParams(temperature=0.7, top_k=50), torch.randn(vocab, generator=noise)),
              (SamplingParams(temperature=0.0), torch.randn(vocab, generator=noise)),
              (SamplingParams(seed=99, top_p=0.9), torch.randn(vocab, generator=noise))]
    alone = seeded_sequence(1234, [seeded], 0, range(20), generator_seed=0)
    first = seeded_sequence(1234, [seeded] + others, 0, range(20), generator_seed=1)
    middle = seeded_sequence(1234, others[:2] + [seeded] + others[2:], 2, range(20), generator_seed=2)
    last = seeded_sequence(1234, others[::-1] + [seeded], 3, range(20), generator_seed=3)
    assert alone == first == middle == last
    assert len(set(alone)) > 15  # the output position moves the draw


def test_seeded_draws_depend_on_seed_and_output_position_only():
    vocab = 1000
    rows = [(SamplingParams(seed=seed), torch.zeros(vocab)) for seed in (7, 8)]
    seven = seeded_sequence(7, rows, 0, range(10), generator_seed=0)
    eight = seeded_sequence(8, rows, 1, range(10), generator_seed=0)
    assert seven != eight
    # resuming at position 5 (a later chunk, a re-admitted request) continues the same stream
    assert seeded_sequence(7, rows[:1], 0, range(5, 10), generator_seed=9) == seven[5:]


def test_seeded_draws_follow_the_distribution():
    probs = [0.5, 0.25, 0.15, 0.1]
    num_draws = 20000
    logits = torch.tensor(logits_for(probs)).repeat(num_draws, 1)
    params = [SamplingParams(seed=seed) for seed in range(num_draws)]
    drawn = Sampler()(logits, build(params)).token_ids.numpy()
    np.testing.assert_allclose(np.bincount(drawn, minlength=4) / num_draws, probs, atol=0.015)


def test_unseeded_rows_follow_the_generator():
    logits = torch.zeros(50, 1000)
    meta = build([SamplingParams()] * 50)
    first = Sampler(torch.Generator().manual_seed(3))(logits, meta).token_ids
    again = Sampler(torch.Generator().manual_seed(3))(logits, meta).token_ids
    other = Sampler(torch.Generator().manual_seed(4))(logits, meta).token_ids
    assert torch.equal(first, again) and not torch.equal(first, other)


def greedy_token(logits_row: list[float], params: SamplingParams, history: list[int],
                 num_prompt_tokens: int, table: torch.Tensor | None = None) -> int:
    meta = build([params], histories=[history], num_prompt_tokens=[num_prompt_tokens], table=table)
    return int(Sampler()(torch.tensor([logits_row]), meta).token_ids[0])


def test_repetition_penalty_makes_a_repeated_argmax_lose():
    positive = [0.0, 0.0, 0.0, 2.0, 1.8]
    negative = [-9.0, -9.0, -9.0, -1.0, -1.1]
    for logits in (positive, negative):  # positive logits are divided, negative multiplied
        params = SamplingParams(temperature=0.0, repetition_penalty=1.2)
        assert greedy_token(logits, SamplingParams(temperature=0.0), [3, 1], 2) == 3
        assert greedy_token(logits, params, [0, 1], 2) == 3  # token 3 not seen: untouched
        assert greedy_token(logits, params, [3, 1], 2) == 4  # seen in the prompt
        assert greedy_token(logits, params, [0, 1, 3], 2) == 4  # seen in the outputs


def test_frequency_penalty_counts_outputs_only():
    logits = [0.0, 0.0, 0.0, 1.0, 0.5]
    params = SamplingParams(temperature=0.0, frequency_penalty=0.3)
    assert greedy_token(logits, params, [3, 3, 3, 3, 1], 5) == 3  # prompt repeats do not count
    assert greedy_token(logits, params, [1, 3], 1) == 3  # 1.0 - 0.3 > 0.5
    assert greedy_token(logits, params, [1, 3, 0, 3], 1) == 4  # 1.0 - 0.6 < 0.5


def test_presence_penalty_counts_outputs_once():
    logits = [0.0, 0.0, 0.0, 1.0, 0.5]
    params = SamplingParams(temperature=0.0, presence_penalty=0.6)
    assert greedy_token(logits, params, [3, 3, 1], 3) == 3  # prompt tokens do not count
    assert greedy_token(logits, params, [1, 3], 1) == 4  # 1.0 - 0.6 < 0.5
    lighter = SamplingParams(temperature=0.0, presence_penalty=0.2)
    assert greedy_token(logits, lighter, [1, 3, 3, 3], 1) == 3  # 1.0 - 0.2 once, not 3 times


def test_table_slots_past_num_tokens_never_count():
    # Row 0 knows 2 tokens; its later slots hold placeholders and stale ids. Row 1 knows 8, so
    # the batch reads 8 columns of both rows.
    logits = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.5]] * 2)
    table = torch.tensor([[1, 1, 3, 3, 3, -1, 3, -7, 3], [1, 1, 1, 1, 1, 1, 1, 1, 3]], dtype=torch.int32)
    params = [SamplingParams(temperature=0.0, repetition_penalty=5.0, frequency_penalty=2.0, presence_penalty=2.0)] * 2
    meta = SamplingMetadata.build(params, np.zeros(2, np.int64), np.array([0, 1]), np.array([2, 8]),
                                  np.array([1, 1]), table, [EOS], CPU)
    assert Sampler()(logits, meta).token_ids.tolist() == [3, 3]


def test_penalties_read_each_rows_own_table_row():
    logits = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.5]] * 3)
    histories = [[1, 3], [1, 4], [1, 0]]
    params = [SamplingParams(temperature=0.0, presence_penalty=1.0)] * 3
    table = torch.zeros(6, 8, dtype=torch.int32)
    table[[4, 1, 5], :2] = torch.tensor(histories, dtype=torch.int32)
    meta = SamplingMetadata.build(params, np.zeros(3, np.int64), np.array([4, 1, 5]), np.full(3, 2),
                                  np.ones(3, np.int64), table, [EOS], CPU)
    assert Sampler()(logits, meta).token_ids.tolist() == [4, 3, 3]


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 0.0, 5.0, 4.0, 3.0, 1.0]])  # EOS (2) best, then stop id 3
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3, 99])  # 99: outside vocab

    def token_at(pos: int, p: SamplingParams = params) -> int:
        return int(Sampler()(logits, build([p], output_pos=[pos])).token_ids[0])

    assert [token_at(pos) for pos in range(4)] == [4, 4, 4, 2]
    ignoring = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3], ignore_eos=True)
    assert token_at(0, ignoring) == 2  # EOS does not stop this request, so it is not barred


def test_min_tokens_blocks_sampled_rows_too():
    logits = torch.tensor([[0.0, 0.0, 3.0, 0.0]]).repeat(500, 1)
    params = [SamplingParams(min_tokens=1)] * 500
    drawn = Sampler(torch.Generator().manual_seed(0))(logits, build(params)).token_ids
    assert EOS not in drawn.tolist() and len(set(drawn.tolist())) == 3


def test_logprobs_are_the_raw_log_softmax_with_the_sampled_token_first():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(6))
    params = [SamplingParams(temperature=0.8, repetition_penalty=2.0, logprobs=3),
              SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(seed=1)]
    meta = build(params, histories=[[1, 2, 3]] * 3)
    out = Sampler()(logits, meta)
    expected = torch.log_softmax(logits, -1)
    assert out.logprobs.dtype == torch.float32 and out.logprob_token_ids.dtype == torch.int32
    assert out.logprobs.shape == (3, 4) and out.logprob_token_ids.shape == (3, 4)
    assert out.logprob_token_ids[:, 0].tolist() == out.token_ids.tolist()
    top = expected.topk(3, dim=-1)
    assert out.logprob_token_ids[:, 1:].tolist() == top.indices.tolist()
    torch.testing.assert_close(out.logprobs[:, 1:], top.values)
    torch.testing.assert_close(out.logprobs[:, 0], expected.gather(1, out.token_ids.long()[:, None])[:, 0])


def test_logprobs_zero_gives_only_the_sampled_token():
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(7))
    out = Sampler()(logits, build([SamplingParams(temperature=0.0, logprobs=0)] * 2))
    assert out.logprobs.shape == (2, 1)
    torch.testing.assert_close(out.logprobs[:, 0], torch.log_softmax(logits, -1).max(-1).values)


def test_bfloat16_logits_and_an_empty_batch():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    out = Sampler()(logits, build([SamplingParams(temperature=0.0, logprobs=1)] * 4))
    assert out.token_ids.tolist() == logits.float().argmax(-1).tolist()
    assert out.logprobs.dtype == torch.float32
    empty_meta = SamplingMetadata.build([], np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0),
                                        torch.zeros(1, 4, dtype=torch.int32), [EOS], CPU)
    empty = Sampler()(torch.zeros(0, 64), empty_meta)
    assert empty.token_ids.shape == (0,)


def test_metadata_gathered_from_the_batch_columns_equals_the_one_built_from_params():
    """The runner gathers each step's params from the persistent batch's columns; the sampler
    must see exactly what the params say, row for row, in the step's order."""
    from stages.gpu_runner.inputs.input_batch import InputBatch

    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3),
              SamplingParams(min_p=0.1, repetition_penalty=1.2, logprobs=4, min_tokens=3, stop_token_ids=[7, 8]),
              SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, top_k=-1, min_tokens=1, ignore_eos=True)]
    batch = InputBatch(6, 32, 4, CPU)
    for row, row_params in zip((5, 0, 3, 1), params):
        batch.req_ids[row], batch.params[row], batch.num_prompt_tokens[row] = row, row_params, 2
        batch.sampling.set(row, row_params)
    rows, num_tokens = np.array([3, 5, 1, 0], np.int32), np.array([4, 3, 2, 9])
    gathered = SamplingMetadata.for_rows(batch, rows, num_tokens, [EOS])
    built = SamplingMetadata.build([params[2], params[0], params[3], params[1]], num_tokens - 2, rows, num_tokens,
                                   np.full(4, 2), batch.token_table, [EOS], CPU)
    for name in SamplingMetadata.__slots__:
        a, b = getattr(gathered, name), getattr(built, name)
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), name
    assert gathered.blocked_token_ids.tolist() == [[7, 8, EOS], [-1, -1, -1], [-1, -1, -1], [-1, -1, -1]]
    with pytest.raises(ValueError, match=r"plan samples rows \[2\] that hold no request"):
        SamplingMetadata.for_rows(batch, np.array([2], np.int32), np.array([3]), [EOS])


def test_build_rejects_mismatched_inputs():
    table = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="rows"):
        SamplingMetadata.build([SamplingParams()] * 2, np.zeros(2), np.zeros(1), np.ones(2), np.ones(2), table, [], CPU)
    with pytest.raises(ValueError, match="num_tokens 9"):
        SamplingMetadata.build([SamplingParams()], np.zeros(1), np.zeros(1), np.array([9]), np.ones(1), table, [], CPU)
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(3, 8), build([SamplingParams()] * 2))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("top_p", [0.9, 1.0])  # the sorting path and the top-k-only path
def test_no_host_synchronisation_on_cuda(top_p: float):
    device = torch.device("cuda")
    vocab = 512
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(seed=3, top_k=20, top_p=top_p),
              SamplingParams(min_p=0.1, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
                             min_tokens=4, stop_token_ids=[5, vocab + 10]),
              SamplingParams(top_k=7, temperature=0.5)]
    generator = torch.Generator().manual_seed(10)
    logits = torch.randn(4, vocab, generator=generator)
    table = torch.randint(0, vocab, (4, 16), dtype=torch.int32, generator=generator)
    layout = dict(output_pos=[0, 1, 2, 3], histories=[[1, 2, 3]] * 4)
    cpu_tokens = Sampler()(logits, build(params, **layout, table=table)).token_ids
    logits, table = logits.to(device), table.to(device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler()(logits, build(params, **layout, table=table, device=device))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.token_ids.device.type == "cuda" and out.logprobs.device.type == "cuda"
    # greedy and seeded rows pick the same tokens on the device as on the host
    assert out.token_ids.cpu()[:2].tolist() == cpu_tokens[:2].tolist()
