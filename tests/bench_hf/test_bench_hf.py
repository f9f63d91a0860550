"""tools/bench/bench_hf.py end to end: transformers and a live daemon on one tiny checkpoint, one JSON object out."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench" / "bench_hf.py"


@pytest.mark.timeout(90)
def test_quick_run_reports_both_paths_and_matching_greedy_outputs() -> None:
    run = subprocess.run([sys.executable, str(TOOL), "--quick", "--json"], capture_output=True, text=True,
                         timeout=80, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 1, run.stdout  # exactly one JSON object; the table went to stderr
    report = json.loads(lines[0])
    for key in ("hf_tok_s", "daemon_tok_s", "ratio", "hf_s", "daemon_s", "num_output_tokens", "hf_computed_tokens",
                "num_prompts", "batch_size", "threads"):
        assert report[key] > 0, key
    assert report["ratio"] == pytest.approx(report["daemon_tok_s"] / report["hf_tok_s"])
    low, high = report["output_len"]
    assert low * report["num_prompts"] <= report["num_output_tokens"] <= high * report["num_prompts"]
    # Static batches run to their longest request, so they generate at least the useful tokens.
    assert report["hf_computed_tokens"] >= report["num_output_tokens"]
    # The longest prompt of each batch has no padding: its greedy output must be the daemon's.
    assert report["num_unpadded"] >= report["num_prompts"] // report["batch_size"]
    assert report["num_unpadded_matched"] == report["num_unpadded"]
    assert "transformers generate" in run.stderr and "daemon" in run.stderr


@pytest.mark.timeout(30)
def test_a_bad_length_range_is_refused_by_name() -> None:
    run = subprocess.run([sys.executable, str(TOOL), "--quick", "--input-len", "9:3"], capture_output=True,
                         text=True, timeout=25, stdin=subprocess.DEVNULL)
    assert run.returncode == 2
    assert "--input-len" in run.stderr and "'9:3'" in run.stderr
    assert run.stdout == ""
