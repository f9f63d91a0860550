"""Decode throughput of the model runner vs transformers (StaticCache), same checkpoint, same run.

A ~20M-parameter random Llama (tools/make_tiny_model.py --preset 20m) runs on the CPU in
float32. For each batch size, every row gets a PROMPT_LEN-token prompt (prefill not timed),
then DECODE_STEPS greedy decode steps are timed: ours through ModelRunner.execute with paged
attention and the result read back each step; transformers through the model's forward with
a StaticCache and an argmax per step. tok/s = batch * steps / seconds.

Then it counts the operator launches of one greedy decode step at batches 1 and 64 (--launch-batches):
torch.profiler's aten op events that do work (not views or allocations) stand in for kernel
launches on the CPU, and each Triton kernel counts once. It counts the dynamic path and the
static (bucketed) path, with the torch backend and, when triton is installed, the triton backend
(its kernels interpreted on the CPU, so that part is slow). "outside" is what the static path
launches outside the decode forward: on CUDA with the triton backend that forward is one graph
replay, so outside + 1 is the step's launches there.

Usage: python tools/micro/bench_runner.py [--json] [--batches 1,32,256] [--steps N] [--model-dir DIR]
                                    [--launch-batches 1,64] [--no-triton]
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors import safe_open
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from pipeline.models.tiny_model import make_tiny_model
from stages.contracts.config import EngineConfig
from stages.contracts.params import SamplingParams
from stages.contracts.plan import NewRequest, StepPlan
from stages.gpu_runner.runner import ModelRunner

PROMPT_LEN = 64
BLOCK_SIZE = 16


def _prompts(batch: int) -> np.ndarray:
    return np.random.default_rng(batch).integers(2, 2000, (batch, PROMPT_LEN)).astype(np.int32)


def _decode_plan(step: int, batch: int, position: int) -> StepPlan:
    rows = np.arange(batch, dtype=np.int32)
    return StepPlan(step=step, new_requests=[], rows=rows,
                    num_computed_tokens=np.full(batch, position, np.int32),
                    num_scheduled_tokens=np.ones(batch, np.int32), sample=np.ones(batch, bool),
                    num_new_blocks=np.zeros(batch, np.int32), new_block_ids=np.zeros(0, np.int32))


def bench_ours(model_dir: Path, batch: int, steps: int) -> tuple[float, list[int]]:
    total = PROMPT_LEN + steps + 1
    blocks_per_row = -(-total // BLOCK_SIZE)
    runner = ModelRunner(EngineConfig(
        model=str(model_dir), device="cpu", max_num_seqs=batch, max_model_len=total + BLOCK_SIZE,
        num_kv_blocks=batch * blocks_per_row, block_size=BLOCK_SIZE, max_num_batched_tokens=max(batch * PROMPT_LEN, 8192)))
    prompts = _prompts(batch)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    prefill = StepPlan(
        step=0,
        new_requests=[NewRequest(req_id=r, row=r, token_ids=prompts[r], num_prompt_tokens=PROMPT_LEN, params=params)
                      for r in range(batch)],
        rows=np.arange(batch, dtype=np.int32), num_computed_tokens=np.zeros(batch, np.int32),
        num_scheduled_tokens=np.full(batch, PROMPT_LEN, np.int32), sample=np.ones(batch, bool),
        num_new_blocks=np.full(batch, blocks_per_row, np.int32),
        new_block_ids=np.arange(batch * blocks_per_row, dtype=np.int32))
    runner.execute(prefill).to_host()
    runner.execute(_decode_plan(1, batch, PROMPT_LEN)).to_host()  # warm-up step, not timed
    start = time.perf_counter()
    for i in range(steps):
        runner.execute(_decode_plan(2 + i, batch, PROMPT_LEN + 1 + i)).to_host()
    seconds = time.perf_counter() - start
    row0 = runner.token_table[0, PROMPT_LEN:PROMPT_LEN + steps + 2].tolist()
    return batch * steps / seconds, row0


def bench_hf(model_dir: Path, batch: int, steps: int) -> tuple[float, list[int]]:
    from transformers import AutoModelForCausalLM, StaticCache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cache = StaticCache(config=model.config, max_cache_len=PROMPT_LEN + steps + 2)
    ids = torch.from_numpy(_prompts(batch)).long()
    generated = []
    with torch.inference_mode():
        logits = model(ids, past_key_values=cache, cache_position=torch.arange(PROMPT_LEN), use_cache=True).logits
        next_ids = logits[:, -1].argmax(-1, keepdim=True)
        generated.append(next_ids)

        def decode(position: int) -> torch.Tensor:
            out = model(generated[-1], past_key_values=cache, cache_position=torch.tensor([position]), use_cache=True)
            return out.logits[:, -1].argmax(-1, keepdim=True)

        generated.append(decode(PROMPT_LEN))  # warm-up step, not timed
        start = time.perf_counter()
        for i in range(steps):
            generated.append(decode(PROMPT_LEN + 1 + i))
        seconds = time.perf_counter() - start
    return batch * steps / seconds, [int(t[0, 0]) for t in generated]


# aten ops that launch nothing on a device: views, metadata and allocation.
_NO_LAUNCH = {
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::slice", "aten::select",
    "aten::split", "aten::split_with_sizes", "aten::tensor_split", "aten::unsqueeze", "aten::squeeze",
    "aten::transpose", "aten::t", "aten::permute", "aten::expand", "aten::narrow", "aten::detach", "aten::alias",
    "aten::unbind", "aten::flatten", "aten::unflatten", "aten::empty", "aten::empty_strided", "aten::empty_like",
    "aten::resize_", "aten::lift_fresh", "aten::_unsafe_view", "aten::view_as", "aten::contiguous",
    "aten::chunk", "aten::set_", "aten::result_type", "aten::is_nonzero", "aten::_local_scalar_dense",
    "aten::to",  # a no-op when the dtype already matches; when it converts, its aten::_to_copy counts
}
_KERNEL_LAUNCHES = {"paged_decode_attention": 2, "paged_prefill_attention": 1, "rms_norm": 1,
                    "fused_add_rms_norm": 1, "rotary_embedding_": 1, "qk_norm_rotary_": 1, "store_kv": 1}
_FORWARD_RANGE = "static_decode_forward"


def _counted_kernels(runner: ModelRunner) -> None:
    """Marks each Triton kernel call with a profiler range named after its launch count."""
    import dataclasses

    kernels = runner.attention_backend.kernels

    def marked(name: str, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            with record_function(f"triton:{_KERNEL_LAUNCHES[name]}"):
                return fn(*args, **kwargs)
        return call

    runner.attention_backend.kernels = dataclasses.replace(
        kernels, **{name: marked(name, getattr(kernels, name)) for name in _KERNEL_LAUNCHES})


def _launches(events) -> tuple[int, int]:
    """(launches of the profiled step, those inside the static decode forward)."""
    total = inside = 0
    for event in events:
        name, ancestors, parent = event.name, [], event.cpu_parent
        while parent is not None:
            ancestors.append(parent.name)
            parent = parent.cpu_parent
        if any(a.startswith("triton:") for a in ancestors):
            continue  # the interpreter's own ops inside a kernel call
        if name.startswith("triton:"):
            count = int(name.split(":")[1])
        elif name.startswith("aten::") and name not in _NO_LAUNCH and not any(
                a.startswith("aten::") and a not in _NO_LAUNCH for a in ancestors):
            count = 1  # an op that does work, not called by another such op
        else:
            continue
        total += count
        inside += count if _FORWARD_RANGE in ancestors else 0
    return total, inside


def count_launches(model_dir: Path, batch: int, backend: str, static: bool) -> dict[str, int]:
    """Launches of one greedy decode step at `batch` (after a warm-up step). The KV cache is left
    empty (the prompts are admitted, not prefilled): what a step launches does not depend on it,
    and the interpreted Triton prefill would take minutes."""
    blocks_per_row = -(-(PROMPT_LEN + 3) // BLOCK_SIZE)
    runner = ModelRunner(EngineConfig(
        model=str(model_dir), device="cpu", max_num_seqs=batch, max_model_len=blocks_per_row * BLOCK_SIZE,
        num_kv_blocks=batch * blocks_per_row, block_size=BLOCK_SIZE, attention_backend=backend),
        static_decode=static)
    prompts = _prompts(batch)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    admit = _decode_plan(0, batch, 0)
    admit.rows = admit.rows[:0]
    admit.num_computed_tokens, admit.num_scheduled_tokens = admit.rows.copy(), admit.rows.copy()
    admit.sample, admit.num_new_blocks = np.zeros(0, bool), admit.rows.copy()
    admit.new_requests = [NewRequest(req_id=r, row=r, token_ids=prompts[r], num_prompt_tokens=PROMPT_LEN,
                                     params=params) for r in range(batch)]
    runner.execute(admit)
    warm_up = _decode_plan(1, batch, PROMPT_LEN)  # every row's blocks come with it
    warm_up.num_new_blocks = np.full(batch, blocks_per_row, np.int32)
    warm_up.new_block_ids = np.arange(batch * blocks_per_row, dtype=np.int32)
    if backend == "triton":
        _counted_kernels(runner)
    forward = runner._static_decode_forward

    def marked_forward(num_rows: int, max_context: int):
        with record_function(_FORWARD_RANGE):
            return forward(num_rows, max_context)

    if runner.decode_graphs is not None:
        runner.decode_graphs.forward = marked_forward
    runner.execute(warm_up).to_host()
    runner.copy_to_host = False  # as in the runner stage, where the mailbox carries the tokens
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.execute(_decode_plan(2, batch, PROMPT_LEN + 1))
    total, inside = _launches(prof.events())
    result = {"launches": total}
    if static:
        result["outside_forward"] = total - inside
    return result


def launch_counts(model_dir: Path, batches: list[int], with_triton: bool) -> dict[str, dict[str, int]]:
    backends = ["torch"] + (["triton"] if with_triton else [])
    counts: dict[str, dict[str, int]] = {}
    for batch in batches:
        row: dict[str, int] = {}
        for backend in backends:
            row[f"dynamic_{backend}"] = count_launches(model_dir, batch, backend, static=False)["launches"]
            static = count_launches(model_dir, batch, backend, static=True)
            row[f"static_{backend}"] = static["launches"]
            row[f"static_{backend}_outside"] = static["outside_forward"]
        counts[str(batch)] = row
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    parser.add_argument("--batches", default="1,32,256")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps (default: 32, 16 at batch 256)")
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse a checkpoint instead of building one")
    parser.add_argument("--launch-batches", default="1,64", help="batches whose decode-step launches are counted")
    parser.add_argument("--no-triton", action="store_true", help="count launches with the torch backend only")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")] if args.batches else []
    launch_batches = [int(b) for b in args.launch_batches.split(",")] if args.launch_batches else []
    with_triton = not args.no_triton and importlib.util.find_spec("triton") is not None

    with tempfile.TemporaryDirectory(prefix="bench-runner-") as tmp:
        model_dir = args.model_dir or make_tiny_model(Path(tmp) / "llama-20m", "llama", seed=0, preset="20m")
        with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
            num_params = sum(int(np.prod(f.get_slice(n).get_shape())) for n in f.keys())
        results: dict[str, dict[str, float | bool]] = {}
        for batch in batches:
            steps = args.steps or (16 if batch >= 128 else 32)
            ours, our_tokens = bench_ours(model_dir, batch, steps)
            hf, hf_tokens = bench_hf(model_dir, batch, steps)
            results[str(batch)] = {"ours_tok_s": round(ours, 1), "hf_tok_s": round(hf, 1),
                                   "ratio": round(ours / hf, 2), "row0_tokens_match": our_tokens == hf_tokens}
        launches = launch_counts(model_dir, launch_batches, with_triton)

    if args.json:
        print(json.dumps({**results, "launches": launches}))
        return 0
    print(f"Llama {num_params / 1e6:.1f}M params, CPU float32, {torch.get_num_threads()} threads, "
          f"prompt {PROMPT_LEN} tokens, greedy decode")
    print(f"{'batch':>6}{'ours tok/s':>14}{'hf tok/s':>14}{'ratio':>8}{'tokens match':>14}")
    for batch, r in results.items():
        print(f"{batch:>6}{r['ours_tok_s']:>14.1f}{r['hf_tok_s']:>14.1f}{r['ratio']:>8.2f}{str(r['row0_tokens_match']):>14}")
    if launches:
        print("\nlaunches of one greedy decode step (aten ops that do work + Triton kernels); "
              "outside: outside the decode forward (a graph replay on CUDA)")
        names = list(next(iter(launches.values())))
        print(f"{'batch':>6}" + "".join(f"{name:>24}" for name in names))
        for batch, row in launches.items():
            print(f"{batch:>6}" + "".join(f"{row[name]:>24}" for name in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
