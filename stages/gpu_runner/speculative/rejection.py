"""Verifying drafts: which of a row's K drafts are accepted, and the token after them.

Drafts are single tokens chosen from the context alone (a prompt lookup, a draft model's argmax):
point masses. At each of a row's K + 1 positions the target draws its token exactly as the plain
sampler would there (`Sampler.draw`: penalties, temperature, min-p, top-k, top-p, then the row's
noise; a greedy row takes the argmax), and the row accepts its drafts while the draw equals the
draft. The first draw that differs is the row's next token and ends its run; when every draft is
accepted the draw at position K follows them.

Draft j is thus accepted with probability p_j(x_j), and a draw that differs from it is
distributed as p_j without x_j renormalised: exactly speculative sampling's accept-or-residual,
with no residual to compute. And since a seeded row's noise depends only on its seed and output
position, each of its tokens is the very token it would have drawn without drafts: a seeded
request's text does not depend on whether, or when, its row speculated. Everything runs on the
device: the accepted counts never reach the host inside the step.
"""
from __future__ import annotations

import torch

from stages.gpu_runner.sampling.metadata import SamplingMetadata
from stages.gpu_runner.sampling.sampler import Sampler, penalized_logits


def verify(logits: torch.Tensor, drafts: torch.Tensor, meta: SamplingMetadata,
           sampler: Sampler) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: float [d * (K + 1), vocab], row i's positions 0..K one after another (position j
    predicts the token after draft j, position 0 the token after the row's last known one); drafts
    int64 [d, K]; meta: the sampling metadata of those d * (K + 1) entries.

    Returns (tokens int32 [d, K + 1]: the accepted drafts, then the drawn token, then -1 for each
    rejected draft; accepted int64 [d]: how many drafts were accepted)."""
    d, k = drafts.shape
    drawn = sampler.draw(penalized_logits(logits, meta), meta).view(d, k + 1)
    accepted = (drawn[:, :k] == drafts).to(torch.int64).cumprod(dim=1).sum(dim=1)
    index = torch.arange(k + 1, device=drafts.device).unsqueeze(0)
    # Up to the first mismatch the draws are the drafts themselves, and that draw is the next token.
    tokens = torch.where(index <= accepted.unsqueeze(1), drawn, -1)
    return tokens.to(torch.int32), accepted
