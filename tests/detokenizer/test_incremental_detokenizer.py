"""IncrementalDetokenizer: streamed text equals the full decode, never half a character, stop strings."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from stages.contracts.params import SamplingParams
from stages.detokenizer.incremental import IncrementalDetokenizer

pytestmark = pytest.mark.timeout(60)

FFFD = "\ufffd"
PROPERTY = settings(
    max_examples=150, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
# Text the tokenizer knows, with characters of 1 to 4 UTF-8 bytes.
ALPHABET = "aeoSTOPé中文语言😀🎉 ,."


def stream(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> tuple[list[str], bool]:
    """Feeds chunks until a stop; returns every delta (the flush last) and whether it stopped."""
    deltas = []
    for chunk in chunks:
        delta = detok.add(chunk)
        deltas.append(delta.text)
        if delta.stopped:
            return deltas, True
    deltas.append(detok.flush())
    return deltas, False


def one_by_one(token_ids: list[int]) -> list[list[int]]:
    return [[t] for t in token_ids]


@st.composite
def chunked(draw: st.DrawFn, token_ids: list[int]) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(token_ids):
        n = draw(st.integers(1, 4))
        chunks.append(token_ids[i : i + n])
        i += n
    return chunks


@PROPERTY
@given(data=st.data())
def test_random_tokens_stream_to_the_full_decode(bpe: Tokenizer, data: st.DataObject) -> None:
    vocab = bpe.get_vocab_size()
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), max_size=8), label="prompt")
    output = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40), label="output")
    skip_special = data.draw(st.booleans(), label="skip_special_tokens")
    detok = IncrementalDetokenizer(bpe, prompt, SamplingParams(skip_special_tokens=skip_special))

    deltas, stopped = stream(detok, data.draw(chunked(output), label="chunks"))

    full = bpe.decode(output, skip_special_tokens=skip_special)
    assert not stopped
    assert "".join(deltas) == full == detok.text
    offset = 0
    for delta in deltas:  # a replacement char is emitted only where the full decode has one
        for i, char in enumerate(delta):
            if char == FFFD:
                assert full[offset + i] == FFFD
        offset += len(delta)


@PROPERTY
@given(text=st.text(ALPHABET, min_size=1, max_size=30), data=st.data())
def test_real_text_never_emits_half_a_character(bpe: Tokenizer, text: str, data: st.DataObject) -> None:
    prompt = bpe.encode("Hello world, ").ids
    output = bpe.encode(text).ids
    detok = IncrementalDetokenizer(bpe, prompt, SamplingParams())
    deltas, _ = stream(detok, data.draw(chunked(output)))
    assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) == text


def test_partial_character_is_held_until_complete(bpe: Tokenizer) -> None:
    emoji_ids = bpe.encode("😀").ids
    assert len(emoji_ids) > 1, "the test tokenizer must split the emoji across tokens"
    detok = IncrementalDetokenizer(bpe, [], SamplingParams())
    assert detok.add(emoji_ids[:1]).text == ""
    assert detok.add(emoji_ids[1:]).text == "😀"


def test_flush_releases_an_unfinished_character_as_the_full_decode_does(bpe: Tokenizer) -> None:
    first_byte = bpe.encode("😀").ids[:1]
    detok = IncrementalDetokenizer(bpe, [], SamplingParams())
    assert detok.add(first_byte).text == ""
    assert detok.flush() == bpe.decode(first_byte) == FFFD


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_skip_special_tokens(bpe: Tokenizer, skip_special_tokens: bool) -> None:
    eos = bpe.token_to_id("<|endoftext|>")
    output = bpe.encode("café").ids + [eos] + bpe.encode(" 中文").ids
    detok = IncrementalDetokenizer(bpe, [], SamplingParams(skip_special_tokens=skip_special_tokens))
    text = "".join(stream(detok, one_by_one(output))[0])
    assert text == ("café 中文" if skip_special_tokens else "café<|endoftext|> 中文")


def test_prompt_context_keeps_the_leading_space_of_the_first_output_token() -> None:
    # A sentencepiece-style vocabulary: decoding "▁world" alone drops its space.
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    assert tokenizer.decode([2]) == "world"
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams())
    assert "".join(stream(detok, one_by_one([2, 3]))[0]) == " world!"


# --- stop strings ---


def run_stop(bpe: Tokenizer, text: str, **params: object) -> tuple[list[str], bool, IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(bpe, [], SamplingParams(**params))
    deltas, stopped = stream(detok, one_by_one(bpe.encode(text).ids))
    return deltas, stopped, detok


@pytest.mark.parametrize("stop", ["fé na", "中文", "😀", "STOP"])
def test_stop_string_across_tokens_and_characters(bpe: Tokenizer, stop: str) -> None:
    text = "Un café naïve, 中文 and 😀 then STOP and more"
    assert len(bpe.encode(stop).ids) > 1, "the stop string must span tokens"
    deltas, stopped, detok = run_stop(bpe, text, stop=[stop])
    expected = text[: text.index(stop)]
    assert stopped
    # Emitted text is final, so this also says no part of the stop string was ever emitted.
    assert "".join(deltas) == expected == detok.text


def test_possible_stop_prefix_is_held_back_then_released(bpe: Tokenizer) -> None:
    detok = IncrementalDetokenizer(bpe, [], SamplingParams(stop=["STOP"]))
    deltas = [detok.add([t]).text for t in bpe.encode("a STO").ids]
    assert "".join(deltas) == "a "  # "STO" could still become "STOP"
    assert detok.add(bpe.encode("x").ids).text == "STOx"  # it did not
    deltas = [detok.add([t]).text for t in bpe.encode(" ST").ids]
    assert "".join(deltas) == " "
    assert detok.flush() == "ST"  # the request ended: the held text is output after all
    assert detok.text == "a STOx ST"


def test_include_stop_str_in_output(bpe: Tokenizer) -> None:
    deltas, stopped, _ = run_stop(bpe, "café 中文 after", stop=["中文"], include_stop_str_in_output=True)
    assert stopped and "".join(deltas) == "café 中文"


def test_earliest_stop_string_wins(bpe: Tokenizer) -> None:
    deltas, stopped, _ = run_stop(bpe, "one 😀 two STOP three", stop=["STOP", "😀"])
    assert stopped and "".join(deltas) == "one "


def test_adds_after_a_stop_return_nothing(bpe: Tokenizer) -> None:
    _, stopped, detok = run_stop(bpe, "x STOP", stop=["STOP"])
    assert stopped
    assert detok.add(bpe.encode("more").ids).text == ""
    assert detok.add([]).stopped
    assert detok.flush() == ""
    assert detok.text == "x "


def test_stop_strings_wait_for_min_tokens(bpe: Tokenizer) -> None:
    ids = bpe.encode("a.b.c").ids
    assert ids == [bpe.token_to_id(c) for c in "a.b.c"]
    deltas, stopped, _ = run_stop(bpe, "a.b.c", stop=["."], min_tokens=3)
    assert stopped and "".join(deltas) == "a.b"  # the first "." came before token 3


@PROPERTY
@given(text=st.text(ALPHABET, min_size=1, max_size=30), data=st.data())
def test_stop_string_property(bpe: Tokenizer, text: str, data: st.DataObject) -> None:
    start = data.draw(st.integers(0, len(text) - 1))
    length = data.draw(st.integers(1, 4))
    stop = data.draw(st.sampled_from([text[start : start + length], "STOP", "😀e"]))
    include = data.draw(st.booleans())
    output = bpe.encode(text).ids
    detok = IncrementalDetokenizer(bpe, [], SamplingParams(stop=[stop], include_stop_str_in_output=include))
    deltas, stopped = stream(detok, data.draw(chunked(output)))

    index = text.find(stop)
    if index == -1:
        assert not stopped and "".join(deltas) == text
    else:
        assert stopped
        assert "".join(deltas) == text[: index + (len(stop) if include else 0)]


# --- cost ---


class CountingTokenizer:
    """Wraps a tokenizer and records how many tokens each decode call is given."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoded_lengths: list[int] = []

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded_lengths.append(len(token_ids))
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def test_per_call_cost_stays_flat_as_output_grows(bpe: Tokenizer) -> None:
    output = bpe.encode(" ".join(["Un café 中文 😀🎉 naïve STOP résumé."] * 150)).ids
    assert len(output) > 3000
    counting = CountingTokenizer(bpe)
    detok = IncrementalDetokenizer(counting, bpe.encode("Hello").ids, SamplingParams(stop=["never seen"]))  # type: ignore[arg-type]
    per_call_max = []
    for token_id in output:
        counting.decoded_lengths.clear()
        detok.add([token_id])
        per_call_max.append(max(counting.decoded_lengths, default=0))
    # Each call decodes the previous emission plus the new token: a few tokens, at any length.
    assert max(per_call_max) <= 8
    assert max(per_call_max[-500:]) <= max(per_call_max[:500])
    detok.flush()
    assert detok.text == bpe.decode(output)
