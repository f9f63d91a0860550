"""Serving benchmark workloads: random or dataset prompts, Poisson arrival times, sampling params."""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline.client import Prompt
from stages.contracts.params import SamplingParams

if TYPE_CHECKING:  # the offline engine loads torch: only mixed_params needs one, given by its caller
    from pipeline.engine.llm import LLM


@dataclass(slots=True)
class BenchRequest:
    prompt: Prompt
    max_tokens: int
    prompt_len: int | None = None  # known for token-id prompts; text prompts learn it from Done


def parse_range(text: str, name: str) -> tuple[int, int]:
    """`"N"` or `"MIN:MAX"` (inclusive) into (min, max); ValueError naming `name` otherwise."""
    parts = text.split(":")
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        low, high = int(parts[0]), int(parts[-1])
    except ValueError:
        raise ValueError(f"{name} must be N or MIN:MAX with integers, got {text!r}") from None
    if low < 1 or high < low:
        raise ValueError(f"{name} must satisfy 1 <= MIN <= MAX, got {text!r}")
    return low, high


def random_requests(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], *,
                    vocab_size: int, min_token_id: int = 0, special_token_ids: Sequence[int] = (),
                    seed: int = 0) -> list[BenchRequest]:
    """Prompts of random token ids in [min_token_id, vocab_size) that are not special, lengths
    uniform in the ranges."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    ordinary = np.setdiff1d(np.arange(min_token_id, vocab_size), np.asarray(special_token_ids, np.int64))
    if not len(ordinary):
        raise ValueError(f"no ordinary token id in [{min_token_id}, {vocab_size}) to draw prompts from")
    rng = np.random.default_rng(seed)
    input_lens = rng.integers(input_len[0], input_len[1] + 1, num_prompts)
    output_lens = rng.integers(output_len[0], output_len[1] + 1, num_prompts)
    return [
        BenchRequest(ordinary[rng.integers(0, len(ordinary), int(n_in))].tolist(), int(n_out), int(n_in))
        for n_in, n_out in zip(input_lens, output_lens)
    ]


# Short common words: each is about one token for the usual tokenizers, space included.
_WORDS = ("time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world", "school",
          "state", "family", "student", "group", "country", "problem", "hand", "part", "place", "case", "week",
          "company", "system", "program", "question", "work", "number", "night", "point", "home", "water", "room")


def random_text_requests(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], *,
                         seed: int = 0) -> list[BenchRequest]:
    """Prompts of random common words (input_len counts words: about one token each), for
    endpoints that take text only (chat)."""
    rng = np.random.default_rng(seed)
    input_lens = rng.integers(input_len[0], input_len[1] + 1, num_prompts)
    output_lens = rng.integers(output_len[0], output_len[1] + 1, num_prompts)
    return [BenchRequest(" ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), int(n_in))), int(n_out))
            for n_in, n_out in zip(input_lens, output_lens)]


def load_dataset(path: Path | str, output_len: tuple[int, int], *, num_prompts: int | None = None,
                 seed: int = 0) -> list[BenchRequest]:
    """JSONL, one object a line: `prompt` (text or token ids), optional `output_len` or
    `max_tokens`; a line without either draws its length from `output_len`."""
    rng = np.random.default_rng(seed)
    requests: list[BenchRequest] = []
    with open(path, encoding="utf-8") as lines:
        for line_no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if num_prompts is not None and len(requests) == num_prompts:
                break
            where = f"{path}:{line_no}"
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(entry, dict):
                raise ValueError(f"{where}: each line must be a JSON object, got {type(entry).__name__}")
            prompt = entry.get("prompt")
            is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
            if not prompt or not (isinstance(prompt, str) or is_ids):
                raise ValueError(f"{where}: prompt must be a non-empty string or list of token ids, got {prompt!r}")
            max_tokens = entry.get("output_len", entry.get("max_tokens"))
            if max_tokens is None:
                max_tokens = int(rng.integers(output_len[0], output_len[1] + 1))
            elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
                raise ValueError(f"{where}: output_len/max_tokens must be a positive integer, got {max_tokens!r}")
            requests.append(BenchRequest(prompt, max_tokens, len(prompt) if is_ids else None))
    if not requests:
        raise ValueError(f"dataset {path} has no requests")
    if num_prompts is not None and len(requests) < num_prompts:
        raise ValueError(f"num_prompts is {num_prompts} but dataset {path} has only {len(requests)} requests")
    return requests


def arrival_offsets_s(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """Send times after the start: a Poisson process of `request_rate` req/s (inf: all at 0)."""
    if not request_rate > 0:  # also refuses NaN
        raise ValueError(f"request_rate must be > 0 req/s (or inf), got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, max(num_requests - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:num_requests]


def bench_params(max_tokens: int, *, temperature: float, top_p: float, top_k: int,
                    ignore_eos: bool) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                          ignore_eos=ignore_eos)


def mixed_params(llm: LLM, prompts: list[str], max_tokens: int) -> list[SamplingParams]:
    """In turn for `prompts`: greedy, seeded sampling, seeded sampling with penalties, and greedy
    stopped by a string from late in the prompt's own greedy text (found with `llm`). Every kind
    of state a request carries from token to token, for tests and benchmarks of stage recovery."""
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    params = []
    for index, prompt in enumerate(prompts):
        kind = index % 4
        if kind == 0:
            params.append(greedy)
        elif kind == 1:
            params.append(SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=40, seed=index,
                                         ignore_eos=True))
        elif kind == 2:
            params.append(SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=index, presence_penalty=0.6,
                                         frequency_penalty=0.4, repetition_penalty=1.2, ignore_eos=True))
        else:
            text = llm.generate(prompt, greedy)[0].text
            params.append(SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                         stop=[text[len(text) * 3 // 4:][:2]]))
    return params
