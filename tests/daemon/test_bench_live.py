"""`pipeline bench` against real daemons on the tiny model: every metric in its JSON, no failures;
and `--compare-sync`, which starts an async and a sync daemon itself and stops both."""
from __future__ import annotations

from pathlib import Path

import pytest
from live_daemon import REAL_BACKEND, WORKLOAD, LiveDaemon, bench

from shm.naming import list_entries

pytestmark = pytest.mark.timeout(120)

LATENCIES = [f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "p90", "p99")]


def check_report(report: dict, num_prompts: int) -> None:
    assert (report["completed"], report["failed"]) == (num_prompts, 0)
    for key in ("request_throughput", "output_throughput", "total_token_throughput", *LATENCIES):
        assert report[key] > 0, key
    assert len(report["requests"]) == num_prompts
    assert sum(r["output_len"] for r in report["requests"]) == report["total_output_tokens"]
    for record in report["requests"]:
        assert 4 <= record["output_len"] <= 12  # ignore_eos: exactly the max_tokens drawn


def test_bench_against_a_live_daemon_reports_every_metric(live_daemon: LiveDaemon) -> None:
    check_report(bench("--socket", str(live_daemon.socket_path), "--num-prompts", "24", "--max-concurrency", "8",
                       *WORKLOAD), 24)


@pytest.mark.skipif(not REAL_BACKEND, reason="--compare-sync starts stage-process daemons")
def test_compare_sync_runs_both_real_daemons_and_stops_them(daemon_model: Path) -> None:
    before = set(list_entries())
    report = bench("--compare-sync", "--model", str(daemon_model), "--num-prompts", "8", *WORKLOAD)
    check_report(report["async"], 8)
    check_report(report["sync"], 8)
    assert report["async"]["config"]["async_scheduling"] is True
    assert report["sync"]["config"]["async_scheduling"] is False
    assert set(list_entries()) - before == set()
