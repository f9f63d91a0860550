"""Serving benchmark reports: the table, the async/sync comparison, and the plot."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.bench.metrics import BenchResult, LatencyStats

TABLE_WIDTH = 50


_LATENCIES = (("ttft", "TTFT", "Time to First Token"), ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
              ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency"))


def _rows(result: BenchResult) -> list[tuple[str, str, float | int] | str]:
    """(label, json key, value) rows, and section titles, shared by the table and the comparison;
    speculative decoding's only where the run verified drafts."""
    m = result.metrics
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
    spec = result.speculative
    if spec.num_draft_tokens > 0:
        rows += ["Speculative Decoding",
                 ("Drafted tokens", "spec_decode_num_draft_tokens", spec.num_draft_tokens),
                 ("Accepted tokens", "spec_decode_num_accepted_tokens", spec.num_accepted_tokens),
                 ("Draft acceptance rate", "spec_decode_draft_acceptance_rate", spec.draft_acceptance_rate),
                 ("Mean accepted length", "spec_decode_mean_accepted_length", spec.mean_accepted_length)]
    return rows


def _number(value: float | int) -> str:
    return str(value) if isinstance(value, int) else f"{value:.2f}"


def format_table(result: BenchResult) -> str:
    lines = [f"{' Serving Benchmark Result ':=^{TABLE_WIDTH}}"]
    for row in _rows(result):
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
    for a_row, s_row in zip(_rows(async_result), _rows(sync_result)):
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
