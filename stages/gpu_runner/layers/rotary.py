"""Rotary position embedding (rotate-half layout, as in HF Llama): default, llama3 and linear scaling.

A model may hold several tables (Gemma 3: a local base for its sliding layers, a global base for
the others); each is one `RotaryEmbedding` built from its `RopeSpec`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from stages.gpu_runner.models.config import ModelConfig, RopeScaling


@dataclass(frozen=True, slots=True)
class RopeSpec:
    head_dim: int
    theta: float
    scaling: RopeScaling | None = None  # llama3 frequency-dependent scaling
    linear_factor: float = 1.0  # positions divided by this (linear scaling)

    @classmethod
    def of(cls, config: ModelConfig) -> RopeSpec:
        """The model's global rotary (every layer's but a local layer's)."""
        return cls(config.head_dim, config.rope_theta, config.rope_scaling, config.rope_linear_factor)


def rope_inv_freq(spec: RopeSpec) -> torch.Tensor:
    """Inverse frequencies, float32 [head_dim // 2], computed exactly as transformers does."""
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if spec.linear_factor != 1.0:
        inv_freq = inv_freq / spec.linear_factor
    s = spec.scaling
    if s is None:
        return inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables for every position up to max_positions, looked up per token.

    The tables stay float32 (plain attributes, not module buffers, so a dtype cast of the
    model leaves them exact); each lookup casts to the activations' dtype, as transformers does.
    `spec` may also be a ModelConfig: its global rotary.
    """

    def __init__(self, spec: RopeSpec | ModelConfig, max_positions: int, device: torch.device) -> None:
        if not isinstance(spec, RopeSpec):
            spec = RopeSpec(spec.head_dim, spec.rope_theta, spec.rope_scaling,
                            getattr(spec, "rope_linear_factor", 1.0))
        self.spec = spec
        # Built on the CPU explicitly (the model may be constructed under a meta-device context).
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), rope_inv_freq(spec))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [num_tokens] -> cos, sin [num_tokens, 1, head_dim] in `dtype`."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, num_heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
