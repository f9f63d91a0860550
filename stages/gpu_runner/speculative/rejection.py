"""Verifying drafts: which of a row's K drafts are accepted, and the token after them.

Drafts are point masses: a draft token x is proposed with certainty from the context alone (a
prompt lookup, or a draft model's argmax). Exact speculative sampling then reads:

- draft j is accepted with probability p_j(x_j), p_j being the target's distribution at that
  position after penalties, temperature, min-p, top-k and top-p; a greedy row accepts it when it
  is the target's argmax;
- at the first rejected draft the token is drawn from the residual, p_j with x_j removed
  (renormalised), and the row's run ends there; when every draft is accepted, one more token is
  drawn from p_K.

Every output token is thus distributed exactly as the target would sample it. Each position's
uniform and noise come from the sampler, so a seeded row draws them from its (seed, output
position) stream and is reproducible. Everything runs on the device: the accepted counts never
reach the host inside the step.
"""
from __future__ import annotations

import torch

from stages.gpu_runner.sampling.metadata import SamplingMetadata
from stages.gpu_runner.sampling.sampler import Sampler, penalized_logits, sampling_probs


def verify(logits: torch.Tensor, drafts: torch.Tensor, meta: SamplingMetadata,
           sampler: Sampler) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: float [d * (K + 1), vocab], row i's positions 0..K one after another (position j
    predicts the token after draft j, position 0 the token after the row's last known one); drafts
    int64 [d, K]; meta: the sampling metadata of those d * (K + 1) entries.

    Returns (tokens int32 [d, K + 1]: the accepted drafts, then the drawn token, then -1 for each
    rejected draft; accepted int64 [d]: how many drafts were accepted)."""
    d, k = drafts.shape
    processed = penalized_logits(logits, meta)
    greedy_ids = processed.argmax(dim=-1).view(d, k + 1)
    if meta.all_greedy:
        accept = greedy_ids[:, :k] == drafts
        drawn = greedy_ids
    else:
        vocab = processed.shape[1]
        probs = sampling_probs(processed, meta).view(d, k + 1, vocab)
        p_draft = probs[:, :k].gather(2, drafts.unsqueeze(2)).squeeze(2)
        accept_random = sampler.uniform(meta).view(d, k + 1)[:, :k] < p_draft
        greedy = meta.greedy.view(d, k + 1)[:, :k]
        accept = torch.where(greedy, greedy_ids[:, :k] == drafts, accept_random)
        residual = probs.clone()
        residual[:, :k].scatter_(2, drafts.unsqueeze(2), 0.0)
        # A target certain of the draft leaves nothing: it was accepted, the residual is never read.
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, probs)
        drawn = sampler.race(residual.view(d * (k + 1), vocab), meta).view(d, k + 1)
        drawn = torch.where(meta.greedy.view(d, k + 1), greedy_ids, drawn)
    accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
    index = torch.arange(k + 1, device=drafts.device).unsqueeze(0)
    padded = torch.cat([drafts, torch.zeros_like(drafts[:, :1])], dim=1)
    after = drawn.gather(1, accepted.unsqueeze(1))
    tokens = torch.where(index < accepted.unsqueeze(1), padded,
                         torch.where(index == accepted.unsqueeze(1), after, -1))
    return tokens.to(torch.int32), accepted
