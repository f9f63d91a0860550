"""Profile a running daemon for N seconds: an Nsight Systems report, or one Chrome trace per stage.

Usage: python tools/profiling/profile_daemon.py [--socket PATH] --seconds N -o FILE
See `--help`; pipeline/nsys.py and stages/profiling.py hold the parts.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import stat
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from pipeline.client import Client
from pipeline.errors import DaemonNotRunning, PipelineError
from pipeline.paths import default_socket_path
from pipeline.serve import nsys
from pipeline.serve.daemon import read_daemon_pid
from pipeline.engine.profiling import ANSWER_TIMEOUT_S

DESCRIPTION = """\
Profile the daemon on --socket for --seconds while it serves.

With Nsight Systems: nsys cannot attach to a process that is already running, so a daemon is
profiled with nsys only when it was started with `pipeline start --nsys` (which runs it under
`nsys launch`); this tool then starts and stops that session's capture and writes
FILE.nsys-rep, where every stage's loop phases are NVTX ranges in its domain pipeline.<stage>.

Otherwise (nsys not on PATH, CUDA not available, or the daemon not started with --nsys) it
says which is missing and falls back to a torch.profiler capture of the same window in every
stage, writing one Chrome-trace JSON per stage into the directory FILE (made with mode 0700),
e.g. FILE/runner.json; open them in https://ui.perfetto.dev or chrome://tracing.
"""
SOCKET_TIMEOUT_S = ANSWER_TIMEOUT_S + 30.0  # a stop waits for every stage to write its trace


def nsys_missing(nsys_path: str | None, cuda_available: bool, session: str | None) -> list[str]:
    """What keeps an nsys capture from happening; empty when it can."""
    missing = []
    if nsys_path is None:
        missing.append("nsys not found on PATH")
    if not cuda_available:
        missing.append("CUDA not available")
    if session is None:
        missing.append("the daemon was not started with `pipeline start --nsys`")
    return missing


def trace_directory(output: Path) -> Path:
    """Where the fallback writes its traces for `-o output`: output without a .nsys-rep suffix."""
    name = output.name.removesuffix(nsys.REPORT_SUFFIX)
    if not name:
        raise PipelineError(f"-o {str(output)!r} names no file")
    return output.with_name(name).absolute()


def make_private_directory(directory: Path) -> Path:
    """Creates `directory` with mode 0700 (its parents as usual), or accepts one of this user's
    that no one else may write; PipelineError otherwise."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        directory.mkdir(mode=0o700)
        os.chmod(directory, 0o700)  # mkdir's mode is narrowed by the umask, never widened
    except FileExistsError:
        info = os.lstat(directory)
        if not stat.S_ISDIR(info.st_mode):
            raise PipelineError(f"{directory} exists and is not a directory; choose another -o") from None
        if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o022:
            raise PipelineError(f"{directory} exists and may be written by another user; remove it or choose "
                                f"another -o") from None
    return directory


def daemon_pid(client: Client) -> int:
    """The pid of the daemon answering on the client's socket (read from its pid file)."""
    client.health()  # the pid file alone could name a recycled pid
    return read_daemon_pid(client.socket_path)


def cuda_available() -> bool:
    """Whether the CUDA driver sees a device: asked of the driver itself (libcuda), which takes
    milliseconds where importing torch to ask it would take seconds."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return libcuda.cuInit(0) == 0 and libcuda.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0


def capture_nsys(nsys_path: str, session: str, output: Path, seconds: float) -> Path:
    start, stop = nsys.capture_commands(nsys_path, session, output)
    subprocess.run(start, check=True)
    try:
        time.sleep(seconds)
    finally:
        subprocess.run(stop, check=True)
    return nsys.report_path(output)


def capture_torch(client: Client, directory: Path, seconds: float) -> list[str]:
    client.profile("start", directory)
    try:
        time.sleep(seconds)
    finally:  # also on Ctrl-C: the stages must not keep capturing
        paths = client.profile("stop")
    return paths


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tools/profiling/profile_daemon.py", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--socket", type=Path, default=None, help=f"daemon socket (default: {default_socket_path()})")
    parser.add_argument("--seconds", type=float, required=True, help="length of the capture window")
    parser.add_argument("-o", "--output", type=Path, required=True, metavar="FILE",
                        help="FILE.nsys-rep with nsys; else the directory FILE of <stage>.json traces")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.seconds > 0:
        print(f"profile: --seconds must be positive, got {args.seconds}", file=sys.stderr)
        return 2
    try:
        with Client(args.socket, timeout_s=SOCKET_TIMEOUT_S) as client:
            nsys_path = nsys.find_nsys()
            session = nsys.daemon_session(daemon_pid(client))
            missing = nsys_missing(nsys_path, cuda_available(), session)
            if not missing:
                report = capture_nsys(nsys_path, session, args.output, args.seconds)
                print(report)
                return 0
            print(f"profile: no nsys capture: {'; '.join(missing)}", file=sys.stderr)
            directory = make_private_directory(trace_directory(args.output))
            print(f"profile: capturing {args.seconds:g} s with torch.profiler in every stage instead", file=sys.stderr)
            paths = capture_torch(client, directory, args.seconds)
    except DaemonNotRunning as exc:
        print(f"profile: {exc.message}", file=sys.stderr)
        return 2
    except PipelineError as exc:
        print(f"profile: {exc.message}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as exc:
        print(f"profile: {' '.join(exc.cmd)} failed with status {exc.returncode}", file=sys.stderr)
        return 1
    print(f"profile: {len(paths)} Chrome traces (open them in https://ui.perfetto.dev):", file=sys.stderr)
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
