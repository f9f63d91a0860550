"""Running the daemon under Nsight Systems: `pipeline start --nsys`, and the capture commands of
tools/profiling/profile_daemon.py.

nsys cannot attach to a process that is already running. So `pipeline start --nsys` re-executes
itself under `nsys launch --session-new=<session>`, which traces the daemon and every stage it
spawns from the start but records nothing until `nsys start --session=<session>`. The session
name is derived from the socket path, and the daemon carries it in its environment
(SESSION_ENV), where tools/profiling/profile_daemon.py reads it back from /proc: a daemon started without --nsys
has none, however its socket is named.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeline.engine.supervision import SESSION_ENV
from pipeline.errors import PipelineError

TRACE = "cuda,nvtx,osrt"
REPORT_SUFFIX = ".nsys-rep"


def find_nsys() -> str | None:
    """The nsys executable on PATH, or None."""
    return shutil.which("nsys")


def session_name(socket_path: Path | str) -> str:
    """The nsys session of the daemon on `socket_path`: one per socket, a valid session name."""
    digest = hashlib.sha256(str(Path(socket_path).absolute()).encode("utf-8")).hexdigest()
    return f"pipeline-{digest[:16]}"


def launch_command(nsys: str, session: str, argv: Sequence[str], python: str = sys.executable) -> list[str]:
    """`pipeline <argv>` under `nsys launch`, tracing CUDA, NVTX and OS runtime calls."""
    return [nsys, "launch", f"--session-new={session}", f"--trace={TRACE}", python, "-m", "pipeline.cli", *argv]


def capture_commands(nsys: str, session: str, output: Path | str) -> tuple[list[str], list[str]]:
    """The commands that start and stop recording `session` into `output` (.nsys-rep added)."""
    start = [nsys, "start", f"--session={session}", "--output", str(output), "--force-overwrite=true"]
    stop = [nsys, "stop", f"--session={session}"]
    return start, stop


def report_path(output: Path | str) -> Path:
    """Where nsys writes the report for `-o output`."""
    output = Path(output)
    return output if output.name.endswith(REPORT_SUFFIX) else output.with_name(output.name + REPORT_SUFFIX)


def start_under_nsys(argv: Sequence[str], socket_path: Path, detach: bool) -> None:
    """`pipeline start --nsys <argv>`: returns when this process is the daemon under nsys already,
    or is about to detach a child (which comes back here and relaunches itself); otherwise
    replaces this process with `nsys launch ... pipeline <argv>`. PipelineError if nsys is missing."""
    if os.environ.get(SESSION_ENV):
        return
    nsys = find_nsys()
    if nsys is None:
        raise PipelineError("--nsys: nsys (Nsight Systems) was not found on PATH; install it, or start without "
                            "--nsys and profile with tools/profiling/profile_daemon.py's torch.profiler fallback")
    if detach:
        return
    session = session_name(socket_path)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(nsys, launch_command(nsys, session, argv), {**os.environ, SESSION_ENV: session})


def daemon_session(pid: int) -> str | None:
    """The nsys session the daemon with `pid` runs under, or None if it was not started with
    --nsys (or its environment cannot be read)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = SESSION_ENV.encode("ascii") + b"="
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix):].decode("utf-8", "replace")
    return None
