"""The fused MoE on the GPU as vLLM's `fused_moe` does it: the (token, choice) slots sorted by expert
and each expert's run padded to the block size, then one grouped GEMM launch for gate/up over all
experts, the activation in torch, and one for down (scaled by the routing weights); biases are
added per slot's expert and the k weighted outputs of a token are summed last. Matches
layers/fused_moe/experts.fused_experts up to the order of the float32 sums.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from stages.gpu_runner.triton_kernels.loading import cdiv, kernels_for


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted_slots, block_experts): the flat slot indices grouped by expert, each
    expert's run padded with T * k to a multiple of block_m (size fixed by T, k and the experts), and
    the expert of every block of block_m (blocks past the last run: padding only). A slot of id
    num_experts (an expert another expert-parallel rank holds) is left out.

    No step reads the device from the host (no bincount, whose CUDA kernel reads the largest id, no
    boolean mask), so it runs inside a captured CUDA graph; the shapes depend on T, k and the
    experts alone, which a run on the meta device proves."""
    flat = ids.reshape(-1)
    num_slots = flat.numel()
    capacity = num_slots + num_experts * (block_m - 1)
    capacity = cdiv(capacity, block_m) * block_m
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat.long(), torch.ones(num_slots, dtype=torch.int64, device=ids.device))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts] = 0  # the slots held elsewhere get no room
    padded_ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank_in_expert = torch.arange(num_slots, device=ids.device) - (torch.cumsum(counts, 0) - counts)[experts]
    # A slot held elsewhere is written one past the end, which is cut off.
    where = torch.where(experts < num_experts, (padded_ends - padded)[experts] + rank_in_expert, capacity)
    sorted_slots = torch.full((capacity + 1,), num_slots, dtype=torch.int64, device=ids.device)
    sorted_slots.scatter_(0, where, order)
    padded_ends = padded_ends[:num_experts]
    block_starts = torch.arange(0, capacity, block_m, device=ids.device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_slots[:capacity], block_experts


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, sorted_slots: torch.Tensor,
                  block_experts: torch.Tensor, top_k: int, weights: torch.Tensor | None, block_m: int) -> None:
    n, k = b.shape[1], b.shape[2]
    block_n, block_k = 32, 32
    grid = (sorted_slots.numel() // block_m, cdiv(n, block_n))
    kernels_for("moe", a).grouped_gemm_kernel[grid](
        a, b, out, out if weights is None else weights, sorted_slots, block_experts,
        n, k, out.shape[0], a.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
        TOP_K=top_k, MUL_WEIGHTS=weights is not None,
        DOT_FP32=a.dtype == torch.float32 or a.device.type == "cpu",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
              activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
              block_m: int = 16) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights/ids [T, k] -> Σ_k weight · expert(x) [T, H],
    expert_e(x) = w2[e] · activation(gate, up) + b2[e] where gate, up = w13[e] · x + b13[e] (biases
    optional; activation silu(gate) * up unless given). An id of E (an expert held elsewhere) adds nothing."""
    num_tokens, top_k = ids.shape
    num_experts = w13.shape[0]
    if x.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("fused_moe needs x, w13 and w2 contiguous in their last dimension")
    sorted_slots, block_experts = align_by_expert(ids, num_experts, block_m)
    flat = ids.reshape(-1)
    held = (flat < num_experts).unsqueeze(1)
    expert_of_slot = flat.clamp(max=num_experts - 1)
    gate_up = torch.empty(num_tokens * top_k, w13.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, sorted_slots, block_experts, top_k, None, block_m)
    if b13 is not None:
        gate_up += b13[expert_of_slot]
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = (F.silu(gate) * up if activation is None else activation(gate, up)).contiguous()
    weights = weights.reshape(-1).float().contiguous()
    out = torch.zeros(num_tokens * top_k, w2.shape[1], dtype=torch.float32, device=x.device)
    _grouped_gemm(hidden, w2, out, sorted_slots, block_experts, 1, weights, block_m)
    if b2 is not None:
        out += torch.where(held, weights.unsqueeze(1) * b2[expert_of_slot].float(), 0.0)
    return out.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)
