"""Suffix tries and the suffix-decoding proposer: matching, counts, the cache's token bound, and
per-row state that leaves with its row."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from stages.contracts.speculative import SpeculativeConfig, SpeculativeConfigError
from stages.gpu_runner.speculative.suffix import SuffixProposer
from stages.suffix_tree import SuffixCache, SuffixDrafter, SuffixTree, Trie


def counts_of(trie: Trie, tokens: list[int]) -> int:
    node = trie.root
    for token in tokens:
        node = node.children.get(token)
        if node is None:
            return 0
    return node.count


def brute_count(text: list[int], sub: list[int]) -> int:
    return sum(text[i:i + len(sub)] == sub for i in range(len(text) - len(sub) + 1))


def test_the_trie_counts_every_substring_up_to_its_depth():
    rng = np.random.default_rng(0)
    text = rng.integers(0, 4, 200).tolist()
    tree = SuffixTree(depth=5)
    tree.append(text[:77])
    tree.append(text[77:])  # grown in two parts: the same trie as in one
    for _ in range(300):
        start, length = int(rng.integers(0, 195)), int(rng.integers(1, 6))
        sub = text[start:start + length]
        assert counts_of(tree.trie, sub) == brute_count(text, sub)
    assert counts_of(tree.trie, text[:6]) == 0  # deeper than the trie


def test_each_node_knows_its_most_frequent_next_token():
    tree = SuffixTree(depth=4)
    tree.append([1, 2, 1, 3, 1, 3, 1, 3, 1, 2])
    node = tree.trie.root.children[1]
    assert node.best == 3 and node.children[3].count == 3 and node.children[2].count == 2


def test_a_text_proposes_what_followed_its_latest_words_before():
    tree = SuffixTree(depth=8)
    tree.append([5, 6, 7, 8, 9, 1, 2, 5, 6, 7])
    drafts, score, _ = tree.propose(max_tokens=3, min_prob=0.1, spec_factor=1.0)
    assert drafts == [8, 9, 1]  # after "5 6 7": "8 9 1"
    assert score > 0


def test_nothing_is_proposed_without_a_recurring_suffix_or_under_the_probability_floor():
    tree = SuffixTree(depth=8)
    tree.append([1, 2, 3, 4, 5])
    assert tree.propose(4, 0.1, 1.0) == ([], 0.0, 0)
    # "1" was followed by 10 different tokens: each has probability under 1/10
    tree = SuffixTree(depth=8)
    tree.append([t for i in range(10) for t in (1, 100 + i)] + [1])
    assert tree.propose(4, 0.2, 1.0)[0] == []
    assert tree.propose(4, 0.05, 1.0)[0] != []


def test_a_short_match_is_trusted_for_fewer_drafts():
    tree = SuffixTree(depth=16)
    tree.append([1, 2, 3, 4, 5, 6, 7, 9, 1])
    assert tree.propose(max_tokens=5, min_prob=0.0, spec_factor=1.0)[0] == [2]
    assert tree.propose(max_tokens=5, min_prob=0.0, spec_factor=3.0)[0] == [2, 3, 4]


def test_the_cache_holds_at_most_its_token_bound_and_drops_the_oldest():
    cache = SuffixCache(depth=6, max_tokens=30)
    first, second, third = [1, 2, 3, 4] * 3, [7, 8, 9] * 4, list(range(20, 35))
    cache.add(first)
    cache.add(second)
    assert cache.propose([1, 2], 2, 0.1, 2.0)[0] == [3, 4]
    cache.add(third)  # 12 + 12 + 15 > 30: the first leaves
    assert cache.num_tokens == 27 and cache.num_sequences == 2
    assert cache.propose([1, 2], 2, 0.1, 2.0) == ([], 0.0, 0)
    assert counts_of(cache.trie, [1]) == 0 and 1 not in cache.trie.root.children
    assert cache.propose([7, 8], 2, 0.1, 2.0)[0] == [9, 7]
    for sub in ([8, 9, 7], [20, 21], [9]):
        assert counts_of(cache.trie, sub) == brute_count(second, sub) + brute_count(third, sub)


def test_eviction_keeps_the_most_frequent_continuation_right():
    cache = SuffixCache(depth=4, max_tokens=8)
    cache.add([1, 2, 1, 2])
    cache.add([1, 3])
    assert cache.trie.root.children[1].best == 2
    cache.add([9, 9, 9])  # 4 + 2 + 3 > 8: [1, 2, 1, 2] leaves, "1" is now followed by 3 only
    assert cache.trie.root.children[1].best == 3
    cache.add([5, 5, 5, 5, 5])  # the rest of the old entries leave: nothing of them remains
    assert cache.num_tokens == 8 and 1 not in cache.trie.root.children


def test_a_sequence_longer_than_the_cache_keeps_its_end():
    cache = SuffixCache(depth=4, max_tokens=5)
    cache.add(list(range(10)))
    assert cache.num_tokens == 5 and sorted(cache.trie.root.children) == [5, 6, 7, 8, 9]


def suffix_config(**values: object) -> SpeculativeConfig:
    return SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 3, **values})


def test_the_proposer_reads_new_tokens_only_and_leaves_with_the_row():
    table = torch.zeros(2, 32, dtype=torch.int32)
    text = [4, 5, 6, 7, 1, 4, 5]
    table[0, :len(text)] = torch.tensor(text)
    prompt_lengths = np.array([3, 0])
    proposer = SuffixProposer(suffix_config(suffix_decoding_max_spec_factor=2.0), prompt_lengths)
    rows = torch.tensor([0])
    drafts = proposer.propose(table, rows, torch.tensor([len(text)]), len(text), 3)
    assert drafts.tolist() == [[6, 7, 1]]
    table[0, 7:9] = torch.tensor([6, 7])
    assert proposer.propose(table, rows, torch.tensor([9]), 9, 3).tolist() == [[1, 4, 5]]
    assert proposer.trees[0].tokens == text + [6, 7]
    # a row with no recurring words gets its last token repeated
    table[1, :3] = torch.tensor([9, 8, 2])
    assert proposer.propose(table, torch.tensor([1]), torch.tensor([3]), 3, 3).tolist() == [[2, 2, 2]]
    proposer.release(np.array([0, 1], np.int32))
    assert proposer.trees == {}
    assert proposer.cache.num_tokens == 6 + 3  # row 0's outputs (after its 3 prompt tokens), row 1's
    # a new request on row 1 finds what row 0 wrote
    table[1, :2] = torch.tensor([1, 4])
    assert proposer.propose(table, torch.tensor([1]), torch.tensor([2]), 2, 3).tolist()[0][:2] == [5, 6]


def test_a_row_that_leaves_caches_its_outputs_as_growing_then_releasing_it_would_without_a_tree():
    rng = np.random.default_rng(3)
    texts = [rng.integers(0, 6, n).tolist() for n in (40, 25, 60)]
    grown, left = SuffixDrafter(suffix_config()), SuffixDrafter(suffix_config())
    for row, text in enumerate(texts):
        grown.grow(row, text[:10], 7)  # proposed for once, mid-way
        grown.grow(row, text, 7)
        grown.release(row)
        left.grow(row, text[:10], 7)
        left.leave(row, text[7:])
    assert left.trees == {} and left.outputs_from == {}
    assert left.cache.num_tokens == grown.cache.num_tokens == sum(len(t) - 7 for t in texts)
    for prefix in ([0], [1, 2], [3, 4, 5], [5, 5]):
        assert counts_of(left.cache.trie, prefix) == counts_of(grown.cache.trie, prefix)


@pytest.mark.parametrize("values, named", [
    ({"suffix_decoding_max_tree_depth": 3}, "must exceed num_speculative_tokens"),
    ({"suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob"),
    ({"suffix_decoding_max_cached_tokens": -1}, "suffix_decoding_max_cached_tokens"),
    ({"prompt_lookup_max": 3}, "only read by method 'ngram'"),
])
def test_a_bad_suffix_config_is_refused_naming_the_key(values, named):
    with pytest.raises(SpeculativeConfigError, match=named):
        suffix_config(**values)
    with pytest.raises(SpeculativeConfigError, match="only read by method 'suffix'"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                     "suffix_decoding_max_tree_depth": 8})


def test_a_short_match_seen_often_is_trusted_as_far_as_its_probability_goes():
    cache = SuffixCache(depth=16, max_tokens=1000)
    for _ in range(3):
        cache.add([7, 1, 2, 3, 4, 5])
    assert cache.propose([9, 7], max_tokens=4, min_prob=0.5, spec_factor=1.0)[0] == [1]  # seen 3 times
    cache.add([7, 1, 2, 3, 4, 5])
    assert cache.propose([9, 7], max_tokens=4, min_prob=0.5, spec_factor=1.0)[0] == [1, 2, 3, 4]


def test_the_longer_match_drafts_whether_the_rows_own_or_the_caches():
    """A row copying from its own prompt keeps its own drafts against many cached outputs that went
    on alike after a short phrase (their counts score more); a row repeating a cached answer at
    length drafts that answer."""
    config = SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 4})
    drafter = SuffixDrafter(config)
    for _ in range(8):  # an agent's answer, cached 8 times: after 5, always 6 7 8 9
        drafter.cache.add([40, 41, 5, 6, 7, 8, 9])
    document = [21, 22, 23, 5, 30, 31, 32, 33, 34]
    tree = drafter.grow(0, document + [50, 51, 21, 22, 23, 5], num_prompt=len(document))
    own, own_score, own_length = tree.propose(4, drafter.min_prob, drafter.spec_factor)
    cached, cached_score, cached_length = drafter.cache.propose(tree.tokens[-(drafter.depth - 1):], 4,
                                                                drafter.min_prob, drafter.spec_factor)
    assert own == [30, 31, 32, 33] and cached == [6, 7, 8, 9]
    assert cached_score > own_score and own_length == 4 > cached_length == 1  # the cache scores more
    assert drafter.draft(tree, 4) == [30, 31, 32, 33]
    repeating = drafter.grow(1, [60, 61, 40, 41, 5], num_prompt=2)
    assert drafter.draft(repeating, 4) == [6, 7, 8, 9]
