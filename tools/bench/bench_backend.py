"""Benchmark: the multi-process pipeline (Backend) against the one-process LLM, same requests.

Both run the same greedy requests on the same checkpoint and device, side by side in one run,
in alternating rounds (engine start-up excluded); the table gives the median output tokens per
second of each and their ratio, plus the pipeline's time from submit to a request's first
event (mean and p90 over all rounds).
Usage: python tools/bench/bench_backend.py [--json] [--preset tiny|20m] [--num-requests 64]
       [--prompt-len 32] [--max-tokens 64] [--max-num-seqs 32] [--device cpu] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from pipeline.engine.llm import LLM
from pipeline.models.tiny_model import make_tiny_model
from pipeline.engine.multiprocess import StageBackend
from shm.naming import new_instance_id
from stages.contracts.config import EngineConfig
from stages.contracts.params import SamplingParams


def run_offline(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outputs)


def run_pipeline(backend: StageBackend, first_id: int, prompts: list[list[int]],
                 params: SamplingParams) -> tuple[float, int, np.ndarray]:
    start = time.perf_counter()
    for offset, prompt in enumerate(prompts):
        backend.submit(first_id + offset, prompt, params)
    first_event = np.full(len(prompts), np.nan)
    pending, num_tokens = set(range(first_id, first_id + len(prompts))), 0
    while pending:
        for event in backend.read_events(1.0):
            num_tokens += len(event.token_ids)
            if np.isnan(first_event[event.req_id - first_id]):
                first_event[event.req_id - first_id] = time.perf_counter() - start
            if event.finish_reason is not None or event.error_code is not None:
                pending.discard(event.req_id)
    return time.perf_counter() - start, num_tokens, first_event


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--preset", default="tiny", choices=["tiny", "20m"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds; medians are reported")
    args = parser.parse_args(argv)

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    options = dict(device=args.device, max_num_seqs=args.max_num_seqs, num_kv_blocks=2048, block_size=16)
    offline, pipeline, first_events, same = [], [], [], True
    with tempfile.TemporaryDirectory(prefix="bench-backend-") as tmp:
        model = make_tiny_model(Path(tmp) / "model", "llama", seed=0, preset=args.preset)
        llm = LLM(model=model, **options)
        backend = StageBackend(EngineConfig(model=str(model), **options), new_instance_id())
        try:
            for round_index in range(args.repeats):
                # Fresh prompts each round, so no round hits the prefix cache of an earlier one.
                rng = np.random.default_rng(round_index)
                prompts = [rng.integers(3, 1000, args.prompt_len).tolist() for _ in range(args.num_requests)]
                offline_s, offline_tokens = run_offline(llm, prompts, params)
                pipeline_s, pipeline_tokens, first_event = run_pipeline(
                    backend, round_index * args.num_requests, prompts, params)
                offline.append(offline_tokens / offline_s)
                pipeline.append(pipeline_tokens / pipeline_s)
                first_events.append(first_event)
                same &= offline_tokens == pipeline_tokens
        finally:
            backend.close()
    first_event = np.concatenate(first_events)
    offline_rate, pipeline_rate = float(np.median(offline)), float(np.median(pipeline))
    result = {
        "preset": args.preset, "device": args.device, "num_requests": args.num_requests,
        "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "max_num_seqs": args.max_num_seqs,
        "repeats": args.repeats, "offline_tokens_per_s": round(offline_rate, 1),
        "pipeline_tokens_per_s": round(pipeline_rate, 1),
        "pipeline_over_offline_throughput": round(pipeline_rate / offline_rate, 3),
        "pipeline_first_event_mean_ms": round(float(np.nanmean(first_event)) * 1e3, 2),
        "pipeline_first_event_p90_ms": round(float(np.nanpercentile(first_event, 90)) * 1e3, 2),
        "same_token_count": same,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'mode':<10} {'tokens/s (median of ' + str(args.repeats) + ')':>26}")
    print(f"{'offline':<10} {offline_rate:>26.1f}")
    print(f"{'pipeline':<10} {pipeline_rate:>26.1f}")
    print(f"pipeline / offline throughput: {result['pipeline_over_offline_throughput']:.3f}")
    print(f"pipeline first event: mean {result['pipeline_first_event_mean_ms']:.1f} ms, "
          f"p90 {result['pipeline_first_event_p90_ms']:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
