"""Which attention backend a runner uses: the config's name (auto | torch | triton) on its device."""
from __future__ import annotations

import torch

from stages.contracts.config import ATTENTION_BACKENDS
from stages.gpu_runner.attention.interface import AttentionBackend, triton_takes_block_size
from stages.gpu_runner.attention.torch_backend import TorchBackend


def resolve_attention_backend(name: str, device: torch.device, block_size: int) -> str:
    """The backend `name` (auto | torch | triton) means on `device` with KV blocks of `block_size`:
    auto is triton on CUDA where its kernels take the block size, torch elsewhere."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_takes_block_size(block_size) else "torch"
    return name


def model_attention_backend(name: str, attention_sinks: bool) -> str:
    """The backend name a model asks for: auto means torch for a model whose attention has sinks
    (gpt-oss), which only the torch backend attends."""
    return "torch" if name == "auto" and attention_sinks else name


def make_attention_backend(name: str, device: torch.device, block_size: int) -> AttentionBackend:
    """The backend `name` resolves to on `device`; the triton kernels are loaded only when asked for."""
    if resolve_attention_backend(name, device, block_size) == "triton":
        from stages.gpu_runner.attention.triton_backend import TritonBackend

        return TritonBackend(device, block_size)
    return TorchBackend(block_size)
