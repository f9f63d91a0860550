"""The Triton fused-MoE kernel (sorted slots padded to the block size, one grouped GEMM per
projection) against the torch fused experts, on CPU under the Triton interpreter (compiled on CUDA
when a device is present)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from stages.gpu_runner.layers.fused_moe.experts import fused_experts  # noqa: E402
from stages.gpu_runner.layers.fused_moe.routing import TopK, select_experts  # noqa: E402
from stages.gpu_runner.triton_kernels.moe import align_by_expert, fused_moe  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.timeout(120)


def test_slots_are_grouped_by_expert_and_padded_to_the_block() -> None:
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])
    sorted_slots, block_experts = align_by_expert(ids, num_experts=4, block_m=4)
    pad = 6  # T * k: a slot no token has
    assert sorted_slots.tolist()[:12] == [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad]
    assert block_experts.tolist()[:3] == [0, 2, 3]
    assert set(sorted_slots.tolist()[12:]) <= {pad}  # capacity for the worst case, padding only


@pytest.mark.parametrize("num_tokens, num_experts, top_k, dtype", [(1, 4, 2, torch.float32), (9, 8, 3, torch.float32),
                                                                   (33, 6, 2, torch.bfloat16)])
def test_the_kernel_equals_the_torch_fused_experts(num_tokens: int, num_experts: int, top_k: int,
                                                   dtype: torch.dtype) -> None:
    hidden, inter = 48, 40  # not multiples of the 32-wide blocks: the masks are exercised
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * 0.2).to(dtype)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=gen).to(dtype),
                                  TopK(top_k, renormalize=True, weights_float32=dtype == torch.float32))
    want = fused_experts(x, w13, w2, weights, ids)
    got = fused_moe(*(t.to(DEVICE) for t in (x, w13, w2, weights, ids))).cpu()
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    assert got.dtype == dtype and torch.allclose(got.float(), want.float(), **tolerance)
