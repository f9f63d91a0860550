"""The offline engine split over two tensor-parallel ranks (gloo on CPU) gives what one rank gives."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline import LLM, SamplingParams
from pipeline.models.tiny_model import make_tiny_model
from stages.gpu_runner.loaders.loader import load_model
from stages.gpu_runner.models.config import load_model_config
from stages.gpu_runner.parallel.group import TensorParallel
from stages.gpu_runner.parallel.sharding import check_tensor_parallel, weight_bytes

pytestmark = pytest.mark.timeout(90)

# One rank and two sum in different orders: their greedy tokens agree where rounding cannot swap the
# two best, so in float32 ("auto" is bfloat16 on a CPU with bf16 instructions, whose rounding moves
# the tiny models' near-ties).
EXACT = "float32"

# (arch, size overrides): qwen2 ties its embeddings and has a vocabulary the ranks split unevenly;
# the llama with one KV head has fewer KV heads than ranks (each rank holds a copy).
SHAPES = {
    "llama": ("llama", {}),
    "llama-1kv": ("llama", {"num_kv_heads": 1}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {"vocab_size": 1001}),
    "qwen3": ("qwen3", {}),
    # Mixtures of experts: every expert's intermediate size split, Qwen2-MoE's shared expert too.
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    # gpt-oss: its sinks split with the heads, its stacked experts' interleaved gate/up units split.
    "gpt_oss": ("gpt_oss", {}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-models")
    return {name: make_tiny_model(root / name, arch, seed=7, **sizes) for name, (arch, sizes) in SHAPES.items()}


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    shared = rng.integers(2, 1000, 13).tolist()
    return [shared + rng.integers(2, 1000, n).tolist() for n in (2, 7)] + [rng.integers(2, 1000, 21).tolist()]


def params() -> list[SamplingParams]:
    """Greedy, seeded and seeded with top-k and logprobs: rank 0 samples from the gathered logits."""
    return [SamplingParams(max_tokens=8, temperature=0),
            SamplingParams(max_tokens=8, temperature=0.9, seed=11),
            SamplingParams(max_tokens=8, temperature=0.7, top_k=20, seed=12, logprobs=2)]


def run(model: Path, **options: object) -> list[list[int]]:
    options = dict(device="cpu", dtype=EXACT, max_model_len=128, num_kv_blocks=64, block_size=4) | options
    with LLM(model, **options) as llm:
        outputs = llm.generate(prompts(), params())
        assert llm.scheduler.stats().kv_blocks_free == llm.runner.num_kv_blocks
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_two_ranks_equal_one(models: dict[str, Path], shape: str) -> None:
    expected = run(models[shape])
    assert all(len(t) == 8 for t in expected)
    assert run(models[shape], tensor_parallel_size=2) == expected


def test_two_ranks_sync_chunked_prefix_hits_and_preemption(models: dict[str, Path]) -> None:
    model = models["llama-1kv"]
    # A small pool and step budget: prompts are chunked and requests preempted; the second
    # generate hits the prefix cache.
    options = dict(num_kv_blocks=14, max_num_batched_tokens=8, max_model_len=48)
    expected = run(model, async_scheduling=False, **options)
    with LLM(model, device="cpu", dtype=EXACT, block_size=4, tensor_parallel_size=2, async_scheduling=False,
             **options) as llm:
        for _ in range(2):
            assert [o.token_ids for o in llm.generate(prompts(), params())] == expected
        stats = llm.scheduler.stats()
        assert stats.num_preemptions > 0
        assert stats.prefix.hit_rate > 0
        assert stats.kv_blocks_free == llm.runner.num_kv_blocks


@pytest.mark.parametrize("shape", ["llama", "llama-1kv", "qwen2"])
def test_each_rank_holds_its_share_of_the_weights(models: dict[str, Path], shape: str) -> None:
    model = models[shape]
    config = load_model_config(model)
    whole = weight_bytes(load_model(model, device=torch.device("cpu"), dtype=torch.float32, max_positions=64))
    # Loading needs no collective: each rank's shard is built here without a group.
    shards = [weight_bytes(load_model(model, device=torch.device("cpu"), dtype=torch.float32, max_positions=64,
                                      tp=TensorParallel(rank, 2, None, None)))
              for rank in range(2)]
    norms = 4 * config.hidden_size * (2 * config.num_layers + 1)
    if config.qk_norm:
        norms += 4 * 2 * config.head_dim * config.num_layers
    # What each rank holds beyond its half: the replicated norms, KV heads copied where there are
    # fewer than ranks, and the padded end of an unevenly split vocabulary.
    kv_copies = 0
    if config.num_kv_heads < 2:
        kv_copies = 4 * 2 * config.kv_size * config.hidden_size * config.num_layers // 2
    padding = 4 * config.hidden_size * (2 * -(-config.vocab_size // 2) - config.vocab_size)
    padding *= 1 if config.tie_word_embeddings else 2
    for shard in shards:
        assert shard < 0.5 * whole + norms + kv_copies + padding + 1
        assert shard >= 0.5 * (whole - norms)
    assert sum(shards) <= whole + 2 * (norms + kv_copies + padding)


def test_refuses_a_size_that_does_not_divide_the_heads(models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's 4 attention heads"):
        LLM(models["llama"], device="cpu", num_kv_blocks=16, tensor_parallel_size=3)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "suffix"])
def test_two_ranks_speculating_equal_one_without(models: dict[str, Path], method: str) -> None:
    """Rank 0 proposes the drafts and samples; the ranks share both on the device."""
    model = models["llama"]
    config = {"method": method, "num_speculative_tokens": 3}
    config |= {"draft_model": {"model": str(model)}, "ngram": {"prompt_lookup_min": 1}}.get(method, {})
    greedy = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)] * 3
    with LLM(model, device="cpu", dtype=EXACT, max_model_len=128, num_kv_blocks=64, block_size=4) as llm:
        expected = [o.token_ids for o in llm.generate(prompts(), greedy)]
    with LLM(model, device="cpu", dtype=EXACT, max_model_len=128, num_kv_blocks=64, block_size=4,
             tensor_parallel_size=2, speculative_config=config) as llm:
        assert [o.token_ids for o in llm.generate(prompts(), greedy)] == expected
        stats = llm.scheduler.stats()
    assert stats.speculative.num_draft_tokens > 0
    if method == "draft_model":  # the target drafts for itself: everything is accepted
        assert stats.speculative.num_accepted_tokens == stats.speculative.num_draft_tokens


@pytest.mark.parametrize("shape", ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"])
def test_expert_parallel_two_ranks_equal_one(models: dict[str, Path], shape: str) -> None:
    expected = run(models[shape])
    assert run(models[shape], tensor_parallel_size=2, enable_expert_parallel=True) == expected


def test_expert_parallel_ranks_hold_whole_experts_each_its_own_half(models: dict[str, Path]) -> None:
    model = models["qwen3_moe"]
    whole = load_model(model, device=torch.device("cpu"), dtype=torch.float32, max_positions=64)
    for rank in range(2):
        shard = load_model(model, device=torch.device("cpu"), dtype=torch.float32, max_positions=64,
                           tp=TensorParallel(rank, 2, None, None), expert_parallel=True)
        for mine, all_of_them in zip(shard.layers, whole.layers):
            assert mine.mlp.experts.held == range(rank * 4, rank * 4 + 4)
            assert torch.equal(mine.mlp.experts.w13, all_of_them.mlp.experts.w13[rank * 4:rank * 4 + 4])
            assert torch.equal(mine.mlp.experts.w2, all_of_them.mlp.experts.w2[rank * 4:rank * 4 + 4])
    with pytest.raises(ValueError, match="expert parallelism over 3 ranks does not divide the model's 8 experts"):
        load_model(model, device=torch.device("cpu"), dtype=torch.float32, max_positions=64,
                   tp=TensorParallel(0, 3, None, None), expert_parallel=True)


def test_expert_parallel_sizes_that_do_not_fit_are_refused_naming_the_numbers(models: dict[str, Path]) -> None:
    mixtral = load_model_config(models["mixtral"])  # 4 heads, 2 KV heads, 8 experts
    with pytest.raises(ValueError, match="expert parallelism over 4 ranks does not divide the model's 6 experts"):
        check_tensor_parallel(dataclasses.replace(mixtral, num_experts=6), 4, "cpu", expert_parallel=True)
    # Whole experts on each rank: their intermediate size need not divide, as it must when split.
    odd = dataclasses.replace(load_model_config(models["qwen3_moe"]), moe_intermediate_size=66)
    check_tensor_parallel(odd, 4, "cpu", expert_parallel=True)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide the model's moe intermediate size 66"):
        check_tensor_parallel(odd, 4, "cpu")
    mxfp4 = dataclasses.replace(load_model_config(models["gpt_oss"]), experts_mxfp4=True, moe_intermediate_size=96)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 splits the MXFP4 experts' intermediate size 96 "
                                         "into 48, not a multiple of its 32-value blocks"):
        check_tensor_parallel(mxfp4, 2, "cpu")
    check_tensor_parallel(mxfp4, 2, "cpu", expert_parallel=True)
    with pytest.raises(ValueError, match="enable_expert_parallel places experts on ranks; LlamaForCausalLM has none"):
        LLM(models["llama"], device="cpu", num_kv_blocks=16, tensor_parallel_size=2, enable_expert_parallel=True)
