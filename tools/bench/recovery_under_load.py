"""Stage recovery on an oversubscribed CPU: each recovery scenario run N times against one daemon, a pass count.

A daemon of the checkout this runs from (its working directory: `python -m pipeline.cli start`,
so an older checkout's daemon can be measured with this same script) serves the tiny model on the
CPU, with the stall limit's floor at 1 s. While every core has two busy processes to share
(tests/contention.py of this script's checkout, at normal priority), each scenario runs `--cycles`
times in its own daemon (the load started afresh for each cycle, stopped between them):

  runner, scheduler, detokenizer, tokenizer0  four fresh streams (greedy, seeded sampling, seeded
      with penalties, greedy to a stop string); the stage SIGKILLed once all run. A pass: every
      stream ends exactly as the offline engine's, one restart, the killed stage named by signal 9,
      no request failed by the poison guard.
  long  one greedy stream of --long-tokens: the runner SIGKILLed at 20% of it, the forkserver at
      45% (once the stages serve again), the runner again at 70%. A pass: every token, exactly.
      Each cycle prints its pace between the faults and the daemon's process count.

A cycle that does not end within its timeout fails; the daemon, if it no longer serves, is
started afresh for the next cycle (and counted). Per scenario: passes out of N, the failures' reasons.

    python tools/bench/recovery_under_load.py [--cycles 20] [--scenarios runner,long] [--no-load] [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pipeline import LLM, SamplingParams
from pipeline.bench.daemon import engine_options, start_daemon
from pipeline.bench.workload import mixed_params
from pipeline.client import AsyncClient, Client, Completion
from pipeline.models.tiny_model import make_tiny_model
from servers import cpu_load, descendants

STAGES = ["tokenizer0", "scheduler", "runner", "detokenizer"]
LONG = "long"
MAX_MODEL_LEN = 4096
NUM_KV_BLOCKS = 1024
NUM_STREAMS = 4
STREAM_TOKENS = 48
LONG_FRACTIONS = (0.2, 0.45, 0.7)  # of the long stream: runner, forkserver, runner killed
KILL_TIMEOUT_S = 90.0  # a kill cycle, from its first request to its last token
LONG_TIMEOUT_S = 240.0  # the long stream, through its three faults
SERVING_TIMEOUT_S = 60.0  # for the daemon to serve again after a cycle


@dataclass
class Scenario:
    name: str
    passes: int = 0
    runs: int = 0
    daemon_starts: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class Workload:
    model: Path
    prompts: list[str]
    params: list[SamplingParams]
    expected: list[tuple[list[int], str, str]]  # token ids, text, finish reason
    long_prompt: str
    long_expected: list[int]


def workload(model: Path, long_tokens: int) -> Workload:
    """The streams of a kill cycle and the long stream, with the offline engine's outputs for them
    (on one thread: a forward's threads that wait for each other crawl on a busy CPU)."""
    torch.set_num_threads(1)
    llm = LLM(model, device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_KV_BLOCKS, block_size=16)
    prompts = [f"{i}: after the fault the daemon" for i in range(NUM_STREAMS)]
    params = mixed_params(llm, prompts, STREAM_TOKENS)
    expected = [(o.token_ids, o.text, o.finish_reason) for o in llm.generate(prompts, params)]
    long_prompt = "Through every fault the stream"
    greedy = SamplingParams(max_tokens=long_tokens, ignore_eos=True, temperature=0.0)
    return Workload(model, prompts, params, expected, long_prompt, llm.generate([long_prompt], greedy)[0].token_ids)


async def kill_cycle(socket_path: Path, work: Workload, stage: str, progress: list[str]) -> str | None:
    """Fresh streams, `stage` SIGKILLed once all run: None if all came exactly, else what went
    wrong. `progress` gets each milestone as it passes (what a cycle that timed out reached)."""
    client = AsyncClient(socket_path)
    try:
        before = await client.health()
        guard_before = (await client.stats()).num_guard_failed_requests
        streams = [client.stream(prompt, params) for prompt, params in zip(work.prompts, work.params)]
        iterators = [stream.__aiter__() for stream in streams]
        await asyncio.gather(*(iterator.__anext__() for iterator in iterators))
        os.kill(before.stage_pids[stage], signal.SIGKILL)
        progress.append(f"{stage} killed under {len(streams)} running streams")

        async def finish(iterator: object) -> None:
            async for _ in iterator:  # type: ignore[attr-defined]
                pass

        ended = await asyncio.gather(*(finish(iterator) for iterator in iterators), return_exceptions=True)
        progress.append("every stream ended")
        after = await wait_restarted(client, before.num_restarts + 1)
        guard_after = (await client.stats()).num_guard_failed_requests
    finally:
        await client.close()
    for index, (stream, error, want) in enumerate(zip(streams, ended, work.expected)):
        got = stream.completion
        if error is not None or not isinstance(got, Completion):
            return f"request {index}: {error!r}"
        if (got.token_ids, got.text, got.finish_reason) != want:
            return f"request {index}: {len(got.token_ids)} tokens, not the offline engine's {len(want[0])}"
    if after.num_restarts != before.num_restarts + 1:
        return f"{after.num_restarts - before.num_restarts} restarts for one kill"
    if f"stage {stage!r} was killed by signal 9" not in str(after.last_failure):
        return f"failure named: {after.last_failure}"
    if guard_after != guard_before:
        return "the poison guard failed a request"
    return None


async def wait_restarted(client: AsyncClient, num_restarts: int) -> object:
    """The daemon's health once it counts `num_restarts` and serves again."""
    while True:
        health = await client.health()
        if health.num_restarts >= num_restarts and health.status == "ok":
            return health
        await asyncio.sleep(0.05)


async def long_cycle(socket_path: Path, daemon_pid: int, work: Workload, progress: list[str]) -> str | None:
    """The long stream through a runner kill, the forkserver's and a second runner kill."""
    client = AsyncClient(socket_path)
    stream = client.stream(work.long_prompt, dict(max_tokens=len(work.long_expected), ignore_eos=True,
                                                  temperature=0.0))
    thresholds = [int(f * len(work.long_expected)) for f in LONG_FRACTIONS]
    kills = ["runner", "forkserver", "runner"]
    received, done = 0, 0
    pace = Pace()
    try:
        async for delta in stream:
            received += len(delta.token_ids)
            pace.tokens(received)
            if done < len(kills) and received >= thresholds[done]:
                health = await client.health()
                while health.status != "ok":  # the fault after the last lands on fresh stages
                    await asyncio.sleep(0.05)
                    health = await client.health()
                pid = forkserver_pid(daemon_pid) if kills[done] == "forkserver" else health.stage_pids["runner"]
                os.kill(pid, signal.SIGKILL)
                done += 1
                progress.append(f"{kills[done - 1]} killed at {received} tokens")
                pace.mark(kills[done - 1])
    except Exception as exc:  # noqa: BLE001 - the cycle's outcome, reported
        return f"{received} tokens, then {exc!r}"
    finally:
        await client.close()
        print(f"  pace: {pace}; the daemon's tree: {len(descendants(daemon_pid)) - 1} processes below it",
              file=sys.stderr, flush=True)
    got = stream.completion.token_ids if isinstance(stream.completion, Completion) else []
    if got != work.long_expected:
        same = next((i for i, (a, b) in enumerate(zip(got, work.long_expected)) if a != b), min(len(got), len(work.long_expected)))
        return f"{len(got)} of {len(work.long_expected)} tokens, the first {same} right"
    return None


class Pace:
    """Milliseconds per token of the long stream, segment by segment between its faults."""

    def __init__(self) -> None:
        self.segments: list[tuple[str, float, int]] = [("start", time.monotonic(), 0)]
        self.last = (time.monotonic(), 0)

    def tokens(self, received: int) -> None:
        self.last = (time.monotonic(), received)

    def mark(self, fault: str) -> None:
        self.segments.append((fault, *self.last))

    def __str__(self) -> str:
        edges = [*self.segments, ("end", *self.last)]
        return ", ".join(f"{name} {1000 * (t1 - t0) / max(n1 - n0, 1):.0f} ms/token over {n1 - n0}"
                         for (name, t0, n0), (_, t1, n1) in zip(edges, edges[1:]))


def forkserver_pid(daemon_pid: int) -> int:
    """The daemon's forkserver: its child running multiprocessing.forkserver."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat_file:
                stat = stat_file.read()
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                command = cmdline.read()
        except OSError:
            continue
        if int(stat[stat.rfind(b")") + 2:].split()[1]) == daemon_pid and b"multiprocessing.forkserver" in command:
            return int(entry)
    raise RuntimeError(f"the daemon {daemon_pid} has no forkserver")


def serving(socket_path: Path, timeout_s: float) -> bool:
    """Whether the daemon serves (status ok) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with Client(socket_path, timeout_s=5) as client:
                if client.health().status == "ok":
                    return True
        except Exception:  # noqa: BLE001 - not answering yet, or gone
            pass
        time.sleep(0.1)
    return False


class Daemon:
    """The daemon a scenario runs against, started afresh when it no longer serves."""

    def __init__(self, work: Workload, directory: Path, cycles: int) -> None:
        self.work, self.directory, self.process = work, directory, None
        self.options = [*engine_options(MAX_MODEL_LEN, NUM_KV_BLOCKS), "--stall-seconds", "1",
                        "--grace-seconds", "3", "--max-restarts", str(4 * cycles + 8)]

    @property
    def socket_path(self) -> Path:
        return self.directory / "pipeline.sock"

    def start(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)
        self.directory.mkdir(mode=0o700)
        self.process = start_daemon(self.work.model, self.directory, "real", self.options)

    def warnings(self) -> str:
        """The daemon log's last warnings and errors."""
        lines = (self.directory / "daemon.log").read_text(errors="replace").splitlines()
        return "\n".join([line for line in lines if " WARNING " in line or " ERROR " in line][-8:])

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def run_scenario(name: str, work: Workload, directory: Path, cycles: int, load: bool,
                 timeout_scale: float) -> Scenario:
    result = Scenario(name)
    daemon = Daemon(work, directory / name, cycles)
    started = time.monotonic()
    try:
        daemon.start()
        result.daemon_starts = 1
        for _ in range(cycles):
            if not serving(daemon.socket_path, SERVING_TIMEOUT_S):
                daemon.start()
                result.daemon_starts += 1
            with cpu_load(2 if load else 0):  # afresh each cycle: one load lasts 600 s at most
                progress: list[str] = ["started"]
                if name == LONG:
                    cycle = long_cycle(daemon.socket_path, daemon.process.pid, work, progress)
                else:
                    cycle = kill_cycle(daemon.socket_path, work, name, progress)
                timeout_s = timeout_scale * (LONG_TIMEOUT_S if name == LONG else KILL_TIMEOUT_S)
                try:
                    failure = asyncio.run(asyncio.wait_for(cycle, timeout_s))
                except TimeoutError:
                    failure = f"not done within {timeout_s:.0f} s; reached: {progress[-1]}"
                except Exception as exc:  # noqa: BLE001 - the cycle's outcome, reported
                    failure = f"{type(exc).__name__}: {exc}"[:200]
                result.runs += 1
                result.passes += failure is None
                if failure is not None:
                    result.failures.append(failure)
                    print(daemon.warnings(), file=sys.stderr, flush=True)
                print(f"{name} run {result.runs}: {'pass' if failure is None else failure}", file=sys.stderr, flush=True)
    finally:
        daemon.stop()
        result.seconds = time.monotonic() - started
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=20, help="runs of each scenario (default 20)")
    parser.add_argument("--scenarios", default=",".join([*STAGES, LONG]),
                        help=f"comma-separated, of {', '.join([*STAGES, LONG])} (default all)")
    parser.add_argument("--long-tokens", type=int, default=1500, help="the long stream's tokens (default 1500)")
    parser.add_argument("--no-load", action="store_true", help="leave the CPU to the daemon alone")
    parser.add_argument("--timeout-scale", type=float, default=1.0,
                        help=f"times each cycle's time limit ({KILL_TIMEOUT_S:g} s a kill, {LONG_TIMEOUT_S:g} s the "
                             "long stream; default 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    names = args.scenarios.split(",")
    unknown = sorted(set(names) - {*STAGES, LONG})
    if unknown or args.cycles < 1 or not 0 < args.long_tokens < MAX_MODEL_LEN - 64 or not args.timeout_scale > 0:
        parser.error(f"unknown scenarios {unknown}" if unknown else
                     f"--cycles must be at least 1, --long-tokens within 1..{MAX_MODEL_LEN - 65} and "
                     "--timeout-scale above 0")
    # SIGTERM unwinds like Ctrl-C, so the daemon and the load this starts are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    directory = Path(tempfile.mkdtemp(prefix="pl-recovery-load-"))
    try:
        work = workload(make_tiny_model(directory / "model", "llama", seed=3, max_position_embeddings=MAX_MODEL_LEN),
                        args.long_tokens)
        results = [run_scenario(name, work, directory, args.cycles, not args.no_load, args.timeout_scale)
                   for name in names]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if args.json:
        print(json.dumps({"cycles": args.cycles, "load": not args.no_load, "scenarios": [asdict(r) for r in results]}))
        return 0
    print(f"tiny llama on CPU, {'two busy processes per core' if not args.no_load else 'no load'}; "
          f"{NUM_STREAMS} streams of {STREAM_TOKENS} tokens per kill, the long stream {args.long_tokens} tokens")
    print(f"{'scenario':<14}{'passes':>10}{'daemons':>9}{'seconds':>9}  first failure")
    for r in results:
        print(f"{r.name:<14}{f'{r.passes}/{r.runs}':>10}{r.daemon_starts:>9}{r.seconds:>9.0f}  "
              f"{r.failures[0] if r.failures else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
