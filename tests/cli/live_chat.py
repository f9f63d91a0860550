"""Helpers and fixtures of the `pipeline` command's tests: a tiny checkpoint, a daemon serving it, and `pipeline
chat` run in a pseudo-terminal (pexpect) or over a pipe."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.client import Client
from pipeline.errors import DaemonNotRunning, PipelineError
from pipeline.models.tiny_model import make_tiny_model
from shm.naming import instance_of, list_entries

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120.0
ENGINE_OPTIONS = ["--device", "cpu", "--max-model-len", "2048", "--num-kv-blocks", "512"]
ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[=>]|[\x00-\x09\x0b-\x1f]")


def plain(text: str) -> str:
    """Terminal output without its escape sequences and control characters (newlines stay)."""
    return ANSI.sub("", text)


def short_dir() -> Path:
    """A 0700 directory short enough for a Unix socket path."""
    directory = Path(tempfile.mkdtemp(prefix="plc-"))
    os.chmod(directory, 0o700)
    return directory


def chat_env(state_dir: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), XDG_STATE_HOME=str(state_dir), PROMPT_TOOLKIT_NO_CPR="1",
                TERM="dumb")


def chat_command(socket_path: Path, *options: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", "chat", "--socket", str(socket_path), *options]


def shm_of(pid: int) -> list[str]:
    return sorted(entry for entry in list_entries() if (instance_of(entry) or "").startswith(f"{pid}_"))


@dataclass(slots=True)
class Served:
    socket_path: Path
    process: subprocess.Popen
    http_url: str

    def metric(self, name: str, label: str) -> float:
        """A counter of the daemon's /metrics (0 when it has no sample yet)."""
        import httpx

        for line in httpx.get(f"{self.http_url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name) and label in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("chat-tiny-llama"), "llama", seed=3)


def wait_serving(socket_path: Path, process: subprocess.Popen, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the daemon exited with {process.returncode}")
        try:
            with Client(socket_path, timeout_s=5) as client:
                client.health()
            return
        except (DaemonNotRunning, OSError, PipelineError):
            time.sleep(0.1)
    raise RuntimeError(f"the daemon did not serve within {timeout_s} s")


@pytest.fixture(scope="module")
def served(tiny_model: Path) -> Iterator[Served]:
    """A daemon on the tiny model with the HTTP API on a free port (for its /metrics)."""
    directory = short_dir()
    socket_path = directory / "p.sock"
    log = open(directory / "daemon.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "start", "--model", str(tiny_model),
                                "--socket", str(socket_path), "--port", "0", *ENGINE_OPTIONS],
                               stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        wait_serving(socket_path, process)
        with Client(socket_path, timeout_s=5) as client:
            http_url = client.health().http_url
        yield Served(socket_path, process, str(http_url))
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"
