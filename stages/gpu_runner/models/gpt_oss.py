"""gpt-oss: a mixture of experts whose attention has sinks and alternates sliding and full layers.

Per layer: x -> x + attn(norm(x)) -> x + moe(norm(x)).
- attention: q/k/v/o with biases, YaRN rope, a learned sink logit per head in the softmax
  denominator; even layers attend a sliding window, odd ones everything (config.layer_types);
- moe: a router with a bias picks the top k of its logits and weights them by their softmax;
  the experts are clamped SwiGLUs with biases (layers/fused_moe/clamped.py).
Experts stored as MXFP4 (`*_blocks` and `*_scales`) are dequantized at load. Under tensor
parallelism each rank holds its heads (and their sinks) and its slice of every expert's
intermediate units, or with expert parallelism whole experts (parallel/sharding.py).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from stages.gpu_runner.layers.attention import Attention
from stages.gpu_runner.layers.fused_moe.clamped import STACKED, ClampedSwigluExperts
from stages.gpu_runner.layers.fused_moe.routing import TopK, select_experts
from stages.gpu_runner.layers.norm import RMSNorm
from stages.gpu_runner.layers.quantization.base import QuantizedWeight
from stages.gpu_runner.layers.quantization.mxfp4 import MXFP4_TENSORS, dequantize_mxfp4
from stages.gpu_runner.models.base import CausalLM
from stages.gpu_runner.models.config import ModelConfig
from stages.gpu_runner.models.llama import LlamaDecoderLayer
from stages.gpu_runner.parallel.group import TensorParallel
from stages.gpu_runner.parallel.sharding import local_experts

_STACKED_TENSOR = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(" + "|".join(STACKED) + ")(_blocks|_scales)?")


class GptOssMoE(nn.Module):
    """moe(x) = Σ_{e in top_k(router(x))} softmax(top-k logits)_e · expert_e(x)."""

    def __init__(self, shard: ModelConfig, tp: TensorParallel | None) -> None:
        super().__init__()
        self.router = nn.Linear(shard.hidden_size, shard.num_experts, bias=True)
        self.top = TopK.of(shard)
        held = local_experts(shard, 0, 1) if tp is None else local_experts(shard, tp.rank, tp.size)
        self.experts = ClampedSwigluExperts(held, shard.hidden_size, shard.moe_intermediate_size, shard.num_experts,
                                            shard.swiglu_alpha, shard.swiglu_limit)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Under `tp` each rank's partial sum (its slice of every expert, or its whole experts) is all-reduced."""
        weights, ids = select_experts(self.router(x), self.top)
        out = self.experts(x, weights, ids)
        return out if self.tp is None else self.tp.all_reduce(out)

    @staticmethod
    def expected_tensors(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        shapes = {prefix + "router.weight": (e, h), prefix + "router.bias": (e,),
                  prefix + "experts.gate_up_proj": (e, h, 2 * i), prefix + "experts.gate_up_proj_bias": (e, 2 * i),
                  prefix + "experts.down_proj": (e, i, h), prefix + "experts.down_proj_bias": (e, h)}
        if config.experts_mxfp4:  # [E, rows, cols] stored as blocks [E, rows, cols / 32, 16] and scales
            for name, (rows, cols) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
                del shapes[prefix + f"experts.{name}"]
                shapes[prefix + f"experts.{name}_blocks"] = (e, rows, cols // 32, 16)
                shapes[prefix + f"experts.{name}_scales"] = (e, rows, cols // 32)
        return shapes


class GptOssDecoderLayer(LlamaDecoderLayer):
    """x -> x + attn(norm(x)) -> x + moe(norm(x)); the forward is the Llama layer's."""

    STACK_NORMS = None  # experts: not a layer layers/decoder_stack.py runs

    def __init__(self, shard: ModelConfig, tp: TensorParallel | None, window: int | None, kv_group: int) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(shard.hidden_size, shard.rms_norm_eps)
        self.self_attn = Attention(shard, tp, window=window, kv_group=kv_group, sinks=True)
        self.post_attention_layernorm = RMSNorm(shard.hidden_size, shard.rms_norm_eps)
        self.mlp = GptOssMoE(shard, tp)

    @staticmethod
    def expected_tensors(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
        return {prefix + "input_layernorm.weight": (config.hidden_size,),
                prefix + "post_attention_layernorm.weight": (config.hidden_size,),
                **Attention.expected_tensors(config, prefix + "self_attn."),
                **GptOssMoE.expected_tensors(config, prefix + "mlp.")}


class GptOssForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device, tp=None) -> None:
        if config.experts_mxfp4 and (config.hidden_size % 32 or config.moe_intermediate_size % 32):
            raise ValueError(f"MXFP4 experts need hidden_size {config.hidden_size} and intermediate_size "
                             f"{config.moe_intermediate_size} to be multiples of 32")
        super().__init__(config, max_positions, device, tp)
        self._mxfp4_blocks: dict[str, torch.Tensor] = {}  # blocks read, waiting for their scales

    def make_layer(self, index: int) -> nn.Module:
        return GptOssDecoderLayer(self.shard, self.tp, self.config.layer_windows[index], self.config.kv_group(index))

    @torch.no_grad()
    def load_hf_tensor(self, name: str, tensor: torch.Tensor | QuantizedWeight) -> None:
        """The stacked experts' tensors go to their layer's experts; the rest load as in any model."""
        stacked = _STACKED_TENSOR.fullmatch(name)
        if stacked is None:
            super().load_hf_tensor(name, tensor)
            return
        layer, kind, part = stacked.groups()
        if part == "_blocks":
            self._mxfp4_blocks[name] = tensor
            return
        if part == "_scales":
            blocks = self._mxfp4_blocks.pop(name.removesuffix("_scales") + "_blocks", None)
            if blocks is None or kind not in MXFP4_TENSORS:
                raise ValueError(f"MXFP4 scales {name} come without their blocks")
            tensor = dequantize_mxfp4(blocks, tensor)
        self.layers[int(layer)].mlp.experts.load_stacked(kind, tensor)
