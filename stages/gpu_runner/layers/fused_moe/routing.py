"""The router's choice of experts for each token, per family as the reference computes it.

Every supported family takes the softmax over all experts' logits in float32, then the top k
(softmax-then-top-k); ties break as `torch.topk` breaks them on those float32 values, as the
reference's. What differs: whether the k weights are renormalised to sum to 1 (Mixtral always,
the Qwen MoEs with norm_topk_prob), and whether they are rounded to the activations' dtype before
they scale the experts' outputs (the Qwen MoEs) or scale them in float32 (Mixtral).

gpt-oss routes the other way (top-k-then-softmax): the top k of the raw logits (its router has a
bias), then the softmax over those k in the logits' dtype; ties break as `torch.topk` on the logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from stages.gpu_runner.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class TopK:
    k: int
    renormalize: bool
    weights_float32: bool  # the weights scale the experts' outputs in float32 (else in the activations' dtype)
    topk_then_softmax: bool = False  # the softmax over the chosen k logits (gpt-oss), not over all

    @classmethod
    def of(cls, config: ModelConfig) -> TopK:
        return cls(config.num_experts_per_tok, config.norm_topk_prob,
                   weights_float32=config.architecture == "MixtralForCausalLM",
                   topk_then_softmax=config.architecture == "GptOssForCausalLM")


def select_experts(router_logits: torch.Tensor, top: TopK) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [tokens, experts] -> (weights [tokens, k], expert ids [tokens, k] int64),
    each row's experts in descending weight."""
    if top.topk_then_softmax:
        logits, ids = torch.topk(router_logits, top.k, dim=-1)
        return torch.softmax(logits, dim=-1, dtype=logits.dtype), ids
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top.k, dim=-1)
    if top.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if top.weights_float32 else weights.to(router_logits.dtype)), ids
