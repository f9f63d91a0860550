"""Which kernels the layers' RMSNorm and rotary run: plain torch (the CPU operators where they take the
tensors) or Triton, chosen with the attention backend (`attention_backend`: torch or triton).

The layers hold the weights (norm.py, rotary.py); a `LayerKernels` applies them. Both sets compute
what the torch functions of norm.py and rotary.py compute, rounded as they round.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from stages.gpu_runner import cpu_ops
from stages.gpu_runner.layers.norm import RMSNorm, rms_norm
from stages.gpu_runner.layers.rotary import RotaryEmbedding, apply_rotary


class LayerKernels(Protocol):
    name: str

    def rope(self, positions: torch.Tensor, rotary: RotaryEmbedding, dtype: torch.dtype) -> Any:
        """What `rotary` and `qk_norm_rotary` read for this step's positions (built once per forward)."""

    def rotary(self, query: torch.Tensor, key: torch.Tensor, rope: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """query [T, H, D], key [T, KVH, D] -> the two rotated."""

    def qk_norm_rotary(self, query: torch.Tensor, key: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm,
                       rope: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head RMSNorm of query and key (Qwen3, Gemma 3), then rotary."""

    def rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """RMSNorm over the last dimension, with the weight, eps and convention of `norm`."""

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual)."""


class TorchKernels:
    """RMSNorm and rotary in plain torch, through the compiled CPU operators where they take the tensors."""

    name = "torch"

    def rope(self, positions: torch.Tensor, rotary: RotaryEmbedding,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary(positions, dtype)

    def rotary(self, query: torch.Tensor, key: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope
        if cpu_ops.elementwise_ready(query, key, cos, sin):
            return cpu_ops.rotary(query, cos, sin), cpu_ops.rotary(key, cos, sin)
        return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)

    def qk_norm_rotary(self, query: torch.Tensor, key: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm,
                       rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(self.rms_norm(query, q_norm), self.rms_norm(key, k_norm), rope)

    def rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        if cpu_ops.elementwise_ready(x, norm.weight):
            return cpu_ops.rms_norm(x, norm.weight, norm.eps, norm.unit_offset)[0]
        return rms_norm(x, norm.weight, norm.eps, norm.unit_offset)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        if cpu_ops.elementwise_ready(x, residual, norm.weight):
            return cpu_ops.rms_norm(x, norm.weight, norm.eps, norm.unit_offset, residual)
        residual = x + residual
        return self.rms_norm(residual, norm), residual


class TritonKernels:
    """RMSNorm (fused with the residual add) and rotary (fused with the per-head q/k norm) in Triton."""

    name = "triton"

    def __init__(self, device: torch.device) -> None:
        from stages.gpu_runner import triton_kernels

        self.kernels = triton_kernels.load(device)

    def rope(self, positions: torch.Tensor, rotary: RotaryEmbedding,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return positions, rotary.cos, rotary.sin

    def rotary(self, query: torch.Tensor, key: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        self.kernels.rotary_embedding_(query, key, *rope)
        return query, key

    def qk_norm_rotary(self, query: torch.Tensor, key: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm,
                       rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        self.kernels.qk_norm_rotary_(query, key, q_norm.weight, k_norm.weight, q_norm.eps, *rope,
                                     unit_offset=q_norm.unit_offset)
        return query, key

    def rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return self.kernels.rms_norm(x, norm.weight, norm.eps, norm.unit_offset)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.fused_add_rms_norm(x, residual, norm.weight, norm.eps, norm.unit_offset)


def make_layer_kernels(name: str, device: torch.device) -> LayerKernels:
    """The kernels that go with attention backend `name` as resolved (torch | triton) on `device`."""
    if name not in ("torch", "triton"):
        raise ValueError(f"make_layer_kernels takes a resolved backend (torch | triton), got {name!r}")
    return TritonKernels(device) if name == "triton" else TorchKernels()
