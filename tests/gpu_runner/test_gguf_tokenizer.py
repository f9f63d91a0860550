"""The tokenizer rebuilt from GGUF metadata gives the ids and text transformers' own GGUF tokenizer gives,
on the real SmolLM2 (byte-level BPE) and Gemma 3 (SentencePiece) files and on tiny written ones."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from real_models import TOKENIZER_CORPUS, TOKENIZERS, gemma3_gguf, smollm2_gguf, start_references
from transformers import AutoTokenizer

from stages.gpu_runner.loaders.gguf_file import GGUFFile
from stages.gpu_runner.loaders.gguf_tokenizer import GGUFTokenizer, _bytes_to_unicode, build_tokenizer

REFERENCE_TIMEOUT_S = 300
# The module's first test waits in its set-up for the references up to REFERENCE_TIMEOUT_S; the
# suite's 120 s default would cut that wait short on a busy machine (a cold cache computes Gemma's).
pytestmark = pytest.mark.timeout(REFERENCE_TIMEOUT_S + 60)


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def built(request: pytest.FixtureRequest) -> tuple[GGUFTokenizer, dict]:
    """(ours, transformers' results on TOKENIZER_CORPUS) for one real file; transformers' come from
    the session's reference worker (real_models.py), whose load of Gemma's tokenizer takes long."""
    path = {"smollm2": smollm2_gguf, "gemma3": gemma3_gguf}[request.param]()
    reference = start_references(TOKENIZERS)[f"tokenizer:{request.param}"]
    return build_tokenizer(GGUFFile(path), path), reference.get(REFERENCE_TIMEOUT_S)


def test_ids_match_transformers(built):
    ours, reference = built
    for text, ids, plain_ids in zip(TOKENIZER_CORPUS, reference["ids"], reference["plain_ids"]):
        assert ours.tokenizer.encode(text).ids == ids, text
        assert ours.tokenizer.encode(text, add_special_tokens=False).ids == plain_ids, text


def test_decode_matches_transformers_and_round_trips(built):
    ours, reference = built
    for text, ids, decoded in zip(TOKENIZER_CORPUS, reference["ids"], reference["decoded"]):
        for skip, expected in zip((False, True), decoded):
            assert ours.tokenizer.decode(ids, skip_special_tokens=skip) == expected, (text, skip)
        plain = ours.tokenizer.encode(text, add_special_tokens=False).ids
        assert ours.tokenizer.decode(plain, skip_special_tokens=False) == text


def test_special_tokens_stay_whole(built):
    ours, _ = built
    turn = "<|im_start|>" if ours.bos_token == "<|im_start|>" else "<start_of_turn>"
    ids = ours.tokenizer.encode(f"{turn}user", add_special_tokens=False).ids
    assert ids[0] == ours.tokenizer.token_to_id(turn)
    assert ours.tokenizer.decode(ids, skip_special_tokens=True) == "user"


def test_settings_match_transformers(built):
    ours, reference = built
    settings = dict(reference["settings"])
    expected_ids = (settings.pop("bos_token_id"), settings.pop("eos_token_id"))
    assert ours.tokenizer_config() == {name: value for name, value in settings.items() if value is not None}
    assert (ours.bos_token_id, ours.eos_token_ids[0]) == expected_ids


# A tiny GGUF written here: the model needs only what transformers asks of a llama file.
def _write_gguf(path: Path, model: str, tokens: list[str], types: list[int], **keys: object) -> Path:
    writer = gguf.GGUFWriter(path, arch="llama")
    for name, value in dict(block_count=1, context_length=64, embedding_length=8, feed_forward_length=16,
                            head_count=2, head_count_kv=2, layer_norm_rms_eps=1e-5, tokenizer_model=model,
                            token_list=tokens, token_types=types, unk_token_id=0, bos_token_id=1,
                            eos_token_id=2, **keys).items():
        getattr(writer, f"add_{name}")(value)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _assert_same_as_transformers(path: Path, texts: list[str]) -> GGUFTokenizer:
    ours = build_tokenizer(GGUFFile(path), path)
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in texts:
        ids = reference.encode(text)
        assert ours.tokenizer.encode(text).ids == ids, text
        assert ours.tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids), text
    assert ours.add_bos_token == reference.add_bos_token
    return ours


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "smollm", None])
def test_byte_level_pre_tokenizers_match_transformers(tmp_path: Path, pre: str | None):
    merges = ["1 2", "12 3", "Ġ h", "Ġh e", "l l", "Ġhe ll", "Ġhell o", "' s"]
    tokens = ["<|endoftext|>", "<|bos|>", "<|eos|>", "<think>", *_bytes_to_unicode().values(),
              *(merge.replace(" ", "") for merge in merges)]
    types = [3, 3, 3, 4] + [1] * (len(tokens) - 4)
    keys = {"token_merges": merges, "eot_token_id": 0} | ({"tokenizer_pre": pre} if pre else {})
    path = _write_gguf(tmp_path / "bpe.gguf", "gpt2", tokens, types, **keys)
    ours = _assert_same_as_transformers(path, ["12345 hello's <think>x<|eos|> \n\n  hello  123", *TOKENIZER_CORPUS[:3]])
    assert ours.eos_token_ids == [2, 0]  # generation also ends at the end-of-turn token
    # llama3's split keeps three digits together, qwen2's splits each digit.
    assert len(ours.tokenizer.encode("123").ids) == (3 if pre == "qwen2" else 1)


@pytest.mark.parametrize("add_bos", [None, False])
def test_sentencepiece_matches_transformers(tmp_path: Path, add_bos: bool | None):
    words = ["▁", "h", "e", "l", "o", "▁h", "▁he", "ll", "llo", "▁hello", "he", "w", "r", "d", "▁w", "or", "▁wor"]
    tokens = ["<unk>", "<s>", "</s>", "<tool>", *(f"<0x{byte:02X}>" for byte in range(256)), *words]
    types = [2, 3, 3, 4] + [6] * 256 + [1] * len(words)
    # Equal scores: the merges they imply must keep transformers' order for ties.
    scores = [0.0] * 260 + [-1.0, -2.0, -2.0, -2.0, -2.0, -3.0, -3.0, -3.0, -4.0, -5.0, -3.0, -2.0, -2.0, -2.0, -3.0, -3.0, -4.0]
    keys = {"token_scores": scores} | ({} if add_bos is None else {"add_bos_token": add_bos})
    path = _write_gguf(tmp_path / "sp.gguf", "llama", tokens, types, **keys)
    ours = _assert_same_as_transformers(path, ["hello world", " hello  world<tool>é", "<s>hi</s>", *TOKENIZER_CORPUS[:3]])
    # A SentencePiece file that does not say adds BOS, as llama.cpp does.
    assert ours.add_bos_token is (add_bos is None)


def test_unknown_tokenizer_model_is_refused_naming_the_file(tmp_path: Path):
    path = _write_gguf(tmp_path / "odd.gguf", "wordpiece-ish", ["<unk>", "<s>", "</s>", "a"], [2, 3, 3, 1])
    with pytest.raises(ValueError, match=r"odd\.gguf.*'wordpiece-ish'"):
        build_tokenizer(GGUFFile(path), path)
