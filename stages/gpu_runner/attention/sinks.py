"""Attention with sinks (gpt-oss): a learned logit per head joins each query's softmax denominator.

softmax([scores, sink])[:-1] @ V: the sink takes a share of the probability mass and gives no
value back, so a query may attend to "nothing". Computed as the reference's eager attention does
(scores in float32, the row max subtracted over the scores and the sink together).
"""
from __future__ import annotations

import torch


def sink_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                   scale: float, sinks: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """query [B, H, Q, D], keys/values [B, Hkv, K, D] (query head h reads KV head h // (H / Hkv)),
    mask bool broadcastable to [B, H, Q, K] (True: attended) or None with `is_causal` (Q == K)
    or for all keys; sinks [H] -> [B, H, Q, D]."""
    group = query.shape[1] // keys.shape[1]
    if group > 1:
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, keys.transpose(-1, -2)).float() * scale
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.matmul(probs.to(values.dtype), values)
