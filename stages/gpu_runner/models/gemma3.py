"""Gemma 3 text models: local (sliding-window) and global layers, each a sandwich of norms.

Per layer: x -> x + norm(attn(norm(x))) -> x + norm(mlp(norm(x))), four RMSNorms of the (1 + w)
kind; per-head q/k RMSNorm; attention scaled by query_pre_attn_scalar ** -0.5; a local layer
attends its window with the local rotary base, a global layer everything with the global base
(and its linear scaling); GeGLU MLP; embeddings scaled by sqrt(hidden); tied LM head.
"""
from __future__ import annotations

import torch
from torch import nn

from stages.gpu_runner.layers.attention import Attention, ForwardContext
from stages.gpu_runner.layers.mlp import GatedMLP
from stages.gpu_runner.layers.norm import RMSNorm
from stages.gpu_runner.models.base import CausalLM
from stages.gpu_runner.models.config import ModelConfig

_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


class Gemma3DecoderLayer(nn.Module):
    # Its norms as layers/decoder_stack.py runs them: input, attention-out, MLP, MLP-out.
    STACK_NORMS = _NORMS
    def __init__(self, shard: ModelConfig, tp, window: int | None, kv_group: int) -> None:
        super().__init__()
        for name in _NORMS:
            setattr(self, name, RMSNorm(shard.hidden_size, shard.rms_norm_eps, unit_offset=True))
        self.self_attn = Attention(shard, tp, window=window, rope="global" if window is None else "local",
                                   kv_group=kv_group)
        self.mlp = GatedMLP(shard, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: torch.Tensor,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        kernels = ctx.kernels
        if residual is None:
            residual, x = x, kernels.rms_norm(x, self.input_layernorm)
        else:
            x, residual = kernels.add_rms_norm(x, residual, self.input_layernorm)
        x = kernels.rms_norm(self.self_attn(x, kv_cache, ctx), self.post_attention_layernorm)
        x, residual = kernels.add_rms_norm(x, residual, self.pre_feedforward_layernorm)
        return kernels.rms_norm(self.mlp(x), self.post_feedforward_layernorm), residual

    @staticmethod
    def expected_tensors(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
        return {**{prefix + f"{name}.weight": (config.hidden_size,) for name in _NORMS},
                **Attention.expected_tensors(config, prefix + "self_attn."),
                **GatedMLP.expected_tensors(config, prefix + "mlp.")}


class Gemma3ForCausalLM(CausalLM):
    def make_layer(self, index: int) -> nn.Module:
        return Gemma3DecoderLayer(self.shard, self.tp, self.config.layer_windows[index], self.config.kv_group(index))
