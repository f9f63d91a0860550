"""`pipeline bench` against real daemons on the tiny model: every metric in its JSON, no failures;
and `--compare-sync`, which starts an async and a sync daemon itself and stops both."""
from __future__ import annotations

from pathlib import Path

import pytest
from live_daemon import REAL_BACKEND, WORKLOAD, LiveDaemon, bench

from shm.naming import check_instance_id, instance_of, list_entries, pid_alive

pytestmark = pytest.mark.timeout(120)

LATENCIES = [f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "p90", "p99")]


def check_report(report: dict, num_prompts: int, output_lens: tuple[int, int] = (4, 12)) -> None:
    assert (report["completed"], report["failed"]) == (num_prompts, 0)
    for key in ("request_throughput", "output_throughput", "total_token_throughput", *LATENCIES):
        assert report[key] > 0, key
    assert len(report["requests"]) == num_prompts
    assert sum(r["output_len"] for r in report["requests"]) == report["total_output_tokens"]
    for record in report["requests"]:
        assert output_lens[0] <= record["output_len"] <= output_lens[1]  # ignore_eos: exactly the max_tokens drawn


def test_bench_against_a_live_daemon_reports_every_metric(live_daemon: LiveDaemon) -> None:
    check_report(bench("--socket", str(live_daemon.socket_path), "--num-prompts", "24", "--max-concurrency", "8",
                       *WORKLOAD), 24)


@pytest.mark.skipif(not REAL_BACKEND, reason="--compare-sync starts stage-process daemons")
def test_compare_sync_runs_both_real_daemons_and_stops_them(daemon_model: Path) -> None:
    before = set(list_entries())
    # Outputs long enough to stream in several deltas: the tiny model on the CPU finishes 12 tokens
    # in about 10 ms, and a hop that falls behind that long merges a whole request into one delta
    # (which leaves no inter-token latency to report).
    workload = [*WORKLOAD, "--output-len", "32:48"]
    report = bench("--compare-sync", "--model", str(daemon_model), "--num-prompts", "8", *workload)
    check_report(report["async"], 8, (32, 48))
    check_report(report["sync"], 8, (32, 48))
    assert report["async"]["config"]["async_scheduling"] is True
    assert report["sync"]["config"]["async_scheduling"] is False
    # Nothing of the two stopped daemons is left; names of live instances (another test's daemon
    # running beside this one under parallel workers) are not theirs.
    instances = {entry: instance_of(entry) for entry in set(list_entries()) - before}
    assert {entry for entry, instance in instances.items()
            if instance is None or not pid_alive(check_instance_id(instance))} == set()
