"""Reference comparison: the same checkpoint and workload through transformers `generate` and the daemon.

The workload is random token-id prompts and output lengths, uniform in the given ranges, with
EOS ignored, so every request produces exactly its output length on both paths. transformers
runs it the usual baseline way: static batches of `--batch-size` requests in order, left-padded
to the batch's longest prompt, each batch generating up to its longest output length; only the
tokens each request asked for count as output. The daemon (real stage processes, started on
the same checkpoint) gets every request at once and holds at most as many sequences at a time
as a transformers batch (`--max-num-seqs`, default `--batch-size`). Both use float32 on CPU
with the same number of torch threads, greedy decoding, one after the other in one run.

Greedy outputs are compared token for token and the matches reported, not asserted: left
padding changes the batched arithmetic a little in transformers, so a padded prompt may diverge
once two candidates are close; an unpadded one (the longest prompt of its batch) should match.

    python tools/bench/bench_hf.py [--json] [--model DIR] [--num-prompts N] [--batch-size B]
        [--input-len A:B] [--output-len A:B] [--seed S] [--threads T] [--max-num-seqs M] [--quick]

Without --model it builds a random checkpoint with pipeline.models.tiny_model (preset 20m; tiny with --quick).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.bench.daemon import engine_options, start_daemon
from pipeline.bench.serve_bench import range_arg
from pipeline.bench.workload import BenchRequest, random_requests
from pipeline.client import AsyncClient
from pipeline.models.tiny_model import make_tiny_model
from pipeline.options import positive_int
from stages.contracts.params import SamplingParams

BLOCK_SIZE = 16
MIN_TOKEN_ID = 2  # random prompts skip the tiny models' BOS (0) and EOS (1)
DAEMON_STOP_TIMEOUT_S = 60.0
WARMUP_TOKENS = 4
# Sized to take about two minutes on a 2-core CPU with the 20m preset.
DEFAULT_WORKLOAD = dict(num_prompts=96, batch_size=16, input_len=(32, 256), output_len=(32, 256))
QUICK_WORKLOAD = dict(num_prompts=8, batch_size=4, input_len=(8, 32), output_len=(8, 16))


@dataclass(slots=True)
class PathResult:
    """One path's run of the whole workload: each request's output token ids, in order."""

    elapsed_s: float
    token_ids: list[list[int]]
    num_computed_tokens: int  # tokens generated, wasted ones included


@dataclass(slots=True)
class Comparison:
    hf_tok_s: float
    daemon_tok_s: float
    ratio: float  # daemon / transformers
    hf_s: float
    daemon_s: float
    num_output_tokens: int  # the tokens the requests asked for: the useful output of either path
    hf_computed_tokens: int  # what the static batches generated, padding waste included
    num_matched: int  # requests whose greedy outputs agree token for token
    num_unpadded: int  # requests that are the longest prompt of their batch
    num_unpadded_matched: int


def load_hf_model(model_dir: Path) -> Any:
    """The transformers model in float32 on CPU, set to generate past EOS."""
    try:
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise RuntimeError("bench_hf.py needs transformers: pip install -e '.[test]'") from None
    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # Passing eos_token_id=None to generate() would be merged with the checkpoint's own and
    # ignored; clearing it on the model is what makes every row run to max_new_tokens.
    model.generation_config.eos_token_id = None
    return model


def left_padded(prompts: Sequence[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both int64 [len(prompts), longest prompt], padding on the left."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.int64)
        attention_mask[row, width - len(prompt):] = 1
    return input_ids, attention_mask


def run_hf(model: Any, requests: Sequence[BenchRequest], batch_size: int) -> PathResult:
    """Static batches in request order; each runs to its longest output length."""
    pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    with torch.inference_mode():
        warmup_ids, warmup_mask = left_padded([[MIN_TOKEN_ID] * 2, [MIN_TOKEN_ID] * 3], pad_token_id)
        model.generate(warmup_ids, attention_mask=warmup_mask, do_sample=False, max_new_tokens=WARMUP_TOKENS,
                       pad_token_id=pad_token_id)
        outputs: list[list[int]] = []
        num_computed = 0
        start_s = time.perf_counter()
        for first in range(0, len(requests), batch_size):
            batch = requests[first:first + batch_size]
            input_ids, attention_mask = left_padded([r.prompt for r in batch], pad_token_id)
            max_new_tokens = max(r.max_tokens for r in batch)
            generated = model.generate(input_ids, attention_mask=attention_mask, do_sample=False,
                                       max_new_tokens=max_new_tokens, pad_token_id=pad_token_id)
            new_tokens = generated[:, input_ids.shape[1]:]
            num_computed += new_tokens.numel()
            outputs += [new_tokens[row, :r.max_tokens].tolist() for row, r in enumerate(batch)]
        elapsed_s = time.perf_counter() - start_s
    return PathResult(elapsed_s, outputs, num_computed)


@contextmanager
def running_daemon(model_dir: Path, options: list[str], threads: int) -> Iterator[Path]:
    """A daemon with the real stages on `model_dir`; yields its socket path."""
    directory = Path(tempfile.mkdtemp(prefix="pl-bench-hf-"))
    run_dir = directory / "run"
    run_dir.mkdir(mode=0o700)
    # The stages inherit the daemon's environment; torch sizes its thread pool from this.
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        process = start_daemon(model_dir, run_dir, "real", options)
    finally:
        if previous is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = previous
    try:
        yield run_dir / "pipeline.sock"
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=DAEMON_STOP_TIMEOUT_S)
        shutil.rmtree(directory, ignore_errors=True)


def run_daemon(socket_path: Path, requests: Sequence[BenchRequest]) -> PathResult:
    """Every request at once, greedy, ignoring EOS."""
    async def run() -> PathResult:
        client = AsyncClient(socket_path)
        await client.generate([MIN_TOKEN_ID] * 3, SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0))
        start_s = time.perf_counter()
        completions = await asyncio.gather(*(
            client.generate(r.prompt, SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
            for r in requests))
        elapsed_s = time.perf_counter() - start_s
        outputs = [c.token_ids for c in completions]
        return PathResult(elapsed_s, outputs, sum(len(t) for t in outputs))

    return asyncio.run(run())


def compare(requests: Sequence[BenchRequest], batch_size: int, hf: PathResult, daemon: PathResult) -> Comparison:
    num_output_tokens = sum(r.max_tokens for r in requests)
    for index, (request, tokens) in enumerate(zip(requests, daemon.token_ids)):
        if len(tokens) != request.max_tokens:  # ignore_eos makes this exact; anything else is a daemon bug
            raise RuntimeError(f"the daemon returned {len(tokens)} tokens for request {index}, "
                               f"which asked for {request.max_tokens}")
    matched = [h == d for h, d in zip(hf.token_ids, daemon.token_ids)]
    unpadded = []
    for first in range(0, len(requests), batch_size):
        batch = range(first, min(first + batch_size, len(requests)))
        width = max(len(requests[i].prompt) for i in batch)
        unpadded += [i for i in batch if len(requests[i].prompt) == width]
    return Comparison(
        hf_tok_s=num_output_tokens / hf.elapsed_s,
        daemon_tok_s=num_output_tokens / daemon.elapsed_s,
        ratio=hf.elapsed_s / daemon.elapsed_s,
        hf_s=hf.elapsed_s,
        daemon_s=daemon.elapsed_s,
        num_output_tokens=num_output_tokens,
        hf_computed_tokens=hf.num_computed_tokens,
        num_matched=sum(matched),
        num_unpadded=len(unpadded),
        num_unpadded_matched=sum(matched[i] for i in unpadded),
    )


def format_table(result: Comparison, workload: dict[str, Any]) -> str:
    lines = [
        f"{workload['num_prompts']} requests, prompts {workload['input_len'][0]}-{workload['input_len'][1]} tokens, "
        f"outputs {workload['output_len'][0]}-{workload['output_len'][1]} tokens (EOS ignored), greedy, "
        f"float32 CPU, {workload['threads']} torch threads",
        f"transformers: static batches of {workload['batch_size']}, left padding; "
        f"daemon: max {workload['max_num_seqs']} sequences at once",
        f"{'path':<28}{'time (s)':>10}{'output tok/s':>14}{'vs transformers':>17}",
        f"{'transformers generate':<28}{result.hf_s:>10.2f}{result.hf_tok_s:>14.1f}{1.0:>17.2f}",
        f"{'daemon':<28}{result.daemon_s:>10.2f}{result.daemon_tok_s:>14.1f}{result.ratio:>17.2f}",
        f"useful output tokens {result.num_output_tokens}; transformers generated {result.hf_computed_tokens} "
        f"({result.hf_computed_tokens - result.num_output_tokens} past a request's length)",
        f"greedy outputs equal token for token: {result.num_matched}/{workload['num_prompts']} requests "
        f"({result.num_unpadded_matched}/{result.num_unpadded} of the unpadded ones)",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout (the table goes to stderr)")
    parser.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: a random 20m llama)")
    parser.add_argument("--num-prompts", type=positive_int, default=None,
                        help=f"requests (default {DEFAULT_WORKLOAD['num_prompts']})")
    parser.add_argument("--batch-size", type=positive_int, default=None,
                        help=f"transformers static batch size (default {DEFAULT_WORKLOAD['batch_size']})")
    parser.add_argument("--input-len", type=range_arg("--input-len"), default=None, metavar="A[:B]",
                        help="prompt tokens, uniform in [A, B] (default {}:{})".format(*DEFAULT_WORKLOAD["input_len"]))
    parser.add_argument("--output-len", type=range_arg("--output-len"), default=None, metavar="A[:B]",
                        help="output tokens, uniform in [A, B] (default {}:{})".format(*DEFAULT_WORKLOAD["output_len"]))
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts, lengths and the random checkpoint")
    parser.add_argument("--threads", type=positive_int, default=torch.get_num_threads(),
                        help="torch threads of transformers and of the daemon's runner (default %(default)s)")
    parser.add_argument("--max-num-seqs", type=positive_int, default=None,
                        help="the daemon's most sequences at once (default: --batch-size)")
    parser.add_argument("--quick", action="store_true",
                        help="a few short requests on the tiny preset, for a smoke test")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the daemon this script started is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    defaults = QUICK_WORKLOAD if args.quick else DEFAULT_WORKLOAD
    num_prompts = args.num_prompts or defaults["num_prompts"]
    batch_size = args.batch_size or defaults["batch_size"]
    input_len = args.input_len or defaults["input_len"]
    output_len = args.output_len or defaults["output_len"]
    max_num_seqs = args.max_num_seqs or batch_size
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="pl-bench-hf-model-") as scratch:
        if args.model is None:
            preset = "tiny" if args.quick else "20m"
            model_dir = make_tiny_model(scratch, "llama", seed=args.seed, preset=preset)
            model_name = f"random llama ({preset} preset)"
        else:
            model_dir, model_name = args.model, str(args.model)
            if not (model_dir / "config.json").is_file():
                print(f"error: --model {model_dir} is not a checkpoint directory (no config.json)", file=sys.stderr)
                return 1
        config = json.loads((model_dir / "config.json").read_text())
        requests = random_requests(num_prompts, input_len, output_len, vocab_size=int(config["vocab_size"]),
                                   min_token_id=MIN_TOKEN_ID, seed=args.seed)
        max_model_len = input_len[1] + output_len[1]
        # Room for every sequence the daemon may hold, so it never preempts.
        num_kv_blocks = max_num_seqs * -(-max_model_len // BLOCK_SIZE)
        model = load_hf_model(model_dir)
        hf = run_hf(model, requests, batch_size)
        del model
        options = engine_options(max_model_len, num_kv_blocks) + ["--dtype", "float32",
                                                                  "--max-num-seqs", str(max_num_seqs)]
        with running_daemon(model_dir, options, args.threads) as socket_path:
            daemon = run_daemon(socket_path, requests)
    result = compare(requests, batch_size, hf, daemon)
    workload = {"model": model_name, "num_prompts": num_prompts, "batch_size": batch_size,
                "input_len": list(input_len), "output_len": list(output_len), "seed": args.seed,
                "threads": args.threads, "max_num_seqs": max_num_seqs}
    table = format_table(result, workload)
    if args.json:
        print(table, file=sys.stderr)
        print(json.dumps({**asdict(result), **workload}))
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
