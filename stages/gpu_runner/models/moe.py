"""Mixtures of experts with Llama-style attention: Mixtral, Qwen2-MoE and Qwen3-MoE.

Per layer: x -> x + attn(norm(x)) -> x + moe(norm(x)), the MoE block (layers/fused_moe/block.py)
in place of the MLP. Per family: Qwen2-MoE has q/k/v bias and a shared expert under a sigmoid
gate, Qwen3-MoE per-head q/k RMSNorm; a Qwen layer listed in mlp_only_layers (or off its
decoder_sparse_step) keeps a dense MLP. Mixtral's checkpoint calls the block `block_sparse_moe`
and its experts' projections w1/w3/w2; the model calls it `mlp` throughout.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from stages.gpu_runner.layers.attention import Attention
from stages.gpu_runner.layers.fused_moe.block import SparseMoeBlock
from stages.gpu_runner.layers.mlp import GatedMLP
from stages.gpu_runner.layers.norm import RMSNorm
from stages.gpu_runner.layers.quantization.base import QuantizedWeight
from stages.gpu_runner.models.base import CausalLM
from stages.gpu_runner.models.config import ModelConfig
from stages.gpu_runner.models.llama import LlamaDecoderLayer

# One expert's projection (safetensors), or every expert's stacked (GGUF).
_EXPERT_TENSOR = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(?:(\d+)\.)?(\w+)\.weight")


class MoEDecoderLayer(LlamaDecoderLayer):
    """x -> x + attn(norm(x)) -> x + moe(norm(x)) (a dense MLP where the layer is not sparse)."""

    STACK_NORMS = None  # experts: not a layer layers/decoder_stack.py runs

    def __init__(self, shard: ModelConfig, tp, window: int | None, kv_group: int, sparse: bool) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(shard.hidden_size, shard.rms_norm_eps)
        self.self_attn = Attention(shard, tp, window=window, kv_group=kv_group)
        self.post_attention_layernorm = RMSNorm(shard.hidden_size, shard.rms_norm_eps)
        self.mlp = SparseMoeBlock(shard, tp) if sparse else GatedMLP(shard, tp)

    def expected_tensors(self, config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
        mixtral_names = config.architecture == "MixtralForCausalLM" and config.gguf_file is None
        ffn = "block_sparse_moe." if mixtral_names else "mlp."
        block = SparseMoeBlock if isinstance(self.mlp, SparseMoeBlock) else GatedMLP
        return {prefix + "input_layernorm.weight": (config.hidden_size,),
                prefix + "post_attention_layernorm.weight": (config.hidden_size,),
                **Attention.expected_tensors(config, prefix + "self_attn."),
                **block.expected_tensors(config, prefix + ffn)}


class MoEForCausalLM(CausalLM):
    def make_layer(self, index: int) -> nn.Module:
        c = self.config
        return MoEDecoderLayer(self.shard, self.tp, c.layer_windows[index], c.kv_group(index), c.sparse_layers[index])

    @torch.no_grad()
    def load_hf_tensor(self, name: str, tensor: torch.Tensor | QuantizedWeight) -> None:
        """Experts' tensors fill their slot of the stacked expert weights; the rest load as in any model."""
        name = name.replace(".block_sparse_moe.", ".mlp.")
        expert = _EXPERT_TENSOR.fullmatch(name)
        if expert is None:
            super().load_hf_tensor(name, tensor)
            return
        layer, index, projection = expert.groups()
        self.layers[int(layer)].mlp.experts.load_expert(None if index is None else int(index), projection, tensor)
