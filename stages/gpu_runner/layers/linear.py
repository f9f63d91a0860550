"""Linear projections under tensor parallelism: merged column-parallel (q/k/v, gate/up) and row-parallel,
and the one place that picks how a weight is multiplied (`method_for`).

A rank holds its shard: column-parallel layers its own output rows (heads, intermediate
columns), read from the checkpoint by `parallel.shard_tensor`; a row-parallel layer its input
columns, followed by the all-reduce that sums the ranks' parts. Checkpoints keep q, k and v (and
gate and up) apart; `PACKED` names where each lands in its merged layer.

A layer's weight is a dense tensor (quantization/dense.py) or GGUF blocks kept as the file
stores them (quantization/gguf.py, a `QuantizedWeight` that replaces the layer's parameter); a
merged layer whose parts are stored in different block types holds a tuple of its parts.
Quantized weights are whole: a tensor-parallel rank holds dense shards only.
"""
from __future__ import annotations

import torch
from torch import nn

from stages.gpu_runner.layers.quantization.base import LinearMethod, QuantizedWeight
from stages.gpu_runner.layers.quantization.dense import DenseMethod
from stages.gpu_runner.layers.quantization.gguf import GGUFMethod
from stages.gpu_runner.parallel.group import TensorParallel

# checkpoint projection name -> (merged module name, index of its part)
PACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}

_DENSE, _GGUF = DenseMethod(), GGUFMethod()


def method_for(weight: torch.Tensor | QuantizedWeight) -> LinearMethod:
    """The linear method of a weight held in this form."""
    return _GGUF if isinstance(weight, QuantizedWeight) else _DENSE


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias by the weight's method."""
    return method_for(weight).apply(weight, x, bias)


@torch.no_grad()
def load_weight(module: nn.Module, kind: str, tensor: torch.Tensor | QuantizedWeight) -> None:
    """Fill `module`'s parameter `kind` from a checkpoint tensor: copied in place, or, for
    quantized blocks, held instead of the parameter (whose dtype stays the module's `compute_dtype`)."""
    if isinstance(tensor, QuantizedWeight):
        hold_weight(module, tensor)
    else:
        getattr(module, kind).copy_(tensor)


def hold_weight(module: nn.Module, weight: QuantizedWeight | tuple) -> None:
    """Replace `module`'s weight parameter by a quantized weight (or a tuple of parts)."""
    old = module._parameters.pop("weight", None)
    if old is not None:
        module.compute_dtype = old.dtype
    module.weight = weight


class MergedColumnLinear(nn.Linear):
    """Several projections of one input in one matmul; forward returns the parts."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(out_sizes), bias=bias)
        self.out_sizes = out_sizes
        self._quantized_parts: dict[int, QuantizedWeight | None] = {}

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if isinstance(self.weight, tuple):
            biases = [None] * len(self.out_sizes) if self.bias is None else self.bias.split(self.out_sizes)
            return tuple(linear(x, part, bias) for part, bias in zip(self.weight, biases))
        return linear(x, self.weight, self.bias).split(self.out_sizes, dim=-1)

    @torch.no_grad()
    def load_part(self, index: int, kind: str, tensor: torch.Tensor | QuantizedWeight) -> None:
        """Copy part `index` (this rank's shard of it) of the weight or bias (`kind`); quantized parts
        are held, as one weight once every part is loaded where all share a block type, else as a tuple."""
        start = sum(self.out_sizes[:index])
        if kind != "weight" or not isinstance(tensor, QuantizedWeight):
            getattr(self, kind)[start:start + self.out_sizes[index]].copy_(tensor)
        if kind != "weight":
            return
        self._quantized_parts[index] = tensor if isinstance(tensor, QuantizedWeight) else None
        parts = self._quantized_parts
        if len(parts) < len(self.out_sizes) or all(part is None for part in parts.values()):
            return
        held = [parts[i] if parts[i] is not None else self.weight[sum(self.out_sizes[:i]):][:size].clone()
                for i, size in enumerate(self.out_sizes)]
        stacked = QuantizedWeight.stack(held) if all(isinstance(p, QuantizedWeight) for p in held) else None
        hold_weight(self, stacked if stacked is not None else tuple(held))
        self._quantized_parts = {}


class RowLinear(nn.Linear):
    """Input split over the ranks; the partial outputs are summed by one all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel | None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, self.bias)
        return out if self.tp is None else self.tp.all_reduce(out)
