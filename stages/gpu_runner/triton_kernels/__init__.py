"""Triton kernels of the GPU runner: paged attention, KV store, RMSNorm, rotary, the fused MoE's grouped GEMM; compiled on CUDA, interpreted on CPU.

The attention backend (attention/triton_backend.py) and the layers' kernels (layers/kernels.py)
call `load(device)` once each: it builds the kernels in the device's mode (see
loading.py for why the mode is fixed when they are defined) and returns them together. The
functions themselves pick the mode from their tensors' device, so calling them directly works too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from stages.gpu_runner.triton_kernels.attention import paged_decode_attention, paged_prefill_attention, store_kv
from stages.gpu_runner.triton_kernels.loading import interpreted, jit_module
from stages.gpu_runner.triton_kernels.norm import fused_add_rms_norm, rms_norm
from stages.gpu_runner.triton_kernels.rotary import qk_norm_rotary_, rotary_embedding_


@dataclass(frozen=True, slots=True)
class Kernels:
    paged_decode_attention: Callable[..., torch.Tensor]
    paged_prefill_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_embedding_: Callable[..., None]
    qk_norm_rotary_: Callable[..., None]
    store_kv: Callable[..., None]


def load(device: torch.device | str) -> Kernels:
    """The kernels for `device` (cuda: compiled; cpu: the Triton interpreter), defined now if not yet."""
    interpret = interpreted(torch.device(device))
    for name in ("attention", "norm", "rotary"):
        jit_module(name, interpret)
    return Kernels(paged_decode_attention, paged_prefill_attention, rms_norm, fused_add_rms_norm,
                   rotary_embedding_, qk_norm_rotary_, store_kv)


__all__ = ["Kernels", "load", "paged_decode_attention", "paged_prefill_attention", "rms_norm",
           "fused_add_rms_norm", "rotary_embedding_", "qk_norm_rotary_", "store_kv"]
