"""The Triton fused-MoE kernel (sorted slots padded to the block size, one grouped GEMM per
projection) against the torch fused experts, on CPU under the Triton interpreter (compiled on CUDA
when a device is present); and the one dispatch that serves it on CUDA, the torch path elsewhere."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", minversion="3.7")  # the interpreter runs the kernels (loading.py)

from stages.gpu_runner.layers.fused_moe import experts as experts_module  # noqa: E402
from stages.gpu_runner.layers.fused_moe.clamped import ClampedSwigluExperts  # noqa: E402
from stages.gpu_runner.layers.fused_moe.experts import FusedExperts, experts_kernel, fused_experts  # noqa: E402
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


def test_slots_of_experts_held_elsewhere_get_no_room() -> None:
    ids = torch.tensor([[2, 0], [4, 3]])  # 4: an expert another expert-parallel rank holds
    sorted_slots, block_experts = align_by_expert(ids, num_experts=4, block_m=2)
    pad = 4
    assert sorted_slots.tolist()[:6] == [1, pad, 0, pad, 3, pad]
    assert block_experts.tolist()[:3] == [0, 2, 3]
    assert 2 not in sorted_slots.tolist()


def test_cuda_serves_the_kernel_and_the_cpu_the_grouped_torch_path() -> None:
    assert experts_kernel(torch.device("cuda", 0)) is fused_moe
    assert experts_kernel(torch.device("cpu")) is fused_experts


@pytest.mark.parametrize("clamped", [False, True])
def test_experts_served_through_the_kernel_equal_the_torch_path(monkeypatch: pytest.MonkeyPatch,
                                                                clamped: bool) -> None:
    """An expert-parallel rank's experts (4 of 8), gpt-oss's with their biases and clamped SwiGLU
    too, run through the kernel as CUDA would run them (interpreted here): what the torch path gives."""
    hidden, inter, num_experts = 32, 16, 8
    gen = torch.Generator().manual_seed(3)
    held = range(4, 8)
    if clamped:
        experts = ClampedSwigluExperts(held, hidden, inter, num_experts, alpha=1.702, limit=0.5)
    else:
        experts = FusedExperts(held, hidden, inter, num_experts)
    for param in experts.parameters():
        param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    x = torch.randn(7, hidden, generator=gen)
    weights, ids = select_experts(torch.randn(7, num_experts, generator=gen), TopK(3, True, True))
    want = experts(x, weights, ids)
    calls = []

    def kernel(device: torch.device):
        calls.append(device)
        return fused_moe

    monkeypatch.setattr(experts_module, "experts_kernel", kernel)
    got = experts(x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE)).cpu()
    assert calls and want.abs().max() > 0.1
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)


def test_grouping_the_slots_reads_nothing_back_from_the_device() -> None:
    """On the meta device a tensor has no values: an op whose result's shape depends on them (a
    bincount, a boolean mask, a host read) raises there, as it would break a CUDA graph's capture."""
    ids = torch.tensor([[2, 0], [4, 3], [1, 1]])  # 4: held elsewhere
    sorted_slots, block_experts = align_by_expert(ids.to("meta"), num_experts=4, block_m=4)
    want_slots, want_experts = align_by_expert(ids, num_experts=4, block_m=4)
    assert sorted_slots.shape == want_slots.shape and block_experts.shape == want_experts.shape
