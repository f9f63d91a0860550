"""The gated MLP: down(act(gate(x)) * up(x)), SwiGLU (silu) or GeGLU (tanh-approximated gelu)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stages.gpu_runner import cpu_ops
from stages.gpu_runner.layers.linear import MergedColumnLinear, RowLinear
from stages.gpu_runner.models.config import ModelConfig
from stages.gpu_runner.parallel.group import TensorParallel

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedMLP(nn.Module):
    def __init__(self, shard: ModelConfig, tp: TensorParallel | None) -> None:
        super().__init__()
        inter = shard.intermediate_size
        self.gate_up_proj = MergedColumnLinear(shard.hidden_size, [inter, inter], bias=shard.mlp_bias)
        self.down_proj = RowLinear(inter, shard.hidden_size, bias=shard.mlp_bias, tp=tp)
        self.act = _ACTIVATIONS[shard.hidden_act]
        self.swiglu = shard.hidden_act == "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        if self.swiglu and cpu_ops.elementwise_ready(gate, up):
            return self.down_proj(cpu_ops.silu_and_mul(gate, up))
        return self.down_proj(self.act(gate) * up)

    @staticmethod
    def expected_tensors(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
        """Checkpoint name -> full shape, for the whole model's `config`."""
        c = config
        shapes = {prefix + "gate_proj.weight": (c.intermediate_size, c.hidden_size),
                  prefix + "up_proj.weight": (c.intermediate_size, c.hidden_size),
                  prefix + "down_proj.weight": (c.hidden_size, c.intermediate_size)}
        if c.mlp_bias:
            shapes |= {prefix + "gate_proj.bias": (c.intermediate_size,), prefix + "up_proj.bias": (c.intermediate_size,),
                       prefix + "down_proj.bias": (c.hidden_size,)}
        return shapes
