"""Mixtures of experts from GGUF files laid out as llama.cpp lays them out (Mixtral as a "llama"
file with an expert count, qwen2moe with its shared expert's ffn_*_shexp and its gate
ffn_gate_inp_shexp, qwen3moe; each projection's experts stacked in one tensor) give the greedy
tokens of their safetensors checkpoints."""
from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file
from test_gguf_loading import greedy, own_cache, write_gguf  # noqa: F401 (own_cache: an autouse fixture)

from pipeline.models.checkpoints import resolve_model

pytestmark = pytest.mark.timeout(90)
_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj", "gate_proj": "gate_proj",
                "up_proj": "up_proj", "down_proj": "down_proj"}
_EXPERT = re.compile(r"(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")


def stacked(model_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with each layer's experts stacked per projection, under HF-like names."""
    tensors, experts = {}, {}
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        match = _EXPERT.fullmatch(name)
        if match is None:
            tensors[name.replace(".block_sparse_moe.", ".mlp.")] = tensor
            continue
        layer, index, projection = match.groups()
        experts.setdefault(f"{layer}.mlp.experts.{_PROJECTIONS[projection]}.weight", {})[int(index)] = tensor
    for name, by_index in experts.items():
        tensors[name] = torch.stack([by_index[i] for i in sorted(by_index)])
    return tensors


@pytest.mark.parametrize("arch, gguf_arch",
                         [("mixtral", "llama"), ("qwen2_moe", "qwen2moe"), ("qwen3_moe", "qwen3moe")])
def test_a_moe_gguf_file_serves_the_tokens_of_its_safetensors_checkpoint(arch, gguf_arch, tiny_checkpoint, tmp_path):
    # llama.cpp's qwen2moe has experts in every layer: one layer, so the tiny model's dense layer 1 is not there.
    source = tiny_checkpoint(arch, num_layers=1) if arch == "qwen2_moe" else tiny_checkpoint(arch)
    config = json.loads((source / "config.json").read_text())

    def experts(writer: gguf.GGUFWriter) -> None:
        writer.add_expert_count(config.get("num_local_experts") or config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if "moe_intermediate_size" in config:
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if "shared_expert_intermediate_size" in config:
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])

    path = write_gguf(source, tmp_path / f"{arch}.gguf", gguf_arch, tensors=stacked(source), metadata=experts)
    served = Path(resolve_model(path))
    assert json.loads((served / "config.json").read_text())["architectures"] == config["architectures"]
    assert greedy(served) == greedy(source)


def test_experts_of_another_gguf_architecture_are_refused_naming_it(tiny_checkpoint, tmp_path):
    from stages.gpu_runner.models.config import ModelLoadError

    source = tiny_checkpoint("qwen3")
    path = write_gguf(source, tmp_path / "qwen3-experts.gguf", "qwen3", metadata=lambda w: w.add_expert_count(4))
    with pytest.raises(ModelLoadError, match="experts of GGUF architecture 'qwen3' are not supported"):
        resolve_model(path)
