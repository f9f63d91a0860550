"""RMSNorm in one Triton kernel (and fused with the residual add), matching layers/norm.rms_norm."""
from __future__ import annotations

import torch

from stages.gpu_runner.triton_kernels.loading import kernels_for, next_power_of_2


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() < 1 or weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [{x.shape[-1] if x.dim() else '?'}] for x of shape {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """[..., hidden] -> a [rows, hidden] view with a contiguous last dim (a copy only if it must)."""
    rows = tensor.reshape(-1, tensor.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            unit_offset: bool) -> torch.Tensor:
    x_rows = _rows(x)
    residual_rows = x_rows if residual is None else residual.view(-1, residual.shape[-1])
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out_rows = out.view(-1, x.shape[-1])
    hidden = x.shape[-1]
    block = next_power_of_2(hidden)
    if x_rows.shape[0]:
        kernels_for("norm", x).rms_norm_kernel[(x_rows.shape[0],)](
            x_rows, residual_rows, weight.contiguous(), out_rows,
            x_rows.stride(0), residual_rows.stride(0), out_rows.stride(0), hidden, eps,
            ADD_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset, BLOCK=block, num_warps=min(max(block // 256, 1), 16),
        )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """x [..., hidden] -> weight * (x normalised in float32, cast to x.dtype), in torch's
    promoted dtype of weight and x, exactly as layers/norm.rms_norm (with its `unit_offset`)."""
    _check(x, weight)
    return _launch(x, None, weight, eps, unit_offset)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual (in x.dtype, in place); returns (rms_norm(residual), residual)."""
    _check(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(f"residual must match x ({tuple(x.shape)}, {x.dtype}, {x.device}), "
                         f"got {tuple(residual.shape)}, {residual.dtype}, {residual.device}")
    if not residual.is_contiguous():
        raise ValueError("residual is updated in place and must be contiguous")
    return _launch(x, residual, weight, eps, unit_offset), residual
