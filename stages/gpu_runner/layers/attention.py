"""The attention layer: fused q/k/v projection, optional per-head q/k norm, rotary, paged attention
(full or over a sliding window, optionally with per-head sinks) through the step's attention
backend, and the output projection."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stages.gpu_runner.layers.linear import MergedColumnLinear, RowLinear
from stages.gpu_runner.layers.norm import RMSNorm
from stages.gpu_runner.models.config import ModelConfig
from stages.gpu_runner.parallel.group import TensorParallel

if TYPE_CHECKING:
    from stages.gpu_runner.attention.interface import AttentionBackend
    from stages.gpu_runner.layers.kernels import LayerKernels


@dataclass(slots=True)
class ForwardContext:
    """What every layer of one forward reads: the attention backend, the kernels of the norms and
    rotary, the step's attention metadata of each KV group, and the rotary lookups of the step's
    positions by table ("global", and "local" where a model has one)."""

    attention: AttentionBackend
    kernels: LayerKernels
    metas: tuple[Any, ...]
    ropes: dict[str, Any]


class Attention(nn.Module):
    def __init__(self, shard: ModelConfig, tp: TensorParallel | None, *, window: int | None = None,
                 rope: str = "global", kv_group: int = 0, sinks: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, shard.head_dim
        self.q_size, self.kv_size = shard.q_size, shard.kv_size
        self.scale = shard.scale
        self.window = window  # keys a query attends back to, itself included; None: all
        self.rope = rope
        self.kv_group = kv_group  # whose block tables and slots this layer's KV uses
        self.qkv_proj = MergedColumnLinear(shard.hidden_size, [self.q_size, self.kv_size, self.kv_size],
                                           bias=shard.qkv_bias)
        self.o_proj = RowLinear(self.q_size, shard.hidden_size, bias=shard.o_bias, tp=tp)
        self.q_norm = self.k_norm = None
        if shard.qk_norm:
            self.q_norm = RMSNorm(shard.head_dim, shard.rms_norm_eps, shard.norm_unit_offset)
            self.k_norm = RMSNorm(shard.head_dim, shard.rms_norm_eps, shard.norm_unit_offset)
        # gpt-oss: each head's learned logit in its softmax denominator (attention/sinks.py).
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False) if sinks else None

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        rope = ctx.ropes[self.rope]
        if self.q_norm is not None:
            q, k = ctx.kernels.qk_norm_rotary(q, k, self.q_norm, self.k_norm, rope)
        else:
            q, k = ctx.kernels.rotary(q, k, rope)
        out = ctx.attention.attention(q, k, v, kv_cache, ctx.metas[self.kv_group], self.scale, window=self.window,
                                      sinks=self.sinks)
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    @staticmethod
    def expected_tensors(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
        """Checkpoint name -> full shape, for the whole model's `config`."""
        c = config
        shapes: dict[str, tuple[int, ...]] = {}
        for name, size in (("q_proj", c.q_size), ("k_proj", c.kv_size), ("v_proj", c.kv_size)):
            shapes[prefix + f"{name}.weight"] = (size, c.hidden_size)
            if c.qkv_bias:
                shapes[prefix + f"{name}.bias"] = (size,)
        shapes[prefix + "o_proj.weight"] = (c.hidden_size, c.q_size)
        if c.o_bias:
            shapes[prefix + "o_proj.bias"] = (c.hidden_size,)
        if c.qk_norm:
            shapes[prefix + "q_norm.weight"] = (c.head_dim,)
            shapes[prefix + "k_norm.weight"] = (c.head_dim,)
        if c.attention_sinks:
            shapes[prefix + "sinks"] = (c.num_heads,)
        return shapes
