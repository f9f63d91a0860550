"""A request's routing key: the hash of its prompt's leading full token blocks, chained as the
engine's prefix cache chains them, so the router and the replicas agree on what a prefix is.

The prompt is tokenized (and a chat rendered with the checkpoint's template) as the daemon does;
the key is the hash of the first `num_blocks` full blocks (fewer when the prompt is shorter),
None for a prompt with no full block: nothing of it can be a cache hit anywhere.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from pipeline.serve.openai.chat import ChatTemplate
from pipeline.serve.openai.schemas import ChatMessage
from stages.contracts.config import TOKENIZER_FILE
from stages.scheduler.block_manager import hash_block


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

    def key_of_tokens(self, token_ids: list[int]) -> bytes | None:
        hashes = self.block_hashes(token_ids[:self.num_blocks * self.block_size])
        return hashes[-1] if hashes else None

    def block_hashes(self, token_ids: list[int]) -> list[bytes]:
        """The chained hash of each full block of `token_ids`, as the prefix cache makes them."""
        ids = np.asarray(token_ids, np.int32)
        hashes: list[bytes] = []
        for start in range(0, len(ids) - self.block_size + 1, self.block_size):
            hashes.append(hash_block(hashes[-1] if hashes else None, ids[start:start + self.block_size]))
        return hashes

    def key_of_text(self, text: str) -> bytes | None:
        # Only the leading blocks matter: a prompt's first characters give at least as many tokens.
        head = text[:self.num_blocks * self.block_size * 16]
        return self.key_of_tokens(self.tokenizer.encode(head, add_special_tokens=False).ids)

    def key_of_prompt(self, prompt: str | list[int]) -> bytes | None:
        return self.key_of_text(prompt) if isinstance(prompt, str) else self.key_of_tokens(prompt)

    def key_of_chat(self, messages: list[ChatMessage]) -> bytes | None:
        """Raises the daemon's 400 OpenAIError when the messages do not render."""
        return self.key_of_text(self.chat_template.render(messages))
