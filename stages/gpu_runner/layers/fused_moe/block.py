"""The sparse MoE block: the router picks each token's experts, the experts run fused, and Qwen2-MoE
adds a shared expert scaled by a sigmoid gate.

moe(x) = Σ_{e in top_k(softmax(router(x)))} w_e · expert_e(x)  [+ sigmoid(gate(x)) · shared(x)]

Under tensor parallelism the router is replicated, the experts and the shared expert hold this
rank's slice of their intermediate sizes, and one all-reduce sums the ranks' partial outputs;
under expert parallelism the rank holds whole experts instead, and the same all-reduce combines
the outputs of the experts the ranks hold (every rank sees every token, so no dispatch is needed).
"""
from __future__ import annotations

import torch
from torch import nn

from stages.gpu_runner.layers.fused_moe.experts import FusedExperts
from stages.gpu_runner.layers.fused_moe.routing import TopK, select_experts
from stages.gpu_runner.layers.mlp import GatedMLP
from stages.gpu_runner.models.config import ModelConfig
from stages.gpu_runner.parallel.group import TensorParallel
from stages.gpu_runner.parallel.sharding import local_experts

# The checkpoint's names of an expert's gate, up and down projections, per family.
_MIXTRAL_NAMES = ("w1", "w3", "w2")
_QWEN_NAMES = ("gate_proj", "up_proj", "down_proj")


class SparseMoeBlock(nn.Module):
    def __init__(self, shard: ModelConfig, tp: TensorParallel | None) -> None:
        super().__init__()
        self.gate = nn.Linear(shard.hidden_size, shard.num_experts, bias=False)
        self.top = TopK.of(shard)
        held = local_experts(shard, 0, 1) if tp is None else local_experts(shard, tp.rank, tp.size)
        self.experts = FusedExperts(held, shard.hidden_size, shard.moe_intermediate_size, shard.num_experts)
        self.shared_expert = self.shared_expert_gate = None
        if shard.shared_expert_intermediate_size:
            # No all-reduce of its own: the block's one all-reduce sums its partial output too.
            self.shared_expert = GatedMLP(shard, None, shard.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(shard.hidden_size, 1, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    @staticmethod
    def expected_tensors(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
        """Checkpoint name -> full shape: the router, each expert's three projections (stored one
        tensor per expert; a GGUF file stacks each projection's experts in one tensor), and
        Qwen2-MoE's shared expert and its gate."""
        c, inter = config, config.moe_intermediate_size
        gate, up, down = _MIXTRAL_NAMES if c.architecture == "MixtralForCausalLM" else _QWEN_NAMES
        shapes = {prefix + "gate.weight": (c.num_experts, c.hidden_size)}
        if c.gguf_file is not None:
            gate, up, down = _QWEN_NAMES
            shapes |= {prefix + f"experts.{gate}.weight": (c.num_experts, inter, c.hidden_size),
                       prefix + f"experts.{up}.weight": (c.num_experts, inter, c.hidden_size),
                       prefix + f"experts.{down}.weight": (c.num_experts, c.hidden_size, inter)}
        for e in range(c.num_experts if c.gguf_file is None else 0):
            shapes |= {prefix + f"experts.{e}.{gate}.weight": (inter, c.hidden_size),
                       prefix + f"experts.{e}.{up}.weight": (inter, c.hidden_size),
                       prefix + f"experts.{e}.{down}.weight": (c.hidden_size, inter)}
        if c.shared_expert_intermediate_size:
            shapes |= GatedMLP.expected_tensors(c, prefix + "shared_expert.", c.shared_expert_intermediate_size)
            shapes[prefix + "shared_expert_gate.weight"] = (1, c.hidden_size)
        return shapes
