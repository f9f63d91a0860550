"""Triton kernel of the fused MoE's grouped GEMM; loaded through triton_kernels.loading."""
import triton
import triton.language as tl

from stages.gpu_runner.triton_kernels.loading import jit_module_in_loading_mode

_common = jit_module_in_loading_mode("common")
round_to = _common.round_to
dot = _common.dot


@triton.jit
def grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_slots_ptr, block_experts_ptr,
    N, K, num_slots, stride_am, stride_be, stride_bn, stride_bk, stride_cm,
    TOP_K: tl.constexpr, MUL_WEIGHTS: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (block of sorted slots, block of output columns): C[slot] = A[slot // TOP_K] @ B[e].T
    for the BLOCK_M slots of one expert e (padding slots, == num_slots, neither read nor written),
    times the slot's routing weight with MUL_WEIGHTS. B is [experts, N, K]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + offs_m).to(tl.int64)
    valid = slots < num_slots
    rows = slots // TOP_K
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :], mask=valid[:, None] & k_mask[None, :],
                    other=0.0)
        b = tl.load(b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk,
                    mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        acc += dot(a, b, DOT_FP32)
    if MUL_WEIGHTS:
        weight = tl.load(weights_ptr + slots, mask=valid, other=0.0)
        acc = acc * weight[:, None]
    tl.store(c_ptr + slots[:, None] * stride_cm + offs_n[None, :], round_to(acc, c_ptr.dtype.element_ty),
             mask=valid[:, None] & n_mask[None, :])
