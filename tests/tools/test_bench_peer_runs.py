"""tools/bench/bench_peer.py's run plan: every run draws prompts of a seed of its own (the same for
both engines), the engine that serves first alternates between repeats, and each engine's /metrics
prefix-cache hit counter is read from its own metric."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"

PIPELINE_METRICS = """# HELP pipeline:prefix_cache_hits_total Admitted prompt tokens found in the prefix cache.
# TYPE pipeline:prefix_cache_hits_total counter
pipeline:prefix_cache_hits_total{model_name="peer-model"} 4096.0
pipeline:prefix_cache_hits_created{model_name="peer-model"} 1.7e9
pipeline:prefix_cache_hit_rate{model_name="peer-model"} 0.5
"""
VLLM_METRICS = """# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="peer-model"} 160.0
vllm:prefix_cache_hits_total{engine="1",model_name="peer-model"} 32.0
vllm:prefix_cache_queries_total{engine="0",model_name="peer-model"} 8192.0
"""


def run_in_bench_peer(code: str) -> object:
    """`code`'s printed JSON, run with bench_peer importable as a module (its folder first on the path)."""
    script = f"import sys, json; sys.path.insert(0, sys.argv[1]); import bench_peer; print(json.dumps({code}))"
    run = subprocess.run([sys.executable, "-c", script, str(TOOLS / "bench")], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_every_run_has_fresh_prompts_and_the_first_engine_alternates() -> None:
    seeds = run_in_bench_peer("[bench_peer.run_seed(d, r, i, 2) for d in range(2) for r in range(3) for i in range(2)]")
    assert len(set(seeds)) == len(seeds) == 12  # no two runs (dtype, repeat, concurrency) share prompts
    warmup = run_in_bench_peer("bench_peer.WARMUP_SEED")
    assert warmup not in seeds
    orders = run_in_bench_peer("[bench_peer.engine_order(r, ['vllm', 'pipeline']) for r in range(4)]")
    assert orders == [["vllm", "pipeline"], ["pipeline", "vllm"], ["vllm", "pipeline"], ["pipeline", "vllm"]]


def test_each_engines_prefix_hits_are_read_from_its_own_counter() -> None:
    hits = run_in_bench_peer(f"[bench_peer.prefix_hits({PIPELINE_METRICS!r}, 'pipeline'), "
                             f"bench_peer.prefix_hits({VLLM_METRICS!r}, 'vllm'), "
                             f"bench_peer.prefix_hits({VLLM_METRICS!r}, 'pipeline')]")
    assert hits == [4096.0, 192.0, 0.0]  # the _created sample and the rate gauge are not hits
