"""Real checkpoints served from their GGUF files, one daemon per model: greedy output equals
transformers' float32 decoding of the same file (its own GGUF loader), several prompts at once
and past Gemma 3's sliding window (read from the file; the window's own tests on a tiny Gemma 3
cross it many times); chat through the OpenAI API equals apply_chat_template and
greedy decoding; the default model knows where Paris is.

transformers' references are computed in a worker process (tests/real_models.py) that starts
on them when the session collects this module, or read from the cache where an earlier session
on this machine computed them with the same file, code and versions.

A divergence passes only where the reference's top-2 logit gap at that token is below NEAR_TIE
(rounding may then pick either); the continuations after it are not compared.
"""
from __future__ import annotations

import asyncio
from multiprocessing.pool import AsyncResult
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from live_daemon import REAL_BACKEND, LiveDaemon, serving
from real_models import (CHAT, CHAT_TOKENS, GEMMA3_PAST_WINDOW, GEMMA3_TOKENS, GEMMA3_WINDOW, SERVING, SMOLLM2_TOKENS,
                         gemma3_gguf, gemma3_prompts, served_tokenizer, smollm2_gguf, smollm2_prompts,
                         start_references)

from pipeline.client import AsyncClient, Client
from pipeline.models.checkpoints import resolve_model

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not REAL_BACKEND, reason="serves real checkpoints with `pipeline start`")]

NEAR_TIE = 1e-3
REFERENCE_TIMEOUT_S = 400
# Compared with transformers in float32: the dequantized float32 path, whatever the defaults are.
ENGINE = ["--max-model-len", "4096", "--num-kv-blocks", "400", "--max-num-seqs", "8", "--port", "0",
          "--dtype", "float32", "--quantization", "none"]


def assert_same_greedy(got: list[int], want: list[int], gaps: list[float], label: str) -> int:
    """How many leading tokens were compared equal (all, or up to a near-tie)."""
    assert len(got) == len(want), f"{label}: {len(got)} tokens, the reference has {len(want)}"
    for i, (ours, theirs) in enumerate(zip(got, want)):
        if ours != theirs:
            assert gaps[i] < NEAR_TIE, (f"{label}: token {i} is {ours}, the reference's {theirs}, "
                                        f"where its top-2 gap is {gaps[i]:.3g}")
            return i
    return len(got)


def assert_mostly_compared(num_equal: list[int], num_tokens: list[int]) -> None:
    """Near-ties must not leave the comparison empty: most tokens are compared."""
    assert sum(num_equal) >= 0.75 * sum(num_tokens), f"only {num_equal} of {num_tokens} tokens compared"


async def generate_all(socket_path: Path, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Every prompt at once, greedy, EOS not stopping them."""
    client = AsyncClient(socket_path)
    try:
        done = await asyncio.gather(*(client.generate(prompt, {"max_tokens": n, "temperature": 0.0, "ignore_eos": True})
                                      for prompt, n in zip(prompts, max_tokens)))
    finally:
        await client.close()
    return [completion.token_ids for completion in done]


def http_url(daemon: LiveDaemon) -> str:
    with Client(daemon.socket_path) as client:
        return client.health().http_url


@pytest.fixture(scope="module")
def references() -> dict[str, AsyncResult]:
    """transformers' references, already being computed when the session collected this module."""
    return start_references(SERVING)


@pytest.fixture(scope="module")
def smollm2(references: dict[str, AsyncResult]) -> Iterator[LiveDaemon]:
    with serving(smollm2_gguf(), ENGINE) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def gemma3(references: dict[str, AsyncResult]) -> Iterator[LiveDaemon]:
    with serving(gemma3_gguf(), ENGINE) as daemon:
        yield daemon


def test_gemma3_greedy_equals_transformers_past_its_window(gemma3: LiveDaemon, references) -> None:
    """A prompt past the window, 48 tokens after it, beside short prompts decoding at once."""
    tokenizer = served_tokenizer(gemma3_gguf())
    prompts = gemma3_prompts()
    assert prompts[0][0] == tokenizer.token_to_id("<bos>") and len(prompts[0]) > GEMMA3_WINDOW + GEMMA3_PAST_WINDOW
    got = asyncio.run(generate_all(gemma3.socket_path, prompts, GEMMA3_TOKENS))
    compared = [assert_same_greedy(ours, want, gaps, f"Gemma 3 on {len(prompt)} tokens")
                for prompt, ours, (want, gaps) in zip(prompts, got, references["gemma3"].get(REFERENCE_TIMEOUT_S))]
    assert_mostly_compared(compared, GEMMA3_TOKENS)


def test_gemma3_text_prompt_gets_its_bos_and_chat_without_a_template_is_a_400(gemma3: LiveDaemon) -> None:
    tokenizer = served_tokenizer(gemma3_gguf())
    with Client(gemma3.socket_path) as client:
        by_text = client.generate("The capital of France is", {"max_tokens": 8, "temperature": 0.0})
        by_ids = client.generate(tokenizer.encode("The capital of France is").ids, {"max_tokens": 8, "temperature": 0.0})
    assert by_text.prompt_token_ids[0] == tokenizer.token_to_id("<bos>")
    assert by_text.token_ids == by_ids.token_ids
    sdk = openai.OpenAI(api_key="unused", base_url=f"{http_url(gemma3)}/v1", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        sdk.chat.completions.create(model=gemma3_gguf().stem, messages=[{"role": "user", "content": "hi"}])


def test_smollm2_greedy_equals_transformers_with_prompts_at_once(smollm2: LiveDaemon, references) -> None:
    prompts = smollm2_prompts()
    got = asyncio.run(generate_all(smollm2.socket_path, prompts, [SMOLLM2_TOKENS] * len(prompts)))
    compared = [assert_same_greedy(ours, want, gaps, f"SmolLM2 on {len(prompt)} tokens")
                for prompt, ours, (want, gaps) in zip(prompts, got, references["smollm2"].get(REFERENCE_TIMEOUT_S))]
    assert_mostly_compared(compared, [SMOLLM2_TOKENS] * len(prompts))


def test_smollm2_chat_equals_transformers_chat_template_and_greedy(smollm2: LiveDaemon, references) -> None:
    sdk = openai.OpenAI(api_key="unused", base_url=f"{http_url(smollm2)}/v1", max_retries=0)
    reply = sdk.chat.completions.create(model=smollm2_gguf().stem, messages=CHAT, max_tokens=CHAT_TOKENS, temperature=0)
    answer = reply.choices[0].message.content
    assert "Paris" in answer
    want, gaps, texts, eos = references["chat"].get(REFERENCE_TIMEOUT_S)
    end = want.index(eos) + 1 if eos in want else len(want)
    near_ties = [i for i in range(end) if gaps[i] < NEAR_TIE]
    if near_ties:  # equal up to the first near-tie; past it either continuation is right
        assert answer.startswith(texts[near_ties[0]])
    else:
        assert answer == texts[end]
        assert reply.choices[0].finish_reason == ("stop" if eos in want else "length")


def test_the_default_model_is_smollm2() -> None:
    default = smollm2_gguf()  # skips, naming the package, where it is not installed
    assert resolve_model(None) == resolve_model(default)
