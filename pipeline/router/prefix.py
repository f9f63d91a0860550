"""A request's routing key: its prompt's full token blocks, each hashed chained as the engine's
prefix cache chains them, so the router and the replicas agree on what a prefix is.

The prompt is tokenized (and a chat rendered with the checkpoint's template) as the daemon does.
`RouteKey.ring`, the hash of the first `num_blocks` full blocks (fewer when the prompt is
shorter), places the prompt on the hash ring; `RouteKey.blocks`, the hash of every full block up
to MAX_KEY_BLOCKS, lets the router find where the longest prefix of it went (policy.py), so that
conversations which share their first blocks (a long system prompt) still each find their own
history. None for a prompt with no full block: nothing of it can be a cache hit anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from pipeline.serve.openai.chat import ChatTemplate
from pipeline.serve.openai.schemas import ChatMessage
from stages.contracts.config import TOKENIZER_FILE
from stages.scheduler.block_manager import hash_block


MAX_KEY_BLOCKS = 64  # the leading full blocks a key holds (1024 tokens at block size 16)
# A prompt's first characters give at least as many tokens: CHARS_PER_TOKEN_AT_MOST of them per
# token make sure of the ring's blocks; the blocks beyond are taken from CHARS_PER_TOKEN_USUALLY
# per token, as far as they reach (tokenizing costs the router about 0.3 ms per 1000 characters).
CHARS_PER_TOKEN_AT_MOST = 16
CHARS_PER_TOKEN_USUALLY = 4


@dataclass(frozen=True, slots=True)
class RouteKey:
    ring: bytes  # the hash of the first num_blocks blocks: the prompt's place on the ring
    blocks: tuple[bytes, ...]  # the chained hash of each leading full block, the last ring's or beyond


class PrefixKeyer:
    def __init__(self, model_dir: str | Path, block_size: int, num_blocks: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"prefix blocks must be a positive integer, got {num_blocks}")
        path = Path(model_dir) / TOKENIZER_FILE
        if not path.is_file():
            raise ValueError(f"no tokenizer at {path}: the router needs the replicas' checkpoint directory")
        self.tokenizer = Tokenizer.from_file(str(path))
        self.chat_template = ChatTemplate.from_checkpoint(model_dir)
        self.block_size = block_size
        self.num_blocks = num_blocks

    def key_of_tokens(self, token_ids: list[int]) -> RouteKey | None:
        hashes = self.block_hashes(token_ids[:MAX_KEY_BLOCKS * self.block_size])
        if not hashes:
            return None
        return RouteKey(hashes[min(self.num_blocks, len(hashes)) - 1], tuple(hashes))

    def block_hashes(self, token_ids: list[int]) -> list[bytes]:
        """The chained hash of each full block of `token_ids`, as the prefix cache makes them."""
        ids = np.asarray(token_ids, np.int32)
        hashes: list[bytes] = []
        for start in range(0, len(ids) - self.block_size + 1, self.block_size):
            hashes.append(hash_block(hashes[-1] if hashes else None, ids[start:start + self.block_size]))
        return hashes

    def key_of_text(self, text: str) -> RouteKey | None:
        # Only the leading blocks matter: a prompt's first characters give at least as many tokens.
        head = text[:self.block_size * max(self.num_blocks * CHARS_PER_TOKEN_AT_MOST,
                                           MAX_KEY_BLOCKS * CHARS_PER_TOKEN_USUALLY)]
        return self.key_of_tokens(self.tokenizer.encode(head, add_special_tokens=False).ids)

    def key_of_prompt(self, prompt: str | list[int]) -> RouteKey | None:
        return self.key_of_text(prompt) if isinstance(prompt, str) else self.key_of_tokens(prompt)

    def key_of_chat(self, messages: list[ChatMessage]) -> RouteKey | None:
        """Raises the daemon's 400 OpenAIError when the messages do not render."""
        return self.key_of_text(self.chat_template.render(messages))
