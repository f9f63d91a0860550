"""Tensor-parallel host logic: refusals naming both numbers, the join deadline naming the rank and
the address, how checkpoint tensors are cut, and the rule that runner ranks restart together."""
from __future__ import annotations

import socket

import pytest
import torch

from pipeline.models.tiny_model import make_tiny_model
from stages.contracts.topology import links, restart_group, runner_rank, stages
from stages.gpu_runner.models.config import load_model_config
from stages.gpu_runner.parallel.group import PeerLostError, RankJoinError, TensorParallel, join_group, naming_lost_peers
from stages.gpu_runner.parallel.sharding import check_tensor_parallel, shard_tensor


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory):
    # 6 heads, 3 KV heads: 2 ranks divide the heads, not the KV heads (nor do the KV heads divide 2).
    model = make_tiny_model(tmp_path_factory.mktemp("tp-shapes"), "llama", num_heads=6, num_kv_heads=3, head_dim=8,
                            hidden_size=48, intermediate_size=96)
    return load_model_config(model)


def test_sizes_the_model_cannot_take_are_refused_naming_both_numbers(config) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide the model's 6 attention heads"):
        check_tensor_parallel(config, 4, "cpu")
    with pytest.raises(ValueError, match="tensor_parallel_size 2 and the model's 3 KV heads: one must divide"):
        check_tensor_parallel(config, 2, "cpu")
    check_tensor_parallel(config, 3, "cpu")


@pytest.mark.skipif(torch.cuda.device_count() >= 3, reason="this machine has the devices")
def test_more_ranks_than_cuda_devices_are_refused(config) -> None:
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"tensor_parallel_size 3 puts 3 ranks on this machine, one per CUDA "
                                         f"device; it has {count}"):
        check_tensor_parallel(config, 3, "cuda")


def test_a_rank_that_does_not_join_in_time_is_named_with_the_address() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(RankJoinError, match=f"rank 1 did not join the group at 127.0.0.1:{port} within 0.5 s"):
        join_group(0, 2, "127.0.0.1", port, "cpu", timeout_s=0.5)


def test_column_parallel_row_parallel_and_replicated_kv_cuts(config) -> None:
    full = {name: torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
            for name, (rows, cols) in {"q": (48, 48), "k": (24, 48), "o": (48, 48)}.items()}

    def cut(name: str, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        return shard_tensor(name, tensor.__getitem__, tuple(tensor.shape), config, rank, size)

    q = [cut("model.layers.0.self_attn.q_proj.weight", full["q"], r, 3) for r in range(3)]
    assert torch.equal(torch.cat(q), full["q"])  # 2 heads of 8 rows each per rank
    o = [cut("model.layers.0.self_attn.o_proj.weight", full["o"], r, 3) for r in range(3)]
    assert torch.equal(torch.cat(o, dim=1), full["o"])
    # 6 ranks, 3 KV heads: ranks 2r and 2r+1 read KV head r.
    k = [cut("model.layers.0.self_attn.k_proj.weight", full["k"], r, 6) for r in range(6)]
    for rank in range(6):
        head = rank // 2
        assert torch.equal(k[rank], full["k"][head * 8:(head + 1) * 8])


def test_runner_ranks_share_the_plan_and_restart_together() -> None:
    names = [stage.name for stage in stages(1, num_ranks=3)]
    assert names == ["runner", "runner1", "runner2", "scheduler", "detokenizer", "tokenizer0"]
    assert [stage.name for stage in stages(1)] == ["runner", "scheduler", "detokenizer", "tokenizer0"]
    plan = next(link for link in links(1, num_ranks=3) if link.name == "plan")
    assert plan.readers == ("runner", "runner1", "runner2")
    # A rank's death restarts every stage, its fellow ranks included; the frontend restarts alone.
    assert restart_group("runner2", 1, num_ranks=3) == names
    assert restart_group("scheduler", 1, num_ranks=3) == names
    assert restart_group("detokenizer", 1, num_ranks=3) == ["detokenizer", "tokenizer0"]
    assert [runner_rank(name) for name in ("runner", "runner1", "runner2")] == [0, 1, 2]


def test_a_collectives_failure_names_the_rank_and_address_and_other_errors_pass_unchanged() -> None:
    tp = TensorParallel(rank=1, size=2, group=None, cpu_group=None)
    with pytest.raises(PeerLostError, match=r"^tensor-parallel rank 1 of 2: a peer rank left the group at "
                                            r"10\.0\.0\.1:29500 \(\[gloo\] Connection closed by peer\)$"):
        with naming_lost_peers(tp, "10.0.0.1", 29500):
            raise RuntimeError("[gloo] Connection closed by peer\nmore lines")
    for unrelated, holder in ((RuntimeError("shape mismatch"), tp), (RuntimeError("[gloo] closed"), None),
                              (ValueError("nccl"), tp)):
        with pytest.raises(type(unrelated)) as caught:
            with naming_lost_peers(holder, "10.0.0.1", 29500):
                raise unrelated
        assert caught.value is unrelated


def test_each_experts_intermediate_size_is_cut_and_the_router_replicated(config) -> None:
    full = torch.arange(96 * 48, dtype=torch.float32).reshape(96, 48)  # [intermediate, hidden]

    def cut(name: str, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        return shard_tensor(f"model.layers.1.{name}", tensor.__getitem__, tuple(tensor.shape), config, rank, 2)

    for name in ("block_sparse_moe.experts.3.w1.weight", "block_sparse_moe.experts.3.w3.weight",
                 "mlp.experts.7.gate_proj.weight", "mlp.experts.0.up_proj.weight", "mlp.shared_expert.up_proj.weight"):
        assert torch.equal(torch.cat([cut(name, full, r) for r in range(2)]), full), name
        assert cut(name, full, 1).shape == (48, 48)
    for name in ("block_sparse_moe.experts.3.w2.weight", "mlp.experts.5.down_proj.weight",
                 "mlp.shared_expert.down_proj.weight"):
        assert torch.equal(torch.cat([cut(name, full.T, r) for r in range(2)], dim=1), full.T), name
        assert cut(name, full.T, 0).shape == (48, 48)
    for name in ("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.shared_expert_gate.weight"):
        assert torch.equal(cut(name, full, 1), full), name
