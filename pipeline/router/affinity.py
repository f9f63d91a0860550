"""The prefix-cache hit rate perfect routing would get on a run of the multi-turn workload
(pipeline/bench/multiturn.py), to measure a routing policy against.

Every turn finds every block that a turn before it (of any conversation) left, as on one replica
whose cache never evicts; a conversation's first turn can find only its system prompt's blocks.
Each reply's text is tokenized again, which may split differently from the tokens generated, so
a measured rate can pass the estimate by a little.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pipeline.router.prefix import PrefixKeyer
from pipeline.serve.openai.schemas import ChatMessage


class Turn(Protocol):
    """One turn as the workload records it (multiturn.TurnResult)."""

    turn: int  # its place in its conversation, from 0
    messages: list[dict]  # what it sent
    reply: str


def affinity_hit_rate(turns: Sequence[Turn], keyer: PrefixKeyer) -> float:
    """The hit rate of `turns` with `keyer`'s tokenizer, chat template and block size: the share of prompt tokens in leading blocks that a turn of a lower place left
    (its prompt and its reply, tokenized again), the last prompt token never counted (the engine
    computes at least one)."""
    left: set[bytes] = set()
    hit_tokens = prompt_tokens = 0
    for place in range(max((turn.turn for turn in turns), default=-1) + 1):
        sequences = []
        for turn in (turn for turn in turns if turn.turn == place):
            prompt = keyer.tokenizer.encode(keyer.chat_template.render(
                [ChatMessage(**message) for message in turn.messages]), add_special_tokens=False).ids
            prompt_tokens += len(prompt)
            hashes = keyer.block_hashes(prompt[:len(prompt) - 1])
            hit_tokens += keyer.block_size * next((i for i, h in enumerate(hashes) if h not in left), len(hashes))
            sequences.append(prompt + keyer.tokenizer.encode(turn.reply, add_special_tokens=False).ids)
        for sequence in sequences:  # a turn's blocks serve later places only: the same place runs alongside
            left.update(keyer.block_hashes(sequence))
    return hit_tokens / prompt_tokens if prompt_tokens else 0.0
