"""kv_cache_dtype: a bfloat16 KV cache under a float32 model on the CPU holds twice the tokens in
the same memory, and its greedy tokens are the float32 cache's but where bfloat16 keys and values
change a near-tie."""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline import LLM, SamplingParams
from pipeline.options import add_daemon_options, add_engine_options, engine_config
from stages.gpu_runner.attention.kv_cache import resolve_kv_dtype

pytestmark = pytest.mark.timeout(120)
OPTIONS = dict(device="cpu", dtype="float32", max_model_len=256, block_size=16, kv_cache_memory_bytes=1 << 20)


def test_a_bfloat16_cache_holds_twice_the_tokens_and_gives_the_float32_caches_greedy_tokens(tiny_llama: Path) -> None:
    prompts = [np.random.default_rng(seed).integers(2, 1000, n).tolist() for seed, n in ((1, 9), (2, 40), (3, 100))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    wide = LLM(tiny_llama, **OPTIONS)
    narrow = LLM(tiny_llama, kv_cache_dtype="bfloat16", **OPTIONS)
    assert wide.runner.kv_caches[0].dtype == torch.float32 and narrow.runner.kv_caches[0].dtype == torch.bfloat16
    assert narrow.runner.num_kv_blocks == pytest.approx(2 * wide.runner.num_kv_blocks, abs=1)
    assert "KV cache bfloat16" in narrow.runner.runs_in and "KV cache float32" in wide.runner.runs_in
    want = [o.token_ids for o in wide.generate(prompts, params)]
    got = [o.token_ids for o in narrow.generate(prompts, params)]
    # bfloat16 keeps 8 significant bits of each key and value: the tiny random model's logits
    # agree to well within its top-2 gaps at every step here.
    assert got == want


def test_a_cache_dtype_other_than_the_models_needs_the_torch_backend() -> None:
    assert resolve_kv_dtype("auto", torch.bfloat16, "triton") == torch.bfloat16
    assert resolve_kv_dtype("bfloat16", torch.float32, "torch") == torch.bfloat16
    assert resolve_kv_dtype("bfloat16", torch.bfloat16, "triton") == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype bfloat16 with a float32 model needs attention_backend 'torch'"):
        resolve_kv_dtype("bfloat16", torch.float32, "triton")


def test_the_cli_option_reaches_the_config_and_a_bad_one_is_refused(tiny_llama: Path) -> None:
    parser = argparse.ArgumentParser()
    add_daemon_options(parser)
    add_engine_options(parser)
    config = engine_config(parser.parse_args(["--model", str(tiny_llama), "--kv-cache-dtype", "bfloat16"]))
    assert config.kv_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", str(tiny_llama), "--kv-cache-dtype", "int8"])
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(tiny_llama, kv_cache_dtype="fp8", **OPTIONS)
