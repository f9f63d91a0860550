"""Rotary embedding of q and k in place in one Triton kernel, with the per-head q/k RMSNorm of Qwen3 and Gemma 3 fused."""
from __future__ import annotations

import torch

from stages.gpu_runner.triton_kernels.loading import kernels_for, next_power_of_2


def _launch(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            weights: tuple[torch.Tensor, torch.Tensor] | None, eps: float, unit_offset: bool = False) -> None:
    if query.dim() != 3 or key.dim() != 3 or key.shape[0] != query.shape[0] or key.shape[2] != query.shape[2]:
        raise ValueError(f"query must be [T, H, D] and key [T, KVH, D], got {tuple(query.shape)} and {tuple(key.shape)}")
    head_dim = query.shape[2]
    if head_dim % 2:
        raise ValueError(f"rotary needs an even head_dim, got {head_dim}")
    if key.dtype != query.dtype:
        raise ValueError(f"key dtype {key.dtype} differs from query dtype {query.dtype}")
    if query.stride(-1) != 1 or key.stride(-1) != 1:
        raise ValueError("query and key are updated in place and must be contiguous in head_dim")
    if positions.shape != (query.shape[0],) or positions.dtype != torch.int64:
        raise ValueError(f"positions must be int64 [{query.shape[0]}], got {positions.dtype} {tuple(positions.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != head_dim or table.dtype != torch.float32 or table.stride(1) != 1:
            raise ValueError(f"{name} must be a float32 [max_positions, {head_dim}] table, got {table.dtype} "
                             f"{tuple(table.shape)}")
    for name, tensor in (("key", key), ("positions", positions), ("cos", cos), ("sin", sin)):
        if tensor.device != query.device:
            raise ValueError(f"{name} is on {tensor.device}, query on {query.device}")
    if weights is not None:
        for name, weight in zip(("q_weight", "k_weight"), weights):
            if weight.shape != (head_dim,) or weight.device != query.device:
                raise ValueError(f"{name} must be [{head_dim}] on {query.device}, got {tuple(weight.shape)} on "
                                 f"{weight.device}")
    if query.shape[0] == 0:
        return
    q_weight, k_weight = (w.contiguous() for w in weights) if weights is not None else (query, key)
    half = head_dim // 2
    kernels_for("rotary", query).rotary_kernel[(query.shape[0],)](
        query, key, positions, cos, sin, q_weight, k_weight,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos.stride(0), sin.stride(0),
        query.shape[1], key.shape[1], eps,
        HALF=half, BLOCK_HALF=next_power_of_2(half), BLOCK_HQ=next_power_of_2(query.shape[1]),
        BLOCK_HK=next_power_of_2(key.shape[1]), QK_NORM=weights is not None, UNIT_OFFSET=unit_offset,
    )


def rotary_embedding_(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> None:
    """In place: query [T, H, D], key [T, KVH, D] <- apply_rotary(x, cos[positions], sin[positions]) with
    the float32 tables of layers/rotary.RotaryEmbedding cast to the activations' dtype."""
    _launch(query, key, positions, cos, sin, None, 0.0)


def qk_norm_rotary_(query: torch.Tensor, key: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                    eps: float, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    unit_offset: bool = False) -> None:
    """In place, Qwen3 and Gemma 3: per-head RMSNorm of query and key (weights [D], products rounded to
    the activations' dtype; `unit_offset`: scaled by 1 + weight in float32), then rotary as rotary_embedding_."""
    _launch(query, key, positions, cos, sin, (q_weight, k_weight), eps, unit_offset)
