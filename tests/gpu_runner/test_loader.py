"""Checkpoint loading: every supported layout loads, every broken one fails with a clear message."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.models.tiny_model import make_tiny_model
from runner_plans import PlannedRequest, make_runner, run_requests
from stages.gpu_runner.loaders.loader import load_model
from stages.gpu_runner.models.config import ModelLoadError, load_model_config

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(model_dir: Path, **changes: object) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def greedy_tokens(model_dir: Path, **runner_options: object) -> list[list[int]]:
    runner = make_runner(model_dir, num_kv_blocks=64, max_num_seqs=4, **runner_options)
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 60))]
    return run_requests(runner, [PlannedRequest(p, 12) for p in prompts], token_budget=64)


def test_unsupported_architecture_is_named(tiny_checkpoint, tmp_path):
    model_dir = copy_checkpoint(tiny_checkpoint("mistral"), tmp_path / "m")
    edit_config(model_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'"):
        make_runner(model_dir, num_kv_blocks=8)


@pytest.mark.parametrize("filename", ["config.json", "model.safetensors", "tokenizer.json"])
def test_missing_file_is_named(tiny_checkpoint, tmp_path, filename):
    model_dir = copy_checkpoint(tiny_checkpoint("qwen3"), tmp_path / "m")
    (model_dir / filename).unlink()
    with pytest.raises(ModelLoadError, match=f"missing file: .*{filename}"):
        make_runner(model_dir, num_kv_blocks=8)


def test_missing_model_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="model directory not found"):
        make_runner(tmp_path / "nowhere", num_kv_blocks=8)


def test_shape_mismatch_names_tensor_and_shapes(tiny_checkpoint, tmp_path):
    model_dir = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "m")
    edit_config(model_dir, intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"mlp\.(gate|up|down)_proj\.weight has shape \[.*\], config.json implies"):
        make_runner(model_dir, num_kv_blocks=8)


@pytest.mark.parametrize("change", ["drop", "add"])
def test_missing_or_unexpected_tensor_is_named(tiny_checkpoint, tmp_path, change):
    model_dir = copy_checkpoint(tiny_checkpoint("qwen2"), tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    if change == "drop":
        del tensors["model.layers.1.self_attn.k_proj.bias"]
        expected = r"missing tensors \['model.layers.1.self_attn.k_proj.bias'\]"
    else:
        tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
        expected = r"unexpected tensors \['model.layers.0.self_attn.o_proj.bias'\]"
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=expected):
        make_runner(model_dir, num_kv_blocks=8)


def test_unsupported_rope_scaling_is_named(tiny_checkpoint, tmp_path):
    model_dir = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "m")
    edit_config(model_dir, rope_scaling={"rope_type": "longrope", "factor": 4.0})
    with pytest.raises(ModelLoadError, match="rope scaling type 'longrope' is not supported"):
        load_model_config(model_dir)


def test_sharded_checkpoint_gives_the_same_tokens(tiny_checkpoint, tmp_path):
    single = tiny_checkpoint("llama")
    sharded = make_tiny_model(tmp_path / "sharded", "llama", seed=11, shards=3, rope_scaling_llama3=True)
    assert not (sharded / "model.safetensors").exists()
    assert len(list(sharded.glob("model-0000?-of-00003.safetensors"))) == 3
    assert greedy_tokens(sharded) == greedy_tokens(single)


def test_shard_listed_in_index_but_absent(tmp_path):
    sharded = make_tiny_model(tmp_path / "sharded", "qwen3", seed=1, shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="missing file: .*model-00002-of-00002.safetensors"):
        make_runner(sharded, num_kv_blocks=8)


def test_transformers5_rope_parameters_are_read_like_rope_scaling(tiny_checkpoint, tmp_path):
    model_dir = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    params = dict(config.pop("rope_scaling"), rope_theta=config.pop("rope_theta"))
    (model_dir / "config.json").write_text(json.dumps(dict(config, rope_parameters=params)))
    assert load_model_config(model_dir).rope_scaling == load_model_config(tiny_checkpoint("llama")).rope_scaling
    assert greedy_tokens(model_dir) == greedy_tokens(tiny_checkpoint("llama"))


def test_config_facts_reach_the_runner(tiny_checkpoint):
    runner = make_runner(tiny_checkpoint("qwen2"), num_kv_blocks=8)
    assert runner.vocab_size == 1024
    assert runner.eos_token_ids == [1]
    assert runner.model.lm_head is None  # tied to the embeddings
    assert runner.tokenizer_path.name == "tokenizer.json"
    assert runner.dtype == torch.float32  # "auto" on CPU


def test_eos_ids_merge_config_and_generation_config(tiny_checkpoint, tmp_path):
    model_dir = copy_checkpoint(tiny_checkpoint("mistral"), tmp_path / "m")
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    assert load_model_config(model_dir).eos_token_ids == [1, 7]


def test_low_precision_dtypes_load_and_generate(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3")
    for dtype in (torch.bfloat16, torch.float16):
        model = load_model(model_dir, device=torch.device("cpu"), dtype=dtype, max_positions=64)
        assert {p.dtype for p in model.parameters()} == {dtype}
    tokens = greedy_tokens(model_dir, dtype="bfloat16")
    assert all(len(t) == 12 and all(0 <= x < 1024 for x in t) for t in tokens)


def test_bad_runner_settings_are_named(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3")
    with pytest.raises(ValueError, match="max_model_len 4096 exceeds the model's limit of 2048"):
        make_runner(model_dir, num_kv_blocks=8, max_model_len=4096)
    with pytest.raises(ValueError, match="dtype must be one of .* got 'int8'"):
        make_runner(model_dir, num_kv_blocks=8, dtype="int8")
    with pytest.raises(ValueError, match="block_size must be a positive integer, got 0"):
        make_runner(model_dir, num_kv_blocks=8, block_size=0)


def test_sliding_window_does_not_cap_max_model_len(tiny_checkpoint, tmp_path):
    model_dir = copy_checkpoint(tiny_checkpoint("mistral"), tmp_path / "m")
    edit_config(model_dir, sliding_window=512)
    runner = make_runner(model_dir, num_kv_blocks=8)
    assert runner.max_model_len == 2048
    assert {layer.self_attn.window for layer in runner.model.layers} == {512}


def test_gemma3_config_reads_its_layers_rope_bases_and_scale(tiny_checkpoint):
    config = load_model_config(tiny_checkpoint("gemma3"))
    assert config.layer_windows == (16, None)
    assert (config.rope_theta, config.local_rope_theta, config.rope_linear_factor) == (10000.0, 1000.0, 2.0)
    assert config.scale == 16 ** -0.5 and config.hidden_act == "gelu_pytorch_tanh"
    assert config.norm_unit_offset and config.embedding_scale and config.qk_norm


def test_gemma3_transformers5_rope_parameters_by_layer_type(tiny_checkpoint, tmp_path):
    model_dir = copy_checkpoint(tiny_checkpoint("gemma3"), tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    del config["rope_scaling"], config["rope_local_base_freq"]
    config["rope_parameters"] = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}
    (model_dir / "config.json").write_text(json.dumps(config))
    assert load_model_config(model_dir) == load_model_config(tiny_checkpoint("gemma3"))


def test_multimodal_gemma3_checkpoint_serves_its_language_model(tiny_checkpoint, tmp_path):
    """Gemma3ForConditionalGeneration: the text config nested, the language model's tensors under
    `model.language_model.`, vision tensors beside them (skipped)."""
    plain = tiny_checkpoint("gemma3")
    model_dir = copy_checkpoint(plain, tmp_path / "mm")
    text_config = json.loads((plain / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {**text_config, "architectures": None}, "vision_config": {"hidden_size": 8},
        "torch_dtype": "float32"}))
    tensors = {f"model.language_model.{name.removeprefix('model.')}" if name.startswith("model.") else name: t
               for name, t in load_file(plain / "model.safetensors").items()}
    tensors["model.vision_tower.patch_embedding.weight"] = torch.zeros(8, 3)
    tensors["model.multi_modal_projector.mm_input_projection_weight"] = torch.zeros(8, 8)
    save_file(tensors, str(model_dir / "model.safetensors"))
    assert greedy_tokens(model_dir) == greedy_tokens(plain)


def test_tiny_model_tool_is_deterministic_and_its_tokenizer_fits(tmp_path):
    from tokenizers import Tokenizer

    cmd = [sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), "--arch", "qwen3", "--seed", "3",
           "--hidden-size", "32", "--num-layers", "1"]
    for name in ("a", "b"):
        subprocess.run(cmd + [str(tmp_path / name)], check=True, capture_output=True, timeout=60)
    for filename in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "a" / filename).read_bytes() == (tmp_path / "b" / filename).read_bytes()
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["hidden_size"] == 32
    tokenizer = Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json"))
    assert 256 < tokenizer.get_vocab_size() <= config["vocab_size"]
    assert tokenizer.token_to_id("<s>") == 0 and tokenizer.token_to_id("</s>") == 1
    text = "The quick brown fox jumps over the lazy dog 12345."
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
