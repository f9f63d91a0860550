"""Serving benchmark: drives a running engine with a workload and reports latency and throughput.

The engine is this daemon through its Unix socket, or any OpenAI-compatible server (`--base-url`:
ours, vLLM, SGLang) through the same workload. Requests are sent at Poisson arrival times and
streamed; each stream's timing becomes a `RequestRecord`, and the metrics (metrics.py) follow
vLLM's `benchmark_serving`, so figures compare with those it prints. Random prompts are drawn
from the ordinary tokens of the served model's vocabulary, as the target reports it.
`--compare-sync` starts an async and a sync daemon and runs both.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from pipeline.bench.metrics import BenchResult, RequestRecord, compute_metrics
from pipeline.bench.report import format_comparison, format_table, plot_result
from pipeline.bench.workload import (
    BenchRequest,
    arrival_offsets_s,
    bench_params,
    load_dataset,
    parse_range,
    random_requests,
    random_text_requests,
)
from pipeline.bench.targets import ENDPOINTS, HttpTarget, ModelInfo, SocketTarget, Target
from pipeline.errors import PipelineError
from pipeline.paths import default_socket_path
from stages.contracts.params import InvalidParams

PROGRESS_BAR_CHARS = 30
DAEMON_START_TIMEOUT_S = 300.0


class ProgressBar:
    """A one-line `\\r`-updated bar on a text stream (stderr, when it is a terminal)."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self._total = total
        self._stream = stream
        self._done = 0
        self._failed = 0
        self._start_s = time.perf_counter()
        self._draw()

    def advance(self, success: bool) -> None:
        self._done += 1
        self._failed += not success
        self._draw()

    def close(self) -> None:
        self._stream.write("\n")
        self._stream.flush()

    def _draw(self) -> None:
        filled = PROGRESS_BAR_CHARS * self._done // max(self._total, 1)
        bar = "#" * filled + "." * (PROGRESS_BAR_CHARS - filled)
        elapsed_s = time.perf_counter() - self._start_s
        failed = f", {self._failed} failed" if self._failed else ""
        self._stream.write(f"\r[{bar}] {self._done}/{self._total} requests{failed}  {elapsed_s:.1f} s")
        self._stream.flush()


async def run_benchmark(socket_path: Path | str | None, requests: Sequence[BenchRequest], *,
                        request_rate: float = math.inf, max_concurrency: int | None = None,
                        temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, ignore_eos: bool = False,
                        seed: int = 0, progress: TextIO | None = None, target: Target | None = None) -> BenchResult:
    """Sends `requests` at Poisson arrival times (`seed` fixes them), at most `max_concurrency`
    in flight, to `target` (default: the daemon on `socket_path`), and measures each stream and
    what the target's speculative decoding counted meanwhile. Raises DaemonNotRunning (or the
    HTTP target's error) before sending anything if nothing answers; a request the engine
    refuses or fails is recorded, not raised."""
    if not requests:
        raise ValueError("requests must not be empty")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 (or None for no limit), got {max_concurrency}")
    params = [bench_params(r.max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, ignore_eos=ignore_eos)
              for r in requests]  # InvalidParams, naming the field, before any load is sent
    offsets_s = arrival_offsets_s(len(requests), request_rate, seed)
    own_target = target is None
    if target is None:
        target = SocketTarget(socket_path)
    try:
        await target.model_info()
        spec_before = await target.speculative_counts()
    except BaseException:
        if own_target:
            await target.close()
        raise
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency is not None else None
    bar = ProgressBar(len(requests), progress) if progress is not None else None
    run_start_s = time.perf_counter()

    async def issue(index: int) -> RequestRecord:
        await asyncio.sleep(max(0.0, run_start_s + offsets_s[index] - time.perf_counter()))
        if limit is None:
            record = await target.send(requests[index], params[index], run_start_s)
        else:
            async with limit:
                record = await target.send(requests[index], params[index], run_start_s)
        if bar is not None:
            bar.advance(record.success)
        return record

    try:
        records = await asyncio.gather(*(issue(i) for i in range(len(requests))))
        duration_s = time.perf_counter() - run_start_s
        speculative = (await target.speculative_counts()).since(spec_before)
    finally:
        if own_target:
            await target.close()
        if bar is not None:
            bar.close()
    # JSON has no infinity: an unlimited rate is written as the string "inf".
    config = {"num_prompts": len(requests), "request_rate": request_rate if math.isfinite(request_rate) else "inf", "max_concurrency": max_concurrency,
              "temperature": temperature, "top_p": top_p, "top_k": top_k, "ignore_eos": ignore_eos, "seed": seed}
    return BenchResult(compute_metrics(records, duration_s), list(records), config, speculative)


# --- async vs sync scheduling ---


def pipeline_command() -> list[str]:
    """The `pipeline` command installed beside this interpreter, or where the package runs
    uninstalled (from a checkout on PYTHONPATH) this interpreter running its command line."""
    script = Path(sys.executable).parent / "pipeline"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "pipeline.cli"]


def compare_sync(model_dir: Path | str, requests: Sequence[BenchRequest], *, request_rate: float = math.inf,
                 max_concurrency: int | None = None, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 ignore_eos: bool = False, seed: int = 0, progress: TextIO | None = None,
                 command: Sequence[str] | None = None) -> tuple[BenchResult, BenchResult]:
    """The same workload on a daemon with async scheduling, then on one without; (async, sync).

    The daemons run one after the other, so neither competes with the other for the device.
    """
    command = list(command) if command is not None else pipeline_command()
    results: list[BenchResult] = []
    with tempfile.TemporaryDirectory(prefix="pl-bench-") as directory:
        for async_scheduling in (True, False):
            socket_path = Path(directory) / ("async.sock" if async_scheduling else "sync.sock")
            start = [*command, "start", "--socket", str(socket_path), "--model", str(model_dir), "--detach"]
            if not async_scheduling:
                start.append("--no-async-scheduling")
            # stdout stays clean for `--json`: `start --detach` prints the socket path there.
            subprocess.run(start, check=True, timeout=DAEMON_START_TIMEOUT_S, stdout=subprocess.DEVNULL)
            try:
                result = asyncio.run(run_benchmark(
                    socket_path, requests, request_rate=request_rate, max_concurrency=max_concurrency,
                    temperature=temperature, top_p=top_p, top_k=top_k, ignore_eos=ignore_eos, seed=seed,
                    progress=progress))
            finally:
                subprocess.run([*command, "stop", "--socket", str(socket_path)], check=False,
                               timeout=DAEMON_START_TIMEOUT_S, stdout=subprocess.DEVNULL)
            result.config["async_scheduling"] = async_scheduling
            results.append(result)
    return results[0], results[1]


# --- command line ---


def range_arg(name: str) -> Callable[[str], tuple[int, int]]:
    """An argparse type for MIN[:MAX], whose error names the option."""
    def parse(text: str) -> tuple[int, int]:
        try:
            return parse_range(text, name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipeline bench", description=__doc__.splitlines()[0])
    parser.add_argument("--socket", type=Path, default=None, help=f"daemon socket (default {default_socket_path()})")
    parser.add_argument("--base-url", default=None, metavar="http://HOST:PORT",
                        help="drive an OpenAI-compatible HTTP server instead (ours with --port, vLLM, SGLang; default: the socket)")
    parser.add_argument("--endpoint", choices=ENDPOINTS, default="completions",
                        help="with --base-url: /v1/completions (token-id prompts) or /v1/chat/completions "
                             "(random prompts are then words, about one token each; default completions)")
    parser.add_argument("--model-name", default=None, help="with --base-url: the served model (default: the first)")
    parser.add_argument("--api-key", default=os.environ.get("PIPELINE_API_KEY"),
                        help="with --base-url: sent as `Authorization: Bearer KEY` (default $PIPELINE_API_KEY)")
    parser.add_argument("--num-prompts", type=int, default=None, help="requests to send (default 100; "
                        "with --dataset, its whole length)")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals in req/s; inf sends all at once (default inf)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once (default: no limit)")
    parser.add_argument("--input-len", type=range_arg("--input-len"), default=(128, 128), metavar="MIN[:MAX]",
                        help="prompt length in tokens, uniform in the range (default 128)")
    parser.add_argument("--output-len", type=range_arg("--output-len"), default=(64, 64), metavar="MIN[:MAX]",
                        help="max_tokens, uniform in the range (default 64)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="random prompt token ids are below this (default: the vocabulary the target reports)")
    parser.add_argument("--min-token-id", type=int, default=0,
                        help="and at least this; special tokens the target reports are skipped too (default 0)")
    parser.add_argument("--dataset", type=Path, default=None, metavar="FILE.jsonl",
                        help="prompts from JSONL: {prompt: text|ids, output_len|max_tokens?} per line (default: random prompts)")
    parser.add_argument("--ignore-eos", action="store_true", help="generate max_tokens even past EOS")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrival times (default 0)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1.0: off)")
    parser.add_argument("--top-k", type=int, default=0, help="top-k sampling (default 0: off)")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                        help="write every figure and per-request record as JSON to FILE (no FILE or -: stdout, "
                             "and the table goes to stderr; default: no JSON)")
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE.png", help="latency CDFs and tokens/s over time (default: no plot)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--compare-sync", action="store_true",
                        help="start two daemons on --model, with and without async scheduling, and compare")
    parser.add_argument("--model", type=Path, default=None, help="model directory for --compare-sync (default: none; it needs one)")
    return parser


def make_requests(args: argparse.Namespace, info: ModelInfo) -> list[BenchRequest]:
    """The workload the options ask for, for the model the target serves."""
    if args.dataset is not None:
        return load_dataset(args.dataset, args.output_len, num_prompts=args.num_prompts, seed=args.seed)
    num_prompts = args.num_prompts if args.num_prompts is not None else 100
    if args.base_url is not None and args.endpoint == "chat":
        return random_text_requests(num_prompts, args.input_len, args.output_len, seed=args.seed)
    vocab_size = args.vocab_size or info.vocab_size
    if vocab_size is None:
        raise ValueError("the target does not report its vocabulary size: pass --vocab-size")
    return random_requests(num_prompts, args.input_len, args.output_len, vocab_size=vocab_size,
                           min_token_id=args.min_token_id, special_token_ids=info.special_token_ids, seed=args.seed)


def checkpoint_info(model_dir: Path) -> ModelInfo:
    """What a daemon on `model_dir` will report: its vocabulary and special tokens."""
    from tokenizers import Tokenizer

    config = json.loads((model_dir / "config.json").read_text())
    added = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_added_tokens_decoder()
    return ModelInfo(model_dir.name, config.get("vocab_size"), None,
                     sorted(token_id for token_id, token in added.items() if token.special))


async def _bench(args: argparse.Namespace, options: dict[str, Any]) -> BenchResult:
    target: Target
    if args.base_url is not None:
        target = HttpTarget(args.base_url, args.endpoint, model=args.model_name, api_key=args.api_key)
    else:
        target = SocketTarget(args.socket)
    try:
        requests = make_requests(args, await target.model_info())
        return await run_benchmark(None, requests, target=target, **options)
    finally:
        await target.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.compare_sync and args.model is None:
            raise ValueError("--compare-sync needs --model DIR")
        options = dict(request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                       temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, ignore_eos=args.ignore_eos,
                       seed=args.seed, progress=None if args.quiet or not sys.stderr.isatty() else sys.stderr)
        if args.compare_sync:
            # SIGTERM unwinds like Ctrl-C, so the daemons compare_sync starts are stopped on the way out.
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
            requests = make_requests(args, checkpoint_info(args.model))
            async_result, sync_result = compare_sync(args.model, requests, **options)
            table = format_comparison(async_result, sync_result)
            report: dict[str, Any] = {"async": async_result.to_json(), "sync": sync_result.to_json()}
            plotted = async_result
        else:
            result = asyncio.run(_bench(args, options))
            table = format_table(result)
            report = result.to_json()
            plotted = result
        if args.plot is not None:
            plot_result(plotted, args.plot)
    except (ValueError, InvalidParams, PipelineError, RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    to_stdout = args.json == "-"
    print(table, file=sys.stderr if to_stdout else sys.stdout)
    if to_stdout:
        print(json.dumps(report))
    elif args.json is not None:
        Path(args.json).write_text(json.dumps(report, indent=1) + os.linesep, encoding="utf-8")
    return 0
