"""One stream at a time through an OpenAI-compatible HTTP server: pipeline's (`pipeline start`) or
llama.cpp's (llama-cpp-python's `llama_cpp.server`), driven by the same streaming client.

Each request is a /v1/completions stream of a ~128-token text prompt, greedy. TTFT is the time to
the first streamed token, TPOT (last token's time - first token's) / (tokens - 1); the server's
memory is read after two requests: the largest resident set in its process tree (pipeline's
runner; llama.cpp's one process) and the tree's PSS. Each round's prompt starts with its own number, so no
round reuses a prefix another round left in either engine's cache. The servers' rounds are
interleaved, all of them up at once (a machine's speed drifts by tens of percent over minutes);
each one's memory is read with it alone. The CPU time each process of a tree spent over its
measured rounds, per streamed token, shows where a served token's time goes.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from servers import cpu_load, free_port, start_server, stop_server, tree_cpu_s, tree_memory_mib

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


@dataclass
class Server:
    """One engine and setting of the table: its row's labels, how it starts, how it is told to
    ignore the end-of-text token, and what was measured."""

    label: str  # its log's and socket's name
    row: dict
    command: list[str]
    port: int
    stop_at_eos: dict
    memory: dict = field(default_factory=dict)
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    tpot_busy: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)

    def result(self) -> dict:
        return {**self.row, "tpot_ms_p50": round(statistics.median(self.tpot), 2),
                "ttft_ms_p50": round(statistics.median(self.ttft), 1), "tokens_min": min(self.tokens), **self.memory,
                "tpot_busy_ms_p50": round(statistics.median(self.tpot_busy), 2) if self.tpot_busy else None,
                "cpu_ms_per_token": {name: round(1e3 * seconds / sum(self.tokens), 2)
                                     for name, seconds in sorted(self.cpu_s.items())}}


def measure(servers: list[Server], prompt: str, max_tokens: int, rounds: int, run_dir: Path,
            busy_per_core: int = 0) -> None:
    """Memory: each server alone (started, one warm-up request and one round, its tree read,
    stopped), so that no other server shares the file's pages with it. Time: every server up at
    once, each warmed up, then `rounds` rounds that take each server in turn, so that a machine
    whose speed drifts meanwhile weighs them alike; each server's CPU time over its own requests.
    With `busy_per_core`, as many rounds again beside that many busy processes per core (TPOT only)."""
    for server in servers:
        process = start_server(server.label, server.command, dict(os.environ), server.port, run_dir)
        try:
            stream_once(server.port, prompt, max_tokens, server.stop_at_eos)
            stream_once(server.port, f"0. {prompt}", max_tokens, server.stop_at_eos)
            server.memory = tree_memory_mib(process.pid)
        finally:
            stop_server(process)
    processes = []
    try:
        for server in servers:
            processes.append(start_server(server.label, server.command, dict(os.environ), server.port, run_dir))
            stream_once(server.port, prompt, max_tokens, server.stop_at_eos)
        for index in range(rounds):
            for server, process in zip(servers, processes):
                before = tree_cpu_s(process.pid)
                first, per_token, count = stream_once(server.port, f"{index + 1}. {prompt}", max_tokens,
                                                      server.stop_at_eos)
                after = tree_cpu_s(process.pid)
                server.ttft.append(first)
                server.tpot.append(per_token)
                server.tokens.append(count)
                for name, seconds in after.items():
                    server.cpu_s[name] = server.cpu_s.get(name, 0.0) + seconds - before.get(name, 0.0)
        with cpu_load(busy_per_core):
            for index in range(rounds if busy_per_core else 0):
                for server in servers:
                    server.tpot_busy.append(stream_once(server.port, f"{index + 101}. {prompt}", max_tokens,
                                                        server.stop_at_eos)[1])
    finally:
        for process in processes:
            stop_server(process)


def pipeline_server(model: Path, quantization: str, dtype: str | None, port: int, run_dir: Path,
                    context_tokens: int = CONTEXT_TOKENS, kv_cache_dtype: str = "auto",
                    activations: str = "float32", backend: str = "stages") -> list[str]:
    command = [sys.executable, "-m", "pipeline.cli", "start", "--model", str(model), "--device", "cpu",
               "--quantization", quantization, "--port", str(port), "--socket", str(run_dir / "pipeline.sock"),
               "--served-model-name", SERVED_NAME, "--max-model-len", str(context_tokens),
               "--num-kv-blocks", str(context_tokens // BLOCK_TOKENS), "--block-size", str(BLOCK_TOKENS)]
    return command + ([] if dtype is None else ["--dtype", dtype]) + ["--kv-cache-dtype", kv_cache_dtype,
                                                                       "--quantized-activations", activations] \
        + (["--in-process"] if backend == "in-process" else []) \
        + (["--cpu-placement", "split"] if backend == "split" else [])


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


def serve_both(model: Path, settings: list[tuple[str, str | None, str, str, str]], llamacpp_python: Path | None, prompt: str,
               max_tokens: int, rounds: int, run_dir: Path, context_tokens: int = CONTEXT_TOKENS,
               busy_per_core: int = 0) -> list[dict]:
    """One row per pipeline setting (quantization, dtype, KV cache dtype, quantized activations, backend), then llama.cpp's (see
    `measure`), each with room for `context_tokens` (llama.cpp's --n_ctx; pipeline's KV pool and
    longest request)."""
    servers = []
    for quantization, dtype, kv_cache_dtype, activations, backend in settings:
        label = f"pipeline-{quantization}-{dtype or 'auto'}-kv-{kv_cache_dtype}-{activations}-{backend}"
        port = free_port()
        shown = ((dtype or "auto") + ("" if kv_cache_dtype == "auto" else f", KV {kv_cache_dtype}")
                 + ("" if activations == "float32" else f", {activations} activations")
                 + ("" if backend == "stages" else f", {backend}"))
        servers.append(Server(label, {"file": model.name, "engine": "pipeline http", "quantization": quantization,
                                      "dtype": shown},
                              pipeline_server(model, quantization, dtype, port, run_dir / label, context_tokens,
                                              kv_cache_dtype, activations, backend), port,
                              {"ignore_eos": True}))
        (run_dir / label).mkdir(mode=0o700, exist_ok=True)
    if llamacpp_python is not None:
        port = free_port()
        servers.append(Server("llamacpp", {"file": model.name, "engine": f"llama.cpp {llamacpp_version(llamacpp_python)}",
                                           "quantization": "file", "dtype": "-"},
                              llamacpp_server(llamacpp_python, model, port, context_tokens), port,
                              {"logit_bias": {str(eos_token_id(model)): -100.0}}))
    measure(servers, prompt, max_tokens, rounds, run_dir, busy_per_core)
    return [server.result() for server in servers]
