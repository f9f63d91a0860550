"""The byte-level fast path of detokenization: every token id's bytes, read once from the vocabulary.

A byte-level BPE (GPT-2, Llama 3, Qwen) spells each token as characters of a 256-character
alphabet, one per byte, and its decoder maps them back and reads the bytes as UTF-8 (invalid
bytes become U+FFFD). So `tokenizer.decode(ids)` is the concatenation of each id's bytes, read as
UTF-8 with replacement: a table of bytes per id answers it with no call into the library, and a
whole step's tokens are gathered at once with numpy. Ids the vocabulary lacks decode to nothing,
as in the library; special tokens decode to nothing when skipped.

`ByteTable.of` returns None for any other tokenizer (another decoder, or a token that is not
spelt in the byte alphabet): those are decoded by the library, token window by token window.
"""
from __future__ import annotations

import json

import numpy as np
from tokenizers import Tokenizer


def byte_alphabet() -> dict[str, int]:
    """The byte-level alphabet: character -> the byte it stands for (GPT-2's `bytes_to_unicode`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars)}


class ByteTable:
    """Bytes of every token id: `data[starts[i]:starts[i] + lengths[i]]`; id `size` is empty and
    stands for every id outside the vocabulary."""

    __slots__ = ("data", "starts", "lengths", "lengths_skipping_special", "size", "plain", "_bytes", "_special")

    def __init__(self, token_bytes: list[bytes], special: list[bool]) -> None:
        if len(token_bytes) != len(special):
            raise ValueError(f"{len(token_bytes)} token byte strings but {len(special)} special flags")
        self.size = len(token_bytes)
        self._bytes = token_bytes  # for a few tokens at a time, a list beats numpy's fixed cost
        self._special = {token_id for token_id, is_special in enumerate(special) if is_special}
        lengths = np.array([len(b) for b in token_bytes] + [0], np.int64)
        self.data = np.frombuffer(b"".join(token_bytes), np.uint8)
        self.lengths = lengths
        self.starts = np.concatenate(([0], np.cumsum(lengths[:-1]))).astype(np.int64)
        self.lengths_skipping_special = np.where(np.array(special + [False]), 0, lengths)
        # ASCII and not special: the token's text is its bytes, whatever came before and whether
        # special tokens are skipped or not (a stream that holds no partial character).
        self.plain = np.array([b.isascii() for b in token_bytes] + [True]) & ~np.array(special + [False])

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> ByteTable | None:
        """The table of a byte-level tokenizer; None when its decoding is not plain bytes."""
        decoder = json.loads(tokenizer.to_str()).get("decoder")
        if not isinstance(decoder, dict) or decoder.get("type") != "ByteLevel":
            return None
        alphabet = byte_alphabet()
        special_ids = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
        token_bytes: list[bytes] = []
        for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
            token = tokenizer.id_to_token(token_id)
            if token is None:
                token_bytes.append(b"")
                continue
            try:
                token_bytes.append(bytes(alphabet[char] for char in token))
            except KeyError:
                return None  # spelt outside the alphabet: only the library knows what it decodes to
        return cls(token_bytes, [i in special_ids for i in range(len(token_bytes))])

    def lengths_of(self, token_ids: np.ndarray, skip_special_tokens: bool) -> np.ndarray:
        """Bytes per token of `token_ids` (int64)."""
        ids = self.ids(token_ids)
        return (self.lengths_skipping_special if skip_special_tokens else self.lengths)[ids]

    def gather(self, token_ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """The bytes of `token_ids`, one after another (uint8); `lengths` from `lengths_of`
        (a skipped special token's length is 0, so it adds nothing)."""
        total = int(lengths.sum())
        if total == 0:
            return self.data[:0]
        starts = self.starts[self.ids(token_ids)]
        ends = np.cumsum(lengths)
        # Byte k of the output is data[start of its token + (k - where its token begins in the output)].
        index = np.arange(total, dtype=np.int64) + np.repeat(starts - (ends - lengths), lengths)
        return self.data[index]

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> bytes:
        """The bytes of a few tokens (a request's, in the per-request path)."""
        table, size = self._bytes, self.size
        skip = self._special if skip_special_tokens else ()
        return b"".join(table[i] for i in token_ids if 0 <= i < size and i not in skip)

    def ids(self, token_ids: np.ndarray) -> np.ndarray:
        """`token_ids` as table indices: those outside the vocabulary become `size`, the empty entry."""
        ids = np.asarray(token_ids, np.int64)
        return np.where((ids >= 0) & (ids < self.size), ids, self.size)
