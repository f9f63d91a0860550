"""The daemons tools/bench/bench_overhead.py measures: the real daemon and stages of a checkout on the
simulated device (stages/gpu_runner/simulated/device.py), started side by side, waited for, and pinned to CPUs."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.client import Client
from pipeline.errors import DaemonNotRunning, PipelineError

TOOLS = Path(__file__).resolve().parents[1]
BATCHES = (1, 64, 256)
BLOCK_SIZE = 16
START_TIMEOUT_S = 300.0
SEED = 0


@dataclass(slots=True)
class Daemon:
    label: str  # "async", "sync", "baseline async", ...
    async_scheduling: bool
    process: subprocess.Popen
    socket_path: Path
    trace_path: Path
    pids: dict[str, int]  # process name -> pid: the daemon and each stage
    http_url: str | None = None  # its OpenAI API, once it serves (started with `http`)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)


def engine_options(model: str, device_ms: float, max_model_len: int, async_scheduling: bool,
                   trace_path: str | None) -> dict:
    """The EngineConfig of a daemon on the simulated device, as keyword arguments."""
    return dict(model=model, device="cpu", max_num_seqs=max(BATCHES), max_model_len=max_model_len,
                num_kv_blocks=max(BATCHES) * -(-max_model_len // BLOCK_SIZE), block_size=BLOCK_SIZE,
                async_scheduling=async_scheduling, simulated_device_ms=device_ms, simulated_device_trace=trace_path)


# The daemon of the checkout in argv[1] on socket argv[2], EngineConfig(**argv[3]) and
# DaemonConfig(**argv[4]) given as JSON: any checkout of this repository serves this way, with
# or without HTTP, whatever its own copy of this script can do.
SERVE_CODE = """import json, logging, sys
sys.path.insert(0, sys.argv[1])
from pipeline.serve.config import DaemonConfig
from pipeline.serve.daemon import run_daemon
from stages.contracts.config import EngineConfig
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
sys.exit(run_daemon(EngineConfig(**json.loads(sys.argv[3])), sys.argv[2], settings=DaemonConfig(**json.loads(sys.argv[4]))))
"""


def make_model(directory: Path) -> Path:
    """The tiny llama checkpoint, made by another process: torch never enters this one, whose
    clients are measured (torch's objects would make each full garbage collection here a
    100 ms pause in the middle of a stream)."""
    run = subprocess.run([sys.executable, str(TOOLS / "make_tiny_model.py"), str(directory), "--arch",
                          "llama", "--seed", str(SEED)], capture_output=True, text=True, check=True)
    return Path(run.stdout.strip())


def daemon_command(checkout: Path, socket_path: Path | str, engine: dict, http_port: int | None,
                   stream_interval: int = 1) -> list[str]:
    """The command line of `checkout`'s daemon on `socket_path` (SERVE_CODE)."""
    settings = {"http_port": http_port} | ({"stream_interval": stream_interval} if stream_interval != 1 else {})
    return [sys.executable, "-c", SERVE_CODE, str(checkout), str(socket_path), json.dumps(engine),
            json.dumps(settings)]


def start_daemon(label: str, checkout: Path, model: Path, directory: Path, device_ms: float, max_model_len: int,
                 async_scheduling: bool, http: bool, stream_interval: int = 1) -> Daemon:
    """Starts the daemon of `checkout` (with the HTTP API on a free port when `http`); returns
    before it answers (see wait_serving)."""
    directory.mkdir(mode=0o700)
    socket_path, trace_path = directory / "pipeline.sock", directory / "timeline.npy"
    engine = engine_options(str(model), device_ms, max_model_len, async_scheduling, str(trace_path))
    log = open(directory / "daemon.log", "wb")  # noqa: SIM115 - lives as long as the daemon
    command = daemon_command(checkout, socket_path, engine, 0 if http else None, stream_interval)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=checkout)
    return Daemon(label, async_scheduling, process, socket_path, trace_path, {"daemon": process.pid})


def wait_serving(daemon: Daemon) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if daemon.process.poll() is not None:
            log = (daemon.socket_path.parent / "daemon.log").read_text()
            raise RuntimeError(f"the {daemon.label} daemon exited with {daemon.process.returncode}:\n{log}")
        try:
            with Client(daemon.socket_path, timeout_s=5) as client:
                health = client.health()
            if health.status == "ok":
                daemon.pids.update(health.stage_pids)
                daemon.http_url = health.http_url
                return
        except (DaemonNotRunning, OSError, PipelineError):
            pass
        time.sleep(0.1)  # start-up poll: the stages take seconds to come up
    raise RuntimeError(f"the {daemon.label} daemon did not serve within {START_TIMEOUT_S} s")


CRITICAL_PATH_PROCESSES = ("scheduler", "runner")


def pin_processes(daemons: list[Daemon]) -> None:
    """--pin: every thread of the critical path's processes (scheduler, runner) on the first CPU
    this process may use, every thread of the daemons' other processes and of this one (the
    clients) on the second."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit(f"--pin needs two CPUs, this process may use {cpus}")
    first, rest = {cpus[0]}, {cpus[1]}
    pids = [(os.getpid(), rest)] + [(pid, first if name in CRITICAL_PATH_PROCESSES else rest)
                                    for daemon in daemons for name, pid in daemon.pids.items()]
    for pid, cores in pids:
        for thread_id in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(thread_id), cores)
