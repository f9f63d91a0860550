"""A stand-in for the `pipeline` command, for compare_sync: `start ... --detach` runs a paced
FakeDaemon in the background (slower per token with --no-async-scheduling, so the two runs
differ) and `stop --socket PATH` ends it. Every call is logged as a JSON line in $FAKE_PIPELINE_LOG."""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ASYNC_TOKEN_DELAY_S = 0.0
SYNC_TOKEN_DELAY_S = 0.005
READY_TIMEOUT_S = 10.0


def _answers(socket_path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(socket_path))
        except OSError:
            return False
    return True


def _serve(socket_path: Path, token_delay_s: float) -> None:
    from paced_daemon import PacedDaemon

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    daemon = PacedDaemon(socket_path, token_delay_s).start()
    signal.sigwait({signal.SIGTERM})
    daemon.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["start", "stop", "serve"])
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--no-async-scheduling", action="store_true")
    parser.add_argument("--detach", action="store_true")
    parser.add_argument("--token-delay-s", type=float, default=0.0)
    args = parser.parse_args()
    pid_file = args.socket.with_name(args.socket.name + ".pid")
    if args.command == "serve":
        _serve(args.socket, args.token_delay_s)
        return 0
    with open(os.environ["FAKE_PIPELINE_LOG"], "a") as log:
        log.write(json.dumps(sys.argv[1:]) + "\n")
    if args.command == "start":
        delay_s = SYNC_TOKEN_DELAY_S if args.no_async_scheduling else ASYNC_TOKEN_DELAY_S
        process = subprocess.Popen([sys.executable, __file__, "serve", "--socket", str(args.socket),
                                    "--token-delay-s", str(delay_s)], start_new_session=True)
        pid_file.write_text(str(process.pid))
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _answers(args.socket):
            if process.poll() is not None or time.monotonic() > deadline:
                return 1
            time.sleep(0.01)
        return 0
    pid = int(pid_file.read_text())
    os.kill(pid, signal.SIGTERM)
    while _alive(pid):  # not our child, so poll rather than waitpid
        time.sleep(0.01)
    return 0


def _alive(pid: int) -> bool:
    """Running: not gone, and not a zombie waiting for whoever adopted it to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


if __name__ == "__main__":
    sys.exit(main())
