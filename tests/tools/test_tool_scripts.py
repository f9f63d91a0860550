"""The scripts in tools/ run as scripts from any directory: none shadows a standard-library module
(tools/profiling/profile_daemon.py is not `profile`, which torch reaches through cProfile as soon as it
runs a model), none touches sys.path, and none imports another script."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
MODULES = sorted(TOOLS.rglob("*.py"))
SCRIPTS = [p for p in MODULES if 'if __name__ == "__main__":' in p.read_text()]
FOLDERS = sorted({p.parent for p in MODULES})


def test_no_tool_file_or_folder_shadows_a_standard_library_module() -> None:
    names = {p.stem: p for p in MODULES} | {folder.name: folder for folder in FOLDERS}
    assert {name: str(path) for name, path in names.items() if name in sys.stdlib_module_names} == {}


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: str(p.relative_to(TOOLS.parent)))
def test_with_a_tools_folder_first_on_the_path_torch_imports_the_standard_profile_module(folder: Path) -> None:
    """Python puts a script's own folder first on sys.path: what cProfile finds there."""
    code = "import sys; sys.path.insert(0, sys.argv[1]); import cProfile, profile; print(profile.__file__)"
    run = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert Path(run.stdout.strip()).parent != folder


@pytest.mark.parametrize("module", MODULES, ids=lambda p: str(p.relative_to(TOOLS)))
def test_no_tool_touches_sys_path_or_imports_a_script_or_a_private_name(module: Path) -> None:
    tree = ast.parse(module.read_text())
    assert "sys.path" not in {ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    siblings = {p.stem: p for p in MODULES if p.parent == module.parent}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in siblings:
            assert siblings[node.module] not in SCRIPTS, f"{module.name} imports the script {node.module}"
            assert not [a.name for a in node.names if a.name.startswith("_")], module.name
        elif isinstance(node, ast.Import):
            assert not [a.name for a in node.names if siblings.get(a.name) in SCRIPTS], module.name


# Runs each script as `python SCRIPT --help` would, one after another in one interpreter (torch is
# imported once, not once per script): its own folder first on sys.path, it as __main__, and every
# module loaded from tools/ forgotten after it, so that no script finds a module another one imported.
HELP_RUNNER = """import contextlib, io, json, os, runpy, sys, traceback
tools, scripts = sys.argv[1], sys.argv[2:]
path = sys.path[1:]
answers = {}
for script in scripts:
    before = set(sys.modules)
    sys.path[:] = [os.path.dirname(script), *path]
    sys.argv = [script, "--help"]
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    for name in set(sys.modules) - before:
        if (getattr(sys.modules[name], "__file__", None) or "").startswith(tools):
            del sys.modules[name]
    answers[script] = {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
sys.__stdout__.write(json.dumps(answers))
"""


@pytest.fixture(scope="module")
def help_answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every script's answer to --help, each run from a directory that is not the checkout."""
    run = subprocess.run([sys.executable, "-c", HELP_RUNNER, str(TOOLS), *map(str, SCRIPTS)], capture_output=True,
                         text=True, timeout=110, cwd=tmp_path_factory.mktemp("elsewhere"), stdin=subprocess.DEVNULL,
                         env=os.environ)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(TOOLS)))
def test_every_script_answers_help_from_another_directory(script: Path, help_answers: dict[str, dict]) -> None:
    run = help_answers[str(script)]
    assert run["returncode"] == 0, run["stderr"][-3000:]
    assert "usage" in run["stdout"].lower(), run["stdout"][:500]


def quick_json_report(script: str, timeout_s: float, *args: str) -> dict:
    """What `tools/<script> --quick --json [args]` prints, parsed (`script` relative to tools/)."""
    run = subprocess.run([sys.executable, str(TOOLS / script), "--quick", "--json", *args], capture_output=True,
                         text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


@pytest.mark.timeout(120)
def test_bench_e2e_quick_runs_the_model_in_process_and_reports_both_paths() -> None:
    report = quick_json_report("bench/bench_e2e.py", timeout_s=110)
    assert report["daemon_tok_s"] > 0 and report["offline_tok_s"] > 0
    assert report["ratio"] == pytest.approx(report["daemon_tok_s"] / report["offline_tok_s"])


@pytest.mark.timeout(180)
def test_bench_recovery_quick_kills_every_stage_and_loses_no_request() -> None:
    report = quick_json_report("bench/bench_recovery.py", timeout_s=170)
    assert [row["stage"] for row in report["stages"]] == ["runner", "scheduler", "detokenizer", "tokenizer0"]
    assert all(row["lost"] == 0 and 0 < row["first_resumed_ms"] <= row["all_resumed_ms"] for row in report["stages"])
    # The frontend's stages restart alone: the resumed requests' replays find the engine's prefix cache.
    assert [row["restarted"] for row in report["stages"]] == ["all", "all", "group", "group"]
    assert all(row["replay_hit_tokens"] > 0 for row in report["stages"][2:])


@pytest.mark.timeout(150)
def test_bench_router_quick_reports_every_policy_and_the_routers_cost() -> None:
    report = quick_json_report("bench/bench_router.py", timeout_s=140)
    assert (report["replicas"], report["conversations"], report["turns"]) == (3, 4, 2)
    assert set(report["policies"]) == {"prefix", "round-robin", "least-load"}
    for policy, row in report["policies"].items():
        assert row["requests"] == 4 * 2, policy
        assert 0 <= row["hit_rate"] <= 1 and 0 < row["affinity_hit_rate"] < 1, policy
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] and row["output_tok_s"] > 0, policy
        assert row["max_over_mean_requests"] >= 1, policy
    prefix = report["policies"]["prefix"]
    assert prefix["hit_rate"] > 0 and prefix["prefix_owner_routes"] > 0  # second turns meet their history
    assert report["prefix_over_round_robin_hit_rate"] == pytest.approx(
        prefix["hit_rate"] / max(report["policies"]["round-robin"]["hit_rate"], 1e-9))
    for path in ("direct", "router"):
        streamed = report["streamed"][path]
        assert streamed["failed"] == 0 and streamed["chunks"] > 0 and streamed["output_tok_s"] > 0, path
    assert report["streamed"]["router"]["router_cpu_us_per_chunk"] > 0
    assert report["added_latency"]["direct_ms"] > 0 and report["added_latency"]["router_ms"] > 0


@pytest.mark.timeout(300)
def test_bench_overhead_quick_reports_every_batch_of_both_daemons_as_one_json_object() -> None:
    report = quick_json_report("bench/bench_overhead.py", timeout_s=290)
    assert report["device_ms"] == 5.0
    for mode in ("async", "sync"):
        assert set(report[mode]) == {"1", "64", "256"}
        for batch in report[mode].values():
            assert {"step_ms", "exposed_pct", "deliver_p50_ms", "deliver_p99_ms", "cpu_ms_per_step"} <= set(batch)
            assert set(batch["cpu_ms_per_step"]) == {"daemon", "tokenizer0", "scheduler", "runner", "detokenizer",
                                                     "client"}


@pytest.mark.timeout(150)
def test_bench_overhead_structured_reports_each_fraction_and_the_mask_time() -> None:
    report = quick_json_report("bench/bench_overhead.py", 140, "--batches", "64", "--structured", "0,1")
    for mode in ("async", "sync"):
        assert set(report[mode]) == {"64 s0", "64 s1"}
        for batch in report[mode].values():
            assert batch["step_ms"] >= 5.0 and batch["deliver_p50_ms"] > 0
    assert report["grammar_mask_us"]["p50"] > 0


@pytest.mark.timeout(150)
def test_bench_overhead_http_measures_the_daemons_cpu_of_sse_streams_without_delivery() -> None:
    report = quick_json_report("bench/bench_overhead.py", 140, "--batches", "64", "--http", "--stream-interval", "2")
    assert report["http"] is True and report["stream_interval"] == 2
    for mode in ("async", "sync"):
        batch = report[mode]["64"]
        assert batch["step_ms"] >= 5.0 and batch["cpu_us_per_token"]["daemon"] > 0
        assert batch["deliver_p50_ms"] is None and batch["deliver_p99_ms"] is None  # frames do not name tokens


def test_bench_grammar_quick_measures_llguidance_on_the_tiny_vocabulary() -> None:
    report = quick_json_report("micro/bench_grammar.py", 120, "--library", "llguidance")
    tiny = report["llguidance"]["tiny_1024"]
    assert set(tiny["compile_ms"]) == {"json_schema", "json_object", "regex", "choice", "lark"}
    assert 0 < tiny["mask_us_p50"] <= tiny["mask_us_p99"] and tiny["num_tokens"] > 20


def test_bench_overhead_clients_run_in_a_process_without_torch() -> None:
    """Its clients are measured: torch's objects would make every full garbage collection there a long pause."""
    code = "import sys; sys.path.insert(0, sys.argv[1]); import bench_overhead; print('torch' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code, str(TOOLS / "bench")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"


def check_quick_gpu_bench(report: dict) -> None:
    """What bench_gpu.py --quick reports: every path of ours, transformers beside it, the floor, the busy share."""
    assert report["setup"]["batches"] == [1, 4] and report["model"]["tokenizer_size"] < report["model"]["vocab_size"]
    ours = {(r["scheduling"], r["graphs"], r["batch"]) for r in report["ours"]}
    assert ours == {(s, g, b) for s in ("async", "sync") for g in (True, False) for b in (1, 4)}
    for run in report["ours"]:
        assert run["tpot_ms"] > 0 and run["num_steady_steps"] > 0
        assert run["output_tok_s"] == pytest.approx(run["batch"] * report["setup"]["output_len"] / run["elapsed_s"])
    assert [r["batch"] for r in report["transformers_generate"]] == [1, 4]
    # continuous batching either ran at every batch or says why not
    cb = report.get("transformers_continuous_batching", [])
    assert len(cb) == 2 or any("continuous batching" in note for note in report["notes"])
    assert report["floor"]["bandwidth_gb_s"] > 0
    assert report["floor"]["weight_floor_ms"] == pytest.approx(
        report["model"]["weight_bytes"] / report["floor"]["bandwidth_gb_s"] / 1e6)
    assert [b["batch"] for b in report["busy"]] == [1, 4]
    assert all(b["steps"] == 5 and b["aten_ops_per_step"] > 0 for b in report["busy"])


def test_bench_gpu_refuses_unknown_sections_and_bad_batches() -> None:
    for args, message in ((["--sections", "floor,gpu"], "unknown ['gpu']"), (["--batches", "1,x"], "--batches"),
                          (["--busy-batches", "0"], "--busy-batches must be positive"),
                          (["--configs", "async-graphs,async-fast"], "unknown ['async-fast']")):
        run = subprocess.run([sys.executable, str(TOOLS / "gpu" / "bench_gpu.py"), "--quick", *args],
                             capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert run.returncode == 2 and message in run.stderr


def test_steady_decode_excludes_prefill_and_the_finishing_steps() -> None:
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import bench_gpu; "
            "print(bench_gpu.steady_step_times({'step_ends': [0.0, 5.0, 6.0, 6.5, 7.5, 9.0, 20.0], "
            "'all_started': 1, 'first_finished': 4}))")
    run = subprocess.run([sys.executable, "-c", code, str(TOOLS / "gpu")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[1.0, 0.5, 1.0]"


def test_the_busy_share_counts_the_device_span_and_names_the_longest_wait() -> None:
    """Two steps of two kernels each: 1 us between launches inside a step, 10 us waiting for the
    host between steps, the window's wall time longer than the device span."""
    code = """
import json, sys
from types import SimpleNamespace as NS
sys.path.insert(0, sys.argv[1])
from torch.autograd import DeviceType
from gpu_profile import summarize_profile
spans = [("Memcpy HtoD", 0, 5), ("gather", 15, 35), ("matmul", 36, 86), ("Memcpy HtoD", 86, 91), ("gather", 101, 121),
         ("matmul", 122, 172)]
events = [NS(name=n, device_type=DeviceType.CUDA, time_range=NS(start=a, end=b)) for n, a, b in spans]
print(json.dumps(summarize_profile(events, 200e-6, 2, "cuda", 64)))
"""
    run = subprocess.run([sys.executable, "-c", code, str(TOOLS / "gpu")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["device_ms_per_step"] == pytest.approx(0.075)  # 150 us busy over 2 steps
    assert result["busy_share"] == pytest.approx(150 / 172) and result["busy_share_wall"] == pytest.approx(150 / 200)
    assert result["short_gaps_ms_per_step"] == pytest.approx(0.001)  # 1 us + 1 us over 2 steps
    assert result["long_gaps_ms_per_step"] == pytest.approx(0.010)  # 10 us + 10 us over 2 steps
    assert result["kernels_per_step"] == 2 and result["copies_per_step"] == 1
    assert result["longest_waits"] == [{"after": "Memcpy HtoD", "before": "gather", "ms_per_step": pytest.approx(0.010)}]


@pytest.mark.timeout(200)
def test_gpu_check_dry_run_walks_every_phase_and_writes_the_summary(tmp_path: Path) -> None:
    run = subprocess.run(["bash", str(TOOLS / "gpu" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=190, stdin=subprocess.DEVNULL)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert summary["dry_run"] is True and summary["ok"] is True
    phases = {p["name"]: p for p in summary["phases"]}
    assert list(phases) == ["install", "versions", "cpu_precision", "bench", "cuda_tests", "device_tests"]
    assert phases["install"]["status"] == phases["cuda_tests"]["status"] == phases["cpu_precision"]["status"] == "skipped"
    assert all(phases[name]["rc"] == 0 for name in ("versions", "device_tests", "bench"))
    # the tests get what is left of the budget, so the whole run ends within 9 minutes
    spent_before_tests = sum(p["seconds"] for p in summary["phases"][:4])
    assert phases["device_tests"]["timeout_s"] + spent_before_tests <= 9 * 60 - 5
    assert json.loads((tmp_path / "versions.log").read_text())["torch"]
    assert "tests collected" in (tmp_path / "device_tests.log").read_text()
    # the dry run's benchmark is bench_gpu.py --quick, whole
    check_quick_gpu_bench(json.loads((tmp_path / "bench.json").read_text()))


@pytest.mark.timeout(120)
def test_cpu_precision_measures_each_linear_path_attention_and_the_engine() -> None:
    run = subprocess.run([sys.executable, str(TOOLS / "gpu" / "cpu_precision.py"), "--variant", "plain-linear"],
                         capture_output=True, text=True, timeout=110, cwd=TOOLS.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(report["linear"]) == {"1", "3", "32", "512"}
    # float32 on this machine: rounding only, every path
    assert all(0 < error < 1e-5 for paths in report["linear"].values() for error in paths.values())
    assert 0 < report["attention"] < 1e-5
    engine = report["engine"]  # float32 whatever "auto" means on this CPU
    assert len(engine["tokens"]) == len(engine["top2"]) == 8
    assert all(first >= second for first, second in engine["top2"])


def test_gpu_check_refuses_an_unknown_argument(tmp_path: Path) -> None:
    run = subprocess.run(["bash", str(TOOLS / "gpu" / "gpu_check.sh"), "--fast"], capture_output=True, text=True,
                         timeout=30)
    assert run.returncode == 2 and "unknown argument '--fast'" in run.stderr


@pytest.mark.timeout(150)
def test_bench_tp_quick_reports_one_and_two_ranks_side_by_side() -> None:
    report = quick_json_report("micro/bench_tp.py", timeout_s=140)
    layers = report["model"]["num_layers"]
    one, two = report["ranks"]["1"], report["ranks"]["2"]
    for batch in ("batch1", "batch32"):
        assert one[batch]["step_ms"] > 0 and two[batch]["step_ms"] > 0
        assert one[batch]["all_reduce_per_step"] == 0
        # Two per layer (o and down) and one for the vocab-parallel embedding; one gather, one broadcast.
        assert two[batch]["all_reduce_per_step"] == 2 * layers + 1
        assert two[batch]["gather_logits_per_step"] == two[batch]["broadcast_tokens_per_step"] == 1
        assert two[batch]["plan_send_per_step"] == 1
    assert 0.45 < report["ratios"]["weight_bytes_rank0_tp2_over_tp1"] < 0.55
    assert set(report["plan_ring_us"]) == {"1_readers", "2_readers"}
    assert all(v["gather_logits_us"] > 0 and v["distributed_argmax_us"] > 0 for v in report["sampling"].values())
