"""Triton kernel of RMSNorm, optionally fused with the residual add; loaded through triton_kernels.loading."""
import triton
import triton.language as tl

from stages.gpu_runner.triton_kernels.loading import jit_module_in_loading_mode

_common = jit_module_in_loading_mode("common")
round_to = _common.round_to
sum_over = _common.sum_over


@triton.jit
def rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, hidden, eps,
    ADD_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (row): out = weight * (x / rms(x)).to(x.dtype), the products rounded as torch rounds
    them (UNIT_OFFSET: (x / rms(x) * (1 + weight)).to(x.dtype), all in float32, as Gemma); with
    ADD_RESIDUAL, x <- x + residual first (in x's dtype), written back to residual."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = round_to(x.to(tl.float32) + residual.to(tl.float32), x_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(sum_over(x32 * x32, 0) / hidden + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        out = x32 * rstd * (1.0 + weight)
    else:
        out = round_to(x32 * rstd, x_ptr.dtype.element_ty).to(tl.float32) * weight
    tl.store(out_ptr + row * stride_o + cols, round_to(out, out_ptr.dtype.element_ty), mask=mask)
