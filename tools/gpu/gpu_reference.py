"""The workload tools/gpu/bench_gpu.py runs and what it sets beside our engine: the memory floor
(a large copy's bandwidth) and transformers' `generate` and continuous batching on the same prompts."""
from __future__ import annotations

import gc
import inspect
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

MIN_TOKEN_ID = 2  # below are the random models' BOS (0) and EOS (1)
BLOCK_SIZE = 16
COPY_BYTES = 1 << 30
COPY_REPEATS = 10
MAX_BATCH_TOKENS = 8192  # tokens per step, ours (EngineConfig's default) and transformers' continuous batching


@dataclass(frozen=True, slots=True)
class Setup:
    """What one run measures: the model, where it runs and the workload."""

    device: str
    dtype: str
    preset: str
    model_sizes: dict[str, int]
    prompt_len: int
    output_len: int
    batches: tuple[int, ...]
    busy_batches: tuple[int, ...]  # the batches torch.profiler watches (async, graphs on)
    profile_steps: int
    warmup_tokens: int


FULL = Setup(device="cuda", dtype="bfloat16", preset="1b", model_sizes={}, prompt_len=512, output_len=256,
             batches=(1, 32, 256), busy_batches=(1, 64), profile_steps=50, warmup_tokens=16)
# A vocabulary larger than the tokenizer, as in the 1b preset, so the quick run draws ids the same way.
QUICK = Setup(device="cpu", dtype="float32", preset="tiny", model_sizes={"vocab_size": 4096}, prompt_len=24,
              output_len=12, batches=(1, 4), busy_batches=(1, 4), profile_steps=5, warmup_tokens=4)


@dataclass(slots=True)
class HfRun:
    """One batch through transformers."""

    path: str  # generate | continuous_batching
    batch: int
    tpot_ms: float | None  # generate only: (time for all tokens - time for one) / (output_len - 1)
    output_tok_s: float
    elapsed_s: float


# ---- the workload


def random_prompts(batch: int, prompt_len: int, tokenizer_size: int, seed: int) -> list[list[int]]:
    if tokenizer_size <= MIN_TOKEN_ID:
        raise ValueError(f"tokenizer has {tokenizer_size} tokens: no room for prompt ids from {MIN_TOKEN_ID}")
    rng = np.random.default_rng(seed)
    return rng.integers(MIN_TOKEN_ID, tokenizer_size, (batch, prompt_len)).tolist()


def release(*objects: object) -> None:
    """Drops what a section built, so the next one has the device's memory."""
    del objects
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- the floor


def measure_bandwidth(device: str) -> dict[str, Any]:
    """Bytes read plus written per second by a large copy: device-to-device on CUDA, host memory on CPU."""
    num_bytes = COPY_BYTES if device == "cuda" else 64 << 20
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times_s = []
    for _ in range(COPY_REPEATS):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times_s.append(start.elapsed_time(end) / 1e3)
        else:
            start_s = time.perf_counter()
            dst.copy_(src)
            times_s.append(time.perf_counter() - start_s)
    seconds = statistics.median(times_s)
    del src, dst
    return {"copy_bytes": num_bytes, "copy_ms": seconds * 1e3, "bandwidth_gb_s": 2 * num_bytes / seconds / 1e9,
            "method": "device-to-device copy" if device == "cuda" else "host memory copy"}


# ---- transformers


def load_hf(model_dir: Path, setup: Setup) -> Any:
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, setup.dtype)).to(setup.device).eval()
    # eos_token_id=None passed to generate() merges with the checkpoint's; clearing it here runs every row to the end.
    model.generation_config.eos_token_id = None
    return model


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def hf_generate(model: Any, setup: Setup, batch: int, tokenizer_size: int) -> HfRun:
    ids = torch.tensor(random_prompts(batch, setup.prompt_len, tokenizer_size, seed=batch), device=setup.device)
    mask = torch.ones_like(ids)

    def timed(new_tokens: int) -> float:
        _sync(setup.device)
        start_s = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0)
        _sync(setup.device)
        if out.shape != (batch, setup.prompt_len + new_tokens):
            raise RuntimeError(f"transformers generate returned shape {tuple(out.shape)}")
        return time.perf_counter() - start_s

    with torch.inference_mode():
        timed(setup.warmup_tokens)
        first_s = timed(1)
        elapsed_s = timed(setup.output_len)
    return HfRun(path="generate", batch=batch, tpot_ms=(elapsed_s - first_s) / (setup.output_len - 1) * 1e3,
                 output_tok_s=batch * setup.output_len / elapsed_s, elapsed_s=elapsed_s)


def hf_continuous_batching(model: Any, setup: Setup, batch: int, tokenizer_size: int) -> HfRun:
    """transformers' own continuous batching; AttributeError when this version has none."""
    from transformers import GenerationConfig

    generate_batch = getattr(model, "generate_batch", None)
    if generate_batch is None:
        raise AttributeError(f"transformers {hf_version()} has no model.generate_batch")
    accepted = inspect.signature(generate_batch).parameters
    kwargs: dict[str, Any] = {"progress_bar": False} if "progress_bar" in accepted else {}
    if "continuous_batching_config" in accepted:
        kwargs["continuous_batching_config"] = _cb_config(batch, setup)

    def run(prompts: list[list[int]], new_tokens: int) -> tuple[dict, float]:
        config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                  eos_token_id=-1, pad_token_id=0)
        _sync(setup.device)
        start_s = time.perf_counter()
        outputs = generate_batch(inputs=prompts, generation_config=config, **kwargs)
        _sync(setup.device)
        return outputs, time.perf_counter() - start_s

    run(random_prompts(min(batch, 2), 16, tokenizer_size, seed=99), setup.warmup_tokens)
    outputs, elapsed_s = run(random_prompts(batch, setup.prompt_len, tokenizer_size, seed=batch), setup.output_len)
    lengths = [len(o.generated_tokens) for o in outputs.values()]
    if len(lengths) != batch or sum(lengths) == 0:
        raise RuntimeError(f"generate_batch returned {len(lengths)} outputs of {lengths[:8]}... tokens")
    return HfRun(path="continuous_batching", batch=batch, tpot_ms=None, output_tok_s=sum(lengths) / elapsed_s,
                 elapsed_s=elapsed_s)


def _cb_config(batch: int, setup: Setup) -> Any:
    """A KV cache sized for the batch, as ours is: left to itself the manager sizes it from free
    memory, which takes tens of seconds on a CPU and most of a GPU."""
    from transformers import ContinuousBatchingConfig

    defaults = ContinuousBatchingConfig()
    page_size = getattr(defaults, "page_size", None) or defaults.block_size  # block_size before 5.2x
    pages_per_request = -(-(setup.prompt_len + setup.output_len) // page_size)
    return ContinuousBatchingConfig(num_blocks=batch * pages_per_request + 2,
                                    max_batch_tokens=max(MAX_BATCH_TOKENS, setup.prompt_len))


def hf_version() -> str:
    import transformers

    return transformers.__version__
