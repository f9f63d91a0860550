"""Serving benchmark metrics: per-request records, latency percentiles, throughput.

The metrics follow vLLM's `benchmark_serving`, so figures compare with those it prints:
- TTFT: from sending the request to the first delta that carries tokens.
- ITL: one gap per token-bearing delta after the first (a delta of k tokens is one gap, as
  vLLM records one per streamed chunk).
- TPOT: `(latency - ttft) / (output_len - 1)`, only for requests with more than one token.
- E2EL (latency): from sending the request to its Done reply.
- Throughputs divide by the whole run's duration; peak output tokens/s is the busiest 1 s
  bucket counted from the first request's start.
Failed requests count in `failed` and add nothing to the latency or token figures.
Speculative decoding counts are the target's own, read before and after the run: their rise.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.protocol import SpeculativeCounts

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestRecord:
    """What one request did; times in ms except `start_s` (seconds after the run began)."""

    prompt_len: int
    output_len: int
    start_s: float
    ttft_ms: float | None
    itl_ms: list[float]
    chunk_tokens: list[int]  # tokens in each token-bearing delta, the first one included
    latency_ms: float | None
    success: bool
    error: str | None = None

    def tpot_ms(self) -> float | None:
        if not self.success or self.output_len <= 1 or self.ttft_ms is None or self.latency_ms is None:
            return None
        return (self.latency_ms - self.ttft_ms) / (self.output_len - 1)

    def token_times_s(self) -> list[float]:
        """When each token-bearing delta arrived, in seconds after the run began."""
        if self.ttft_ms is None:
            return []
        times = [self.start_s + self.ttft_ms / 1e3]
        for gap_ms in self.itl_ms:
            times.append(times[-1] + gap_ms / 1e3)
        return times


@dataclass(slots=True)
class LatencyStats:
    mean_ms: float
    median_ms: float
    std_ms: float
    p90_ms: float
    p99_ms: float

    @classmethod
    def of(cls, values_ms: Sequence[float]) -> LatencyStats:
        """All zeros when there are no values (as vLLM reports), so the JSON keeps its shape."""
        if not values_ms:
            return cls(0.0, 0.0, 0.0, 0.0, 0.0)
        values = np.asarray(values_ms, dtype=np.float64)
        median, p90, p99 = (float(v) for v in np.percentile(values, PERCENTILES))
        return cls(float(values.mean()), median, float(values.std()), p90, p99)


@dataclass(slots=True)
class Metrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens per second
    total_token_throughput: float  # input and output tokens per second
    peak_output_throughput: float  # output tokens in the busiest 1 s bucket
    max_concurrent_requests: int
    output_tokens_per_second: list[int]  # the 1 s buckets, from the first request's start
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats


def compute_metrics(records: Sequence[RequestRecord], duration_s: float) -> Metrics:
    done = [r for r in records if r.success]
    ttfts = [r.ttft_ms for r in done if r.ttft_ms is not None]
    tpots = [t for r in done if (t := r.tpot_ms()) is not None]
    itls = [gap for r in done for gap in r.itl_ms]
    e2els = [r.latency_ms for r in done if r.latency_ms is not None]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_len for r in done)
    buckets = _output_tokens_per_second(records)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    return Metrics(
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration_s,
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=per_s(len(done)),
        output_throughput=per_s(total_output),
        total_token_throughput=per_s(total_input + total_output),
        peak_output_throughput=float(max(buckets, default=0)),
        max_concurrent_requests=_max_concurrent(done),
        output_tokens_per_second=buckets,
        ttft=LatencyStats.of(ttfts),
        tpot=LatencyStats.of(tpots),
        itl=LatencyStats.of(itls),
        e2el=LatencyStats.of(e2els),
    )


def _output_tokens_per_second(records: Sequence[RequestRecord]) -> list[int]:
    # vLLM counts one token per chunk here; a chunk's real token count is known, so it is used.
    if not records:
        return []
    origin_s = min(r.start_s for r in records)
    counts: dict[int, int] = {}
    for record in records:
        if not record.success:
            continue
        for when_s, num_tokens in zip(record.token_times_s(), record.chunk_tokens):
            bucket = int(when_s - origin_s)
            counts[bucket] = counts.get(bucket, 0) + num_tokens
    if not counts:
        return []
    return [counts.get(second, 0) for second in range(max(counts) + 1)]


def _max_concurrent(records: Sequence[RequestRecord]) -> int:
    # Ends sort before starts at the same instant: a request that ends as another starts overlaps none.
    events = sorted(
        [(r.start_s, 1) for r in records if r.latency_ms is not None]
        + [(r.start_s + r.latency_ms / 1e3, -1) for r in records if r.latency_ms is not None]
    )
    running = peak = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    return peak


@dataclass(slots=True)
class BenchResult:
    metrics: Metrics
    records: list[RequestRecord]
    config: dict[str, Any] = field(default_factory=dict)  # the workload, echoed in reports
    speculative: SpeculativeCounts = field(default_factory=SpeculativeCounts)  # during the run

    def to_json(self) -> dict[str, Any]:
        m = self.metrics
        out: dict[str, Any] = {
            "config": self.config,
            "completed": m.completed,
            "failed": m.failed,
            "duration_s": m.duration_s,
            "total_input_tokens": m.total_input_tokens,
            "total_output_tokens": m.total_output_tokens,
            "request_throughput": m.request_throughput,
            "output_throughput": m.output_throughput,
            "total_token_throughput": m.total_token_throughput,
            "peak_output_throughput": m.peak_output_throughput,
            "max_concurrent_requests": m.max_concurrent_requests,
            "output_tokens_per_second": m.output_tokens_per_second,
        }
        spec = self.speculative
        out.update(spec_decode_num_draft_tokens=spec.num_draft_tokens,
                   spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
                   spec_decode_num_verifications=spec.num_verifications,
                   spec_decode_draft_acceptance_rate=spec.draft_acceptance_rate,
                   spec_decode_mean_accepted_length=spec.mean_accepted_length)
        for name in ("ttft", "tpot", "itl", "e2el"):
            stats: LatencyStats = getattr(m, name)
            for stat in ("mean", "median", "std", "p90", "p99"):
                out[f"{stat}_{name}_ms"] = getattr(stats, f"{stat}_ms")
        out["requests"] = [
            {
                "prompt_len": r.prompt_len,
                "output_len": r.output_len,
                "start_s": r.start_s,
                "ttft_ms": r.ttft_ms,
                "itl_ms": r.itl_ms,
                "chunk_tokens": r.chunk_tokens,
                "latency_ms": r.latency_ms,
                "success": r.success,
                "error": r.error,
            }
            for r in self.records
        ]
        return out
