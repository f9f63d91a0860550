"""The Llama family (Llama 1-3.x, Mistral, Qwen2, Qwen3): pre-norm decoder layers of attention and a SwiGLU MLP.

Per-architecture differences are switches on ModelConfig: q/k/v bias (Qwen2), per-head q/k
RMSNorm (Qwen3), tied embeddings, llama3 rope scaling, a sliding window on every layer
(Mistral, Qwen2 with use_sliding_window).
"""
from __future__ import annotations

import torch
from torch import nn

from stages.gpu_runner.layers.attention import Attention, ForwardContext
from stages.gpu_runner.layers.mlp import GatedMLP
from stages.gpu_runner.layers.norm import RMSNorm
from stages.gpu_runner.models.base import CausalLM
from stages.gpu_runner.models.config import ModelConfig


class LlamaDecoderLayer(nn.Module):
    """x -> x + attn(norm(x)) -> x + mlp(norm(x))."""

    # Its norms as layers/decoder_stack.py runs them: input, attention-out, MLP, MLP-out.
    STACK_NORMS = ("input_layernorm", None, "post_attention_layernorm", None)

    def __init__(self, shard: ModelConfig, tp, window: int | None, kv_group: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shard.hidden_size, shard.rms_norm_eps)
        self.self_attn = Attention(shard, tp, window=window, kv_group=kv_group)
        self.post_attention_layernorm = RMSNorm(shard.hidden_size, shard.rms_norm_eps)
        self.mlp = GatedMLP(shard, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: torch.Tensor,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, ctx.kernels.rms_norm(x, self.input_layernorm)
        else:
            x, residual = ctx.kernels.add_rms_norm(x, residual, self.input_layernorm)
        x = self.self_attn(x, kv_cache, ctx)
        x, residual = ctx.kernels.add_rms_norm(x, residual, self.post_attention_layernorm)
        return self.mlp(x), residual

    @staticmethod
    def expected_tensors(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
        return {prefix + "input_layernorm.weight": (config.hidden_size,),
                prefix + "post_attention_layernorm.weight": (config.hidden_size,),
                **Attention.expected_tensors(config, prefix + "self_attn."),
                **GatedMLP.expected_tensors(config, prefix + "mlp.")}


class LlamaForCausalLM(CausalLM):
    def make_layer(self, index: int) -> nn.Module:
        return LlamaDecoderLayer(self.shard, self.tp, self.config.layer_windows[index], self.config.kv_group(index))
