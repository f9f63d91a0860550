"""Real checkpoints served from their GGUF files, one daemon per model: greedy output equals
transformers' float32 decoding of the same file (its own GGUF loader), several prompts at once
and past Gemma 3's sliding window; chat through the OpenAI API equals apply_chat_template and
greedy decoding; the default model knows where Paris is.

A divergence passes only where the reference's top-2 logit gap at that token is below NEAR_TIE
(rounding may then pick either); the continuations after it are not compared.
"""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from live_daemon import REAL_BACKEND, LiveDaemon, serving
from real_models import gemma3_gguf, share_gguf_readers, smollm2_gguf
from tokenizers import Tokenizer

from pipeline.client import AsyncClient, Client
from pipeline.models.checkpoints import resolve_model
from pipeline.models.tiny_model import corpus

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not REAL_BACKEND, reason="serves real checkpoints with `pipeline start`")]

NEAR_TIE = 1e-3
GEMMA_WINDOW = 512
ENGINE = ["--max-model-len", "4096", "--num-kv-blocks", "400", "--max-num-seqs", "8", "--port", "0"]


@functools.cache
def reference_model(gguf: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    share_gguf_readers()
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()


def reference_greedy(gguf: Path, prompts: list[list[int]], num_new: int) -> list[tuple[list[int], list[float]]]:
    """transformers' tokens for each prompt, argmax each step, and the top-2 logit gap at each."""
    model = reference_model(gguf)
    results = []
    with torch.no_grad():
        for prompt in prompts:
            out = model(torch.tensor([prompt]), use_cache=True)
            tokens, gaps = [], []
            for _ in range(num_new):
                top = out.logits[0, -1].float().topk(2)
                tokens.append(int(top.indices[0]))
                gaps.append(float(top.values[0] - top.values[1]))
                out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            results.append((tokens, gaps))
    return results


def assert_same_greedy(got: list[int], want: list[int], gaps: list[float], label: str) -> int:
    """How many leading tokens were compared equal (all, or up to a near-tie)."""
    assert len(got) == len(want), f"{label}: {len(got)} tokens, the reference has {len(want)}"
    for i, (ours, theirs) in enumerate(zip(got, want)):
        if ours != theirs:
            assert gaps[i] < NEAR_TIE, (f"{label}: token {i} is {ours}, the reference's {theirs}, "
                                        f"where its top-2 gap is {gaps[i]:.3g}")
            return i
    return len(got)


def assert_mostly_compared(num_equal: list[int], num_tokens: int) -> None:
    """Near-ties must not leave the comparison empty: most tokens are compared."""
    assert sum(num_equal) >= 0.75 * num_tokens * len(num_equal), f"only {num_equal} of {num_tokens} each compared"


def served_tokenizer(gguf: Path) -> Tokenizer:
    return Tokenizer.from_file(str(Path(resolve_model(gguf)) / "tokenizer.json"))


def text_of_tokens(tokenizer: Tokenizer, num_tokens: int) -> str:
    """Plain English-like text of at least `num_tokens` tokens."""
    lines, text = corpus(seed=7), ""
    for line in lines:
        text += line + " "
        if len(tokenizer.encode(text, add_special_tokens=False).ids) >= num_tokens:
            return text
    raise AssertionError("the corpus is too short")


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
def smollm2() -> Iterator[LiveDaemon]:
    with serving(smollm2_gguf(), ENGINE) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def gemma3() -> Iterator[LiveDaemon]:
    with serving(gemma3_gguf(), ENGINE) as daemon:
        yield daemon


def test_smollm2_greedy_equals_transformers_with_prompts_at_once(smollm2: LiveDaemon) -> None:
    tokenizer = served_tokenizer(smollm2_gguf())
    texts = ["The history of the printing press", "def fibonacci(n):", "Bonjour, je m'appelle",
             text_of_tokens(tokenizer, 300)]
    prompts = [tokenizer.encode(text).ids for text in texts]
    got = asyncio.run(generate_all(smollm2.socket_path, prompts, [24] * len(prompts)))
    assert_mostly_compared([assert_same_greedy(ours, want, gaps, f"SmolLM2 on {text[:30]!r}") for text, ours, (want, gaps)
                            in zip(texts, got, reference_greedy(smollm2_gguf(), prompts, 24))], 24)


def test_smollm2_chat_equals_transformers_chat_template_and_greedy(smollm2: LiveDaemon) -> None:
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    sdk = openai.OpenAI(api_key="unused", base_url=f"{http_url(smollm2)}/v1", max_retries=0)
    reply = sdk.chat.completions.create(model=gguf.stem, messages=messages, max_tokens=24, temperature=0)
    answer = reply.choices[0].message.content
    assert "Paris" in answer

    share_gguf_readers()
    reference = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    prompt = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = reference.encode(prompt, add_special_tokens=False)
    (want, gaps), = reference_greedy(gguf, [prompt_ids], 24)
    end = want.index(reference.eos_token_id) + 1 if reference.eos_token_id in want else len(want)
    near_ties = [i for i in range(end) if gaps[i] < NEAR_TIE]
    if near_ties:  # equal up to the first near-tie; past it either continuation is right
        assert answer.startswith(reference.decode(want[:near_ties[0]], skip_special_tokens=True))
    else:
        assert answer == reference.decode(want[:end], skip_special_tokens=True)
        assert reply.choices[0].finish_reason == ("stop" if end < len(want) or want[-1] == reference.eos_token_id
                                                  else "length")


def test_the_default_model_is_smollm2() -> None:
    assert resolve_model(None) == resolve_model(smollm2_gguf())


def test_gemma3_greedy_equals_transformers_past_its_window(gemma3: LiveDaemon) -> None:
    """A prompt of about twice the window, 48 tokens after it, beside short prompts decoding at once."""
    tokenizer = served_tokenizer(gemma3_gguf())
    texts = [text_of_tokens(tokenizer, 2 * GEMMA_WINDOW - 24), "The capital of France is",
             "Once upon a time, in a small village,"]
    prompts = [tokenizer.encode(text).ids for text in texts]
    assert prompts[0][0] == tokenizer.token_to_id("<bos>") and len(prompts[0]) > 2 * GEMMA_WINDOW - 24
    num_new = [48, 16, 16]  # the short ones decode beside the long one's prefill and first tokens
    got = asyncio.run(generate_all(gemma3.socket_path, prompts, num_new))
    compared = [assert_same_greedy(ours, want, gaps, f"Gemma 3 on {len(prompt)} tokens")
                for prompt, ours, n in zip(prompts, got, num_new)
                for (want, gaps) in reference_greedy(gemma3_gguf(), [prompt], n)]
    assert sum(compared) >= 0.75 * sum(num_new), f"only {compared} of {num_new} tokens compared"


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
