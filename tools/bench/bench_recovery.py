"""Stage recovery: each stage SIGKILLed under load, the pause it costs and the requests it loses.

16 streaming requests (greedy, seeded sampling, seeded sampling with penalties, greedy with a stop
string late in its text) against a daemon this script starts on the tiny model on CPU; once every
stream has delivered a quarter of its tokens (or ended early, on its stop string), one stage is
SIGKILLed, and the daemon restarts the stages and resumes the requests. Per stage: which stages restarted (a frontend stage's group alone, or all), the time
from the kill to the first token from the fresh stages and to the moment every stream has had
one, the prompt tokens the resumed requests' replays found in the prefix cache (a fresh engine
has an empty one), and the requests lost: ended with an error, or with output other than the
offline engine's for the same requests.

    python tools/bench/bench_recovery.py [--quick] [--json]
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
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline import LLM, SamplingParams
from pipeline.bench.daemon import engine_options, start_daemon
from pipeline.bench.workload import mixed_params
from pipeline.client import AsyncClient, Client, Completion
from pipeline.models.tiny_model import make_tiny_model

STAGES = ["runner", "scheduler", "detokenizer", "tokenizer0"]
NUM_STREAMS = 16
START_TIMEOUT_S = 120.0  # for the stages to come back after a kill
MAX_MODEL_LEN = 2048
NUM_KV_BLOCKS = 512


@dataclass
class Outcome:
    stage: str
    restarted: str  # "group" (the killed stage's group alone: the engine ran on) or "all"
    first_resumed_ms: float  # kill -> the first token from the fresh stages
    all_resumed_ms: float  # kill -> every stream still running at the kill has had one
    lost: int  # streams that ended with an error or with output other than the offline engine's
    replay_hit_tokens: int  # tokens found in the prefix cache from the kill until every stream ended


def workload(model: Path, num_tokens: int) -> tuple[list[str], list[SamplingParams], list[list[int]]]:
    """Prompts, params, and the offline engine's tokens for them."""
    llm = LLM(model, device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_KV_BLOCKS, block_size=16)
    prompts = [f"{i}: the daemon resumes every request" for i in range(NUM_STREAMS)]
    params = mixed_params(llm, prompts, num_tokens)
    return prompts, params, [output.token_ids for output in llm.generate(prompts, params)]


async def kill_under_load(socket_path: Path, stage: str, prompts: list[str], params: list[SamplingParams],
                          expected: list[list[int]]) -> Outcome:
    client = AsyncClient(socket_path)
    streams = [client.stream(prompt, request_params) for prompt, request_params in zip(prompts, params)]
    arrivals: list[list[float]] = [[] for _ in streams]
    num_tokens = [0] * len(streams)
    min_tokens = max(1, min(p.max_tokens for p in params) // 4)

    async def read(index: int) -> None:
        async for delta in streams[index]:
            arrivals[index].append(time.monotonic())
            num_tokens[index] += len(delta.token_ids)

    readers = [asyncio.ensure_future(read(index)) for index in range(len(streams))]
    while not all(n >= min_tokens or reader.done() for n, reader in zip(num_tokens, readers)):
        await asyncio.sleep(0.005)
    before = await client.health()
    hit_tokens = (await client.stats()).prefix_cache_hit_tokens
    killed_at = time.monotonic()
    os.kill(before.stage_pids[stage], signal.SIGKILL)
    # Once the daemon says it restarts the stages, or has, it has let go of the dead ones: every
    # delta that comes later is from the fresh stages.
    while ((health := await client.health()).instance == before.instance and "restarting" not in str(health.reason)
           and health.num_restarts == before.num_restarts):
        await asyncio.sleep(0.005)
    restarting_at = time.monotonic()
    ended = await asyncio.gather(*readers, return_exceptions=True)
    after = await client.health()
    same_engine = after.instance == before.instance
    replay_hit_tokens = (await client.stats()).prefix_cache_hit_tokens - (hit_tokens if same_engine else 0)
    await client.close()
    resumed = [min((t for t in times if t > restarting_at), default=None) for times in arrivals]
    resumed = [t for t in resumed if t is not None]
    lost = sum(error is not None or not isinstance(stream.completion, Completion)
               or stream.completion.token_ids != want for error, stream, want in zip(ended, streams, expected))
    return Outcome(stage, "group" if same_engine else "all", (min(resumed) - killed_at) * 1000,
                   (max(resumed) - killed_at) * 1000, lost, replay_hit_tokens)


def wait_serving(socket_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    with Client(socket_path, timeout_s=5) as client:
        while client.health().status != "ok":
            if time.monotonic() > deadline:
                raise RuntimeError("the stages did not come back in time")
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--quick", action="store_true", help="shorter outputs (64 tokens instead of 200)")
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the daemon this starts is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    num_tokens = 64 if args.quick else 200
    directory = Path(tempfile.mkdtemp(prefix="pl-recovery-"))
    try:
        model = make_tiny_model(directory / "model", "llama", seed=0)
        prompts, params, expected = workload(model, num_tokens)
        run_dir = directory / "run"
        run_dir.mkdir(mode=0o700)
        socket_path = run_dir / "pipeline.sock"
        options = [*engine_options(MAX_MODEL_LEN, NUM_KV_BLOCKS), "--max-restarts", str(len(STAGES))]
        process = start_daemon(model, run_dir, "real", options)
        try:
            outcomes = []
            for stage in STAGES:
                wait_serving(socket_path)
                outcomes.append(asyncio.run(kill_under_load(socket_path, stage, prompts, params, expected)))
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if args.json:
        print(json.dumps({"num_streams": NUM_STREAMS, "num_tokens": num_tokens,
                          "stages": [asdict(outcome) for outcome in outcomes]}))
        return 0
    print(f"{NUM_STREAMS} streams of {num_tokens} tokens, tiny llama on CPU; one stage SIGKILLed once all run")
    print(f"{'stage killed':<16}{'restarted':>10}{'first resumed ms':>18}{'all resumed ms':>16}"
          f"{'replay hit tokens':>19}{'requests lost':>15}")
    for o in outcomes:
        print(f"{o.stage:<16}{o.restarted:>10}{o.first_resumed_ms:>18.0f}{o.all_resumed_ms:>16.0f}"
              f"{o.replay_hit_tokens:>19}{o.lost:>15}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
