"""Metric definitions on hand-made timestamps: the figures vLLM's benchmark_serving would give."""
from __future__ import annotations

import math

import pytest

from pipeline.bench.metrics import LatencyStats, RequestRecord, compute_metrics
from pipeline.bench.targets import speculative_counts_of
from pipeline.bench.workload import arrival_offsets_s, parse_range, random_requests
from pipeline.protocol import SpeculativeCounts

pytestmark = pytest.mark.timeout(10)


def record(start_s: float, ttft_ms: float, itl_ms: list[float], chunk_tokens: list[int], latency_ms: float,
           prompt_len: int = 10) -> RequestRecord:
    return RequestRecord(prompt_len, sum(chunk_tokens), start_s, ttft_ms, itl_ms, chunk_tokens, latency_ms, True)


def failed(start_s: float) -> RequestRecord:
    return RequestRecord(7, 0, start_s, None, [], [], None, False, "Overloaded: busy")


def test_definitions_on_synthetic_timestamps() -> None:
    # a: tokens at 0.1, 0.3, 0.6 s (one token each), Done at 0.7 s.
    a = record(0.0, 100.0, [200.0, 300.0], [1, 1, 1], 700.0)
    # b: starts at 0.5 s; a chunk of 2 tokens at 0.55 s, then 1 token at 1.6 s; Done at 1.7 s.
    b = record(0.5, 50.0, [1050.0], [2, 1], 1200.0, prompt_len=20)
    # c: one token only: no TPOT; tokens at 2.05 s.
    c = record(2.0, 50.0, [], [1], 60.0, prompt_len=5)
    m = compute_metrics([a, b, failed(0.2), c], duration_s=2.5)

    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (35, 7)
    assert m.request_throughput == pytest.approx(3 / 2.5)
    assert m.output_throughput == pytest.approx(7 / 2.5)
    assert m.total_token_throughput == pytest.approx(42 / 2.5)
    assert m.ttft.mean_ms == pytest.approx((100 + 50 + 50) / 3)
    assert m.ttft.median_ms == pytest.approx(50.0)
    # TPOT = (latency - ttft) / (output_len - 1), only for requests with more than one token.
    tpots = [(700 - 100) / 2, (1200 - 50) / 2]
    assert m.tpot.mean_ms == pytest.approx(sum(tpots) / 2)
    # ITL: one gap per chunk after the first, pooled over requests.
    assert m.itl.mean_ms == pytest.approx((200 + 300 + 1050) / 3)
    assert m.itl.median_ms == pytest.approx(300.0)
    assert m.e2el.mean_ms == pytest.approx((700 + 1200 + 60) / 3)
    # 1 s buckets from the first start: [0,1): 1+1+1+2 = 5, [1,2): 1, [2,3): 1.
    assert m.output_tokens_per_second == [5, 1, 1]
    assert m.peak_output_throughput == 5.0
    assert m.max_concurrent_requests == 2  # a (0-0.7 s) overlaps b (0.5-1.7 s); c starts after both


def test_percentiles_interpolate_like_numpy() -> None:
    stats = LatencyStats.of([float(v) for v in range(1, 101)])
    assert stats.median_ms == pytest.approx(50.5)
    assert stats.p90_ms == pytest.approx(90.1)
    assert stats.p99_ms == pytest.approx(99.01)
    assert LatencyStats.of([]) == LatencyStats(0.0, 0.0, 0.0, 0.0, 0.0)


def test_all_failed_gives_zero_figures_not_errors() -> None:
    m = compute_metrics([failed(0.0), failed(0.1)], duration_s=0.5)
    assert (m.completed, m.failed, m.request_throughput, m.peak_output_throughput) == (0, 2, 0.0, 0.0)
    assert m.output_tokens_per_second == []


def test_poisson_arrivals_reproducible_with_a_seed() -> None:
    first = arrival_offsets_s(2000, 50.0, seed=3)
    assert first == arrival_offsets_s(2000, 50.0, seed=3)
    assert first != arrival_offsets_s(2000, 50.0, seed=4)
    assert first[0] == 0.0 and all(b >= a for a, b in zip(first, first[1:]))
    mean_gap_s = first[-1] / (len(first) - 1)
    assert mean_gap_s == pytest.approx(1 / 50.0, rel=0.1)
    assert arrival_offsets_s(5, math.inf) == [0.0] * 5
    with pytest.raises(ValueError, match="request_rate"):
        arrival_offsets_s(5, 0.0)


def test_random_workload_lengths_and_token_range() -> None:
    requests = random_requests(200, (3, 9), (2, 5), vocab_size=50, min_token_id=2, seed=1)
    assert {len(r.prompt) for r in requests} == set(range(3, 10))
    assert {r.max_tokens for r in requests} == set(range(2, 6))
    assert all(r.prompt_len == len(r.prompt) for r in requests)
    assert {t for r in requests for t in r.prompt} <= set(range(2, 50))
    assert requests == random_requests(200, (3, 9), (2, 5), vocab_size=50, min_token_id=2, seed=1)


def test_ranges_parse_and_bad_ones_name_the_option() -> None:
    assert parse_range("16", "--input-len") == (16, 16)
    assert parse_range("8:32", "--input-len") == (8, 32)
    for bad in ("0", "9:3", "a:b", "1:2:3"):
        with pytest.raises(ValueError, match="--output-len"):
            parse_range(bad, "--output-len")


def test_speculative_counts_are_read_from_our_metrics_and_vllms() -> None:
    ours = """# TYPE pipeline:spec_decode_num_draft_tokens counter
pipeline:spec_decode_num_draft_tokens_total{model_name="m"} 30.0
pipeline:spec_decode_num_draft_tokens_created{model_name="m"} 1.7e9
pipeline:spec_decode_num_accepted_tokens_total{model_name="m"} 21.0
pipeline:spec_decode_num_verifications_total{model_name="m"} 10.0
pipeline:generation_tokens_total{model_name="m"} 99.0
"""
    assert speculative_counts_of(ours) == SpeculativeCounts(30, 21, 10)
    vllm = """vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 4.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 6.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 9.0
"""
    assert speculative_counts_of(vllm) == SpeculativeCounts(12, 9, 10)
    assert speculative_counts_of("") == SpeculativeCounts()


def test_speculative_counts_of_a_run_are_the_rise_and_derive_their_rates() -> None:
    run = SpeculativeCounts(70, 51, 30).since(SpeculativeCounts(30, 21, 10))
    assert run == SpeculativeCounts(40, 30, 20)
    assert (run.draft_acceptance_rate, run.mean_accepted_length) == (0.75, 2.5)
    assert SpeculativeCounts(5, 2, 3).since(SpeculativeCounts(30, 21, 10)) == SpeculativeCounts(5, 2, 3)  # restarted
    assert (SpeculativeCounts().draft_acceptance_rate, SpeculativeCounts().mean_accepted_length) == (0.0, 0.0)
