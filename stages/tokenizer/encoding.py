"""Text prompts to token ids as the model expects them: with the special tokens its tokenizer puts
before a text (Gemma's BOS), except where the text already starts with them (a chat template's
rendering names its BOS itself), so no prompt gets that prefix twice."""
from __future__ import annotations

from typing import Protocol, Sequence


class BatchEncoder(Protocol):
    def encode_batch(self, texts: list[str], add_special_tokens: bool) -> list: ...


class PromptEncoder:
    def __init__(self, tokenizer: BatchEncoder) -> None:
        self.tokenizer = tokenizer
        probe = tokenizer.encode_batch(["a"], add_special_tokens=True)[0]
        leading = 0
        while leading < len(probe.ids) and probe.special_tokens_mask[leading]:
            leading += 1
        self.prefix: list[int] = probe.ids[:leading]  # what the tokenizer adds before every text

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=bool(self.prefix))
        n = len(self.prefix)
        out = []
        for encoding in encodings:
            ids = encoding.ids
            if n and ids[n:2 * n] == self.prefix:
                ids = ids[n:]
            out.append(ids)
        return out

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]
