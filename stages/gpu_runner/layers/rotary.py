"""Rotary position embedding (rotate-half layout, as in HF Llama): default, llama3, linear and YaRN scaling.

A model may hold several tables (Gemma 3: a local base for its sliding layers, a global base for
the others); each is one `RotaryEmbedding` built from its `RopeSpec`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from stages.gpu_runner.models.config import ModelConfig, RopeScaling, YarnScaling


@dataclass(frozen=True, slots=True)
class RopeSpec:
    head_dim: int
    theta: float
    scaling: RopeScaling | None = None  # llama3 frequency-dependent scaling
    linear_factor: float = 1.0  # positions divided by this (linear scaling)
    yarn: YarnScaling | None = None

    @classmethod
    def of(cls, config: ModelConfig) -> RopeSpec:
        """The model's global rotary (every layer's but a local layer's)."""
        return cls(config.head_dim, config.rope_theta, config.rope_scaling, config.rope_linear_factor,
                   config.rope_yarn)


def yarn_attention_factor(yarn: YarnScaling) -> float:
    """The factor YaRN multiplies cos and sin by, as transformers computes it."""
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if yarn.attention_factor is not None:
        return yarn.attention_factor
    if yarn.mscale and yarn.mscale_all_dim:
        return float(mscale(yarn.factor, yarn.mscale) / mscale(yarn.factor, yarn.mscale_all_dim))
    return mscale(yarn.factor)


def yarn_inv_freq(dim: int, theta: float, yarn: YarnScaling) -> torch.Tensor:
    """YaRN's inverse frequencies: interpolated below the correction range, extrapolated above it."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_inv_freq(spec: RopeSpec) -> torch.Tensor:
    """Inverse frequencies, float32 [head_dim // 2], computed exactly as transformers does."""
    dim = spec.head_dim
    if spec.yarn is not None:
        return yarn_inv_freq(dim, spec.theta, spec.yarn)
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
                            getattr(spec, "rope_linear_factor", 1.0), getattr(spec, "rope_yarn", None))
        self.spec = spec
        # Built on the CPU explicitly (the model may be constructed under a meta-device context).
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), rope_inv_freq(spec))
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = 1.0 if spec.yarn is None else yarn_attention_factor(spec.yarn)
        self.cos = (emb.cos() * scale).to(device)
        self.sin = (emb.sin() * scale).to(device)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [num_tokens] -> cos, sin [num_tokens, 1, head_dim] in `dtype`."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, num_heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
