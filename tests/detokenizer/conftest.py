"""A small byte-level BPE trained on fixed text, so multi-byte characters split across tokens."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "Un café crème, s'il vous plaît: naïve résumé à la française, ça va?",
    "中文分词测试：我们喜欢自然语言处理。日本語のテキストも少し。",
    "Emoji time 😀🎉🚀 and flags 👍🏽 in the middle of text 🤖.",
    "Mixed: café 中文 😀 done. Stop here STOP and then more text after.",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>"]


def make_byte_level_bpe(vocab_size: int = 300) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    return tokenizer


@pytest.fixture(scope="session")
def bpe() -> Tokenizer:
    return make_byte_level_bpe()
