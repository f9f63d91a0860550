"""The experts of one layer, their weights stacked, run over the tokens grouped by expert.

The (token, choice) pairs are sorted by expert id (a stable argsort of the flat ids), so each
active expert's tokens are one contiguous run: one gate/up matmul and one down matmul per expert
that some token chose, none for the others. The weighted outputs are summed back into their
tokens by one index_add in that order (ascending expert per token), the order in which the
reference adds them, so float32 sums agree to the bit.

Under tensor parallelism a rank holds every expert's slice of the intermediate size (gate/up
rows, down columns) and its output is a partial sum that the block all-reduces. Under expert
parallelism it holds whole experts, a range of them: a choice of an expert held elsewhere has the
id num_experts (one past this rank's), sorts last and is left out.

`experts_kernel` is the one place that picks how they run: this torch path on the CPU, the Triton
fused-MoE kernel (triton_kernels/moe.py) on CUDA.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from stages.gpu_runner import cpu_ops

# gate, up [n, I] -> the hidden activations [n, I] an expert feeds its down projection.
Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# checkpoint projection name -> the part of an expert it fills (Mixtral names w1/w3/w2, Qwen gate/up/down_proj)
EXPERT_PARTS = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


@dataclass(slots=True)
class ExpertGroups:
    """The (token, choice) slots of a step sorted by expert: slot i of the sorted order is token
    `tokens[i]`'s choice `order[i]` (flat index), and experts[j] owns slots bounds[j]:bounds[j + 1]."""

    order: torch.Tensor  # [tokens * k] int64: flat (token, choice) index of each sorted slot
    tokens: torch.Tensor  # [tokens * k] int64: the token of each sorted slot
    experts: list[int]  # the active experts, ascending
    bounds: list[int]  # len(experts) + 1 slot offsets


def group_by_expert(ids: torch.Tensor, num_experts: int) -> ExpertGroups:
    """ids [tokens, k] -> the slots grouped by expert (one host read of the per-expert counts);
    slots of id num_experts (experts held elsewhere) are dropped."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
    active = torch.nonzero(counts).flatten()
    bounds = [0] + torch.cumsum(counts[active], 0).tolist()
    order = order[:bounds[-1]]
    return ExpertGroups(order, order // ids.shape[1], active.tolist(), bounds)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU of the Mixtral and Qwen experts: silu(gate) * up."""
    return cpu_ops.silu_and_mul(gate, up) if cpu_ops.elementwise_ready(gate, up) else F.silu(gate) * up


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                  activation: Activation = silu_and_mul) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights/ids [T, k] -> Σ_k weight · expert(x) [T, H],
    expert_e(x) = w2[e] · activation(gate, up) + b2[e] where gate, up = w13[e] · x + b13[e] (biases optional)."""
    groups = group_by_expert(ids, w13.shape[0])
    if not groups.experts:  # every choice is an expert held elsewhere (or there are no tokens)
        return torch.zeros_like(x)
    sorted_x = x[groups.tokens]

    def expert(tokens: torch.Tensor, e: int) -> torch.Tensor:
        gate, up = F.linear(tokens, w13[e], None if b13 is None else b13[e]).chunk(2, dim=-1)
        return F.linear(activation(gate, up), w2[e], None if b2 is None else b2[e])

    outs = [expert(sorted_x[start:end], e) for e, start, end in zip(groups.experts, groups.bounds, groups.bounds[1:])]
    weighted = torch.cat(outs) * weights.reshape(-1)[groups.order].unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, groups.tokens, weighted.to(x.dtype))


def experts_kernel(device: torch.device) -> Callable[..., torch.Tensor]:
    """The one choice of how the fused experts run (`fused_experts`' signature): on CUDA the Triton
    fused-MoE kernel (triton_kernels/moe.py), elsewhere the torch path above."""
    if device.type == "cuda":
        from stages.gpu_runner.triton_kernels.moe import fused_moe
        return fused_moe
    return fused_experts


class FusedExperts(nn.Module):
    """Experts `held` (all of them, or an expert-parallel rank's range): w13 [E, 2I, H] (each
    expert's gate rows, then its up rows), w2 [E, H, I]; the SwiGLU of `silu_and_mul`, no biases."""

    def __init__(self, held: range, hidden_size: int, intermediate_size: int, num_experts: int) -> None:
        super().__init__()
        self.held = held
        self.some_held_elsewhere = len(held) != num_experts
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(len(held), 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(len(held), hidden_size, intermediate_size), requires_grad=False)
        self.b13 = self.b2 = None
        self.activation: Activation = silu_and_mul

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The weighted sum over the chosen experts this module holds (global expert `ids`)."""
        if self.some_held_elsewhere:
            ids = torch.where((ids >= self.held.start) & (ids < self.held.stop), ids - self.held.start, len(self.held))
        return experts_kernel(x.device)(x, self.w13, self.w2, weights, ids, self.b13, self.b2, self.activation)

    @torch.no_grad()
    def load_expert(self, expert: int | None, projection: str, tensor: torch.Tensor) -> None:
        """Copy one expert's checkpoint projection (an EXPERT_PARTS name; this rank's shard of it),
        or with `expert` None every expert's, stacked [experts, ...]."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expert weights load as dense tensors, got {type(tensor).__name__}")
        if expert is not None and expert not in self.held:
            return  # held by another rank (expert parallelism): not read
        part, inter = EXPERT_PARTS[projection], self.intermediate_size
        experts = slice(None) if expert is None else expert - self.held.start
        if part == "down":
            self.w2[experts].copy_(tensor)
        else:
            start = 0 if part == "gate" else inter
            self.w13[experts, ..., start:start + inter, :].copy_(tensor)
