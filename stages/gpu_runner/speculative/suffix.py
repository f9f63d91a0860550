"""Suffix decoding: drafts from a suffix trie of the request's own tokens and one of recent outputs.

Each row keeps a SuffixTree (stages/suffix_tree.py) over its prompt and outputs, grown by the tokens that
became known since the row's last proposal; the proposer also keeps one SuffixCache over the
outputs of requests that left their rows, bounded by tokens. A verifying row's drafts are the
continuation with the better score of the two (its own text, or what earlier requests wrote
after the same words), cut where its probability falls under `min_token_prob` and at
`max_spec_factor` times the length of the match (stages/suffix_tree.py's SuffixDrafter). The
scheduler keeps the same tries over the tokens it knows and plans each row no more drafts than
they propose (none where nothing good matches); where the runner, knowing a step more, finds fewer
than planned, the rest are padded with the last one: any draft keeps verification exact.

The tries live on the host: the rows' new tokens are read from the token table when drafts are
asked for (on CUDA this waits for the previous step). A row's state goes when the plan frees the
row (`release`), after its outputs, read from the token table up to the count the plan gives,
were added to the cache (the scheduler caches the same tokens, so both caches agree).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from stages.contracts.speculative import SpeculativeConfig
from stages.suffix_tree import SuffixCache, SuffixDrafter, SuffixTree


class SuffixProposer:
    def __init__(self, config: SpeculativeConfig, num_prompt_tokens: np.ndarray) -> None:
        """`num_prompt_tokens`: the batch's host array of each row's prompt length (read when a
        row first proposes: what follows goes to the cache when the row leaves)."""
        self.k = config.num_speculative_tokens
        self.drafter = SuffixDrafter(config)
        self.num_prompt_tokens = num_prompt_tokens

    @property
    def trees(self) -> dict[int, SuffixTree]:
        return self.drafter.trees

    @property
    def cache(self) -> SuffixCache:
        return self.drafter.cache

    def propose(self, token_table: torch.Tensor, rows: torch.Tensor, num_known: torch.Tensor,
                max_known: int, num_drafts: int) -> torch.Tensor:
        """int64 [d, num_drafts] drafts (num_drafts <= K) for `rows` (int64 [d]) whose first
        num_known[i] tokens are known; max_known is a host-known upper bound of num_known."""
        width = min(max_known, token_table.shape[1])
        row_list = rows.tolist()
        known = num_known.clamp(1, width).tolist()
        table, table_rows = _host_rows(token_table, row_list, width, rows)
        drafts = np.empty((len(row_list), num_drafts), np.int64)
        for i, (row, table_row, n) in enumerate(zip(row_list, table_rows, known)):
            tree = self.drafter.grow(row, table[table_row, :n], int(self.num_prompt_tokens[row]))
            found = self.drafter.draft(tree, num_drafts)
            drafts[i] = found + [found[-1] if found else tree.tokens[-1]] * (num_drafts - len(found))
        return torch.from_numpy(drafts).to(rows.device)

    def release(self, rows: np.ndarray, num_tokens: np.ndarray | None = None,
                token_table: torch.Tensor | None = None) -> None:
        """`rows` leave (finished, aborted or preempted): their outputs join the cache. With their
        known tokens `num_tokens` (the plan's freed_num_tokens) the outputs are read from the token
        table, so a row the runner never drafted for is cached too, as the scheduler caches it;
        without, what the row's tree holds."""
        if num_tokens is None or token_table is None or len(num_tokens) != len(rows):
            for row in rows.tolist():
                self.drafter.release(row)
            return
        row_list, counts = rows.tolist(), num_tokens.tolist()
        table, table_rows = _host_rows(token_table, row_list, min(max(counts), token_table.shape[1]))
        for row, table_row, count in zip(row_list, table_rows, counts):
            start = int(self.num_prompt_tokens[row])
            self.drafter.leave(row, table[table_row, start:max(start, count)].tolist())


def _host_rows(token_table: torch.Tensor, rows: list[int], width: int,
               index: torch.Tensor | None = None) -> tuple[np.ndarray, Sequence[int]]:
    """The token table's `rows` on the host, as (table, where each row is in it): the table itself
    on the CPU; on CUDA the rows' first `width` tokens, in one copy (`index`: the rows on the device,
    where the caller has them)."""
    if token_table.device.type == "cpu":
        return token_table.numpy(), rows
    if index is None:
        index = torch.tensor(rows, dtype=torch.int64, device=token_table.device)
    return token_table.index_select(0, index)[:, :width].cpu().numpy(), range(len(rows))
