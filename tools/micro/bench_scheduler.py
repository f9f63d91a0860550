"""Benchmark: host time of one scheduler step (schedule + update) with many decoding requests.

Fake step outputs stand in for the runner; the loop is the async one (plan N+1 built before
step N is applied), so placeholders, one-step-late updates and block growth are all exercised.
Usage: python tools/micro/bench_scheduler.py [--json] [--steps N]
"""
from __future__ import annotations

import argparse
import json
import time
from collections import deque

import numpy as np

from stages.contracts.config import EngineConfig, ModelLimits
from stages.contracts.outputs import HostStepOutput
from stages.contracts.params import SamplingParams
from stages.contracts.plan import StepPlan
from stages.scheduler.scheduler import Scheduler
from stages.scheduler.step_loop import StepLoop

BLOCK_SIZE = 16
PROMPT_TOKENS = 32
VOCAB = 32000


class FakeExecutor:
    """Stands in for the runner: each step's tokens are random and ready at once. The time it
    spends making them is the runner's, not the scheduler's: it is added up to be left out."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.outputs: deque[HostStepOutput] = deque()
        self.last_plan: StepPlan | None = None
        self.own_s = 0.0

    def launch(self, plan: StepPlan) -> None:
        start = time.perf_counter()
        rows = plan.sampled_rows
        # Never EOS (id 0 is the EOS here and tokens start at 1): requests keep decoding.
        tokens = self.rng.integers(1, VOCAB, rows.shape[0], dtype=np.int32)
        self.outputs.append(HostStepOutput(plan.step, rows, tokens, None, None))
        self.last_plan = plan
        self.own_s += time.perf_counter() - start

    def poll(self, timeout_s: float | None) -> HostStepOutput:
        return self.outputs.popleft()


def bench(num_requests: int, num_steps: int) -> dict[str, float]:
    max_model_len = PROMPT_TOKENS + num_steps + 64
    num_blocks = num_requests * (-(-max_model_len // BLOCK_SIZE))
    config = EngineConfig(max_num_seqs=num_requests, max_num_batched_tokens=num_requests * PROMPT_TOKENS,
                          block_size=BLOCK_SIZE)
    scheduler = Scheduler(config, ModelLimits(num_blocks, max_model_len, VOCAB, eos_token_ids=[0]))
    executor = FakeExecutor(np.random.default_rng(0))
    loop = StepLoop(scheduler, executor, async_scheduling=True)
    params = SamplingParams(max_tokens=max_model_len, temperature=0)
    for req_id in range(num_requests):
        scheduler.add_request(req_id, executor.rng.integers(1, VOCAB, PROMPT_TOKENS), params)
    # Warm up: the prefill step and a few decodes, so every request is decoding.
    while loop.num_steps < 5:
        loop.turn()
    first_step = loop.num_steps
    executor.own_s = 0.0
    start = time.perf_counter()
    while loop.num_steps < first_step + num_steps:
        loop.turn()
    elapsed = time.perf_counter() - start - executor.own_s
    plan = executor.last_plan
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
