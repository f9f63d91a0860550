"""Suffix decoding: drafts from a suffix trie of the request's own tokens and one of recent outputs.

Each row keeps a SuffixTree (suffix_tree.py) over its prompt and outputs, grown by the tokens that
became known since the row's last proposal; the proposer also keeps one SuffixCache over the
outputs of requests that left their rows, bounded by tokens. A verifying row's drafts are the
continuation with the better score of the two (its own text, or what earlier requests wrote
after the same words), cut where its probability falls under `min_token_prob` and at
`max_spec_factor` times the length of the match. Fewer than K drafts are padded with the row's
last token, as the n-gram lookup pads a row it finds no match for: any draft keeps verification
exact.

The tries live on the host: the rows' new tokens are read from the token table when drafts are
asked for (on CUDA this waits for the previous step). A row's state goes when the plan frees the
row (`release`), after its outputs were added to the cache.
"""
from __future__ import annotations

import numpy as np
import torch

from stages.contracts.speculative import SpeculativeConfig
from stages.gpu_runner.speculative.suffix_tree import SuffixCache, SuffixTree


class SuffixProposer:
    def __init__(self, config: SpeculativeConfig, num_prompt_tokens: np.ndarray) -> None:
        """`num_prompt_tokens`: the batch's host array of each row's prompt length (read when a
        row first proposes: what follows goes to the cache when the row leaves)."""
        self.k = config.num_speculative_tokens
        self.depth = config.suffix_decoding_max_tree_depth
        self.min_prob = config.suffix_decoding_min_token_prob
        self.spec_factor = config.suffix_decoding_max_spec_factor
        self.cache = SuffixCache(self.depth, config.suffix_decoding_max_cached_tokens)
        self.num_prompt_tokens = num_prompt_tokens
        self.trees: dict[int, SuffixTree] = {}
        self.outputs_from: dict[int, int] = {}  # row -> where its outputs start in its tree's tokens

    def propose(self, token_table: torch.Tensor, rows: torch.Tensor, num_known: torch.Tensor,
                max_known: int) -> torch.Tensor:
        """int64 [d, K] drafts for `rows` (int64 [d]) whose first num_known[i] tokens are known;
        max_known is a host-known upper bound of num_known."""
        width = min(max_known, token_table.shape[1])
        row_list = rows.tolist()
        known = num_known.clamp(1, width).tolist()
        if token_table.device.type == "cpu":
            table, table_rows = token_table.numpy(), row_list
        else:
            table, table_rows = token_table.index_select(0, rows)[:, :width].cpu().numpy(), range(len(row_list))
        drafts = np.empty((len(row_list), self.k), np.int64)
        for i, (row, table_row, n) in enumerate(zip(row_list, table_rows, known)):
            tree = self.trees.get(row)
            if tree is None or len(tree.tokens) > n:
                tree = self.trees[row] = SuffixTree(self.depth)
                self.outputs_from[row] = int(self.num_prompt_tokens[row])
            tree.append(table[table_row, len(tree.tokens):n].tolist())
            drafts[i] = self._pad(self.draft(tree), tree.tokens[-1])
        return torch.from_numpy(drafts).to(rows.device)

    def draft(self, tree: SuffixTree) -> list[int]:
        """Up to K drafts after `tree`'s text: from its own text or the cache, whichever scores more."""
        own, own_score = tree.propose(self.k, self.min_prob, self.spec_factor)
        context = tree.tokens[-(self.depth - 1):]
        cached, cached_score = self.cache.propose(context, self.k, self.min_prob, self.spec_factor)
        return cached if cached_score > own_score else own

    def _pad(self, drafts: list[int], last: int) -> list[int]:
        return drafts + [drafts[-1] if drafts else last] * (self.k - len(drafts))

    def release(self, rows: np.ndarray) -> None:
        """`rows` leave (finished, aborted or preempted): their outputs join the cache."""
        for row in rows.tolist():
            tree = self.trees.pop(row, None)
            if tree is not None:
                self.cache.add(tree.tokens[self.outputs_from.pop(row):])
