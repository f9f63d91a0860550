"""Serving benchmark: drives a running daemon with a workload and reports latency and throughput.

The metrics follow vLLM's `benchmark_serving`, so figures compare with those it prints:
- TTFT: from sending the request to the first delta that carries tokens.
- ITL: one gap per token-bearing delta after the first (a delta of k tokens is one gap, as
  vLLM records one per streamed chunk).
- TPOT: `(latency - ttft) / (output_len - 1)`, only for requests with more than one token.
- E2EL (latency): from sending the request to its Done reply.
- Throughputs divide by the whole run's duration; peak output tokens/s is the busiest 1 s
  bucket counted from the first request's start.
Failed requests count in `failed` and add nothing to the latency or token figures.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from pipeline.client import AsyncClient, Prompt
from pipeline.errors import PipelineError
from pipeline.paths import default_socket_path
from stages.contracts.params import InvalidParams, SamplingParams

PERCENTILES = (50, 90, 99)
TABLE_WIDTH = 50
PROGRESS_BAR_CHARS = 30
DAEMON_START_TIMEOUT_S = 300.0


@dataclass(slots=True)
class BenchRequest:
    prompt: Prompt
    max_tokens: int
    prompt_len: int | None = None  # known for token-id prompts; text prompts learn it from Done


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


# --- workload ---


def parse_range(text: str, name: str) -> tuple[int, int]:
    """`"N"` or `"MIN:MAX"` (inclusive) into (min, max); ValueError naming `name` otherwise."""
    parts = text.split(":")
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        low, high = int(parts[0]), int(parts[-1])
    except ValueError:
        raise ValueError(f"{name} must be N or MIN:MAX with integers, got {text!r}") from None
    if low < 1 or high < low:
        raise ValueError(f"{name} must satisfy 1 <= MIN <= MAX, got {text!r}")
    return low, high


def random_requests(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], *,
                    vocab_size: int, min_token_id: int = 0, seed: int = 0) -> list[BenchRequest]:
    """Prompts of random token ids in [min_token_id, vocab_size), lengths uniform in the ranges."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if not 0 <= min_token_id < vocab_size:
        raise ValueError(f"need 0 <= min_token_id < vocab_size, got min_token_id={min_token_id}, vocab_size={vocab_size}")
    rng = np.random.default_rng(seed)
    input_lens = rng.integers(input_len[0], input_len[1] + 1, num_prompts)
    output_lens = rng.integers(output_len[0], output_len[1] + 1, num_prompts)
    return [
        BenchRequest(rng.integers(min_token_id, vocab_size, int(n_in)).tolist(), int(n_out), int(n_in))
        for n_in, n_out in zip(input_lens, output_lens)
    ]


def load_dataset(path: Path | str, output_len: tuple[int, int], *, num_prompts: int | None = None,
                 seed: int = 0) -> list[BenchRequest]:
    """JSONL, one object a line: `prompt` (text or token ids), optional `output_len` or
    `max_tokens`; a line without either draws its length from `output_len`."""
    rng = np.random.default_rng(seed)
    requests: list[BenchRequest] = []
    with open(path, encoding="utf-8") as lines:
        for line_no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if num_prompts is not None and len(requests) == num_prompts:
                break
            where = f"{path}:{line_no}"
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(entry, dict):
                raise ValueError(f"{where}: each line must be a JSON object, got {type(entry).__name__}")
            prompt = entry.get("prompt")
            is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
            if not prompt or not (isinstance(prompt, str) or is_ids):
                raise ValueError(f"{where}: prompt must be a non-empty string or list of token ids, got {prompt!r}")
            max_tokens = entry.get("output_len", entry.get("max_tokens"))
            if max_tokens is None:
                max_tokens = int(rng.integers(output_len[0], output_len[1] + 1))
            elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
                raise ValueError(f"{where}: output_len/max_tokens must be a positive integer, got {max_tokens!r}")
            requests.append(BenchRequest(prompt, max_tokens, len(prompt) if is_ids else None))
    if not requests:
        raise ValueError(f"dataset {path} has no requests")
    if num_prompts is not None and len(requests) < num_prompts:
        raise ValueError(f"num_prompts is {num_prompts} but dataset {path} has only {len(requests)} requests")
    return requests


def arrival_offsets_s(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """Send times after the start: a Poisson process of `request_rate` req/s (inf: all at 0)."""
    if not request_rate > 0:  # also refuses NaN
        raise ValueError(f"request_rate must be > 0 req/s (or inf), got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, max(num_requests - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:num_requests]


# --- load loop ---


class ProgressBar:
    """A one-line `\\r`-updated bar on a text stream (stderr, when it is a terminal)."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self._total = total
        self._stream = stream
        self._done = 0
        self._failed = 0
        self._start_s = time.perf_counter()
        self._draw()

    def advance(self, success: bool) -> None:
        self._done += 1
        self._failed += not success
        self._draw()

    def close(self) -> None:
        self._stream.write("\n")
        self._stream.flush()

    def _draw(self) -> None:
        filled = PROGRESS_BAR_CHARS * self._done // max(self._total, 1)
        bar = "#" * filled + "." * (PROGRESS_BAR_CHARS - filled)
        elapsed_s = time.perf_counter() - self._start_s
        failed = f", {self._failed} failed" if self._failed else ""
        self._stream.write(f"\r[{bar}] {self._done}/{self._total} requests{failed}  {elapsed_s:.1f} s")
        self._stream.flush()


def bench_params(max_tokens: int, *, temperature: float, top_p: float, top_k: int,
                    ignore_eos: bool) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                          ignore_eos=ignore_eos)


async def _send_one(client: AsyncClient, request: BenchRequest, params: SamplingParams, run_start_s: float) -> RequestRecord:
    sent_s = time.perf_counter()
    ttft_ms: float | None = None
    itl_ms: list[float] = []
    chunk_tokens: list[int] = []
    last_s = sent_s
    try:
        stream = client.stream(request.prompt, params)
        async for delta in stream:
            now_s = time.perf_counter()
            if not delta.token_ids:
                continue
            if ttft_ms is None:
                ttft_ms = (now_s - sent_s) * 1e3
            else:
                itl_ms.append((now_s - last_s) * 1e3)
            last_s = now_s
            chunk_tokens.append(len(delta.token_ids))
        completion = stream.completion
        if completion is None:  # the loop ends only on Done or an error, so this is a daemon bug
            raise PipelineError("stream ended without a Done reply")
    except (PipelineError, OSError) as exc:  # OSError: the connection broke below the protocol
        return RequestRecord(request.prompt_len or 0, sum(chunk_tokens), sent_s - run_start_s, ttft_ms, itl_ms,
                             chunk_tokens, None, False, f"{type(exc).__name__}: {exc}")
    latency_ms = (time.perf_counter() - sent_s) * 1e3
    return RequestRecord(completion.usage.prompt_tokens, completion.usage.completion_tokens, sent_s - run_start_s,
                         ttft_ms, itl_ms, chunk_tokens, latency_ms, True)


async def run_benchmark(socket_path: Path | str | None, requests: Sequence[BenchRequest], *,
                        request_rate: float = math.inf, max_concurrency: int | None = None,
                        temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, ignore_eos: bool = False,
                        seed: int = 0, progress: TextIO | None = None) -> BenchResult:
    """Sends `requests` at Poisson arrival times (`seed` fixes them), at most `max_concurrency`
    in flight, and measures each stream. Raises DaemonNotRunning before sending anything if no
    daemon answers; a request the daemon refuses or fails is recorded, not raised."""
    if not requests:
        raise ValueError("requests must not be empty")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 (or None for no limit), got {max_concurrency}")
    params = [bench_params(r.max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, ignore_eos=ignore_eos)
              for r in requests]  # InvalidParams, naming the field, before any load is sent
    offsets_s = arrival_offsets_s(len(requests), request_rate, seed)
    client = AsyncClient(socket_path)
    await client.health()
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency is not None else None
    bar = ProgressBar(len(requests), progress) if progress is not None else None
    run_start_s = time.perf_counter()

    async def issue(index: int) -> RequestRecord:
        await asyncio.sleep(max(0.0, run_start_s + offsets_s[index] - time.perf_counter()))
        if limit is None:
            record = await _send_one(client, requests[index], params[index], run_start_s)
        else:
            async with limit:
                record = await _send_one(client, requests[index], params[index], run_start_s)
        if bar is not None:
            bar.advance(record.success)
        return record

    try:
        records = await asyncio.gather(*(issue(i) for i in range(len(requests))))
    finally:
        await client.close()
        if bar is not None:
            bar.close()
    duration_s = time.perf_counter() - run_start_s
    # JSON has no infinity: an unlimited rate is written as the string "inf".
    config = {"num_prompts": len(requests), "request_rate": request_rate if math.isfinite(request_rate) else "inf", "max_concurrency": max_concurrency,
              "temperature": temperature, "top_p": top_p, "top_k": top_k, "ignore_eos": ignore_eos, "seed": seed}
    return BenchResult(compute_metrics(records, duration_s), list(records), config)


# --- reports ---

_LATENCIES = (("ttft", "TTFT", "Time to First Token"), ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
              ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency"))


def _rows(m: Metrics) -> list[tuple[str, str, float | int] | str]:
    """(label, json key, value) rows, and section titles, shared by the table and the comparison."""
    rows: list[tuple[str, str, float | int] | str] = [
        ("Successful requests", "completed", m.completed),
        ("Failed requests", "failed", m.failed),
        ("Benchmark duration (s)", "duration_s", m.duration_s),
        ("Total input tokens", "total_input_tokens", m.total_input_tokens),
        ("Total generated tokens", "total_output_tokens", m.total_output_tokens),
        ("Request throughput (req/s)", "request_throughput", m.request_throughput),
        ("Output token throughput (tok/s)", "output_throughput", m.output_throughput),
        ("Peak output token throughput (tok/s)", "peak_output_throughput", m.peak_output_throughput),
        ("Peak concurrent requests", "max_concurrent_requests", m.max_concurrent_requests),
        ("Total token throughput (tok/s)", "total_token_throughput", m.total_token_throughput),
    ]
    for name, short, title in _LATENCIES:
        stats: LatencyStats = getattr(m, name)
        rows.append(title)
        rows += [(f"Mean {short} (ms)", f"mean_{name}_ms", stats.mean_ms),
                 (f"Median {short} (ms)", f"median_{name}_ms", stats.median_ms),
                 (f"P90 {short} (ms)", f"p90_{name}_ms", stats.p90_ms),
                 (f"P99 {short} (ms)", f"p99_{name}_ms", stats.p99_ms)]
    return rows


def _number(value: float | int) -> str:
    return str(value) if isinstance(value, int) else f"{value:.2f}"


def format_table(result: BenchResult) -> str:
    lines = [f"{' Serving Benchmark Result ':=^{TABLE_WIDTH}}"]
    for row in _rows(result.metrics):
        if isinstance(row, str):
            lines.append(f"{' ' + row + ' ':-^{TABLE_WIDTH}}")
        else:
            lines.append(f"{row[0] + ':':<40} {_number(row[2])}")
    lines.append("=" * TABLE_WIDTH)
    return "\n".join(lines)


def format_comparison(async_result: BenchResult, sync_result: BenchResult) -> str:
    """Both runs side by side, with the ratio async/sync of each figure."""
    header = f"{'':<40} {'async':>10} {'sync':>10} {'async/sync':>10}"
    lines = [f"{' Async vs sync scheduling ':=^{len(header)}}", header]
    for a_row, s_row in zip(_rows(async_result.metrics), _rows(sync_result.metrics)):
        if isinstance(a_row, str) or isinstance(s_row, str):
            lines.append(f"{' ' + str(a_row) + ' ':-^{len(header)}}")
            continue
        ratio = f"{a_row[2] / s_row[2]:.3f}" if s_row[2] else "-"
        lines.append(f"{a_row[0] + ':':<40} {_number(a_row[2]):>10} {_number(s_row[2]):>10} {ratio:>10}")
    lines.append("=" * len(header))
    return "\n".join(lines)


def plot_result(result: BenchResult, path: Path | str) -> None:
    """Latency CDFs (TTFT, TPOT, E2EL) and output tokens/s over time, as an image file."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never needs a display
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'pipeline[plot]'") from None
    done = [r for r in result.records if r.success]
    series = {
        "TTFT (ms)": [r.ttft_ms for r in done if r.ttft_ms is not None],
        "TPOT (ms)": [t for r in done if (t := r.tpot_ms()) is not None],
        "E2EL (ms)": [r.latency_ms for r in done if r.latency_ms is not None],
    }
    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    for axis, (label, values) in zip(axes.flat, series.items()):
        ordered = np.sort(np.asarray(values, dtype=np.float64))
        axis.plot(ordered, np.arange(1, len(ordered) + 1) / max(len(ordered), 1), drawstyle="steps-post")
        axis.set(xlabel=label, ylabel="fraction of requests", title=f"{label.split()[0]} CDF")
        axis.grid(True, alpha=0.3)
    per_second = result.metrics.output_tokens_per_second
    axis = axes.flat[3]
    axis.bar(np.arange(len(per_second)), per_second, width=1.0, align="edge")
    axis.set(xlabel="time since start (s)", ylabel="output tokens/s", title="Output throughput")
    axis.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


# --- async vs sync scheduling ---


def pipeline_command() -> list[str]:
    """The `pipeline` command installed beside this interpreter."""
    script = Path(sys.executable).parent / "pipeline"
    if not script.exists():
        raise RuntimeError(f"no `pipeline` command at {script}: install the package (pip install -e .)")
    return [str(script)]


def compare_sync(model_dir: Path | str, requests: Sequence[BenchRequest], *, request_rate: float = math.inf,
                 max_concurrency: int | None = None, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 ignore_eos: bool = False, seed: int = 0, progress: TextIO | None = None,
                 command: Sequence[str] | None = None) -> tuple[BenchResult, BenchResult]:
    """The same workload on a daemon with async scheduling, then on one without; (async, sync).

    The daemons run one after the other, so neither competes with the other for the device.
    """
    command = list(command) if command is not None else pipeline_command()
    results: list[BenchResult] = []
    with tempfile.TemporaryDirectory(prefix="pl-bench-") as directory:
        for async_scheduling in (True, False):
            socket_path = Path(directory) / ("async.sock" if async_scheduling else "sync.sock")
            start = [*command, "start", "--socket", str(socket_path), "--model", str(model_dir), "--detach"]
            if not async_scheduling:
                start.append("--no-async-scheduling")
            # stdout stays clean for `--json`: `start --detach` prints the socket path there.
            subprocess.run(start, check=True, timeout=DAEMON_START_TIMEOUT_S, stdout=subprocess.DEVNULL)
            try:
                result = asyncio.run(run_benchmark(
                    socket_path, requests, request_rate=request_rate, max_concurrency=max_concurrency,
                    temperature=temperature, top_p=top_p, top_k=top_k, ignore_eos=ignore_eos, seed=seed,
                    progress=progress))
            finally:
                subprocess.run([*command, "stop", "--socket", str(socket_path)], check=False,
                               timeout=DAEMON_START_TIMEOUT_S, stdout=subprocess.DEVNULL)
            result.config["async_scheduling"] = async_scheduling
            results.append(result)
    return results[0], results[1]


# --- command line ---


def range_arg(name: str) -> Callable[[str], tuple[int, int]]:
    """An argparse type for MIN[:MAX], whose error names the option."""
    def parse(text: str) -> tuple[int, int]:
        try:
            return parse_range(text, name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipeline bench", description=__doc__.splitlines()[0])
    parser.add_argument("--socket", type=Path, default=None, help=f"daemon socket (default {default_socket_path()})")
    parser.add_argument("--num-prompts", type=int, default=None, help="requests to send (default 100; "
                        "with --dataset, its whole length)")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals in req/s; inf sends all at once")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    parser.add_argument("--input-len", type=range_arg("--input-len"), default=(128, 128), metavar="MIN[:MAX]",
                        help="prompt length in tokens, uniform in the range (default 128)")
    parser.add_argument("--output-len", type=range_arg("--output-len"), default=(64, 64), metavar="MIN[:MAX]",
                        help="max_tokens, uniform in the range (default 64)")
    parser.add_argument("--vocab-size", type=int, default=1024, help="random prompt token ids are below this")
    parser.add_argument("--min-token-id", type=int, default=2, help="and at least this (skips BOS/EOS)")
    parser.add_argument("--dataset", type=Path, default=None, metavar="FILE.jsonl",
                        help="prompts from JSONL: {prompt: text|ids, output_len|max_tokens?} per line")
    parser.add_argument("--ignore-eos", action="store_true", help="generate max_tokens even past EOS")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrival times")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                        help="write every figure and per-request record as JSON to FILE (no FILE or -: stdout, "
                             "and the table goes to stderr)")
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE.png", help="latency CDFs and tokens/s over time")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--compare-sync", action="store_true",
                        help="start two daemons on --model, with and without async scheduling, and compare")
    parser.add_argument("--model", type=Path, default=None, help="model directory for --compare-sync")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.dataset is not None:
            requests = load_dataset(args.dataset, args.output_len, num_prompts=args.num_prompts, seed=args.seed)
        else:
            requests = random_requests(args.num_prompts if args.num_prompts is not None else 100, args.input_len,
                                       args.output_len, vocab_size=args.vocab_size, min_token_id=args.min_token_id,
                                       seed=args.seed)
        if args.compare_sync and args.model is None:
            raise ValueError("--compare-sync needs --model DIR")
        options = dict(request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                       temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, ignore_eos=args.ignore_eos,
                       seed=args.seed, progress=None if args.quiet or not sys.stderr.isatty() else sys.stderr)
        if args.compare_sync:
            # SIGTERM unwinds like Ctrl-C, so the daemons compare_sync starts are stopped on the way out.
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
            async_result, sync_result = compare_sync(args.model, requests, **options)
            table = format_comparison(async_result, sync_result)
            report: dict[str, Any] = {"async": async_result.to_json(), "sync": sync_result.to_json()}
            plotted = async_result
        else:
            result = asyncio.run(run_benchmark(args.socket, requests, **options))
            table = format_table(result)
            report = result.to_json()
            plotted = result
        if args.plot is not None:
            plot_result(plotted, args.plot)
    except (ValueError, InvalidParams, PipelineError, RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    to_stdout = args.json == "-"
    print(table, file=sys.stderr if to_stdout else sys.stdout)
    if to_stdout:
        print(json.dumps(report))
    elif args.json is not None:
        Path(args.json).write_text(json.dumps(report, indent=1) + os.linesep, encoding="utf-8")
    return 0
