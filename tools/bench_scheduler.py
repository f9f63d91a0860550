"""Benchmark: host time of one scheduler step (schedule + update) with many decoding requests.

Fake step outputs stand in for the runner; the loop is the async one (plan N+1 built before
step N is applied), so placeholders, one-step-late updates and block growth are all exercised.
Usage: python tools/bench_scheduler.py [--json] [--steps N]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

import checkout_path  # noqa: E402,F401 - first: the checkout on sys.path, not tools/ (see there)
from pipeline.sampling_params import SamplingParams  # noqa: E402
from stages.gpu_runner.output import HostStepOutput  # noqa: E402
from stages.scheduler.config import SchedulerConfig  # noqa: E402
from stages.scheduler.plan import StepPlan  # noqa: E402
from stages.scheduler.scheduler import Scheduler  # noqa: E402

BLOCK_SIZE = 16
PROMPT_TOKENS = 32
VOCAB = 32000


def fake_output(plan: StepPlan, rng: np.random.Generator) -> HostStepOutput:
    rows = plan.sampled_rows
    # Never EOS (id 0 is the EOS here and tokens start at 1): requests keep decoding.
    return HostStepOutput(plan.step, rows, rng.integers(1, VOCAB, rows.shape[0], dtype=np.int32), None, None)


def bench(num_requests: int, num_steps: int) -> dict[str, float]:
    max_model_len = PROMPT_TOKENS + num_steps + 64
    num_blocks = num_requests * (-(-max_model_len // BLOCK_SIZE))
    config = SchedulerConfig(max_num_seqs=num_requests, max_num_batched_tokens=num_requests * PROMPT_TOKENS,
                             max_model_len=max_model_len)
    scheduler = Scheduler(config, num_blocks, BLOCK_SIZE, eos_token_ids=[0])
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=max_model_len, temperature=0)
    for req_id in range(num_requests):
        scheduler.add_request(req_id, rng.integers(1, VOCAB, PROMPT_TOKENS), params)
    # Warm up: the prefill step and a few decodes, so every request is decoding.
    in_flight = None
    for _ in range(4):
        plan = scheduler.schedule()
        if in_flight is not None:
            scheduler.update(*in_flight)
        in_flight = (plan, fake_output(plan, rng))
    outputs = [None] * num_steps
    start = time.perf_counter()
    for index in range(num_steps):
        plan = scheduler.schedule()
        scheduler.update(*in_flight)
        # Building the fake output is the runner's job: not timed.
        pause = time.perf_counter()
        in_flight = outputs[index] = (plan, fake_output(plan, rng))
        start += time.perf_counter() - pause
    elapsed = time.perf_counter() - start
    if plan.num_rows != num_requests:
        raise RuntimeError(f"expected {num_requests} decoding rows, the last plan had {plan.num_rows}")
    return {"us_per_step": round(elapsed / num_steps * 1e6, 1), "rows_per_step": plan.num_rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args(argv)
    results = {str(n): bench(n, args.steps) for n in (256, 1024)}
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"{'requests':>9} {'us/step':>9}   (schedule + update, {args.steps} decode steps, block {BLOCK_SIZE})")
    for n, result in results.items():
        print(f"{n:>9} {result['us_per_step']:>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
