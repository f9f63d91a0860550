"""The router: its policies side by side on a multi-turn chat workload, and its own cost.

Starts three daemons (`pipeline start --port`) on a tiny model and, for each policy (prefix,
round-robin, least-load), a router in front of them; runs the multi-turn chat workload
(pipeline/bench/multiturn.py: conversations side by side, each turn carrying the history, shared
system prompts) through it, each policy with conversations of its own so that no policy finds
another's prefixes. Reports per policy the fleet's prefix-cache hit rate (from the daemons' own
metrics: hit rate x prompt tokens, before and after) beside the rate perfect routing would get on
the same turns (pipeline/router/affinity.py: one replica whose cache never evicts), TTFT p50/p99
of the turns, output tokens/s and how evenly requests spread. Then the router's own cost, against a direct connection to one
daemon in the same run: the latency it adds to a one-token request (median of sequential ones),
and the CPU time the router process spends per streamed chunk (the daemon's own per chunk beside
it, for scale) on the serving benchmark's streamed workload.

    python tools/bench/bench_router.py [--quick] [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from pipeline.bench.daemon import cpu_s, engine_options, run_target, start_daemon
from pipeline.bench.multiturn import fleet_prefix_hit_tokens, run_workload, scrape_metric
from pipeline.bench.targets import HttpTarget
from pipeline.bench.workload import random_requests
from pipeline.client import Client
from pipeline.models.tiny_model import make_tiny_model
from pipeline.router.affinity import affinity_hit_rate
from pipeline.router.prefix import PrefixKeyer

POLICIES = ("prefix", "round-robin", "least-load")
NUM_REPLICAS = 3
BLOCK_SIZE = 16  # the daemons' (engine_options leave the default)
ROUTER_START_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_router(model: Path, urls: list[str], policy: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "pipeline.cli", "router", "--port", str(port), "--model", str(model),
               "--policy", policy, "--health-interval", "0.2"]
    for url in urls:
        command += ["--backend", url]
    log = open(log_path, "wb")  # noqa: SIM115 - lives as long as the router
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ROUTER_START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the router exited: {log_path.read_text()}")
        try:
            health = httpx.get(f"{url}/health", timeout=2).json()
            if sum(b["healthy"] for b in health["backends"].values()) == len(urls):
                return process, url
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"the router did not see its backends within {ROUTER_START_S} s")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def run_policy(model: Path, urls: list[str], policy: str, seed: int, directory: Path, args: argparse.Namespace) -> dict:
    process, url = start_router(model, urls, policy, directory / f"router-{policy}.log")
    try:
        hits_before, total_before = fleet_prefix_hit_tokens(urls)
        result = asyncio.run(run_workload(url, num_conversations=args.conversations, num_turns=args.turns,
                                          max_tokens=args.max_tokens, seed=seed))
        hits, total = fleet_prefix_hit_tokens(urls)
        per_backend = [scrape_metric(url, f'pipeline:router_backend_requests_total{{backend="{u}"}}') for u in urls]
        prefix_owner = scrape_metric(url, 'pipeline:router_routed_total{route="prefix_owner"}')
    finally:
        stop(process)
    ttft_ms = np.array([turn.ttft_s * 1000 for turn in result.turns])
    tokens = sum(turn.num_tokens for turn in result.turns)
    mean = sum(per_backend) / len(per_backend)
    return {"hit_rate": (hits - hits_before) / (total - total_before),
            "affinity_hit_rate": affinity_hit_rate(result.turns, PrefixKeyer(model, BLOCK_SIZE, 1)), "ttft_p50_ms": float(np.percentile(ttft_ms, 50)),
            "ttft_p99_ms": float(np.percentile(ttft_ms, 99)), "output_tok_s": tokens / result.wall_s,
            "requests": len(result.turns), "max_over_mean_requests": max(per_backend) / mean,
            "prefix_owner_routes": prefix_owner}


def added_latency(direct: str, routed: str, num_requests: int) -> dict:
    """Median latency of sequential one-token completions, direct and through the router, alternated."""
    body = {"model": "default", "prompt": "Latency probe", "max_tokens": 1, "temperature": 0}
    times: dict[str, list[float]] = {"direct": [], "router": []}
    with httpx.Client(timeout=30) as client:
        for _ in range(num_requests):
            for name, url in (("direct", direct), ("router", routed)):
                start = time.perf_counter()
                response = client.post(f"{url}/v1/completions", json=body)
                times[name].append(time.perf_counter() - start)
                response.raise_for_status()
    direct_ms, router_ms = (statistics.median(times[n]) * 1000 for n in ("direct", "router"))
    return {"direct_ms": direct_ms, "router_ms": router_ms, "added_ms": router_ms - direct_ms}


def streamed_cost(direct: str, routed: str, router_pid: int, daemon_pid: int, requests: list, rounds: int) -> dict:
    """Each path `rounds` times, alternated; medians over the rounds."""
    runs: dict[str, list[dict]] = {"direct": [], "router": []}
    for _ in range(rounds):
        for name, url in (("direct", direct), ("router", routed)):
            router_before, daemon_before = cpu_s(router_pid), cpu_s(daemon_pid)
            result = asyncio.run(run_target(lambda url=url: HttpTarget(url), requests))
            router_used, daemon_used = cpu_s(router_pid) - router_before, cpu_s(daemon_pid) - daemon_before
            chunks = sum(len(record.chunk_tokens) for record in result.records)
            runs[name].append({"output_tok_s": result.metrics.output_throughput,
                               "ttft_p50_ms": result.metrics.ttft.median_ms, "failed": result.metrics.failed,
                               "chunks": chunks, "router_cpu_us_per_chunk": router_used / chunks * 1e6,
                               "daemon_cpu_us_per_chunk": daemon_used / chunks * 1e6})
    return {name: {key: statistics.median(run[key] for run in results) for key in results[0]}
            for name, results in runs.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--quick", action="store_true", help="a smaller workload: a smoke run")
    args = parser.parse_args()
    args.conversations, args.turns, args.max_tokens = (4, 2, 2) if args.quick else (12, 4, 8)
    num_streamed, num_probes, rounds = (16, 5, 1) if args.quick else (128, 40, 3)
    directory = Path(tempfile.mkdtemp(prefix="pl-router-"))
    model = make_tiny_model(directory / "model", "llama", seed=0)
    daemons: list[subprocess.Popen] = []
    urls: list[str] = []
    report: dict = {"replicas": NUM_REPLICAS, "conversations": args.conversations, "turns": args.turns,
                    "max_tokens": args.max_tokens, "policies": {}}
    try:
        for i in range(NUM_REPLICAS):
            run_dir = directory / f"run{i}"
            run_dir.mkdir(mode=0o700)
            options = engine_options(max_model_len=2048, num_kv_blocks=2048) + [
                "--port", "0", "--served-model-name", "default"]
            daemons.append(start_daemon(model, run_dir, "real", options))
            with Client(run_dir / "pipeline.sock", timeout_s=5) as client:
                urls.append(client.health().http_url)
        for seed, policy in enumerate(POLICIES):
            report["policies"][policy] = run_policy(model, urls, policy, seed, directory, args)
        router, routed = start_router(model, urls[:1], "prefix", directory / "router-cost.log")
        try:
            report["added_latency"] = added_latency(urls[0], routed, num_probes)
            with Client(directory / "run0" / "pipeline.sock") as client:
                stats = client.stats()
            requests = random_requests(num_streamed, (64, 128), (64, 64), vocab_size=stats.vocab_size,
                                       special_token_ids=stats.special_token_ids, seed=0)
            report["streamed"] = streamed_cost(urls[0], routed, router.pid, daemons[0].pid, requests, rounds)
        finally:
            stop(router)
    finally:
        for daemon in daemons:
            stop(daemon)
        shutil.rmtree(directory, ignore_errors=True)
    policies = report["policies"]
    report["prefix_over_round_robin_hit_rate"] = policies["prefix"]["hit_rate"] / max(
        policies["round-robin"]["hit_rate"], 1e-9)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{NUM_REPLICAS} daemons, {args.conversations} conversations x {args.turns} turns, {args.max_tokens} "
          "tokens per reply, all conversations at once")
    print(f"{'policy':<12} {'hit rate':>9} {'affinity':>8} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'tok/s':>8} "
          f"{'max/mean reqs':>14}")
    for policy, row in policies.items():
        print(f"{policy:<12} {row['hit_rate']:>9.3f} {row['affinity_hit_rate']:>8.3f} {row['ttft_p50_ms']:>12.1f} {row['ttft_p99_ms']:>12.1f} "
              f"{row['output_tok_s']:>8.1f} {row['max_over_mean_requests']:>14.2f}")
    print(f"prefix / round-robin hit rate: {report['prefix_over_round_robin_hit_rate']:.2f}")
    latency = report["added_latency"]
    print(f"one-token request, median: direct {latency['direct_ms']:.2f} ms, through the router "
          f"{latency['router_ms']:.2f} ms (+{latency['added_ms']:.2f} ms)")
    print(f"{num_streamed} streamed requests at once, 64 tokens each, median of {rounds} alternated runs:")
    print(f"{'path':<8} {'tok/s':>8} {'TTFT p50 ms':>12} {'router CPU us/chunk':>20} {'daemon CPU us/chunk':>20}")
    for name, row in report["streamed"].items():
        print(f"{name:<8} {row['output_tok_s']:>8.1f} {row['ttft_p50_ms']:>12.1f} {row['router_cpu_us_per_chunk']:>20.1f} "
              f"{row['daemon_cpu_us_per_chunk']:>20.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
