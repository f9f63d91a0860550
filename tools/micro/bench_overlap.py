"""Benchmark: how much host time the offline engine loop exposes per step, async vs sync.

BENCHMARK HARNESS: `SimulatedDevice` is a fake runner whose every step takes a fixed T ms of
wall time on a simulated device without using the CPU (execute queues the step and records
when it will be done; to_host sleeps until then). The engine, scheduler and LLM are the real
ones. exposed = step time - T: the host work the device waited for.
Usage: python tools/micro/bench_overlap.py [--json] [--device-ms 5] [--batch 256] [--steps 100]
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import numpy as np

from pipeline.engine.llm import LLM
from stages.contracts.outputs import HostStepOutput
from stages.contracts.params import SamplingParams
from stages.contracts.plan import StepPlan

VOCAB = 32000


@dataclass(slots=True)
class _PendingStep:
    output: HostStepOutput
    done_at: float

    def to_host(self) -> HostStepOutput:
        delay = self.done_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return self.output


class SimulatedDevice:
    """Runner-like: steps run back to back on one simulated stream, T ms each."""

    def __init__(self, device_ms: float, num_kv_blocks: int, max_model_len: int) -> None:
        self.step_s = device_ms / 1e3
        self.num_kv_blocks = num_kv_blocks
        self.max_model_len = max_model_len
        self.vocab_size = VOCAB
        self.eos_token_ids = [0]
        self.tokenizer_path = None
        self._busy_until = 0.0
        self._rng = np.random.default_rng(0)

    def execute(self, plan: StepPlan) -> _PendingStep:
        self._busy_until = max(time.perf_counter(), self._busy_until) + self.step_s
        rows = plan.sampled_rows
        tokens = self._rng.integers(1, VOCAB, rows.shape[0], dtype=np.int32)
        return _PendingStep(HostStepOutput(plan.step, rows, tokens, None, None), self._busy_until)


def bench(async_scheduling: bool, device_ms: float, batch: int, num_steps: int) -> dict[str, float]:
    block_size, prompt_tokens = 16, 32
    max_model_len = prompt_tokens + num_steps + 16
    device = SimulatedDevice(device_ms, batch * (-(-max_model_len // block_size)), max_model_len)
    llm = LLM(runner=device, async_scheduling=async_scheduling, block_size=block_size, max_num_seqs=batch,
              max_num_batched_tokens=batch * prompt_tokens)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, VOCAB, prompt_tokens).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=num_steps, temperature=0)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    if any(len(o.token_ids) != num_steps for o in outputs):
        raise RuntimeError("a request did not produce all its tokens")
    step_ms = elapsed / llm.engine.num_steps * 1e3
    return {"step_ms": round(step_ms, 3), "exposed_ms": round(step_ms - device_ms, 3),
            "steps": llm.engine.num_steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--device-ms", type=float, default=5.0)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    results = {"device_ms": args.device_ms}
    for name, async_scheduling in (("async", True), ("sync", False)):
        results[name] = bench(async_scheduling, args.device_ms, args.batch, args.steps)
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"batch {args.batch}, simulated device step {args.device_ms} ms, {args.steps} decode steps")
    print(f"{'mode':>6} {'step ms':>9} {'exposed ms':>11} {'exposed % of T':>15}")
    for name in ("async", "sync"):
        r = results[name]
        print(f"{name:>6} {r['step_ms']:>9.3f} {r['exposed_ms']:>11.3f} {100 * r['exposed_ms'] / args.device_ms:>14.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
