"""Benchmark: a grammar library's compile time and per-token mask time, on the tiny vocabularies and a 128k one.

Measures whichever of llguidance and xgrammar is importable (both when both are), on the byte-level
BPE tokenizers of the tiny checkpoints (1024 and 2048 entries) and on a 128k-entry byte-level BPE
vocabulary built with the tokenizers library (merges of random pairs: the size and shape of a
Llama-3 vocabulary, not its entries). Per library and vocabulary:

  tokenizer_ms   building the library's view of the vocabulary (once per model)
  compile_ms     compiling each grammar kind (json_schema with nested objects, arrays and enums;
                 json_object; regex; choice; lark), median over fresh compiles
  mask_us        per token: filling the next-token bitmask and then accepting the token, along a
                 valid output of each grammar (median and p99 over every token of every kind)

    python tools/micro/bench_grammar.py [--json] [--quick] [--library llguidance|xgrammar]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import time
from collections.abc import Callable

import numpy as np

from pipeline.models.tiny_model import PRESETS, train_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
SCHEMA_TEXT = ('{"name": "river stream", "age": 42, "role": "user", "tags": ["fast", "token"], '
               '"address": {"city": "the city", "zip": "12345"}}')
OBJECT_TEXT = '{"model": "token", "batch": [1, 2, 3], "cache": {"hit": true, "rate": 0.5}}'
REGEX = r"[a-z]{3,8}-[0-9]{2,4}\.(com|org)"
REGEX_TEXT = "stream-2048.org"
CHOICES = ["positive", "negative", "neutral"]
LARK = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[0-9]+/\n'
LARK_TEXT = "(12+3)-(4-56)+7"
LARGE_VOCAB = 128_256


def grammars() -> dict[str, tuple[str, str, str]]:
    """kind -> (library-neutral kind, spec text, a valid output)."""
    return {
        "json_schema": ("json_schema", json.dumps(SCHEMA), SCHEMA_TEXT),
        "json_object": ("json_schema", json.dumps({"type": "object"}), OBJECT_TEXT),
        "regex": ("regex", REGEX, REGEX_TEXT),
        "choice": ("choice", json.dumps(CHOICES), "negative"),
        "lark": ("lark", LARK, LARK_TEXT),
    }


def large_bpe_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE tokenizer with `vocab_size` entries: the 256 byte symbols, BOS and EOS,
    then merges of random pairs of shorter entries (each merge's parts exist, so it is valid BPE)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<s>": 0, "</s>": 1}
    for symbol in alphabet:
        vocab[symbol] = len(vocab)
    rng = random.Random(seed)
    short = [s for s in alphabet if s.isalnum()] + ["Ġ", ",", ".", '"', ":", "{", "}"]
    entries, merges = list(short), []
    while len(vocab) < vocab_size:
        a, b = rng.choice(entries), rng.choice(entries)
        merged = a + b
        if merged in vocab or len(merged) > 12:
            continue
        vocab[merged] = len(vocab)
        merges.append((a, b))
        entries.append(merged)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance

        self.lib = llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=1)
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec: str):
        """A matcher in its start state: what a cache keeps, deep-copied for each request."""
        grammar = self.lib.grammar_from(kind, spec)
        error = self.lib.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error)
        return self.lib.LLMatcher(self.tokenizer, grammar, log_level=0)

    def matcher(self, compiled) -> Callable[[np.ndarray, int | None], None]:
        from llguidance.numpy import fill_next_token_bitmask

        matcher = compiled.deep_copy()

        def step(bitmask: np.ndarray, token: int | None) -> None:
            fill_next_token_bitmask(matcher, bitmask, 0)
            if token is not None and not matcher.consume_token(token):
                raise RuntimeError(f"llguidance refused token {token}: {matcher.get_error()}")

        return step

    def bitmask(self) -> np.ndarray:
        return np.full((1, (self.vocab_size + 31) // 32), -1, np.int32)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.lib = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=[1])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec: str):
        if kind == "json_schema":
            return self.compiler.compile_json_schema(spec)
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        if kind == "choice":
            ebnf = "root ::= " + " | ".join(json.dumps(c) for c in json.loads(spec))
            return self.compiler.compile_grammar(ebnf)
        ebnf = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"\n'
        return self.compiler.compile_grammar(ebnf)

    def matcher(self, compiled) -> Callable[[np.ndarray, int | None], None]:
        matcher = self.lib.GrammarMatcher(compiled)
        mask = self.lib.allocate_token_bitmask(1, self.vocab_size)

        def step(bitmask: np.ndarray, token: int | None) -> None:
            matcher.fill_next_token_bitmask(mask, 0)
            bitmask[:] = mask.numpy()
            if token is not None and not matcher.accept_token(token):
                raise RuntimeError(f"xgrammar refused token {token}")

        return step

    def bitmask(self) -> np.ndarray:
        return np.full((1, (self.vocab_size + 31) // 32), -1, np.int32)


LIBRARIES = {"llguidance": Llguidance, "xgrammar": Xgrammar}


def measure(library: type, tokenizer, vocab_size: int, repeats: int) -> dict:
    start = time.perf_counter()
    lib = library(tokenizer, vocab_size)
    tokenizer_ms = (time.perf_counter() - start) * 1e3
    compile_ms, mask_us = {}, []
    for name, (kind, spec, text) in grammars().items():
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            compiled = lib.compile(kind, spec)
            times.append((time.perf_counter() - start) * 1e3)
        compile_ms[name] = round(statistics.median(times), 3)
        token_ids = tokenizer.encode(text, add_special_tokens=False).ids
        bitmask = lib.bitmask()
        for _ in range(repeats):
            step = lib.matcher(compiled)
            for token in token_ids + [None]:
                start = time.perf_counter_ns()
                step(bitmask, token)
                mask_us.append((time.perf_counter_ns() - start) / 1e3)
    mask = np.array(mask_us)
    return {"tokenizer_ms": round(tokenizer_ms, 1), "compile_ms": compile_ms,
            "mask_us_p50": round(float(np.percentile(mask, 50)), 1),
            "mask_us_p99": round(float(np.percentile(mask, 99)), 1), "num_tokens": len(mask_us)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    parser.add_argument("--quick", action="store_true", help="the tiny vocabulary only, one repeat")
    parser.add_argument("--library", choices=sorted(LIBRARIES), action="append",
                        help="measure this library (repeatable; default: every importable one)")
    args = parser.parse_args(argv)
    names = args.library or [n for n in LIBRARIES if importlib.util.find_spec(n) is not None]
    if not names:
        parser.error("neither llguidance nor xgrammar is importable")
    vocabs = {"tiny_1024": lambda: (train_tokenizer(PRESETS["tiny"]["vocab_size"]), PRESETS["tiny"]["vocab_size"])}
    if not args.quick:
        vocabs["20m_2048"] = lambda: (train_tokenizer(PRESETS["20m"]["vocab_size"]), PRESETS["20m"]["vocab_size"])
        vocabs["bpe_128k"] = lambda: (large_bpe_tokenizer(LARGE_VOCAB), LARGE_VOCAB)
    repeats = 1 if args.quick else 5
    results: dict[str, dict] = {}
    for vocab_name, make in vocabs.items():
        tokenizer, vocab_size = make()
        for name in names:
            results.setdefault(name, {})[vocab_name] = measure(LIBRARIES[name], tokenizer, vocab_size, repeats)
    if args.json:
        print(json.dumps(results))
        return 0
    kinds = list(grammars())
    print(f"{'library':<11} {'vocabulary':<10} {'tokenizer ms':>12} " + " ".join(f"{k + ' ms':>15}" for k in kinds)
          + f" {'mask us p50':>11} {'p99':>7}")
    for name, per_vocab in results.items():
        for vocab_name, r in per_vocab.items():
            print(f"{name:<11} {vocab_name:<10} {r['tokenizer_ms']:>12} "
                  + " ".join(f"{r['compile_ms'][k]:>15}" for k in kinds)
                  + f" {r['mask_us_p50']:>11} {r['mask_us_p99']:>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
