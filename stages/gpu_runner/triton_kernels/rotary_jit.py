"""Triton kernel of rotary embedding (rotate-half), optionally after a per-head RMSNorm (Qwen3).

Loaded through triton_kernels.loading. Every product and sum is rounded to the activations' dtype
where the torch path (apply_rotary on cos/sin cast to that dtype) rounds it, so a bf16 result
is the torch result to the bit.
"""
import triton
import triton.language as tl

from stages.gpu_runner.triton_kernels.loading import jit_module_in_loading_mode

_common = jit_module_in_loading_mode("common")
round_to = _common.round_to
sum_over = _common.sum_over


@triton.jit
def _rounded(x, DTYPE: tl.constexpr):
    return round_to(x, DTYPE).to(tl.float32)


@triton.jit
def _rotate_heads(base, stride_h, num_heads, weight_ptr, cos1, cos2, sin1, sin2, eps,
                  HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, QK_NORM: tl.constexpr,
                  UNIT_OFFSET: tl.constexpr):
    """In place on one token's heads [num_heads, 2 * HALF] at `base`."""
    dtype = base.dtype.element_ty
    h = tl.arange(0, BLOCK_H)
    c = tl.arange(0, BLOCK_HALF)
    c_mask = c < HALF
    mask = (h < num_heads)[:, None] & c_mask[None, :]
    first = base + h[:, None] * stride_h + c[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        rstd = tl.rsqrt((sum_over(x1 * x1, 1) + sum_over(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(weight_ptr + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(weight_ptr + HALF + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
        if UNIT_OFFSET:  # Gemma: scaled in float32, rounded once
            x1 = _rounded(x1 * rstd * (1.0 + w1), dtype)
            x2 = _rounded(x2 * rstd * (1.0 + w2), dtype)
        else:
            x1 = _rounded(_rounded(x1 * rstd, dtype) * w1, dtype)
            x2 = _rounded(_rounded(x2 * rstd, dtype) * w2, dtype)
    c1 = _rounded(cos1, dtype)[None, :]
    c2 = _rounded(cos2, dtype)[None, :]
    s1 = _rounded(sin1, dtype)[None, :]
    s2 = _rounded(sin2, dtype)[None, :]
    out1 = _rounded(x1 * c1, dtype) - _rounded(x2 * s1, dtype)
    out2 = _rounded(x2 * c2, dtype) + _rounded(x1 * s2, dtype)
    tl.store(first, round_to(out1, dtype), mask=mask)
    tl.store(first + HALF, round_to(out2, dtype), mask=mask)


@triton.jit
def rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr, q_weight_ptr, k_weight_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin, num_heads, num_kv_heads, eps,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    QK_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr,
):
    """Program (token): all its query and key heads."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token)
    c = tl.arange(0, BLOCK_HALF)
    c_mask = c < HALF
    cos1 = tl.load(cos_ptr + position * stride_cos + c, mask=c_mask, other=0.0)
    cos2 = tl.load(cos_ptr + position * stride_cos + HALF + c, mask=c_mask, other=0.0)
    sin1 = tl.load(sin_ptr + position * stride_sin + c, mask=c_mask, other=0.0)
    sin2 = tl.load(sin_ptr + position * stride_sin + HALF + c, mask=c_mask, other=0.0)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_heads, q_weight_ptr, cos1, cos2, sin1, sin2, eps,
                  HALF, BLOCK_HALF, BLOCK_HQ, QK_NORM, UNIT_OFFSET)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, num_kv_heads, k_weight_ptr, cos1, cos2, sin1, sin2, eps,
                  HALF, BLOCK_HALF, BLOCK_HK, QK_NORM, UNIT_OFFSET)
