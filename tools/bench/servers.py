"""Benchmark servers started and stopped in their own process group: a free port, waiting for the
OpenAI API to answer, and the resident memory of a server's whole process tree; and a load of busy
processes to run them beside."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeline.bench.daemon import cpu_s

START_TIMEOUT_S = 900.0  # vLLM compiles its CPU kernels on start
CONTENTION = Path(__file__).resolve().parents[2] / "tests" / "contention.py"


@contextmanager
def cpu_load(per_core: int) -> Iterator[None]:
    """`per_core` busy processes per core (tests/contention.py run alone) for the block, none for 0;
    the load's whole process group ended after it (a background shell may have it ignore SIGINT)."""
    if per_core <= 0:
        yield
        return
    load = subprocess.Popen([sys.executable, str(CONTENTION), "600", str(per_core)], stdout=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        time.sleep(0.5)  # the busy processes started
        yield
    finally:
        os.killpg(load.pid, signal.SIGKILL)
        load.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(process: subprocess.Popen, port: int, log: Path) -> None:
    """Until GET /v1/models answers; RuntimeError with the log's tail if the server exits first."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server did not answer on port {port} in {START_TIMEOUT_S:.0f} s")


def start_server(engine: str, command: list[str], env: dict[str, str], port: int, run_dir: Path) -> subprocess.Popen:
    log = run_dir / f"{engine}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                   start_new_session=True)
    try:
        wait_ready(process, port, log)
    except BaseException:
        stop_server(process)
        raise
    return process


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, then SIGKILL if it lingers."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, 15)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        process.wait()


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (children of children included) that is alive now,
    parents before children."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_bytes().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # it exited meanwhile
            children.setdefault(parent, []).append(int(entry.name))
    found = [pid]
    for current in found:
        found.extend(sorted(children.get(current, [])))
    return found


def _kib(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_memory_mib(pid: int) -> dict[str, float]:
    """The largest resident set in the server's process tree (the runner's, for pipeline), and the
    tree's proportional set size (shared pages split among the processes that map them)."""
    pids = descendants(pid)
    rss = [_kib(Path(f"/proc/{p}/status"), "VmRSS") for p in pids]
    pss = sum(_kib(Path(f"/proc/{p}/smaps_rollup"), "Pss") for p in pids)
    return {"largest_rss_mib": round(max(rss, default=0) / 1024), "tree_pss_mib": round(pss / 1024),
            "processes": len(pids)}


def tree_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system, all threads) of each process in the server's tree, by its name
    (the kernel's `comm`, which pipeline's stages set to their role), summed over same-named ones."""
    seconds: dict[str, float] = {}
    for p in descendants(pid):
        try:
            name = Path(f"/proc/{p}/comm").read_text().strip()
            spent = cpu_s(p)
        except OSError:
            continue  # it exited meanwhile
        seconds[name] = seconds.get(name, 0.0) + spent
    return seconds
