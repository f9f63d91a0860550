"""gpt-oss's experts: a clamped SwiGLU with biases, run fused over the tokens grouped by expert.

expert(x) = down((up + 1) · glu) + b_down, where gate, up = gate_up(x) + b_gate_up,
gate = min(gate, limit), up = clamp(up, -limit, limit), glu = gate · sigmoid(alpha · gate).

The checkpoint stacks every expert in one tensor per projection, transposed against a linear's
weight and with gate and up interleaved: gate_up_proj [E, H, 2I] (column 2i gate unit i, column
2i + 1 up unit i) and down_proj [E, I, H]. Loading splits the interleaving into w13's gate rows
then up rows, as the other families' experts hold them.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from stages.gpu_runner.layers.fused_moe.experts import FusedExperts

# The checkpoint's stacked expert tensors (their names under `mlp.experts.`).
STACKED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class ClampedSwigluExperts(FusedExperts):
    """Experts `held` (all, or an expert-parallel rank's range): w13 [E, 2I, H] (gate rows, then up
    rows) and b13 [E, 2I]; w2 [E, H, I] and b2 [E, H]; the clamped SwiGLU as the activation."""

    def __init__(self, held: range, hidden_size: int, intermediate_size: int, num_experts: int, alpha: float,
                 limit: float) -> None:
        super().__init__(held, hidden_size, intermediate_size, num_experts)
        self.b13 = nn.Parameter(torch.empty(len(held), 2 * intermediate_size), requires_grad=False)
        self.b2 = nn.Parameter(torch.empty(len(held), hidden_size), requires_grad=False)
        self.alpha, self.limit = alpha, limit
        self.activation = functools.partial(clamped_swiglu, alpha=alpha, limit=limit)

    @torch.no_grad()
    def load_stacked(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one of the checkpoint's STACKED tensors (every expert's, shapes as the module docstring says)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"gpt-oss expert weights load as dense tensors, got {type(tensor).__name__}")
        inter = self.intermediate_size
        if name == "gate_up_proj":
            self.w13[:, :inter].copy_(tensor[..., 0::2].transpose(1, 2))
            self.w13[:, inter:].copy_(tensor[..., 1::2].transpose(1, 2))
        elif name == "gate_up_proj_bias":
            self.b13[:, :inter].copy_(tensor[..., 0::2])
            self.b13[:, inter:].copy_(tensor[..., 1::2])
        elif name == "down_proj":
            self.w2.copy_(tensor.transpose(1, 2))
        elif name == "down_proj_bias":
            self.b2.copy_(tensor)
        else:
            raise KeyError(f"not a stacked gpt-oss expert tensor: {name!r} (known: {', '.join(STACKED)})")
