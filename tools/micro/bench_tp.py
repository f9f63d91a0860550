"""Tensor-parallel benchmark on the CPU (gloo): one rank against two, side by side in one run.

  - step time: the runner's execute of a decode step at batch 1 and 32 (rank 0's view: it waits for
    the other rank in every collective), median over the run's decode steps;
  - collectives per step and the time rank 0 spends in them (all-reduces: 2 per layer + 1 for the
    embedding; then one gather of the logits and one broadcast of the sampled ids);
  - the plan's broadcast to the ranks: over the shared-memory ring with N readers (one record,
    write to read, per reader process) and over the process group (what other machines get);
  - sampling: gathering the logits on rank 0 against a distributed argmax (each rank's best, then
    an all-gather of the pairs), at batch 1 and 32;
  - weight bytes each rank holds.

    python tools/micro/bench_tp.py [--quick] [--json]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from pipeline import LLM, SamplingParams
from pipeline.models.tiny_model import make_tiny_model
from shm.naming import new_instance_id, unlink_instance
from shm.ring import RingWriter
from shm.ring_reader import RingReader
from shm.segment import RingSegment
from stages.gpu_runner.parallel.group import PlanBroadcast, TensorParallel, join_group, leave_group
from stages.gpu_runner.parallel.sharding import weight_bytes

FULL = dict(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=8, head_dim=64, intermediate_size=2816,
            vocab_size=8192, max_position_embeddings=1024)
QUICK = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256,
             vocab_size=1024, max_position_embeddings=1024)
BATCHES = (1, 32)
PROMPT_LEN = 16
SAMPLING_VOCAB = (32000, 128256)  # the logits rank 0 gathers, at real vocabularies
PLAN_BYTES = 1024  # a decode plan of 32 rows is about this size
RING_CAPACITY = 1 << 20
# The ring readers and the sampling ranks are forked, before this process has run any torch op
# (main() measures them first): a spawned child would import torch again, seconds each.
CHILD_START = "fork"


class Timer:
    """Wraps a function of a class with one that adds its wall time and calls to totals."""

    def __init__(self, owner: type, name: str) -> None:
        self.calls = 0
        self.seconds = 0.0
        original = getattr(owner, name)
        timer = self

        def timed(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                timer.seconds += time.perf_counter() - start
                timer.calls += 1

        setattr(owner, name, timed)
        self._restore: Callable[[], None] = lambda: setattr(owner, name, original)

    def close(self) -> None:
        self._restore()


def _decode_steps(llm: LLM, batch: int, max_tokens: int, timers: dict[str, Timer]) -> dict[str, float]:
    """Runs `batch` requests; per decode step of the whole batch: median ms, collectives and their ms."""
    runner = llm.runner
    steps: list[dict[str, float]] = []
    execute = runner.execute

    def timed_execute(plan: object) -> object:
        before = {name: (t.calls, t.seconds) for name, t in timers.items()}
        start = time.perf_counter()
        output = execute(plan)
        elapsed = time.perf_counter() - start
        if len(plan.rows) == batch and not plan.new_requests and bool(np.all(plan.num_scheduled_tokens == 1)):
            record = {"ms": elapsed * 1e3}
            for name, timer in timers.items():
                calls, seconds = before[name]
                record[f"{name}_calls"] = timer.calls - calls
                record[f"{name}_ms"] = (timer.seconds - seconds) * 1e3
            steps.append(record)
        return output

    runner.execute = timed_execute
    try:
        rng = np.random.default_rng(batch)
        prompts = rng.integers(2, llm.vocab_size - 1, (batch, PROMPT_LEN)).tolist()
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    finally:
        runner.execute = execute
    summary = {"step_ms": statistics.median(s["ms"] for s in steps), "num_steps": len(steps)}
    for name in timers:
        summary[f"{name}_per_step"] = statistics.median(s[f"{name}_calls"] for s in steps)
        summary[f"{name}_ms_per_step"] = statistics.median(s[f"{name}_ms"] for s in steps)
    return summary


def bench_ranks(model: Path, size: int, max_tokens: int, num_threads: int | None = None) -> dict[str, object]:
    """`size` ranks; `num_threads`: torch threads of the one rank (None: torch's default, every core)."""
    default_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    timers = {"all_reduce": Timer(TensorParallel, "all_reduce"), "gather_logits": Timer(TensorParallel, "gather_logits"),
              "broadcast_tokens": Timer(TensorParallel, "broadcast_tokens"), "plan_send": Timer(PlanBroadcast, "send")}
    try:
        llm = LLM(model, device="cpu", tensor_parallel_size=size, async_scheduling=False, block_size=16,
                  num_kv_blocks=max(BATCHES) * 8, max_model_len=PROMPT_LEN + max_tokens + 16)
        try:
            result: dict[str, object] = {"weight_bytes_rank0": weight_bytes(llm.runner.model),
                                         "torch_threads_rank0": torch.get_num_threads()}
            _decode_steps(llm, max(BATCHES), 3, timers)  # warm-up: first-call costs, not measured
            for batch in BATCHES:
                result[f"batch{batch}"] = _decode_steps(llm, batch, max_tokens, timers)
        finally:
            llm.close()
    finally:
        for timer in timers.values():
            timer.close()
        torch.set_num_threads(default_threads)
    return result


# ---- the plan ring with N readers, each in its own process


def _ring_reader(name: str, index: int, count: int, attached: mp.Semaphore, results: mp.Queue) -> None:
    reader = RingReader.attach(name, index)
    attached.release()
    latencies = []
    for _ in range(count):
        record = reader.read(30.0)
        latencies.append(time.monotonic_ns() - int.from_bytes(bytes(record.payload[:8]), "little"))
    reader.release()
    results.put(statistics.median(latencies) / 1e3)


def bench_plan_ring(num_readers: int, count: int) -> float:
    """Median µs from a plan-sized record's write to its read, the worst reader's median."""
    context = mp.get_context(CHILD_START)
    instance = new_instance_id()
    segment = RingSegment.create(instance, "plan", RING_CAPACITY, num_readers)
    results = context.Queue()
    attached = context.Semaphore(0)
    readers = [context.Process(target=_ring_reader, args=(segment.name, index, count, attached, results))
               for index in range(num_readers)]
    try:
        for process in readers:
            process.start()
        writer = RingWriter(segment)
        for _ in readers:
            if not attached.acquire(timeout=120):
                raise RuntimeError("a plan ring reader did not attach within 120 s")
        body = bytes(PLAN_BYTES - 8)
        for _ in range(count):
            writer.write(0, time.monotonic_ns().to_bytes(8, "little") + body, timeout=30.0)
            time.sleep(0.001)  # one plan per step, not a flood
        return max(results.get(timeout=60) for _ in readers)
    finally:
        for process in readers:
            process.join(10)
            if process.is_alive():
                process.kill()
        unlink_instance(instance)


# ---- sampling on the ranks: gathered logits or a distributed argmax, in a 2-rank group


def _sampling_rank(rank: int, port: int, reps: int, results: mp.Queue) -> None:
    tp = join_group(rank, 2, "127.0.0.1", port, "cpu", 60.0)
    out = {}
    for vocab in SAMPLING_VOCAB:
        for batch in BATCHES:
            local = torch.randn(batch, vocab // 2)
            gather, argmax = [], []
            for _ in range(reps):
                dist.barrier()
                start = time.perf_counter()
                tp.gather_logits(local, vocab)
                gather.append(time.perf_counter() - start)
                dist.barrier()
                start = time.perf_counter()
                values, indices = local.max(dim=-1)
                pair = torch.stack([values, (indices + rank * (vocab // 2)).float()], dim=-1)
                pairs = [torch.empty_like(pair) for _ in range(2)]
                dist.all_gather(pairs, pair)
                both = torch.stack(pairs)  # [ranks, batch, 2]
                both[both[..., 0].argmax(dim=0), torch.arange(batch), 1]
                argmax.append(time.perf_counter() - start)
            out[f"vocab{vocab}_batch{batch}"] = {"gather_logits_us": statistics.median(gather) * 1e6,
                                                 "distributed_argmax_us": statistics.median(argmax) * 1e6}
    if rank == 0:
        results.put(out)
    leave_group()


def bench_sampling(reps: int) -> dict[str, dict[str, float]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context(CHILD_START)
    results = context.Queue()
    ranks = [context.Process(target=_sampling_rank, args=(rank, port, reps, results)) for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        return results.get(timeout=300)
    finally:
        for process in ranks:
            process.join(30)
            if process.is_alive():
                process.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model and few steps (for tests)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else FULL
    max_tokens = 6 if args.quick else 24
    plan_ring_us = {f"{n}_readers": bench_plan_ring(n, 50 if args.quick else 500) for n in (1, 2)}
    sampling = bench_sampling(3 if args.quick else 30)
    with tempfile.TemporaryDirectory(prefix="bench-tp-") as tmp:
        model = make_tiny_model(Path(tmp) / "model", "llama", seed=0, **shape)
        # "1/2 cores": one rank on the share of the cores each of two ranks gets, which tells how much
        # of two ranks' speed-up is the second core's and how much the split's.
        ranks = {"1/2 cores": bench_ranks(model, 1, max_tokens, max(1, (os.cpu_count() or 1) // 2)),
                 **{str(size): bench_ranks(model, size, max_tokens) for size in (1, 2)}}
    report = {
        "model": shape, "device": "cpu", "backend": "gloo", "ranks": ranks,
        "ratios": {f"batch{b}_step_tp2_over_tp1": ranks["2"][f"batch{b}"]["step_ms"] / ranks["1"][f"batch{b}"]["step_ms"]
                   for b in BATCHES}
                  | {"weight_bytes_rank0_tp2_over_tp1": ranks["2"]["weight_bytes_rank0"] / ranks["1"]["weight_bytes_rank0"]},
        "plan_ring_us": plan_ring_us, "sampling": sampling,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"model: {shape}")
    columns = list(ranks)
    print(f"{'':<34}" + "".join(f"{'TP=' + name:>14}" for name in columns))
    for batch in BATCHES:
        key = f"batch{batch}"
        for field, label in (("step_ms", "step ms"), ("all_reduce_per_step", "all-reduces/step"),
                             ("all_reduce_ms_per_step", "all-reduce ms/step"),
                             ("gather_logits_ms_per_step", "logits gather ms/step"),
                             ("broadcast_tokens_ms_per_step", "token broadcast ms/step"),
                             ("plan_send_ms_per_step", "plan broadcast ms/step")):
            print(f"{f'batch {batch}: {label}':<34}" + "".join(f"{ranks[c][key][field]:>14.3f}" for c in columns))
    print(f"{'weight bytes, rank 0':<34}" + "".join(f"{ranks[c]['weight_bytes_rank0']:>14}" for c in columns))
    print(f"{'torch threads, rank 0':<34}" + "".join(f"{ranks[c]['torch_threads_rank0']:>14}" for c in columns))
    print(f"plan ring, write to read (µs, worst reader's median): {report['plan_ring_us']}")
    for key, times in report["sampling"].items():
        print(f"sampling {key}: gather logits {times['gather_logits_us']:.0f} µs, "
              f"distributed argmax {times['distributed_argmax_us']:.0f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
