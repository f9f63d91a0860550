"""What proposes drafts: a prompt lookup (ngram.py), suffix decoding (suffix.py), a draft model
(draft_model.py), or any other method that reads the token table and returns each verifying row's
drafts (at most K). A proposer that keeps per-row state also has `release(rows)`, called with the rows each
plan frees before the rows are reused."""
from __future__ import annotations

from typing import Protocol

import torch


class Proposer(Protocol):
    k: int  # drafts per verifying row

    def propose(self, token_table: torch.Tensor, rows: torch.Tensor, num_known: torch.Tensor,
                max_known: int, num_drafts: int) -> torch.Tensor:
        """int64 [d, num_drafts] drafts (num_drafts <= K: the most any of them verifies) for `rows`
        (int64 [d]) whose first num_known[i] tokens are known; max_known is a host-known upper
        bound of num_known."""
