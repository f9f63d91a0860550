"""The byte-level fast path: the byte table decodes as the tokenizers library does, and a step
decoded whole gives the same events as the per-request path."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_output_processor import Entries, Tokens
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pipeline.models.tiny_model import train_tokenizer
from stages.contracts.outputs import FinishReason, OutputEvent
from stages.contracts.params import SamplingParams
from stages.detokenizer.byte_table import ByteTable
from stages.detokenizer.incremental import IncrementalDetokenizer
from stages.detokenizer.output_processor import OutputProcessor

pytestmark = pytest.mark.timeout(60)

PROPERTY = settings(max_examples=100, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
# Split multi-byte characters, stop strings, special tokens, leading spaces.
EDGE_TEXTS = ["café crème", " 中文分词", "😀🎉🚀 done", "Stop here STOP and", "  two spaces", "naïve résumé à",
              "<|endoftext|> after"]


@pytest.fixture(scope="module", params=["conftest_bpe", "tiny_model"])
def tokenizer(request: pytest.FixtureRequest, bpe: Tokenizer) -> Tokenizer:
    return bpe if request.param == "conftest_bpe" else train_tokenizer(512)


def test_the_table_decodes_random_ids_as_the_library_does(tokenizer: Tokenizer) -> None:
    table = ByteTable.of(tokenizer)
    assert table is not None
    rng = np.random.default_rng(0)
    for _ in range(500):
        ids = rng.integers(0, table.size + 3, rng.integers(1, 16)).tolist()  # a few ids beyond the vocabulary
        for skip in (False, True):
            expected = tokenizer.decode(ids, skip_special_tokens=skip)
            assert table.decode(ids, skip).decode("utf-8", "replace") == expected, (ids, skip)


def test_a_tokenizer_that_is_not_byte_level_has_no_table() -> None:
    tokenizer = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    assert ByteTable.of(tokenizer) is None


def deltas_of(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> tuple[list[str], bool, str | None]:
    deltas = []
    for chunk in chunks:
        delta = detok.add(chunk)
        deltas.append(delta.text)
        if delta.stopped:
            return deltas, True, detok.stop_string
    deltas.append(detok.flush())
    return deltas, False, None


@PROPERTY
@given(data=st.data())
def test_the_table_streams_the_same_deltas_as_the_library(tokenizer: Tokenizer, data: st.DataObject) -> None:
    table = ByteTable.of(tokenizer)
    vocab = tokenizer.get_vocab_size()
    if data.draw(st.booleans(), label="edge corpus"):
        text = data.draw(st.sampled_from(EDGE_TEXTS), label="text")
        output = tokenizer.encode(text, add_special_tokens=False).ids
    else:
        output = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=30), label="output")
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), max_size=6), label="prompt")
    stop = data.draw(st.lists(st.sampled_from(["STOP", "é", "中文", "e ", "😀"]), max_size=2), label="stop")
    params = SamplingParams(skip_special_tokens=data.draw(st.booleans(), label="skip"), stop=stop,
                            include_stop_str_in_output=data.draw(st.booleans(), label="include"),
                            min_tokens=data.draw(st.integers(0, 3), label="min_tokens"))
    chunks, i = [], 0
    while i < len(output):
        n = data.draw(st.integers(1, 3))
        chunks.append(output[i:i + n])
        i += n

    expected = deltas_of(IncrementalDetokenizer(tokenizer, prompt, params), chunks)
    assert deltas_of(IncrementalDetokenizer(tokenizer, prompt, params, table), chunks) == expected


def run_steps(outputs: OutputProcessor, steps: list[tuple[Entries, Tokens]], batched: bool) -> list[OutputEvent]:
    events = []
    for entries, tokens in steps:
        if batched:
            out = outputs.on_step_batch(entries, tokens)
            events += (out.plain.to_events() if out.plain is not None else []) + out.events
        else:
            events += outputs.on_step(entries, tokens).events
    return events


def by_request(events: list[OutputEvent]) -> dict[int, tuple[str, list[int], str | None, object]]:
    result: dict[int, tuple[str, list[int], str | None, object]] = {}
    for e in events:
        text, ids, _, _ = result.get(e.req_id, ("", [], None, None))
        result[e.req_id] = (text + e.text, ids + e.token_ids.tolist(), e.finish_reason, e.stop_reason)
    return result


def test_a_whole_step_gives_each_request_the_text_of_its_own_decode(tokenizer: Tokenizer) -> None:
    rng = np.random.default_rng(1)
    vocab = tokenizer.get_vocab_size()
    num_requests, num_steps = 24, 12
    params = [SamplingParams(skip_special_tokens=bool(r % 2), stop=["STOP"] if r % 5 == 0 else [],
                             logprobs=1 if r % 7 == 0 else None) for r in range(num_requests)]
    texts = [EDGE_TEXTS[r % len(EDGE_TEXTS)] * 3 for r in range(num_requests)]
    outputs_of = [tokenizer.encode(t, add_special_tokens=False).ids[:num_steps] if r % 3 else
                  rng.integers(0, vocab, num_steps).tolist() for r, t in enumerate(texts)]
    steps = []
    for step in range(num_steps):
        rows = [r for r in range(num_requests) if step < len(outputs_of[r]) and not (r % 4 == 1 and step == 3)]
        finished = [(r, FinishReason.LENGTH) for r in rows if step == len(outputs_of[r]) - 1]
        token_ids = np.array([outputs_of[r][step] for r in rows], np.int32)
        logprobs = rng.random((len(rows), 2)).astype(np.float32)
        steps.append((Entries(np.array(rows, np.int64), np.arange(len(rows)), finished,
                              admitted=[(r, 5) for r in rows] if step == 2 else []),
                      Tokens(token_ids, logprobs, np.tile(token_ids[:, None], 2))))

    results = []
    for batched in (False, True):
        outputs = OutputProcessor(tokenizer)
        for r in range(num_requests):
            outputs.add(r, [2, 3], params[r])
        results.append(run_steps(outputs, steps, batched))
    per_token, whole_step = results
    assert by_request(whole_step) == by_request(per_token)
    for r in range(num_requests):  # and each request's text is the decode of its tokens, up to a stop string
        text, ids, _, stop_reason = by_request(whole_step)[r]
        full = tokenizer.decode(ids, skip_special_tokens=params[r].skip_special_tokens)
        assert text == full if stop_reason is None else full.startswith(text)


def test_plain_rows_come_as_arrays_and_the_rest_as_events(bpe: Tokenizer) -> None:
    outputs = OutputProcessor(bpe)
    for req_id in (1, 2, 3):
        outputs.add(req_id, [5], SamplingParams(stop=["zz"] if req_id == 3 else []))
    a, e_acute = bpe.encode("a", add_special_tokens=False).ids[0], bpe.token_to_id("Ã©")
    first = outputs.on_step_batch(Entries(np.array([1, 2, 3]), np.arange(3)), Tokens(np.array([a, a, a], np.int32)))
    assert first.plain is None and len(first.events) == 3  # first events carry the prompt
    second = outputs.on_step_batch(Entries(np.array([1, 2, 3]), np.arange(3)),
                                   Tokens(np.array([a, e_acute, a], np.int32)))
    # Request 1's ASCII token is gathered from the table, request 2's "é" decoded alone; both are
    # plain. Request 3 has stop strings: an event.
    assert second.plain is not None and second.plain.req_ids.tolist() == [1, 2]
    assert second.plain.text.tobytes() == "aé".encode() and second.plain.token_ids.tolist() == [a, e_acute]
    assert second.plain.text_ends.tolist() == [1, 3]
    assert [(e.req_id, e.text) for e in second.events] == [(3, "a")]
    # A character split across two tokens: its first byte shows nothing, and its second the character.
    first_byte, second_byte = bpe.token_to_id("Ã"), bpe.token_to_id("©")
    third = outputs.on_step_batch(Entries(np.array([1, 2]), np.arange(2)),
                                  Tokens(np.array([first_byte, a], np.int32)))
    assert third.plain.req_ids.tolist() == [2, 1] and third.plain.text.tobytes() == b"a"
    assert third.plain.text_ends.tolist() == [1, 1] and third.plain.token_ids.tolist() == [a, first_byte]
    fourth = outputs.on_step_batch(Entries(np.array([1]), np.arange(1)), Tokens(np.array([second_byte], np.int32)))
    assert fourth.plain.req_ids.tolist() == [1] and fourth.plain.text.tobytes() == "é".encode()
    assert not fourth.events
