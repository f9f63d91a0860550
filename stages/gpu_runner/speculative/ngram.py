"""Prompt lookup on the device: drafts copied from where the row's latest tokens occurred before.

For n from prompt_lookup_max down to prompt_lookup_min, the last n known tokens of the row are
searched for in its earlier tokens (prompt and outputs); the most recent earlier occurrence of the
longest n that has one gives the drafts: the tokens that followed it, repeated with the period
between that occurrence and now where they would run past the known tokens. A row with no match
gets its last token repeated: any draft chosen from the context alone keeps verification exact,
it is only less likely to be accepted.
"""
from __future__ import annotations

import torch


class NgramProposer:
    def __init__(self, num_drafts: int, lookup_min: int, lookup_max: int) -> None:
        self.k = num_drafts
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, token_table: torch.Tensor, rows: torch.Tensor, num_known: torch.Tensor,
                max_known: int, num_drafts: int) -> torch.Tensor:
        """int64 [d, num_drafts] drafts (num_drafts <= K) for `rows` (int64 [d]) whose first
        num_known[i] tokens are known; max_known is a host-known upper bound of num_known."""
        width = min(max_known, token_table.shape[1])
        tokens = token_table.index_select(0, rows)[:, :width].to(torch.int64)  # [d, L]
        d, device = rows.shape[0], rows.device
        known = num_known.clamp(1, width)
        follow = torch.full((d,), -1, dtype=torch.int64, device=device)
        for n in range(self.lookup_max, self.lookup_min - 1, -1):
            if width <= n:
                continue
            suffix_pos = (known - n).unsqueeze(1) + torch.arange(n, device=device)
            suffix = tokens.gather(1, suffix_pos.clamp_min(0))
            starts = torch.arange(width - n + 1, device=device)
            match = (tokens.unfold(1, n, 1) == suffix.unsqueeze(1)).all(dim=-1)
            # an earlier occurrence, followed by at least one known token
            match &= starts.unsqueeze(0) <= (known - n - 1).unsqueeze(1)
            latest = torch.where(match, starts, -1).amax(dim=1)
            follow = torch.where((follow < 0) & (latest >= 0), latest + n, follow)
        period = (known - follow).clamp_min(1).unsqueeze(1)
        draft_pos = follow.unsqueeze(1) + torch.arange(num_drafts, device=device) % period
        last = tokens.gather(1, (known - 1).unsqueeze(1))
        return torch.where(follow.unsqueeze(1) >= 0, tokens.gather(1, draft_pos.clamp(0, width - 1)), last)
