"""One stream at a time on the CPU: TPOT, TTFT and the runner's resident memory of a GGUF file served with
each --quantization (none: dequantized at load; gguf: its blocks multiplied in place).

Each mode runs in a fresh process holding the offline engine (the runner in that process, so its
resident memory is the process's): load, one warm-up request, then `--rounds` greedy requests of a
~`--prompt-tokens`-token prompt and `--max-tokens` outputs (EOS ignored). TTFT is a one-token
request's time; TPOT is (time of the whole request - TTFT) / (outputs - 1); the medians are printed.
With `--batch N`, the same process then times N such requests at once (fresh prompts): output
tokens per second of the whole batch, the figure the fused kernel must not lose at many streams.
Memory: VmRSS after loading and at the end, and VmHWM (the peak). The machine's load average is
printed with the table: on a shared machine only ratios from one run count.

    python tools/bench/bench_one_stream.py [--model FILE.gguf] [--quantization none gguf] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TEXT = ("The history of the printing press begins in the fifteenth century, when movable type changed how "
        "books were made, sold and read across Europe. ")


def _memory_mib() -> dict[str, float]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields


def child(args: argparse.Namespace) -> dict:
    """Measure one mode in this process."""
    from pipeline import LLM, SamplingParams
    from pipeline.models.checkpoints import resolve_model

    start = time.perf_counter()
    # KV for every request of the batch at once (16-token blocks), and some to spare.
    blocks = max(1, args.batch) * ((args.prompt_tokens + args.max_tokens) // 16 + 2) + 16
    llm = LLM(resolve_model(args.model), device="cpu", quantization=args.child, dtype=args.dtype,
              num_kv_blocks=blocks, max_model_len=1024)
    load_s = time.perf_counter() - start
    loaded = _memory_mib()
    ids = llm.runner.tokenizer_path
    from tokenizers import Tokenizer
    prompt = Tokenizer.from_file(str(ids)).encode(TEXT * 8).ids[:args.prompt_tokens]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    full = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate([prompt], full)  # warm-up
    ttft, tpot = [], []
    for round_index in range(args.rounds):
        # A fresh prompt each round (its last token changes), so no round reads another's prefix cache.
        fresh = prompt[:-1] + [prompt[-1] + round_index + 1]
        t0 = time.perf_counter()
        llm.generate([fresh], one)
        first = time.perf_counter() - t0
        fresh = prompt[:-2] + [prompt[-2] + round_index + 1, prompt[-1]]
        t0 = time.perf_counter()
        output = llm.generate([fresh], full)[0]
        whole = time.perf_counter() - t0
        ttft.append(first * 1e3)
        tpot.append((whole - first) / (len(output.token_ids) - 1) * 1e3)
    batch_tok_s = None
    if args.batch:
        prompts = [prompt[:-1] + [prompt[-1] + 100 + i] for i in range(args.batch)]
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, full)
        batch_tok_s = round(sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - t0), 1)
    end = _memory_mib()
    return {"quantization": args.child, "dtype": args.dtype, "load_s": round(load_s, 2),
            "batch": args.batch, "batch_tokens_per_s": batch_tok_s,
            "ttft_ms_p50": round(statistics.median(ttft), 1), "tpot_ms_p50": round(statistics.median(tpot), 2),
            "tokens_per_s": round(1e3 / statistics.median(tpot), 1), "rss_loaded_mib": round(loaded["VmRSS"]),
            "rss_end_mib": round(end["VmRSS"]), "rss_peak_mib": round(end["VmHWM"]),
            "prompt_tokens": len(prompt), "output_tokens": args.max_tokens, "rounds": args.rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model's)")
    parser.add_argument("--quantization", nargs="+", default=["none", "gguf"], choices=["none", "gguf"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=0, help="also time this many requests at once (0: not)")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args)))
        return
    rows = []
    for mode in args.quantization:
        command = [sys.executable, __file__, "--child", mode, "--dtype", args.dtype, "--rounds", str(args.rounds),
                   "--batch", str(args.batch), "--prompt-tokens", str(args.prompt_tokens),
                   "--max-tokens", str(args.max_tokens)]
        if args.model is not None:
            command += ["--model", args.model]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    result = {"load_average": os.getloadavg(), "cpus": os.cpu_count(), "rows": rows}
    if args.json:
        print(json.dumps(result))
        return
    print(f"load average {' '.join(f'{x:.2f}' for x in result['load_average'])}, {result['cpus']} CPUs")
    print(f"{'quantization':<13}{'dtype':<10}{'TPOT p50':>10}{'tok/s':>8}{'TTFT p50':>10}{'RSS loaded':>12}"
          f"{'RSS end':>10}{'RSS peak':>10}" + (f"{'batch tok/s':>14}" if args.batch else ""))
    for row in rows:
        batch = f"{row['batch_tokens_per_s']:>9} ({args.batch})" if args.batch else ""
        print(f"{row['quantization']:<13}{row['dtype']:<10}{row['tpot_ms_p50']:>8.2f}ms{row['tokens_per_s']:>8.1f}"
              f"{row['ttft_ms_p50']:>8.1f}ms{row['rss_loaded_mib']:>8} MiB{row['rss_end_mib']:>6} MiB"
              f"{row['rss_peak_mib']:>6} MiB{batch}")


if __name__ == "__main__":
    main()
