"""The offline engine the engine tests build on a tiny checkpoint: small enough to start in a moment."""
from __future__ import annotations

from pathlib import Path

from device_choice import engine_device

from pipeline import LLM


def small_llm(model: Path, **options: object) -> LLM:
    """`LLM(model)` on the test run's device, 256 tokens long, 128 KV blocks of 4; `options` override."""
    options.setdefault("device", engine_device())
    options.setdefault("max_model_len", 256)
    options.setdefault("num_kv_blocks", 128)
    options.setdefault("block_size", 4)
    return LLM(model=model, **options)
