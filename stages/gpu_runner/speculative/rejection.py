"""Verifying drafts: which of a row's K drafts are accepted, and the token after them.

Drafts are single tokens chosen from the context alone (a prompt lookup, a draft model's argmax):
point masses. At each of a row's K + 1 positions the target draws its token exactly as the plain
sampler would there (`Sampler.draw`: penalties, temperature, min-p, top-k, top-p, then the row's
noise; a greedy row takes the argmax), and the row accepts its drafts while the draw equals the
draft. The first draw that differs is the row's next token and ends its run; when every draft is
accepted the draw after the last one follows them. Rows verify different numbers of drafts,
their positions packed one after another.

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


def verify(logits: torch.Tensor, drafts: torch.Tensor, meta: SamplingMetadata, sampler: Sampler,
           num_drafts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: float [sum(num_drafts + 1), vocab], row i's positions 0..num_drafts[i] one after
    another, packed (position j predicts the token after draft j, position 0 the token after the
    row's last known one); drafts int64 [d, K], row i's first num_drafts[i] read; num_drafts int64
    [d] on the device, 1..K (None: K each); meta: the sampling metadata of the logits' entries.

    Returns (tokens int32 [d, K + 1]: the accepted drafts, then the drawn token, then -1 for each
    rejected or absent draft; accepted int64 [d]: how many drafts were accepted)."""
    d, k = drafts.shape
    drawn = sampler.draw(penalized_logits(logits, meta), meta)
    index = torch.arange(k + 1, device=drafts.device).unsqueeze(0)
    if num_drafts is None:
        drawn = drawn.view(d, k + 1)
        read = index[:, :k] < k
    else:
        drawn = unpack(drawn, num_drafts, k + 1)
        read = index[:, :k] < num_drafts.unsqueeze(1)
    accepted = ((drawn[:, :k] == drafts) & read).to(torch.int64).cumprod(dim=1).sum(dim=1)
    # Up to the first mismatch the draws are the drafts themselves, and that draw is the next token.
    tokens = torch.where(index <= accepted.unsqueeze(1), drawn, -1)
    return tokens.to(torch.int32), accepted


def unpack(packed: torch.Tensor, num_drafts: torch.Tensor, width: int) -> torch.Tensor:
    """Entries packed row after row, 1 + num_drafts[i] for row i -> [d, width], -1 where a row has none."""
    counts = num_drafts + 1
    total = packed.shape[0]
    row = torch.repeat_interleave(torch.arange(len(counts), device=packed.device), counts, output_size=total)
    column = torch.arange(total, device=packed.device) - (counts.cumsum(0) - counts).index_select(0, row)
    out = torch.full((len(counts), width), -1, dtype=packed.dtype, device=packed.device)
    return out.index_put_((row, column), packed)
