"""The load generator against the paced FakeDaemon: real streams over the real protocol."""
from __future__ import annotations

import asyncio
import io
import json
import math
import re
import sys
from pathlib import Path

import pytest
from paced_daemon import PacedDaemon

from pipeline.errors import DaemonNotRunning
from stages.contracts.params import InvalidParams
from pipeline.bench.report import format_comparison, plot_result
from pipeline.bench.serve_bench import compare_sync, main, pipeline_command, run_benchmark
from pipeline.bench.workload import BenchRequest, load_dataset, random_requests

pytestmark = pytest.mark.timeout(20)

LATENCY_KEYS = [f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "p90", "p99")]
TOP_KEYS = ["completed", "failed", "request_throughput", "output_throughput", "total_token_throughput",
            "peak_output_throughput"]


def test_cli_run_reports_every_metric(daemon: PacedDaemon, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "result.json"
    argv = ["--socket", str(daemon.socket_path), "--num-prompts", "12", "--input-len", "8:16", "--output-len", "2:8",
            "--request-rate", "200", "--seed", "5", "--json", str(out)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "Serving Benchmark Result" in table and "Mean TTFT (ms):" in table and "P99 E2EL (ms):" in table
    report = json.loads(out.read_text())
    for key in TOP_KEYS + LATENCY_KEYS:
        assert isinstance(report[key], (int, float)), key
    assert (report["completed"], report["failed"]) == (12, 0)
    requested = [r.max_tokens for r in random_requests(12, (8, 16), (2, 8), vocab_size=1024, min_token_id=2, seed=5)]
    records = report["requests"]
    assert [r["output_len"] for r in records] == requested  # the echo is longer than max_tokens
    assert all(r["success"] and r["error"] is None and len(r["itl_ms"]) == r["output_len"] - 1 for r in records)
    assert report["total_output_tokens"] == sum(requested)
    assert report["mean_ttft_ms"] > 0 and report["mean_tpot_ms"] > 0 and report["peak_output_throughput"] > 0
    assert report["mean_e2el_ms"] > report["mean_ttft_ms"]
    assert "Speculative" not in table and report["spec_decode_num_draft_tokens"] == 0  # the daemon drafted nothing


def test_a_run_reports_what_speculative_decoding_counted_during_it(
        daemon: PacedDaemon, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    daemon.speculative_base = (100, 80, 50)  # counted before the run: not the run's
    daemon.speculative_per_request = (4, 3, 2)
    out = tmp_path / "result.json"
    assert main(["--socket", str(daemon.socket_path), "--num-prompts", "6", "--input-len", "4", "--output-len", "3",
                 "--json", str(out)]) == 0
    table = capsys.readouterr().out
    for label, shown in (("Drafted tokens", "24"), ("Accepted tokens", "18"), ("Draft acceptance rate", "0.75"),
                         ("Mean accepted length", "2.50")):
        assert re.search(rf"^{label}:\s+{shown}$", table, re.MULTILINE), label
    report = json.loads(out.read_text())
    assert (report["spec_decode_num_draft_tokens"], report["spec_decode_num_accepted_tokens"],
            report["spec_decode_num_verifications"]) == (24, 18, 12)
    assert report["spec_decode_draft_acceptance_rate"] == 0.75
    assert report["spec_decode_mean_accepted_length"] == 2.5


def test_json_to_stdout_is_one_object(daemon: PacedDaemon, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--socket", str(daemon.socket_path), "--num-prompts", "3", "--input-len", "4", "--output-len", "2",
                 "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert report["completed"] == 3 and report["config"]["request_rate"] == "inf"
    assert "Serving Benchmark Result" in captured.err


def test_max_concurrency_bounds_streams_at_the_daemon(daemon: PacedDaemon) -> None:
    requests = random_requests(12, (10, 10), (6, 6), vocab_size=100, seed=0)
    result = asyncio.run(run_benchmark(daemon.socket_path, requests, request_rate=math.inf, max_concurrency=3))
    assert result.metrics.completed == 12
    assert daemon.peak_running == 3
    assert result.metrics.max_concurrent_requests <= 3


def test_without_a_limit_all_run_at_once(daemon: PacedDaemon) -> None:
    requests = random_requests(8, (10, 10), (6, 6), vocab_size=100, seed=0)
    asyncio.run(run_benchmark(daemon.socket_path, requests, request_rate=math.inf))
    assert daemon.peak_running > 3


def test_dataset_with_failures_counts_them(daemon: PacedDaemon, tmp_path: Path) -> None:
    dataset = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "hello world", "output_len": 4}, {"prompt": [5, 6, 7], "max_tokens": 2},
             {"prompt": "error:overloaded"}, {"prompt": "late-error:stage_failed", "output_len": 5},
             {"prompt": "abcdefghij"}]
    dataset.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    requests = load_dataset(dataset, (3, 3))
    assert [r.max_tokens for r in requests] == [4, 2, 3, 5, 3]
    assert [r.prompt_len for r in requests] == [None, 3, None, None, None]
    progress = io.StringIO()
    result = asyncio.run(run_benchmark(daemon.socket_path, requests, progress=progress))
    m = result.metrics
    assert (m.completed, m.failed) == (3, 2)
    records = result.records
    assert [(r.prompt_len, r.output_len) for r in records if r.success] == [(11, 4), (3, 2), (10, 3)]
    assert records[2].error is not None and "Overloaded" in records[2].error
    assert records[3].error is not None and "StageFailed" in records[3].error and records[3].latency_ms is None
    assert m.total_output_tokens == 9 and m.total_input_tokens == 24
    assert "5/5 requests, 2 failed" in progress.getvalue()


def test_bad_dataset_lines_name_the_line(tmp_path: Path) -> None:
    dataset = tmp_path / "bad.jsonl"
    dataset.write_text('{"prompt": "ok"}\n{"prompt": "x", "output_len": 0}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: output_len"):
        load_dataset(dataset, (4, 4))
    dataset.write_text('{"prompt": ""}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: prompt"):
        load_dataset(dataset, (4, 4))
    dataset.write_text('{"prompt": "a"}\n')
    with pytest.raises(ValueError, match="num_prompts is 2"):
        load_dataset(dataset, (4, 4), num_prompts=2)


def test_refusals_before_any_load(daemon: PacedDaemon, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(InvalidParams, match="top_p"):
        asyncio.run(run_benchmark(daemon.socket_path, [BenchRequest([1, 2], 2)], top_p=0.0))
    with pytest.raises(ValueError, match="max_concurrency"):
        asyncio.run(run_benchmark(daemon.socket_path, [BenchRequest([1, 2], 2)], max_concurrency=0))
    assert daemon.messages_of(object) == []  # nothing was sent
    with pytest.raises(DaemonNotRunning):
        asyncio.run(run_benchmark(tmp_path / "none.sock", [BenchRequest([1, 2], 2)]))
    assert main(["--socket", str(tmp_path / "none.sock"), "--num-prompts", "1"]) == 1
    assert "no pipeline daemon is listening" in capsys.readouterr().err


def test_plot_writes_a_png(daemon: PacedDaemon, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    requests = random_requests(6, (6, 6), (4, 4), vocab_size=100, seed=0)
    result = asyncio.run(run_benchmark(daemon.socket_path, requests))
    image = tmp_path / "latency.png"
    plot_result(result, image)
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.stat().st_size > 1000


@pytest.mark.timeout(30)
def test_compare_sync_runs_both_daemons_and_stops_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_PIPELINE_LOG", str(log))
    command = [sys.executable, str(Path(__file__).with_name("fake_pipeline_command.py"))]
    requests = random_requests(6, (8, 8), (6, 6), vocab_size=100, seed=0)
    async_result, sync_result = compare_sync(tmp_path, requests, max_concurrency=2, command=command)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [call[0] for call in calls] == ["start", "stop", "start", "stop"]
    assert "--no-async-scheduling" not in calls[0] and "--no-async-scheduling" in calls[2]
    assert all(call[call.index("--model") + 1] == str(tmp_path) and "--detach" in call for call in calls[::2])
    assert calls[0][calls[0].index("--socket") + 1] == calls[1][calls[1].index("--socket") + 1]
    assert async_result.metrics.completed == sync_result.metrics.completed == 6
    # The fake sync daemon waits 5 ms per token, the async one does not.
    assert sync_result.metrics.tpot.mean_ms > 4.0 > async_result.metrics.tpot.mean_ms
    table = format_comparison(async_result, sync_result)
    assert "async/sync" in table and "Mean TPOT (ms):" in table


def test_the_daemons_start_from_the_installed_command_or_else_from_this_interpreter(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkout on PYTHONPATH, not installed (no `pipeline` script beside the interpreter), still
    starts its daemons: through `python -m pipeline.cli`."""
    python = tmp_path / "bin" / "python3"
    python.parent.mkdir()
    monkeypatch.setattr(sys, "executable", str(python))
    assert pipeline_command() == [str(python), "-m", "pipeline.cli"]
    (python.parent / "pipeline").write_text("#!/bin/sh\n")
    assert pipeline_command() == [str(python.parent / "pipeline")]
