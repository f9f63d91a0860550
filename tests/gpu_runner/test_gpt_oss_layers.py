"""gpt-oss's pieces against transformers' own: the router (top-k of the biased logits, then their
softmax; ties broken alike), the clamped SwiGLU experts loaded from the stacked, interleaved
checkpoint layout, attention with sinks, YaRN's frequencies, and MXFP4 experts dequantized at load."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter, eager_attention_forward

from stages.gpu_runner.attention.selector import model_attention_backend
from stages.gpu_runner.attention.sinks import sink_attention
from stages.gpu_runner.layers.fused_moe.clamped import STACKED, ClampedSwigluExperts
from stages.gpu_runner.layers.fused_moe.routing import TopK, select_experts
from stages.gpu_runner.layers.quantization.mxfp4 import dequantize_mxfp4
from stages.gpu_runner.loaders.loader import load_model
from stages.gpu_runner.layers.rotary import yarn_attention_factor, yarn_inv_freq
from stages.gpu_runner.models.config import ModelLoadError, YarnScaling, load_model_config
from stages.gpu_runner.parallel.group import TensorParallel

E, H, I, K = 8, 16, 12, 2


def config(**extra: object) -> GptOssConfig:
    return GptOssConfig(num_local_experts=E, num_experts_per_tok=K, hidden_size=H, intermediate_size=I,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, swiglu_limit=1.5, **extra)


def test_router_takes_the_top_k_logits_then_their_softmax_and_ties_break_alike() -> None:
    gen = torch.Generator().manual_seed(0)
    router = GptOssTopKRouter(config())
    router.weight.data.copy_(torch.randn(E, H, generator=gen))
    router.weight.data[5] = router.weight.data[2]  # experts 2 and 5 tie for every token
    router.bias.data.zero_()
    x = torch.randn(64, H, generator=gen)
    logits, want_weights, want_ids = router(x)
    weights, ids = select_experts(logits, TopK(K, renormalize=False, weights_float32=False, topk_then_softmax=True))
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    assert any(len({2, 5} & set(row)) == 1 for row in ids.tolist())  # a tie was crossed
    # Softmax-then-top-k would weight the same experts differently.
    other, _ = select_experts(logits, TopK(K, renormalize=False, weights_float32=False))
    assert not torch.allclose(other, weights)


def test_experts_loaded_from_the_stacked_interleaved_layout_equal_transformers() -> None:
    gen = torch.Generator().manual_seed(1)
    reference = GptOssExperts(config())
    tensors = {"gate_up_proj": torch.randn(E, H, 2 * I, generator=gen), "gate_up_proj_bias": torch.randn(E, 2 * I, generator=gen),
               "down_proj": torch.randn(E, I, H, generator=gen), "down_proj_bias": torch.randn(E, H, generator=gen)}
    for name, tensor in tensors.items():
        getattr(reference, name).data.copy_(tensor)
    experts = ClampedSwigluExperts(range(E), H, I, E, alpha=reference.alpha, limit=reference.limit)
    for name in STACKED:
        experts.load_stacked(name, tensors[name])
    x = torch.randn(40, H, generator=gen) * 2  # large enough that the clamp at 1.5 binds
    logits = x @ torch.randn(H, E, generator=gen)
    weights, ids = select_experts(logits, TopK(K, False, False, topk_then_softmax=True))
    with torch.no_grad():
        want = reference(x, ids, weights)
        got = experts(x, weights, ids)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)
    with pytest.raises(KeyError, match="not a stacked gpt-oss expert tensor"):
        experts.load_stacked("gate_up_proj_blocks", tensors["gate_up_proj"])


@pytest.mark.parametrize("window", [None, 5])
def test_sink_attention_equals_transformers_eager_attention(window: int | None) -> None:
    gen = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, 4, 12, 8, generator=gen), torch.randn(1, 2, 12, 8, generator=gen), torch.randn(1, 2, 12, 8, generator=gen)
    sinks = torch.randn(4, generator=gen)
    pos = torch.arange(12)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    additive = torch.zeros(12, 12).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    module = torch.nn.Module()
    module.num_key_value_groups, module.sinks, module.training = 2, sinks, False
    want, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.3)  # [1, q, heads, d]
    got = sink_attention(q, k, v, allowed, 0.3, sinks)
    assert torch.allclose(got.transpose(1, 2), want, rtol=1e-5, atol=1e-6)
    causal = sink_attention(q, k, v, None, 0.3, sinks, is_causal=True)
    assert window is not None or torch.allclose(causal, got, rtol=1e-6, atol=1e-7)
    # The sinks take probability mass: without them the output differs.
    assert not torch.allclose(got, sink_attention(q, k, v, allowed, 0.3, torch.full((4,), -1e9)), atol=1e-3)


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_frequencies_and_factor_equal_transformers(truncate: bool) -> None:
    params = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate,
              "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    hf = GptOssConfig(head_dim=32, hidden_size=64, num_attention_heads=2, max_position_embeddings=2048,
                      rope_parameters=params)
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    yarn = YarnScaling(32.0, 64, 32.0, 1.0, truncate)
    assert torch.equal(yarn_inv_freq(32, 10000.0, yarn), want_freq)
    assert yarn_attention_factor(yarn) == want_factor


def test_a_quantization_other_than_mxfp4_is_refused_by_name(tmp_path) -> None:
    cfg = {"architectures": ["GptOssForCausalLM"], "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100,
           "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
           "quantization_config": {"quant_method": "fp8"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="'fp8' are not supported"):
        load_model_config(tmp_path)
    del cfg["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = load_model_config(tmp_path)
    assert loaded.layer_windows == (8, None) and loaded.attention_sinks and loaded.qkv_bias and loaded.o_bias
    assert loaded.rope_theta == 150_000.0 and not loaded.experts_mxfp4


def random_mxfp4(gen: torch.Generator, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = torch.randint(0, 256, (*shape[:-1], shape[-1] // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(122, 130, (*shape[:-1], shape[-1] // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_dequantizes_as_transformers_does() -> None:
    blocks, scales = random_mxfp4(torch.Generator().manual_seed(3), 3, 24, 64)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(dequantize_mxfp4(blocks, scales), want) and want.shape == (3, 64, 24)


@pytest.fixture
def mxfp4_twins(tiny_checkpoint, tmp_path) -> tuple[Path, Path]:
    """The same experts stored dense (dequantized by transformers) and as MXFP4 blocks and scales."""
    source = tiny_checkpoint("gpt_oss")
    dense_dir, mxfp4_dir = tmp_path / "dense", tmp_path / "mxfp4"
    for out in (dense_dir, mxfp4_dir):
        shutil.copytree(source, out)
    tensors = load_file(source / "model.safetensors")
    dense, quantized = dict(tensors), dict(tensors)
    gen = torch.Generator().manual_seed(4)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, rows, cols = tensors[name].shape  # the dense [E, in, out]: stored as [E, out, in / 32, 16]
        blocks, scales = random_mxfp4(gen, e, cols, rows)
        dense[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        del quantized[name]
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
    save_file(dense, str(dense_dir / "model.safetensors"))
    save_file(quantized, str(mxfp4_dir / "model.safetensors"))
    cfg = json.loads((source / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (mxfp4_dir / "config.json").write_text(json.dumps(cfg))
    return dense_dir, mxfp4_dir


# (rank, expert-parallel) of two ranks; None: the whole model.
@pytest.mark.parametrize("shard", [None, (0, False), (1, False), (1, True)], ids=["whole", "tp0", "tp1", "ep1"])
def test_an_mxfp4_checkpoint_loads_as_its_dequantized_dense_twin(mxfp4_twins, shard) -> None:
    """Whole, and each rank's shard: its slice of the interleaved gate/up units and of down's
    blocks' groups under tensor parallelism, whole experts under expert parallelism."""
    options = {} if shard is None else dict(tp=TensorParallel(shard[0], 2, None, None), expert_parallel=shard[1])
    models = [load_model(d, device=torch.device("cpu"), dtype=torch.float32, max_positions=64, **options)
              for d in mxfp4_twins]
    assert models[1].config.experts_mxfp4
    want, got = (dict(m.named_parameters()) for m in models)
    assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)
    assert not torch.equal(want["layers.0.mlp.experts.w13"], models[0].layers[1].mlp.experts.w13)
    experts = models[1].layers[0].mlp.experts
    assert experts.w13.shape[0] == (4 if shard and shard[1] else 8)


def test_auto_attends_sinks_with_the_torch_backend() -> None:
    assert model_attention_backend("auto", attention_sinks=True) == "torch"
    assert model_attention_backend("auto", attention_sinks=False) == "auto"
    assert model_attention_backend("triton", attention_sinks=True) == "triton"  # refused by the backend itself
