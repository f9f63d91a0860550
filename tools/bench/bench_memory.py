"""The daemon's process tree in memory: each process's PSS and RSS, the total, and which have torch loaded.

Starts `pipeline start` (on the default model unless `--model` is given, with any further engine
flags after `--`), serves a few greedy requests through its socket, then reads every process of
the tree (the daemon and its descendants: the forkserver and the stages it forked) from
/proc/PID/smaps_rollup and /proc/PID/maps. PSS divides each shared page among the processes that
map it, so the PSS column adds up to what the tree costs the machine; RSS counts shared pages in
full in each process. "torch" says whether the process has torch's libraries mapped. With
`--kill-runner`, the runner is then SIGKILLed: the time until the daemon answers a request again
(the runner's restart: its fork, its imports, the model's load) is printed, and the tree read again.

    python tools/bench/bench_memory.py [--model PATH] [--kill-runner] [--json] [-- --kv-cache-tokens 8192 ...]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from servers import descendants

from pipeline.client import Client
from pipeline.errors import DaemonNotRunning, PipelineError

START_TIMEOUT_S = 300.0
PROMPT = "Write three sentences about the sea, each about a different colour."


@dataclass(slots=True)
class ProcessMemory:
    pid: int
    title: str
    pss_mib: float
    rss_mib: float
    pss_anon_mib: float  # private or copy-on-write memory: heaps, tensors, Python objects
    torch: bool  # torch's shared libraries are mapped


def _title(pid: int) -> str:
    """The process's title: its command line (a stage sets `pipeline: NAME`), shortened."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    text = " ".join(arg.decode(errors="replace") for arg in argv)
    if "multiprocessing.forkserver" in text:
        return "forkserver"
    if "multiprocessing.resource_tracker" in text:
        return "resource tracker"
    if " -m pipeline.cli start" in text:
        return "daemon (pipeline start)"
    return text[:48]


def process_memory(pid: int) -> ProcessMemory:
    """What /proc says of process `pid`'s memory now."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, value = line.partition(":")
        fields[key] = int(value.split()[0]) / 1024  # kB -> MiB
    maps = Path(f"/proc/{pid}/maps").read_text()
    return ProcessMemory(pid, _title(pid), fields["Pss"], fields["Rss"], fields.get("Pss_Anon", 0.0),
                         "/torch/lib/" in maps)


def tree_memory(root: int) -> list[ProcessMemory]:
    """Each process of the tree under `root` (those that exit while being read are left out)."""
    rows = []
    for pid in descendants(root):
        try:
            rows.append(process_memory(pid))
        except (OSError, KeyError):
            continue
    return rows


def start_daemon(model: str | None, flags: list[str], directory: Path) -> tuple[subprocess.Popen, Path]:
    """`pipeline start` on its own socket in `directory`, once it answers; its log in daemon.log."""
    socket_path = directory / "pipeline.sock"
    command = [sys.executable, "-m", "pipeline.cli", "start", "--socket", str(socket_path), *flags]
    if model is not None:
        command += ["--model", model]
    with open(directory / "daemon.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the daemon exited with {process.returncode}:\n"
                               f"{(directory / 'daemon.log').read_text()[-4000:]}")
        try:
            with Client(socket_path, timeout_s=5) as client:
                client.health()
            return process, socket_path
        except (DaemonNotRunning, OSError, PipelineError):
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("the daemon did not answer in time")


def stop_daemon(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it does not end in time."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def serve(socket_path: Path, num_requests: int, max_tokens: int) -> None:
    """`num_requests` greedy requests, one after another."""
    with Client(socket_path, timeout_s=120) as client:
        for i in range(num_requests):
            client.generate(f"{i}. {PROMPT}", {"max_tokens": max_tokens, "temperature": 0.0})


def tree_result(root: int) -> dict:
    """The tree's rows, once the stages have gone idle, and their totals."""
    time.sleep(0.5)
    rows = tree_memory(root)
    return {"processes": [asdict(row) for row in rows], "total_pss_mib": sum(row.pss_mib for row in rows),
            "total_rss_mib": sum(row.rss_mib for row in rows)}


def runner_restart_s(socket_path: Path) -> float:
    """SIGKILLs the runner; seconds until a one-token request is answered again."""
    with Client(socket_path, timeout_s=10) as client:
        runner = client.health().stage_pids["runner"]
    start = time.perf_counter()
    os.kill(runner, signal.SIGKILL)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            with Client(socket_path, timeout_s=120) as client:
                if client.health().stage_pids.get("runner") not in (None, runner):
                    client.generate(PROMPT, {"max_tokens": 1, "temperature": 0.0})
                    return time.perf_counter() - start
        except (DaemonNotRunning, OSError, PipelineError):
            pass  # restarting: requests fail meanwhile
        time.sleep(0.05)
    raise RuntimeError("the daemon did not serve again after the runner's kill")


def measure(model: str | None, flags: list[str], num_requests: int, max_tokens: int, kill_runner: bool) -> dict:
    """Start, serve `num_requests`, read the tree (then, if asked, kill the runner, time its restart and
    read the tree again), stop."""
    directory = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    process = None
    try:
        process, socket_path = start_daemon(model, flags, directory)
        serve(socket_path, num_requests, max_tokens)
        result = {"flags": flags, "model": model or "(default)", **tree_result(process.pid)}
        if kill_runner:
            result["runner_restart_s"] = runner_restart_s(socket_path)
            serve(socket_path, num_requests, max_tokens)
            result["after_restart"] = tree_result(process.pid)
    finally:
        if process is not None:
            stop_daemon(process)
        shutil.rmtree(directory, ignore_errors=True)
    return result


def format_tree(tree: dict) -> list[str]:
    lines = [f"{'process':<34} {'pid':>7} {'PSS MiB':>9} {'anon':>8} {'RSS MiB':>9}  torch"]
    for row in tree["processes"]:
        lines.append(f"{row['title']:<34} {row['pid']:>7} {row['pss_mib']:>9.1f} {row['pss_anon_mib']:>8.1f} "
                     f"{row['rss_mib']:>9.1f}  {'yes' if row['torch'] else 'no'}")
    lines.append(f"{'total':<34} {'':>7} {tree['total_pss_mib']:>9.1f} {'':>8} {tree['total_rss_mib']:>9.1f}")
    return lines


def format_table(result: dict) -> str:
    lines = [f"model {result['model']}, flags: {' '.join(result['flags']) or '(none)'}", *format_tree(result)]
    if "runner_restart_s" in result:
        lines += [f"runner SIGKILLed: serving again after {result['runner_restart_s']:.2f} s; the tree then:",
                  *format_tree(result["after_restart"])]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory or GGUF file (default: the daemon's)")
    parser.add_argument("--requests", type=int, default=4, help="greedy requests served before reading (default 4)")
    parser.add_argument("--max-tokens", type=int, default=32, help="outputs per request (default 32)")
    parser.add_argument("--kill-runner", action="store_true", help="then SIGKILL the runner and time its restart")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("flags", nargs="*", help="`pipeline start` flags, after `--`")
    args = parser.parse_args()
    result = measure(args.model, args.flags, args.requests, args.max_tokens, args.kill_runner)
    result["load_average"] = os.getloadavg()
    print(json.dumps(result) if args.json else format_table(result) + f"\nload average {result['load_average']}")


if __name__ == "__main__":
    main()
