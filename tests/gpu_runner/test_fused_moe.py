"""The fused MoE layer: routing per family (top-k ties broken as transformers breaks them, the
renormalisation, the weights' dtype), experts grouped by expert equal to transformers' experts to
the bit in float32, and inactive experts never touched."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import MixtralConfig, Qwen2MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

from stages.gpu_runner import cpu_ops
from stages.gpu_runner.layers.fused_moe.experts import FusedExperts, fused_experts, group_by_expert
from stages.gpu_runner.layers.fused_moe.routing import TopK, select_experts

E, H, I = 8, 16, 24


def mixtral_router(weight: torch.Tensor, k: int) -> MixtralTopKRouter:
    router = MixtralTopKRouter(MixtralConfig(num_local_experts=E, num_experts_per_tok=k, hidden_size=H))
    router.weight.data.copy_(weight)
    return router


def qwen_router(weight: torch.Tensor, k: int, norm: bool) -> Qwen2MoeTopKRouter:
    router = Qwen2MoeTopKRouter(Qwen2MoeConfig(num_experts=E, num_experts_per_tok=k, hidden_size=H,
                                               norm_topk_prob=norm))
    router.weight.data.copy_(weight)
    return router


def tied_router_weight() -> torch.Tensor:
    """Experts 1, 4 and 6 share a row, 2 and 5 another: their logits tie exactly for every token."""
    weight = torch.randn(E, H, generator=torch.Generator().manual_seed(0))
    weight[4] = weight[6] = weight[1]
    weight[5] = weight[2]
    return weight


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_ties_break_as_transformers_breaks_them_with_each_familys_weights(k: int) -> None:
    weight = tied_router_weight()
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(1))
    logits = x @ weight.T
    _, want_weights, want_ids = mixtral_router(weight, k)(x)
    weights, ids = select_experts(logits, TopK(k, renormalize=True, weights_float32=True))
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    assert torch.allclose(weights.sum(-1), torch.ones(64))
    for norm in (False, True):
        _, want_weights, want_ids = qwen_router(weight, k, norm)(x)
        weights, ids = select_experts(logits, TopK(k, renormalize=norm, weights_float32=False))
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    # Some token's choice does cross a tie, so the order of tied experts is what was compared.
    tied = {1, 4, 6}
    assert any(len(tied & set(row)) not in (0, 3) for row in ids.tolist())


def test_the_weights_dtype_follows_the_family_under_bfloat16() -> None:
    logits = torch.randn(5, E, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    mixtral_weights, _ = select_experts(logits, TopK(2, True, weights_float32=True))
    qwen_weights, _ = select_experts(logits, TopK(2, False, weights_float32=False))
    assert mixtral_weights.dtype == torch.float32 and qwen_weights.dtype == torch.bfloat16
    assert not torch.allclose(qwen_weights.float().sum(-1), torch.ones(5))  # no renormalisation


def random_experts(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen)


@pytest.mark.parametrize("num_tokens", [1, 7, 100])
def test_grouped_experts_equal_transformers_experts_to_the_bit(num_tokens: int, monkeypatch) -> None:
    """With torch's silu (the C silu_and_mul may differ in the last bit), the grouping and the
    order of the sums are the reference's exactly; with the C kernel, equal within rounding."""
    w13, w2 = random_experts(3)
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, H, generator=gen)
    weights, ids = select_experts(torch.randn(num_tokens, E, generator=gen), TopK(3, True, True))
    reference = MixtralExperts(MixtralConfig(num_local_experts=E, hidden_size=H, intermediate_size=I))
    reference.gate_up_proj.data.copy_(w13)
    reference.down_proj.data.copy_(w2)
    with torch.no_grad():
        want = reference(x, ids, weights)
    assert torch.allclose(fused_experts(x, w13, w2, weights, ids), want, rtol=1e-5, atol=1e-4)
    monkeypatch.setattr(cpu_ops, "elementwise_ready", lambda *tensors: False)
    assert torch.equal(fused_experts(x, w13, w2, weights, ids), want)


def test_inactive_experts_are_never_computed() -> None:
    w13, w2 = random_experts(4)
    ids = torch.tensor([[5, 2], [2, 0], [0, 5]])
    weights = torch.full((3, 2), 0.5)
    groups = group_by_expert(ids, E)
    assert groups.experts == [0, 2, 5] and groups.bounds == [0, 2, 4, 6]
    assert groups.tokens.tolist() == [1, 2, 0, 1, 0, 2]
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(5))
    want = fused_experts(x, w13, w2, weights, ids)
    for expert in set(range(E)) - {0, 2, 5}:  # poison what no token chose: any use of it shows as NaN
        w13[expert] = float("nan")
        w2[expert] = float("nan")
    got = fused_experts(x, w13, w2, weights, ids)
    assert torch.isfinite(got).all() and torch.equal(got, want)



def test_expert_parallel_halves_add_up_to_all_experts_even_when_a_rank_holds_no_chosen_expert() -> None:
    w13, w2 = random_experts(6)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(7))
    ids = torch.tensor([[0, 1], [1, 0], [5, 6], [2, 7], [3, 0]])  # token 0 and 1: experts of the first half only
    weights = torch.full((5, 2), 0.5)
    halves = []
    for held in (range(0, 4), range(4, 8)):
        experts = FusedExperts(held, H, I, num_experts=E)
        for e in held:
            experts.load_expert(e, "gate_proj", w13[e, :I])
            experts.load_expert(e, "up_proj", w13[e, I:])
            experts.load_expert(e, "down_proj", w2[e])
        halves.append(experts(x, weights, ids))
    assert torch.equal(halves[1][:2], torch.zeros(2, H))
    assert torch.allclose(halves[0] + halves[1], fused_experts(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-4)
    assert torch.equal(FusedExperts(range(4, 8), H, I, E)(x[:2], weights[:2], ids[:2]), torch.zeros(2, H))

def test_the_benchmark_compares_three_equal_forwards_and_prints_one_json_row_per_batch(capsys) -> None:
    from tools.bench import bench_moe

    assert bench_moe.main(["--batches", "1", "5", "--layers", "1", "--experts", "4", "--top-k", "2", "--hidden", "16",
                           "--moe-intermediate", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [row["batch"] for row in result["rows"]] == [1, 5]
    assert all(row["fused_tokens_s"] > 0 and row["floor_tokens_s"] > 0 for row in result["rows"])
