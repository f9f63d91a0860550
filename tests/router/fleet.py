"""A fleet for router tests: daemons on the tiny model, each with its HTTP API, and a router in
front of them, each in its own process."""
from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "daemon"))
from live_daemon import LiveDaemon, short_dir, start_daemon  # noqa: E402

from pipeline.client import Client  # noqa: E402

START_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(slots=True)
class Replica:
    daemon: LiveDaemon
    directory: Path
    url: str
    port: int


def start_replica(model: Path, port: int | None = None, extra: list[str] | None = None) -> Replica:
    port = port or free_port()
    directory = short_dir()
    daemon = start_daemon(model, directory, ["--port", str(port), "--served-model-name", "default", *(extra or [])])
    with Client(daemon.socket_path, timeout_s=5) as client:
        url = client.health().http_url
    return Replica(daemon, directory, url, port)


def restart_replica(replica: Replica) -> Replica:
    """A fresh daemon on a killed one's socket and port."""
    if replica.daemon.process.poll() is None:
        raise RuntimeError("the replica's daemon still runs")
    daemon = start_daemon(replica.daemon.model, replica.directory,
                          ["--port", str(replica.port), "--served-model-name", "default"])
    return Replica(daemon, replica.directory, replica.url, replica.port)


def stop_replica(replica: Replica) -> None:
    try:
        replica.daemon.stop()
    finally:
        shutil.rmtree(replica.directory.parent, ignore_errors=True)


@dataclass(slots=True)
class RouterProcess:
    process: subprocess.Popen
    url: str
    log_path: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_router(model: Path, backends: list[str], log_path: Path, *extra: str) -> RouterProcess:
    port = free_port()
    command = [sys.executable, "-m", "pipeline.cli", "router", "--port", str(port), "--model", str(model),
               "--health-interval", "0.2", *extra]
    for url in backends:
        command += ["--backend", url]
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    router = RouterProcess(process, f"http://127.0.0.1:{port}", log_path)
    wait_healthy(router, len(backends))
    return router


def wait_healthy(router: RouterProcess, num_backends: int, timeout_s: float = START_TIMEOUT_S) -> dict:
    """The router's /health once `num_backends` backends are in its ring."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        if router.process.poll() is not None:
            raise RuntimeError(f"router exited with {router.process.returncode}:\n{router.log_path.read_text()}")
        try:
            last = httpx.get(f"{router.url}/health", timeout=2).json()
            if sum(b["healthy"] for b in last["backends"].values()) == num_backends:
                return last
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"the router did not see {num_backends} healthy backends within {timeout_s} s: {last}\n"
                       f"{router.log_path.read_text()}")


@dataclass(slots=True)
class Fleet:
    replicas: list[Replica]
    router: RouterProcess
    model: Path
    tmp: Path = field(default_factory=Path)
