"""End-to-end throughput: the same workload through a live daemon and through the offline engine.

256 requests (random token prompts of 100-1024 tokens, 100-512 output tokens, ignore_eos,
fixed seed) sent all at once with AsyncClient to a daemon this script starts, then run by
`pipeline.LLM` in this process; both on the tiny model on CPU, in one run. Prints output
tokens/s of each and daemon/offline; `--compare-sync` adds a daemon with --no-async-scheduling.
`--backend engine-thread` serves the daemon with the test double of the stage processes (the
offline engine in a thread, tests/daemon/engine_thread_backend.py) instead of the real backend.

    python tools/bench/bench_e2e.py [--quick] [--json] [--compare-sync] [--backend real|engine-thread]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from pipeline.bench.daemon import engine_options, start_daemon
from pipeline.client import AsyncClient
from pipeline.models.tiny_model import make_tiny_model
from stages.contracts.params import SamplingParams

SEED = 0


def workload(num_requests: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int],
             vocab_size: int) -> list[tuple[list[int], SamplingParams]]:
    rng = np.random.default_rng(SEED)
    requests = []
    for _ in range(num_requests):
        prompt = rng.integers(2, vocab_size, int(rng.integers(prompt_lens[0], prompt_lens[1] + 1))).tolist()
        max_tokens = int(rng.integers(output_lens[0], output_lens[1] + 1))
        requests.append((prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    return requests


def run_daemon_workload(socket_path: Path, requests: list[tuple[list[int], SamplingParams]]) -> tuple[float, int]:
    async def run() -> tuple[float, int]:
        client = AsyncClient(socket_path)
        start = time.perf_counter()
        completions = await asyncio.gather(*(client.generate(prompt, params) for prompt, params in requests))
        elapsed_s = time.perf_counter() - start
        return elapsed_s, sum(len(c.token_ids) for c in completions)

    return asyncio.run(run())


def measure_daemon(model: Path, backend: str, options: list[str],
                   requests: list[tuple[list[int], SamplingParams]]) -> float:
    directory = Path(tempfile.mkdtemp(prefix="pl-bench-"))
    run_dir = directory / "run"
    run_dir.mkdir(mode=0o700)
    process = start_daemon(model, run_dir, backend, options)
    try:
        elapsed_s, num_tokens = run_daemon_workload(run_dir / "pipeline.sock", requests)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        shutil.rmtree(directory, ignore_errors=True)
    return num_tokens / elapsed_s


def measure_offline(model: Path, max_model_len: int, num_kv_blocks: int,
                    requests: list[tuple[list[int], SamplingParams]]) -> float:
    from pipeline.engine.llm import LLM

    llm = LLM(model, device="cpu", max_model_len=max_model_len, num_kv_blocks=num_kv_blocks, block_size=16)
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in requests], [s for _, s in requests])
    elapsed_s = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outputs) / elapsed_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--quick", action="store_true", help="32 requests, shorter prompts and outputs")
    parser.add_argument("--compare-sync", action="store_true", help="also a daemon with --no-async-scheduling")
    parser.add_argument("--backend", choices=["real", "engine-thread"], default="real")
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the daemons this starts are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.quick:
        num_requests, prompt_lens, output_lens = 32, (50, 200), (20, 100)
    else:
        num_requests, prompt_lens, output_lens = 256, (100, 1024), (100, 512)
    max_model_len = prompt_lens[1] + output_lens[1]
    # Room for every request at once, so neither side preempts.
    num_kv_blocks = num_requests * -(-max_model_len // 16)
    with tempfile.TemporaryDirectory(prefix="pl-bench-model-") as model_dir:
        model = make_tiny_model(model_dir, "llama", seed=SEED)
        requests = workload(num_requests, prompt_lens, output_lens, vocab_size=1024)
        options = engine_options(max_model_len, num_kv_blocks)
        results = {"daemon_tok_s": measure_daemon(model, args.backend, options, requests)}
        results["offline_tok_s"] = measure_offline(model, max_model_len, num_kv_blocks, requests)
        results["ratio"] = results["daemon_tok_s"] / results["offline_tok_s"]
        if args.compare_sync:
            results["daemon_sync_tok_s"] = measure_daemon(model, args.backend, options + ["--no-async-scheduling"],
                                                          requests)
            results["sync_ratio"] = results["daemon_sync_tok_s"] / results["offline_tok_s"]
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"{num_requests} requests, prompts {prompt_lens[0]}-{prompt_lens[1]} tokens, outputs "
          f"{output_lens[0]}-{output_lens[1]} tokens, tiny llama on CPU, daemon backend: {args.backend}")
    print(f"{'path':<24}{'output tok/s':>14}{'vs offline':>12}")
    print(f"{'daemon (async)':<24}{results['daemon_tok_s']:>14.1f}{results['ratio']:>12.2f}")
    if args.compare_sync:
        print(f"{'daemon (sync)':<24}{results['daemon_sync_tok_s']:>14.1f}{results['sync_ratio']:>12.2f}")
    print(f"{'offline engine':<24}{results['offline_tok_s']:>14.1f}{1.0:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
