"""The OpenAI HTTP API against the Unix socket: one daemon, the same streamed workload through each.

Starts one daemon (`pipeline start --port 0`) on a tiny model, then runs the serving benchmark
(pipeline/bench) through the socket and through HTTP (`/v1/completions`, streamed), alternately,
`--rounds` times each. Reports output tokens/s of each path, their ratio, and the CPU time the
daemon process and the benchmark's own client spent per streamed chunk (one token per chunk
here), read from /proc and getrusage around each run. `http_front_us_per_chunk` is the daemon's
CPU per chunk through HTTP less that through the socket: what the HTTP front itself costs.
`--baseline DIR` also runs the daemon of another checkout of this repository (`git worktree add
DIR REV`) in the same rounds, so a change is measured side by side with the old code.

    python tools/bench/bench_http.py [--quick] [--json] [--rounds N] [--num-prompts N] [--baseline DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from pipeline.bench.daemon import cpu_s, engine_options, own_cpu_s, run_target, start_daemon
from pipeline.bench.targets import HttpTarget, SocketTarget
from pipeline.bench.workload import random_requests
from pipeline.client import Client
from pipeline.models.tiny_model import make_tiny_model


def start_http_daemon(model: Path, run_dir: Path, checkout: Path | None = None) -> tuple[subprocess.Popen, Path, str]:
    """A tiny CPU daemon, serving HTTP on a free port too; (process, socket, HTTP URL)."""
    options = engine_options(max_model_len=1024, num_kv_blocks=4096) + ["--max-num-seqs", "256", "--port", "0"]
    process = start_daemon(model, run_dir, "real", options, checkout)
    socket_path = run_dir / "pipeline.sock"
    with Client(socket_path, timeout_s=5) as client:
        return process, socket_path, client.health().http_url


def measure(target: object, requests: list, pid: int) -> dict[str, float]:
    daemon_before, own_before = cpu_s(pid), own_cpu_s()
    result = asyncio.run(run_target(target, requests))
    daemon_used, own_used = cpu_s(pid) - daemon_before, own_cpu_s() - own_before
    metrics = result.metrics
    chunks = sum(len(record.chunk_tokens) for record in result.records)
    return {"output_tok_s": metrics.output_throughput, "failed": metrics.failed, "chunks": chunks,
            "daemon_cpu_us_per_chunk": daemon_used / chunks * 1e6, "client_cpu_us_per_chunk": own_used / chunks * 1e6}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--quick", action="store_true", help="64 requests, 2 rounds: a smoke run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=256, help="requests per run, all sent at once")
    parser.add_argument("--baseline", type=Path, help="another checkout whose daemon runs in the same rounds")
    args = parser.parse_args()
    if args.baseline is not None and not (args.baseline / "pipeline" / "cli.py").is_file():
        parser.error(f"--baseline {args.baseline}: not a checkout of this repository (no pipeline/cli.py)")
    num_prompts, rounds = (64, 2) if args.quick else (args.num_prompts, args.rounds)
    directory = Path(tempfile.mkdtemp(prefix="pl-http-"))
    model = make_tiny_model(directory / "model", "llama", seed=0)
    checkouts = {"": None} | ({"baseline ": args.baseline.resolve()} if args.baseline is not None else {})
    daemons: dict[str, tuple[subprocess.Popen, Path, str]] = {}
    runs: dict[str, list[dict[str, float]]] = {}
    try:
        for label, checkout in checkouts.items():
            run_dir = directory / f"run-{len(daemons)}"
            run_dir.mkdir(mode=0o700)
            daemons[label] = start_http_daemon(model, run_dir, checkout)
        with Client(daemons[""][1]) as client:
            stats = client.stats()
        requests = random_requests(num_prompts, (64, 128), (128, 128), vocab_size=stats.vocab_size,
                                   special_token_ids=stats.special_token_ids, seed=0)
        for _ in range(rounds):
            for label, (process, socket_path, url) in daemons.items():
                targets = {"socket": lambda: SocketTarget(socket_path), "http": lambda: HttpTarget(url)}
                for name in ("socket", "http"):
                    runs.setdefault(label + name, []).append(measure(targets[name], requests, process.pid))
    finally:
        for process, _, _ in daemons.values():
            process.send_signal(signal.SIGTERM)
        for process, _, _ in daemons.values():
            process.wait(timeout=60)
        shutil.rmtree(directory, ignore_errors=True)
    summary = {name: {key: statistics.median(run[key] for run in results) for key in results[0]}
               for name, results in runs.items()}
    report = {"num_prompts": num_prompts, "rounds": rounds, **summary, "runs": runs}
    for label in daemons:
        report[label.replace(" ", "_") + "http_over_socket"] = (summary[label + "http"]["output_tok_s"]
                                                                / summary[label + "socket"]["output_tok_s"])
        report[label.replace(" ", "_") + "http_front_us_per_chunk"] = (
            summary[label + "http"]["daemon_cpu_us_per_chunk"] - summary[label + "socket"]["daemon_cpu_us_per_chunk"])
    if args.baseline is not None:
        report["baseline"] = str(args.baseline)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{num_prompts} streamed requests at once, prompts 64-128, 128 output tokens; median of {rounds} runs each")
    print(f"{'path':<17} {'output tok/s':>13} {'daemon CPU us/chunk':>20} {'client CPU us/chunk':>20}")
    for name, row in summary.items():
        print(f"{name:<17} {row['output_tok_s']:>13.1f} {row['daemon_cpu_us_per_chunk']:>20.1f} "
              f"{row['client_cpu_us_per_chunk']:>20.1f}")
    for label in daemons:
        key = label.replace(" ", "_")
        print(f"{label}HTTP / socket output tok/s: {report[key + 'http_over_socket']:.3f}; "
              f"HTTP front (daemon CPU, HTTP less socket): {report[key + 'http_front_us_per_chunk']:.1f} us/chunk")
    return 0


if __name__ == "__main__":
    sys.exit(main())
