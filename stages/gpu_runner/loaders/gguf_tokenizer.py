"""A GGUF file's tokenizer, rebuilt from its metadata as a `tokenizers.Tokenizer` plus the settings a
tokenizer_config.json would hold, so serving a GGUF needs neither transformers nor a tokenizer.json.

The result matches transformers' own GGUF tokenizer (`AutoTokenizer.from_pretrained(..., gguf_file=...)`):
same ids with and without special tokens, same decoded text.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from stages.gpu_runner.loaders.gguf_file import GGUFFile

Key = gguf.Keys.Tokenizer

# How text is cut into words before byte-level BPE, by `tokenizer.ggml.pre` (llama.cpp's names). A name
# not listed gets GPT-2's split, as in transformers. That includes SmolLM2's "smollm": llama.cpp also
# splits its digits one by one, but its vocabulary has no token of two digits, so the ids are the same.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}
# Gemma's SentencePiece files need the Gemma shape (no prefix space, spaces as ▁ before lookup).
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


@dataclass(slots=True)
class GGUFTokenizer:
    tokenizer: Tokenizer
    bos_token: str | None
    eos_token: str | None
    bos_token_id: int | None
    eos_token_ids: list[int]  # end of generation: the EOS id first, then end-of-turn / end-of-message ids
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None

    def tokenizer_config(self) -> dict:
        """The fields of a Hugging Face tokenizer_config.json this file determines; unknowns are left out."""
        config = {"bos_token": self.bos_token, "eos_token": self.eos_token, "add_bos_token": self.add_bos_token,
                  "add_eos_token": self.add_eos_token, "chat_template": self.chat_template}
        return {name: value for name, value in config.items() if value is not None}


def build_tokenizer(file: GGUFFile, path: str | Path) -> GGUFTokenizer:
    """The tokenizer `file`'s metadata describes; `path` names the file in errors."""
    def field(key: str, default: Any = None) -> Any:
        found = file.get(key)
        if found is None:
            return default
        return found.tolist() if isinstance(found, np.ndarray) else found

    model_type = field(Key.MODEL)
    if model_type not in ("gpt2", "llama"):
        raise ValueError(f"{path}: unsupported GGUF tokenizer model {model_type!r} ({Key.MODEL}); "
                         f"supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece)")
    tokens: list[str] = field(Key.LIST, [])
    if not tokens:
        raise ValueError(f"{path}: no tokenizer vocabulary ({Key.LIST}) in the GGUF metadata")
    token_types: list[int] = field(Key.TOKEN_TYPE) or [gguf.TokenType.NORMAL] * len(tokens)
    ids = {name: field(key) for name, key in (("bos", Key.BOS_ID), ("eos", Key.EOS_ID), ("unk", Key.UNK_ID),
                                               ("pad", Key.PAD_ID), ("eot", Key.EOT_ID), ("eom", Key.EOM_ID))}
    texts = {name: tokens[i] if i is not None and 0 <= i < len(tokens) else None for name, i in ids.items()}

    if model_type == "gpt2":
        tokenizer, vocab = _byte_level(tokens, field(Key.MERGES, []), field(Key.PRE))
    else:
        tokenizer, vocab = _sentencepiece(tokens, field(Key.SCORES), field(Key.MERGES),
                                          field(gguf.Keys.General.ARCHITECTURE), texts["unk"])
    _add_special_tokens(tokenizer, vocab, tokens, token_types, model_type == "gpt2",
                        [texts[name] for name in ("bos", "eos", "unk", "pad")])

    # Older SentencePiece files lack the flag, and llama.cpp adds BOS to those unless told otherwise.
    add_bos = bool(field(Key.ADD_BOS, model_type == "llama")) and texts["bos"] is not None
    add_eos = bool(field(Key.ADD_EOS, False)) and texts["eos"] is not None
    tokenizer.post_processor = _post_processor(texts["bos"], ids["bos"], add_bos, texts["eos"], ids["eos"], add_eos)
    eos_token_ids = list(dict.fromkeys(ids[name] for name in ("eos", "eot", "eom") if texts[name] is not None))
    return GGUFTokenizer(tokenizer=tokenizer, bos_token=texts["bos"], eos_token=texts["eos"],
                         bos_token_id=ids["bos"] if texts["bos"] is not None else None,
                         eos_token_ids=eos_token_ids, add_bos_token=add_bos, add_eos_token=add_eos,
                         chat_template=field(Key.CHAT_TEMPLATE))


def _byte_level(tokens: list[str], merges: list[str], pre: str | None) -> tuple[Tokenizer, dict[str, int]]:
    """GPT-2 style BPE over bytes spelled as printable characters."""
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token in the file is normally spelled in the byte alphabet already; one that is not (a raw
    # special token with a space, say) is respelled so the model can still reach it.
    vocab = {token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): index
             for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(BPE(vocab, [tuple(merge.split(" ", 1)) for merge in merges],
                              continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, vocab


def _sentencepiece(tokens: list[str], scores: list[float] | None, merges: list[str] | None,
                   architecture: str | None, unk: str | None) -> tuple[Tokenizer, dict[str, int]]:
    """SentencePiece BPE with byte fallback (<0x41> tokens), as Llama 2 and Gemma use."""
    gemma = architecture in GEMMA_ARCHITECTURES
    if gemma:
        # Gemma stores runs of spaces as real spaces, but looks text up after turning spaces into ▁.
        tokens = ["\u2581" * len(token) if " " in token and not token.strip() else token for token in tokens]
    vocab = {token: index for index, token in enumerate(tokens)}
    if merges:
        pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    else:
        # Gemma's scores do not follow its merge order; the order of its tokens does.
        ranks = {token: -index for index, token in enumerate(tokens)} if gemma else dict(zip(tokens, scores or ()))
        pairs = _merges_from_vocab(vocab, ranks)
    # Unlike transformers' Llama shape, keep the file's <unk>: SentencePiece maps a character with no byte
    # token to it rather than dropping it.
    tokenizer = Tokenizer(BPE(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        steps.append(decoders.Strip(" ", 1, 0))  # the space the pre-tokenizer put before the first word
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer, vocab


def _merges_from_vocab(vocab: dict[str, int], ranks: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every split of a token into two tokens, the
    best-ranked token's first and, within a token, the longer left part first."""
    found = [(rank, cut, len(token) - cut, token[:cut], token[cut:])
             for token, rank in ranks.items() for cut in range(1, len(token))
             if token[:cut] in vocab and token[cut:] in vocab]
    # Stable, so equal ranks keep the vocabulary's order, as in transformers' generate_merges.
    found.sort(key=lambda merge: merge[:3], reverse=True)
    return [(left, right) for _, _, _, left, right in found]


def _add_special_tokens(tokenizer: Tokenizer, vocab: dict[str, int], tokens: list[str], token_types: list[int],
                        byte_level: bool, named: list[str | None]) -> None:
    """Control tokens (like <|im_end|>) become special added tokens and user-defined ones (like <think>)
    plain added tokens, so text that spells them maps to one id instead of being cut into pieces."""
    # In a byte-level vocabulary a control token outside the byte alphabet is a llama.cpp mislabel;
    # adding it would grow the vocabulary past the model's size.
    alphabet = set(_bytes_to_unicode().values()) if byte_level else None
    control = [token for token, kind in zip(tokens, token_types)
               if kind == gguf.TokenType.CONTROL and (alphabet is None or set(token) <= alphabet)]
    # BOS/EOS/UNK/PAD are special whatever their type, so skip_special_tokens drops them.
    control += [token for token in named if token is not None and token in vocab]
    tokenizer.add_special_tokens([AddedToken(token, normalized=False, special=True)
                                  for token in dict.fromkeys(control)])
    tokenizer.add_tokens([AddedToken(token, normalized=False, special=False)
                          for token, kind in zip(tokens, token_types)
                          if kind == gguf.TokenType.USER_DEFINED and token in vocab])


def _post_processor(bos: str | None, bos_id: int | None, add_bos: bool,
                    eos: str | None, eos_id: int | None, add_eos: bool) -> processors.TemplateProcessing:
    """BOS/EOS around each sequence when the file asks for them (`add_special_tokens=True`)."""
    first = f"{bos}:0 " if add_bos else ""
    last = f" {eos}:0" if add_eos else ""
    single = f"{first}$A:0{last}"
    pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
    special = ([(bos, bos_id)] if add_bos else []) + ([(eos, eos_id)] if add_eos else [])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable bytes stand for themselves, the rest are
    moved above U+0100 so no token holds whitespace or control characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [byte for byte in range(256) if byte not in printable]
    return {**{byte: chr(byte) for byte in printable}, **{byte: chr(256 + n) for n, byte in enumerate(moved)}}
