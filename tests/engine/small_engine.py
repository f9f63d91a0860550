"""The offline engine the engine tests build on a tiny checkpoint: small enough to start in a moment."""
from __future__ import annotations

from pathlib import Path

from device_choice import engine_device

from pipeline import LLM


def small_llm(model: Path, **options: object) -> LLM:
    """`LLM(model)` on the test run's device, 256 tokens long, 128 KV blocks of 4; `options` override.
    On the CPU in float32: there "auto" is bfloat16 where the CPU has bf16 instructions, and the
    tests compare exact tokens across batch shapes, which bfloat16's rounding moves at near-ties."""
    options.setdefault("device", engine_device())
    if options["device"] == "cpu":
        options.setdefault("dtype", "float32")
    options.setdefault("max_model_len", 256)
    options.setdefault("num_kv_blocks", 128)
    options.setdefault("block_size", 4)
    return LLM(model=model, **options)
