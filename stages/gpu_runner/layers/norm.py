"""RMSNorm: the function the torch kernels compute, and the module that holds its weight.

Two conventions: `weight * x` (Llama, Qwen) and `(1 + weight) * x` (Gemma, `unit_offset`). Both
normalise in float32; they differ in where the result is cast back, as their references do.
"""
from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        # Gemma scales in float32 and casts last; folding the 1 into a bf16 weight would round it.
        return (x32 * (1.0 + weight.float())).to(x.dtype)
    # Llama casts back before the weight: the same rounding keeps low-precision outputs
    # token-identical to the reference.
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    """The weight and eps of an RMSNorm; the model's layers hand them to their kernels (kernels.py)."""

    def __init__(self, size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if unit_offset else torch.ones(size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.unit_offset)
