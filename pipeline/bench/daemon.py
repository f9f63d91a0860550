"""A daemon for a benchmark to measure: started on a tiny model as its own process, waited for until it
answers, its CPU time read from /proc, and a serving-benchmark run against one of its targets."""
from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.bench.metrics import BenchResult
from pipeline.bench.serve_bench import run_benchmark
from pipeline.bench.targets import Target
from pipeline.bench.workload import BenchRequest
from pipeline.client import Client
from pipeline.errors import DaemonNotRunning, PipelineError

CHECKOUT = Path(__file__).resolve().parents[2]  # the checkout this package runs from
START_TIMEOUT_S = 300.0


def engine_options(max_model_len: int, num_kv_blocks: int) -> list[str]:
    """`pipeline start`'s options for a CPU daemon of this many KV blocks of 16 tokens."""
    return ["--device", "cpu", "--max-model-len", str(max_model_len), "--num-kv-blocks", str(num_kv_blocks),
            "--block-size", "16"]


def start_daemon(model: Path, directory: Path, backend: str, options: list[str],
                 checkout: Path | None = None) -> subprocess.Popen:
    """The daemon of `checkout` (default: this one), answering on directory/pipeline.sock, its log in
    directory/daemon.log. `backend` "real" runs `pipeline start`; any other, the offline engine in a
    thread (tests/daemon/serve_engine_thread.py, the stage processes' test double)."""
    socket_path = directory / "pipeline.sock"
    if backend == "real":
        command = [sys.executable, "-m", "pipeline.cli", "start"]
    else:
        command = [sys.executable, str(CHECKOUT / "tests" / "daemon" / "serve_engine_thread.py")]
    command += ["--model", str(model), "--socket", str(socket_path), *options]
    log = open(directory / "daemon.log", "wb")  # noqa: SIM115 - lives as long as the daemon
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               cwd=checkout)  # `python -m` imports the package of its working directory
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"daemon exited with {process.returncode}: {(directory / 'daemon.log').read_text()}")
        try:
            with Client(socket_path, timeout_s=5) as client:
                client.health()
            return process
        except (DaemonNotRunning, OSError, PipelineError):
            time.sleep(0.05)
    process.kill()
    raise RuntimeError("daemon did not start in time")


def cpu_s(pid: int) -> float:
    """utime + stime of process `pid` (all its threads), in seconds, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        fields = stat.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """utime + stime of this process, in seconds."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def run_target(make_target: Callable[[], Target], requests: list[BenchRequest]) -> BenchResult:
    """The serving benchmark's run of `requests` (all at once, ignore_eos) against a target made
    here, in the running event loop, and closed after."""
    target = make_target()
    try:
        return await run_benchmark(None, requests, ignore_eos=True, target=target)
    finally:
        await target.close()
