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
    def __init__(self, shard: ModelConfig, tp: TensorParallel | None, intermediate_size: int | None = None) -> None:
        """`intermediate_size` (this rank's) overrides the config's (a mixture's shared expert)."""
        super().__init__()
        inter = shard.intermediate_size if intermediate_size is None else intermediate_size
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
    def expected_tensors(config: ModelConfig, prefix: str, intermediate_size: int | None = None
                         ) -> dict[str, tuple[int, ...]]:
        """Checkpoint name -> full shape, for the whole model's `config`."""
        c = config
        inter = c.intermediate_size if intermediate_size is None else intermediate_size
        shapes = {prefix + "gate_proj.weight": (inter, c.hidden_size),
                  prefix + "up_proj.weight": (inter, c.hidden_size),
                  prefix + "down_proj.weight": (c.hidden_size, inter)}
        if c.mlp_bias:
            shapes |= {prefix + "gate_proj.bias": (inter,), prefix + "up_proj.bias": (inter,),
                       prefix + "down_proj.bias": (c.hidden_size,)}
        return shapes
