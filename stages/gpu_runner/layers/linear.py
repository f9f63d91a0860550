"""Linear projections under tensor parallelism: merged column-parallel (q/k/v, gate/up) and row-parallel.

A rank holds its shard: column-parallel layers its own output rows (heads, intermediate
columns), read from the checkpoint by `parallel.shard_tensor`; a row-parallel layer its input
columns, followed by the all-reduce that sums the ranks' parts. Checkpoints keep q, k and v (and
gate and up) apart; `PACKED` names where each lands in its merged layer.
"""
from __future__ import annotations

import torch
from torch import nn

from stages.gpu_runner.parallel import TensorParallel

# checkpoint projection name -> (merged module name, index of its part)
PACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class MergedColumnLinear(nn.Linear):
    """Several projections of one input in one matmul; forward returns the parts."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(out_sizes), bias=bias)
        self.out_sizes = out_sizes

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return super().forward(x).split(self.out_sizes, dim=-1)

    @torch.no_grad()
    def load_part(self, index: int, kind: str, tensor: torch.Tensor) -> None:
        """Copy part `index` (this rank's shard of it) of the weight or bias (`kind`)."""
        start = sum(self.out_sizes[:index])
        getattr(self, kind)[start:start + self.out_sizes[index]].copy_(tensor)


class RowLinear(nn.Linear):
    """Input split over the ranks; the partial outputs are summed by one all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel | None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if self.tp is None else self.tp.all_reduce(out)
