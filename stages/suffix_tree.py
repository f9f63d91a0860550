"""Suffix tries of bounded depth: every substring of at most `depth` tokens of the text added, with
how often it occurs, and the most frequent continuation of each.

A trie node stands for one substring; its count is how many times that substring occurs, and
`best` is its most frequent next token. Appending a token to a sequence extends the nodes of the
sequence's suffixes that end at the previous token (its `active` nodes, at most depth - 1 of
them) by that token: O(depth) per token, whatever the length of the text. Drafts are read by
matching the longest suffix of a row's tokens that has occurred followed by something, then
walking down the most frequent continuations while their probability (the product of each
step's count / parent count) stays at least a floor: a text that never repeated itself proposes
nothing.

`SuffixTree` is one text's trie (a request's prompt and outputs). `SuffixCache` holds the outputs
of recent requests in one trie, bounded by tokens: the oldest sequence is taken out (its counts
replayed downwards) when the total goes over the bound. `SuffixDrafter` keeps one tree per row and
the cache, and drafts from whichever of the two matches longer (then scores more): the runner's suffix proposer drafts
with it, and the scheduler keeps its own over the tokens it knows, to decide on the host how many
drafts a row verifies (none where nothing good matches).

Drafts may be asked for `ahead` of the text: a continuation past tokens not known yet (under async
scheduling the scheduler decides a step's drafts before the previous step's tokens arrive). The
walk then goes `ahead` tokens further and returns what follows them, as if those tokens continue
the match, which they do when the row is copying.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from stages.contracts.speculative import SpeculativeConfig


CONFIDENT_COUNT = 4  # occurrences of a match that lift max_spec_factor's bound on its drafts


class Node:
    __slots__ = ("count", "children", "best")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, Node] = {}
        self.best = -1  # the child token with the largest count; -1: a leaf

    def continuation(self, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
        """The most frequent path below this node, at most max_tokens long, while its
        probability stays >= min_prob; and its score (the sum of the probabilities: the
        expected number of its tokens accepted)."""
        node, prob, score, tokens = self, 1.0, 0.0, []
        while len(tokens) < max_tokens and node.best >= 0:
            child = node.children[node.best]
            prob *= child.count / node.count
            if prob < min_prob:
                break
            tokens.append(node.best)
            score += prob
            node = child
        return tokens, score


class Trie:
    """The counted substrings (at most `depth` tokens) of the sequences added to it."""

    def __init__(self, depth: int) -> None:
        if depth < 2:
            raise ValueError(f"a suffix trie needs a depth of at least 2, got {depth}")
        self.depth = depth
        self.root = Node()

    def extend(self, active: list[Node], token: int) -> list[Node]:
        """Count `token` after the suffixes whose nodes are `active` (shortest first, as returned
        here) and after the empty one; the nodes of the suffixes that end at `token` and may
        still grow."""
        grown = []
        for node in (self.root, *active):
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = Node()
            child.count += 1
            if node.best < 0 or (node.best != token and child.count > node.children[node.best].count):
                node.best = token
            grown.append(child)
        del grown[self.depth - 1:]
        return grown

    def shrink(self, active: list[Node], token: int) -> list[Node]:
        """Undo `extend(active, token)` for a sequence that leaves the trie: counts go down,
        nodes left at 0 are dropped, and each parent's `best` is found again where it changes."""
        shrunk = []
        for node in (self.root, *active):
            child = node.children[token]
            child.count -= 1
            if child.count == 0:
                del node.children[token]
            if node.best == token:
                node.best = max(node.children, key=lambda t: node.children[t].count, default=-1)
            shrunk.append(child)
        del shrunk[self.depth - 1:]
        return shrunk

    def longest_match(self, context: Sequence[int], max_length: int) -> tuple[Node | None, int]:
        """The node of the longest suffix of `context` (at most max_length tokens) that occurs
        followed by a token, and its length; (None, 0) when even the last token never has been."""
        n = len(context)
        for length in range(min(n, max_length), 0, -1):
            node = self.root
            for token in context[n - length:]:
                node = node.children.get(token)
                if node is None:
                    break
            if node is not None and node.best >= 0:
                return node, length
        return None, 0


class SuffixTree:
    """One request's trie over its tokens so far (prompt, then outputs), grown a token at a time."""

    def __init__(self, depth: int) -> None:
        self.trie = Trie(depth)
        self.tokens: list[int] = []
        self._active: list[Node] = []

    def append(self, tokens: Sequence[int]) -> None:
        trie, active = self.trie, self._active
        for token in tokens:
            active = trie.extend(active, int(token))
        self._active = active
        self.tokens.extend(int(t) for t in tokens)

    def propose(self, max_tokens: int, min_prob: float, spec_factor: float,
                ahead: int = 0) -> tuple[list[int], float, int]:
        """Drafts continuing the text from its own earlier occurrences of its longest suffix that
        recurs, their score and the match's length. The active nodes are the text's suffixes
        (shortest first): the current occurrence is counted in them but has no continuation yet."""
        for length in range(min(len(self._active), _max_match(self.trie.depth, max_tokens + ahead)), 0, -1):
            node = self._active[length - 1]
            if node.best >= 0:
                return _after(node, length, max_tokens, min_prob, spec_factor, ahead)
        return [], 0.0, 0


class SuffixCache:
    """Recent requests' outputs in one trie, at most `max_tokens` tokens of them; the oldest
    sequences leave first."""

    def __init__(self, depth: int, max_tokens: int) -> None:
        self.trie = Trie(depth)
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self._sequences: OrderedDict[int, list[int]] = OrderedDict()
        self._next_id = 0

    def add(self, tokens: Sequence[int]) -> None:
        """Add one finished sequence (its last max_tokens tokens), evicting the oldest ones."""
        tokens = [int(t) for t in tokens[max(0, len(tokens) - self.max_tokens):]] if self.max_tokens else []
        if not tokens:
            return
        active: list[Node] = []
        for token in tokens:
            active = self.trie.extend(active, token)
        self._sequences[self._next_id] = tokens
        self._next_id += 1
        self.num_tokens += len(tokens)
        while self.num_tokens > self.max_tokens:
            _, oldest = self._sequences.popitem(last=False)
            self._remove(oldest)

    def _remove(self, tokens: list[int]) -> None:
        active: list[Node] = []
        for token in tokens:
            active = self.trie.shrink(active, token)
        self.num_tokens -= len(tokens)

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    def propose(self, context: Sequence[int], max_tokens: int, min_prob: float,
                spec_factor: float, ahead: int = 0) -> tuple[list[int], float, int]:
        """Drafts continuing `context` as the cached outputs went on after its longest suffix, their
        score and the match's length."""
        node, length = self.trie.longest_match(context, _max_match(self.trie.depth, max_tokens + ahead))
        if node is None:
            return [], 0.0, 0
        return _after(node, length, max_tokens, min_prob, spec_factor, ahead)


class SuffixDrafter:
    """One SuffixTree per row over its prompt and outputs, and the SuffixCache of the outputs of
    rows that left; drafts from the better of the two."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.depth = config.suffix_decoding_max_tree_depth
        self.min_prob = config.suffix_decoding_min_token_prob
        self.spec_factor = config.suffix_decoding_max_spec_factor
        self.cache = SuffixCache(self.depth, config.suffix_decoding_max_cached_tokens)
        self.trees: dict[int, SuffixTree] = {}
        self.outputs_from: dict[int, int] = {}  # row -> where its outputs start in its tree's tokens

    def grow(self, row: int, tokens: Sequence[int], num_prompt: int) -> SuffixTree:
        """The row's tree, grown to `tokens` (the row's text so far; its first num_prompt are the
        prompt). A text shorter than the tree's is a new request's: its tree starts again."""
        tree = self.trees.get(row)
        if tree is None or len(tree.tokens) > len(tokens):
            tree = self.trees[row] = SuffixTree(self.depth)
            self.outputs_from[row] = num_prompt
        tree.append([int(t) for t in tokens[len(tree.tokens):]])
        return tree

    def draft(self, tree: SuffixTree, max_tokens: int, ahead: int = 0) -> list[int]:
        """Up to max_tokens drafts after `tree`'s text (and `ahead` tokens more): from whichever of
        its own text and the cache matches a longer suffix of it, and at equal lengths whichever
        scores more. A longer match is the more specific prediction: a row copying from its own
        prompt is not drafted for by short common phrases that many cached outputs continued
        alike (whose counts score high), while outputs that repeat an earlier answer match it at
        length."""
        own, own_score, own_length = tree.propose(max_tokens, self.min_prob, self.spec_factor, ahead)
        context = tree.tokens[-(self.depth - 1):]
        cached, cached_score, cached_length = self.cache.propose(context, max_tokens, self.min_prob,
                                                                 self.spec_factor, ahead)
        return cached if (cached_length, cached_score) > (own_length, own_score) else own

    def forget(self, row: int) -> None:
        """Drop the row's tree without caching it (its request's outputs were cached already)."""
        self.trees.pop(row, None)
        self.outputs_from.pop(row, None)

    def release(self, row: int) -> None:
        """The row's request leaves (finished, aborted or preempted): its outputs join the cache."""
        tree = self.trees.pop(row, None)
        if tree is not None:
            self.cache.add(tree.tokens[self.outputs_from.pop(row):])

    def leave(self, row: int, outputs: Sequence[int]) -> None:
        """The row's request leaves with `outputs`: they join the cache, and its tree goes ungrown
        (what `grow` then `release` would do, without building the tree over the whole text)."""
        self.forget(row)
        self.cache.add(outputs)


def _after(node: Node, length: int, max_tokens: int, min_prob: float, spec_factor: float,
           ahead: int) -> tuple[list[int], float, int]:
    """The drafts below `node` (a match of `length` tokens) that follow its first `ahead` tokens.
    A match seen CONFIDENT_COUNT times is trusted as far as its continuation's probability goes,
    however short: the same words answered the same way again and again (an agent's loop)."""
    budget = max_tokens if node.count >= CONFIDENT_COUNT else _budget(length + ahead, max_tokens, spec_factor)
    tokens, score = node.continuation(ahead + budget, min_prob)
    return tokens[ahead:], score, length


def _max_match(depth: int, max_tokens: int) -> int:
    """The longest suffix worth matching: one that leaves room below it for max_tokens drafts."""
    return max(1, depth - max_tokens)


def _budget(match_length: int, max_tokens: int, spec_factor: float) -> int:
    """Drafts a match of `match_length` tokens may propose: a longer match is trusted further."""
    return max(1, min(max_tokens, int(match_length * spec_factor + 0.5)))
