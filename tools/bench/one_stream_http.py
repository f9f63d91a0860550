"""One stream at a time through an OpenAI-compatible HTTP server: pipeline's (`pipeline start`) or
llama.cpp's (llama-cpp-python's `llama_cpp.server`), driven by the same streaming client.

Each request is a /v1/completions stream of a ~128-token text prompt, greedy. TTFT is the time to
the first streamed token, TPOT (last token's time - first token's) / (tokens - 1); the server's
memory is read at the end: the largest resident set in its process tree (pipeline's runner;
llama.cpp's one process) and the tree's PSS. Each round's prompt starts with its own number, so no
round reuses a prefix another round left in either engine's cache. The CPU time each process of the
tree spent over the measured rounds, per streamed token, shows where a served token's time goes.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from servers import free_port, start_server, stop_server, tree_cpu_s, tree_memory_mib

SERVED_NAME = "one-stream"
CONTEXT_TOKENS = 2048  # default of llama.cpp's --n_ctx, and pipeline's KV pool and longest request alike
BLOCK_TOKENS = 16


def stream_once(port: int, prompt: str, max_tokens: int, stop_at_eos: dict) -> tuple[float, float, int]:
    """(TTFT ms, TPOT ms, tokens) of one streamed completion; `stop_at_eos` is the body's part that
    keeps the end-of-text token from ending it (each engine has its own way)."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            **stop_at_eos}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    times: list[float] = []
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            choices = json.loads(line[5:]).get("choices") or []
            if choices and choices[0].get("text"):
                times.append(time.perf_counter())
    if len(times) < 2:
        raise RuntimeError(f"the server on port {port} streamed {len(times)} tokens; at least 2 are needed")
    return (times[0] - start) * 1e3, (times[-1] - times[0]) / (len(times) - 1) * 1e3, len(times)


def measure_server(engine: str, command: list[str], port: int, prompt: str, max_tokens: int, rounds: int,
                   stop_at_eos: dict, run_dir: Path) -> dict:
    """Start the server, one warm-up request, `rounds` measured ones, its memory; then stop it."""
    process = start_server(engine, command, dict(os.environ), port, run_dir)
    try:
        stream_once(port, prompt, max_tokens, stop_at_eos)
        ttft, tpot, tokens = [], [], []
        cpu_before = tree_cpu_s(process.pid)
        for index in range(rounds):
            first, per_token, count = stream_once(port, f"{index + 1}. {prompt}", max_tokens, stop_at_eos)
            ttft.append(first)
            tpot.append(per_token)
            tokens.append(count)
        cpu_after = tree_cpu_s(process.pid)
        memory = tree_memory_mib(process.pid)
    finally:
        stop_server(process)
    return {"tpot_ms_p50": round(statistics.median(tpot), 2), "ttft_ms_p50": round(statistics.median(ttft), 1),
            "tokens_min": min(tokens), **memory,
            "cpu_ms_per_token": {name: round(1e3 * (cpu_after[name] - cpu_before.get(name, 0.0)) / sum(tokens), 2)
                                 for name in sorted(cpu_after)}}


def pipeline_server(model: Path, quantization: str, dtype: str | None, port: int, run_dir: Path,
                    context_tokens: int = CONTEXT_TOKENS) -> list[str]:
    command = [sys.executable, "-m", "pipeline.cli", "start", "--model", str(model), "--device", "cpu",
               "--quantization", quantization, "--port", str(port), "--socket", str(run_dir / "pipeline.sock"),
               "--served-model-name", SERVED_NAME, "--max-model-len", str(context_tokens),
               "--num-kv-blocks", str(context_tokens // BLOCK_TOKENS), "--block-size", str(BLOCK_TOKENS)]
    return command + ([] if dtype is None else ["--dtype", dtype])


def llamacpp_server(python: Path, model: Path, port: int, context_tokens: int = CONTEXT_TOKENS) -> list[str]:
    return [str(python), "-m", "llama_cpp.server", "--model", str(model), "--n_threads", "2",
            "--n_ctx", str(context_tokens), "--port", str(port), "--host", "127.0.0.1", "--model_alias", SERVED_NAME]


def llamacpp_version(python: Path) -> str:
    done = subprocess.run([str(python), "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True,
                          text=True, timeout=120)
    return done.stdout.strip() or "unknown"


def eos_token_id(model: Path) -> int:
    """The file's end-of-text token id, from the config this engine derives from its metadata."""
    from pipeline.models.checkpoints import resolve_model

    config = json.loads((Path(resolve_model(model)) / "config.json").read_text())
    eos = config.get("eos_token_id")
    return int(eos[0] if isinstance(eos, list) else eos)


def serve_both(model: Path, settings: list[tuple[str, str | None]], llamacpp_python: Path | None, prompt: str,
               max_tokens: int, rounds: int, run_dir: Path, context_tokens: int = CONTEXT_TOKENS) -> list[dict]:
    """One row per pipeline setting (quantization, dtype), then llama.cpp's, one server at a time, each
    with room for `context_tokens` (llama.cpp's --n_ctx; pipeline's KV pool and longest request)."""
    rows = []
    for quantization, dtype in settings:
        port = free_port()
        command = pipeline_server(model, quantization, dtype, port, run_dir, context_tokens)
        row = measure_server("pipeline", command, port, prompt, max_tokens, rounds, {"ignore_eos": True}, run_dir)
        rows.append({"file": model.name, "engine": "pipeline http", "quantization": quantization,
                     "dtype": dtype or "auto", **row})
    if llamacpp_python is not None:
        port = free_port()
        no_eos = {"logit_bias": {str(eos_token_id(model)): -100.0}}
        row = measure_server("llamacpp", llamacpp_server(llamacpp_python, model, port, context_tokens), port, prompt, max_tokens,
                             rounds, no_eos, run_dir)
        rows.append({"file": model.name, "engine": f"llama.cpp {llamacpp_version(llamacpp_python)}",
                     "quantization": "file", "dtype": "-", **row})
    return rows
