"""--quantization q8_0 / q4_0: a safetensors checkpoint's float weights quantized at load to ggml
blocks and multiplied by the GGUF linear method; what each --quantization comes to where it
cannot be had; "auto" on a GGUF file.

Tolerances. Both types round each weight to a step of its 32-value block's scale d, stored as
float16 (a relative error of 2^-11, times at most 127 or 8 steps): q8_0 steps amax/127, so its
error is <= amax/254 + amax 2^-11; q4_0 steps amax/8 (16x coarser) from the block's largest
value, and the opposite extreme, clamped to +7 steps, may be off by a whole step: <= amax/8 +
amax 2^-11. The weight test checks those bounds. The logits of the
tiny model (2 layers, random weights, hidden 64) carry the weights' rounding: measured along a
teacher-forced continuation, the worst top-5 log-probability differs from the float32 engine's
by 0.055 nats for q8_0 and 0.45 for q4_0 (about the 16x step ratio, less the averaging of
independent roundings in each dot). The bounds below are ~3x and ~2x those: loose enough for
other summation orders (AVX2, scalar, thread counts), tight enough that a wrong block layout, a
lost scale or a transposed weight (errors of whole nats) fails.
"""
from __future__ import annotations

import logging

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize

from pipeline import LLM, SamplingParams
from stages.contracts.config import EngineConfig
from stages.gpu_runner import cpu_ops
from stages.gpu_runner.layers.quantization.base import QuantizedWeight
from stages.gpu_runner.loaders.quantization import choose_quantization, quantize_at_load
from stages.gpu_runner.models.config import ModelLoadError, load_model_config

pytestmark = pytest.mark.timeout(120)

LOGPROB_TOLERANCE = {"q8_0": 0.15, "q4_0": 1.0}
PROMPT = [1, 5, 9, 22, 7, 100, 200, 300]
NUM_TOKENS = 12


@pytest.fixture(autouse=True, scope="module")
def built() -> None:
    """The kernels must build where a compiler exists (test_quant_kernels.py checks the same)."""
    if cpu_ops.library() is None:
        pytest.skip("the CPU kernels are not built: quantize-at-load falls back to dense weights")


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


def engine(checkpoint, quantization: str) -> LLM:
    return LLM(checkpoint, device="cpu", dtype="float32", quantization=quantization, num_kv_blocks=64,
               max_model_len=128)


@pytest.mark.parametrize("name, bound", [("q8_0", 1 / 254 + 2 ** -11), ("q4_0", 1 / 8 + 2 ** -11)])
def test_each_weight_is_rounded_within_its_blocks_step(name, bound):
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(3)) * 0.02
    held = quantize_at_load(weight, int(QType[name.upper()]))
    assert isinstance(held, QuantizedWeight) and held.shape == (48, 96) and held.blocks.dtype == torch.uint8
    back = torch.from_numpy(dequantize(held.blocks.numpy(), QType[name.upper()])).reshape(48, 96)
    amax = weight.reshape(48, 3, 32).abs().amax(-1, keepdim=True).expand(48, 3, 32).reshape(48, 96)
    error = (back - weight).abs()
    assert (error <= amax * bound).all(), (error / amax).max()
    assert error.max() > 0  # it was rounded, not kept
    vector = torch.randn(96)
    assert quantize_at_load(vector, int(QType.Q8_0)) is vector  # norms stay dense
    assert quantize_at_load(torch.randn(4, 40), int(QType.Q8_0)).shape == (4, 40)  # 40 columns fill no block


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0"])
def test_quantized_at_load_logits_follow_the_float32_engine(checkpoint, quantization):
    """Teacher-forced: each prefix of the float32 engine's greedy continuation, one step each."""
    one = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    with engine(checkpoint, "none") as llm:
        continuation = llm.generate([PROMPT], SamplingParams(max_tokens=NUM_TOKENS, temperature=0))[0].token_ids
        prefixes = [PROMPT + continuation[:k] for k in range(NUM_TOKENS)]
        reference = [out.logprobs[0] for out in llm.generate(prefixes, one)]
    with engine(checkpoint, quantization) as llm:
        model = llm.runner.model
        held = [model.embed_tokens.weight, model.layers[0].self_attn.qkv_proj.weight,
                model.layers[1].mlp.down_proj.weight]
        assert all(isinstance(w, QuantizedWeight) and w.qtype == int(QType[quantization.upper()]) for w in held)
        assert f"quantization {quantization}" in llm.runner.runs_in and quantization.upper() in llm.runner.runs_in
        got = [out.logprobs[0] for out in llm.generate(prefixes, one)]
    shared = [(want[t], step[t]) for want, step in zip(reference, got) for t in want if t in step]
    assert len(shared) >= 3 * NUM_TOKENS  # most of the reference's top tokens stay among its own
    worst = max(abs(a - b) for a, b in shared)
    assert 0 < worst <= LOGPROB_TOLERANCE[quantization], worst


def test_q8_0_greedy_text_equals_the_float32_engine(checkpoint):
    params = SamplingParams(max_tokens=8, temperature=0)
    with engine(checkpoint, "none") as llm:
        want = llm.generate([PROMPT[:5]], params)[0].token_ids
    with engine(checkpoint, "q8_0") as llm:
        assert llm.generate([PROMPT[:5]], params)[0].token_ids == want


def test_bad_combinations_are_refused_or_fall_back_naming_the_problem(checkpoint, caplog):
    config = load_model_config(checkpoint)
    with pytest.raises(ModelLoadError, match="quantization q4_0 .* tensor parallelism"):
        choose_quantization("q4_0", config, torch.device("cpu"), tensor_parallel=True)
    with pytest.raises(ValueError, match="quantization q4_0 holds each weight whole .* tensor_parallel_size 2"):
        EngineConfig(model="m", quantization="q4_0", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"quantization must be one of \['auto', 'none', 'gguf', 'q8_0', 'q4_0'\]"):
        EngineConfig(model="m", quantization="q3_k")
    with pytest.raises(ModelLoadError, match="quantization must be one of"):
        choose_quantization("int8", config, torch.device("cpu"), tensor_parallel=False)
    on_gpu = choose_quantization("q8_0", config, torch.device("cuda"), tensor_parallel=False)
    assert on_gpu.qtype is None and not on_gpu.keep_blocks and "on cuda the weights are dense" in on_gpu.reason
    with caplog.at_level(logging.INFO, logger="stages.gpu_runner.loaders.loader"), engine(checkpoint, "gguf") as llm:
        assert not any(isinstance(m.__dict__.get("weight"), QuantizedWeight) for m in llm.runner.model.modules())
    assert "gguf asked, but the checkpoint is not a GGUF file" in caplog.text


def test_auto_keeps_a_gguf_files_blocks_on_the_cpu_and_dequantizes_elsewhere(checkpoint):
    gguf_config = load_model_config(checkpoint)
    gguf_config.gguf_file = "model.gguf"
    cpu = choose_quantization("auto", gguf_config, torch.device("cpu"), tensor_parallel=False)
    assert cpu.keep_blocks and cpu.name == "gguf" and "kept" in cpu.reason
    for device, parallel, why in [("cuda", False, "CPU-only"), ("cpu", True, "tensor parallelism")]:
        chosen = choose_quantization("auto", gguf_config, torch.device(device), tensor_parallel=parallel)
        assert not chosen.keep_blocks and chosen.name == "none" and why in chosen.reason
    plain = choose_quantization("auto", load_model_config(checkpoint), torch.device("cpu"), tensor_parallel=False)
    assert plain.name == "none" and "not a GGUF file" in plain.reason
    assert EngineConfig(model="m").quantization == "auto"
