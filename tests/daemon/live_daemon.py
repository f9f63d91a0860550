"""Live daemons for end-to-end tests, each in its own process on a tiny checkpoint (helpers and fixtures).

The daemon runs `pipeline start` with the real stage processes, unless
PIPELINE_TEST_BACKEND=engine-thread, which runs it over the EngineThreadBackend test double
(the in-process backend with a fault to inject). A test may also ask for a test double itself
(`start_daemon(..., backend=...)`, see serve_engine_thread.py).
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from device_choice import engine_device, engine_dtype

from pipeline.client import Client
from pipeline.errors import DaemonNotRunning, PipelineError
from pipeline.protocol import Done, Error, FrameDecoder, HealthReply, ServerMessage, StatsReply, encode_frame
from pipeline.models.tiny_model import make_tiny_model
from shm.naming import instance_of, list_entries, pid_alive

HERE = Path(__file__).resolve().parent
BACKEND = os.environ.get("PIPELINE_TEST_BACKEND", "real")  # "real", or a test double of serve_engine_thread.py
REAL_BACKEND = BACKEND == "real"
START_TIMEOUT_S = 60.0  # a start with no new line in the daemon's log for this long has stalled
START_LIMIT_S = 600.0  # and one that makes progress ends within this
# Small enough to start in seconds, large enough for 64 requests at once.
# A small `pipeline bench` workload: outputs of 4 to 12 tokens, EOS ignored.
WORKLOAD = ["--input-len", "8:48", "--output-len", "4:12", "--ignore-eos", "--quiet", "--seed", "3"]
ENGINE_OPTIONS = ["--max-model-len", "2048", "--num-kv-blocks", "512", "--block-size", "16"]  # and --device


@dataclass(slots=True)
class LiveDaemon:
    socket_path: Path
    process: subprocess.Popen
    model: Path
    log_path: Path

    def stop(self) -> int:
        """SIGTERM, then the exit status (the process is killed if it hangs)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise

    def shm_entries(self) -> list[str]:
        """/dev/shm entries whose instance id names this daemon's pid."""
        prefix = f"{self.process.pid}_"
        return sorted(e for e in list_entries() if (instance_of(e) or "").startswith(prefix))


def parent_pids() -> dict[int, int]:
    """Every process's parent pid, by pid, as /proc shows them now."""
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                parents[int(entry)] = int(stat.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # it exited meanwhile
    return parents


def process_tree(pid: int) -> set[int]:
    """`pid` and every process descended from it: a daemon's are its forkserver, its resource
    tracker and the stages."""
    parents = parent_pids()
    tree = {pid}
    while grown := {child for child, parent in parents.items() if parent in tree} - tree:
        tree |= grown
    return tree


def wait_nothing_left(daemon: LiveDaemon, tree: set[int], since_s: float, within_s: float = 5.0) -> float:
    """Waits until no process of `tree` (a killed daemon's, taken before the kill) runs and none of
    the daemon's /dev/shm names remain; fails the test if that takes more than within_s after
    since_s (time.monotonic()). Returns when it was so, in seconds after since_s."""
    while True:
        running = sorted(pid for pid in tree if pid_alive(pid))
        names = daemon.shm_entries()
        if not running and not names:
            return time.monotonic() - since_s
        if time.monotonic() - since_s > within_s:
            pytest.fail(f"{within_s:g} s after the daemon died, processes {running} of its tree run and its names "
                        f"{names} remain in /dev/shm")
        time.sleep(0.02)


def daemon_command(model: Path, socket_path: Path, extra: list[str], backend: str = BACKEND) -> list[str]:
    device = engine_device()
    options = ["--device", device, *ENGINE_OPTIONS]
    if "--dtype" not in extra:  # the daemons are compared with offline engines token for token
        options += ["--dtype", engine_dtype(device)]
    if backend == "real":
        return [sys.executable, "-m", "pipeline.cli", "start", "--model", str(model), "--socket", str(socket_path),
                *options, *extra]
    return [sys.executable, str(HERE / "serve_engine_thread.py"), "--backend", backend, "--model", str(model),
            "--socket", str(socket_path), *options, *extra]


def wait_until_serving(socket_path: Path, process: subprocess.Popen, log_path: Path) -> None:
    """Until the daemon answers /health. It may take START_TIMEOUT_S without a new line in its log,
    so a busy machine's slow start is waited for as long as it makes progress (START_LIMIT_S at most)."""
    start = time.monotonic()
    deadline, logged = start + START_TIMEOUT_S, -1
    while time.monotonic() < min(deadline, start + START_LIMIT_S):
        if process.poll() is not None:
            raise RuntimeError(f"daemon exited with {process.returncode}:\n{log_path.read_text()}")
        size = log_path.stat().st_size if log_path.exists() else 0
        if size != logged:
            deadline, logged = time.monotonic() + START_TIMEOUT_S, size
        try:
            with Client(socket_path, timeout_s=5) as client:
                client.health()
            return
        except (DaemonNotRunning, OSError, PipelineError):
            time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"daemon did not serve within {time.monotonic() - start:.0f} s (waited {START_TIMEOUT_S:g} s "
                       f"past its log's last line, {START_LIMIT_S:g} s at most):\n{log_path.read_text()}")


def wait_for_health(socket_path: Path, accept: Callable[[HealthReply], bool], timeout_s: float) -> HealthReply:
    """Polls the daemon's health until `accept` takes a reply; fails the test after timeout_s."""
    deadline = time.monotonic() + timeout_s
    with Client(socket_path, timeout_s=5) as client:
        while True:
            health = client.health()
            if accept(health):
                return health
            if time.monotonic() > deadline:
                pytest.fail(f"no accepted health reply within {timeout_s} s; the last: {health}")
            time.sleep(0.05)


def start_daemon(model: Path, directory: Path, extra: list[str] | None = None, backend: str = BACKEND) -> LiveDaemon:
    socket_path = directory / "pipeline.sock"
    log_path = directory.parent / "daemon.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(daemon_command(model, socket_path, extra or [], backend), stdout=log_file,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    daemon = LiveDaemon(socket_path, process, model, log_path)
    try:
        wait_until_serving(socket_path, process, log_path)
    except BaseException:
        # Not serving (or the test's time limit struck during the wait): no caller holds the
        # process to stop it, so it is stopped here rather than left running with its stages.
        try:
            daemon.stop()
        except subprocess.TimeoutExpired:
            pass  # stop() killed it
        raise
    return daemon


@pytest.fixture(scope="session")
def daemon_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    engine_device()  # with --device cuda and no CUDA device, every test of a live daemon skips here
    return make_tiny_model(tmp_path_factory.mktemp("daemon-tiny-llama"), "llama", seed=3)


def short_dir() -> Path:
    # Not tmp_path: a Unix socket path must fit in 108 bytes, and tmp_path embeds the test name.
    directory = Path(tempfile.mkdtemp(prefix="pld-"))
    os.chmod(directory, 0o700)
    return directory / "run"  # made by the daemon, so its mode is the daemon's doing


@pytest.fixture
def run_dir() -> Iterator[Path]:
    directory = short_dir()
    yield directory
    shutil.rmtree(directory.parent, ignore_errors=True)


@contextmanager
def serving(model: Path, extra: list[str] | None = None) -> Iterator[LiveDaemon]:
    """A daemon started in a directory of its own, stopped and its directory removed on exit."""
    directory = short_dir()
    daemon = start_daemon(model, directory, extra)
    try:
        yield daemon
    finally:
        daemon.stop()
        shutil.rmtree(directory.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def live_daemon(daemon_model: Path) -> Iterator[LiveDaemon]:
    with serving(daemon_model) as daemon:
        yield daemon


def wait_idle(socket_path: Path, timeout_s: float = 1.0) -> StatsReply:
    """Stats once no request runs or waits and no KV block is held (or fails after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    with Client(socket_path, timeout_s=5) as client:
        while True:
            stats = client.stats()
            if stats.num_running_requests == stats.num_waiting_requests == stats.kv_blocks_used == 0:
                return stats
            if time.monotonic() > deadline:
                pytest.fail(f"requests still hold resources {timeout_s} s after ending: {stats}")
            time.sleep(0.01)


def memory_kib(pid: int) -> tuple[int, int]:
    """(resident, private) KiB of a process: VmRSS, and RssAnon (its heaps, no shared memory)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        fields = dict(line.split(":", 1) for line in status if line.startswith(("VmRSS:", "RssAnon:")))
    if len(fields) != 2:
        raise RuntimeError(f"/proc/{pid}/status lacks VmRSS or RssAnon: {fields}")
    return int(fields["VmRSS"].split()[0]), int(fields["RssAnon"].split()[0])


class RawConnection:
    """A client that speaks the wire protocol directly, to do what the client library won't."""

    def __init__(self, socket_path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(str(socket_path))
        self.decoder: FrameDecoder[ServerMessage] = FrameDecoder(ServerMessage)

    def send(self, message: object) -> None:
        self.sock.sendall(encode_frame(message))  # type: ignore[arg-type]

    def receive(self) -> ServerMessage:
        while (message := self.decoder.next_message()) is None:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("the daemon closed the connection")
            self.decoder.feed(data)
        return message

    def close(self) -> None:
        self.sock.close()


class AsyncRawConnection:
    """RawConnection on asyncio: many at once, each frame sent exactly when the test says."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder: FrameDecoder[ServerMessage] = FrameDecoder(ServerMessage)

    @classmethod
    async def open(cls, socket_path: Path) -> AsyncRawConnection:
        return cls(*await asyncio.open_unix_connection(str(socket_path)))

    def send(self, message: object) -> None:
        self.writer.write(encode_frame(message))  # type: ignore[arg-type]

    async def receive(self) -> ServerMessage:
        while (message := self.decoder.next_message()) is None:
            data = await self.reader.read(65536)
            if not data:
                raise ConnectionError("the daemon closed the connection")
            self.decoder.feed(data)
        return message

    async def ask(self, message: object) -> ServerMessage:
        self.send(message)
        return await self.receive()

    async def final(self) -> Done | Error:
        """The request's last reply (the daemon sends one request's replies in order)."""
        while not isinstance(message := await self.receive(), (Done, Error)):
            pass
        return message

    def close(self) -> None:
        self.writer.close()


def bench(*args: str) -> dict:
    """`pipeline bench ARGS --json -` in a process of its own; its report."""
    run = subprocess.run([sys.executable, "-m", "pipeline.cli", "bench", *args, "--json", "-"], capture_output=True,
                         text=True, timeout=110, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)
