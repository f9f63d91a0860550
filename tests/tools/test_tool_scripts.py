"""The scripts in tools/ run as scripts: tools/profile.py must not shadow the standard library's
`profile`, which torch reaches through cProfile as soon as it runs a model."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
SCRIPTS = sorted(p for p in TOOLS.glob("*.py") if p.name != "checkout_path.py")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_tool_puts_the_checkout_first_before_importing_anything_of_its_own(script: Path) -> None:
    source = script.read_text()
    first_own_import = re.search(r"^(from|import) (pipeline|stages|shm|bench_\w+)\b", source, re.M)
    guard = re.search(r"^import checkout_path\b", source, re.M)
    assert guard is not None, f"{script.name} does not import checkout_path"
    assert first_own_import is None or guard.start() < first_own_import.start(), script.name


def test_with_the_path_a_tool_sees_torch_imports_the_standard_profile_module() -> None:
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import checkout_path, cProfile, profile; "
            "print(profile.__file__)")
    run = subprocess.run([sys.executable, "-c", code, str(TOOLS)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert Path(run.stdout.strip()).parent != TOOLS


def quick_json_report(script: str, timeout_s: float) -> dict:
    """What `tools/<script> --quick --json` prints, parsed."""
    run = subprocess.run([sys.executable, str(TOOLS / script), "--quick", "--json"], capture_output=True, text=True,
                         timeout=timeout_s, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


@pytest.mark.timeout(120)
def test_bench_e2e_quick_runs_the_model_in_process_and_reports_both_paths() -> None:
    report = quick_json_report("bench_e2e.py", timeout_s=110)
    assert report["daemon_tok_s"] > 0 and report["offline_tok_s"] > 0
    assert report["ratio"] == pytest.approx(report["daemon_tok_s"] / report["offline_tok_s"])


@pytest.mark.timeout(180)
def test_bench_recovery_quick_kills_every_stage_and_loses_no_request() -> None:
    report = quick_json_report("bench_recovery.py", timeout_s=170)
    assert [row["stage"] for row in report["stages"]] == ["runner", "scheduler", "detokenizer", "tokenizer0"]
    assert all(row["lost"] == 0 and 0 < row["first_resumed_ms"] <= row["all_resumed_ms"] for row in report["stages"])


@pytest.mark.timeout(300)
def test_bench_overhead_quick_reports_every_batch_of_both_daemons_as_one_json_object() -> None:
    report = quick_json_report("bench_overhead.py", timeout_s=290)
    assert report["device_ms"] == 5.0
    for mode in ("async", "sync"):
        assert set(report[mode]) == {"1", "64", "256"}
        for batch in report[mode].values():
            assert {"step_ms", "exposed_pct", "deliver_p50_ms", "deliver_p99_ms", "cpu_ms_per_step"} <= set(batch)
            assert set(batch["cpu_ms_per_step"]) == {"daemon", "tokenizer0", "scheduler", "runner", "detokenizer",
                                                     "client"}


def test_bench_overhead_clients_run_in_a_process_without_torch() -> None:
    """Its clients are measured: torch's objects would make every full garbage collection there a long pause."""
    code = "import sys; sys.path.insert(0, sys.argv[1]); import bench_overhead; print('torch' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code, str(TOOLS)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"
