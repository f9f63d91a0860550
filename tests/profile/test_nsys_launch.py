"""`pipeline start --nsys` and the nsys commands of tools/profiling/profile_daemon.py (nsys itself is
not installed here: a stand-in on PATH records how it was called)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.cli import main as cli_main
from pipeline.serve.nsys import (
    SESSION_ENV,
    capture_commands,
    daemon_session,
    launch_command,
    report_path,
    session_name,
)

pytestmark = pytest.mark.timeout(30)

TOOL = Path(__file__).resolve().parents[2] / "tools" / "profiling" / "profile_daemon.py"
FAKE_NSYS = """#!/bin/sh
printf '%s\\n' "$@" > "$NSYS_ARGS_FILE"
printf '%s\\n' "${PIPELINE_NSYS_SESSION}" > "$NSYS_ARGS_FILE.session"
"""


def test_session_names_follow_the_socket() -> None:
    first, again, other = session_name("/run/a/pipeline.sock"), session_name("/run/a/pipeline.sock"), \
        session_name("/run/b/pipeline.sock")
    assert first == again != other
    assert first.startswith("pipeline-") and first.replace("-", "").isalnum()


def test_nsys_commands() -> None:
    assert launch_command("/opt/nsys", "pipeline-s", ["start", "--nsys"], python="/py") == [
        "/opt/nsys", "launch", "--session-new=pipeline-s", "--trace=cuda,nvtx,osrt", "/py", "-m", "pipeline.cli",
        "start", "--nsys"]
    start, stop = capture_commands("nsys", "pipeline-s", "/out/run")
    assert start == ["nsys", "start", "--session=pipeline-s", "--output", "/out/run", "--force-overwrite=true"]
    assert stop == ["nsys", "stop", "--session=pipeline-s"]
    assert report_path("/out/run") == Path("/out/run.nsys-rep") == report_path("/out/run.nsys-rep")


def test_start_nsys_without_nsys_fails_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(SESSION_ENV, raising=False)
    assert cli_main(["start", "--nsys", "--socket", str(tmp_path / "p.sock")]) == 1
    assert "nsys (Nsight Systems) was not found on PATH" in capsys.readouterr().err
    assert not (tmp_path / "p.sock").exists()


def test_start_nsys_relaunches_the_daemon_under_nsys_launch(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    nsys = bin_dir / "nsys"
    nsys.write_text(FAKE_NSYS)
    nsys.chmod(0o755)
    args_file = tmp_path / "nsys-args"
    socket_path = tmp_path / "run" / "p.sock"
    env = {key: value for key, value in os.environ.items() if key != SESSION_ENV}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", NSYS_ARGS_FILE=str(args_file))
    argv = ["start", "--nsys", "--socket", str(socket_path), "--device", "cpu"]
    result = subprocess.run([sys.executable, "-m", "pipeline.cli", *argv], env=env, capture_output=True,
                            text=True, timeout=20)
    assert result.returncode == 0, result.stderr
    session = session_name(socket_path)
    assert args_file.read_text().splitlines() == launch_command(str(nsys), session, argv)[1:]
    assert Path(f"{args_file}.session").read_text().strip() == session


def test_the_session_is_read_from_the_daemons_environment() -> None:
    env = dict(os.environ, **{SESSION_ENV: "pipeline-0123"})
    # Until a child has exec'd, /proc shows the environment it forked with: each says when it runs.
    waiting = [sys.executable, "-c", "import time; print('running', flush=True); time.sleep(30)"]
    with_session = subprocess.Popen(waiting, env=env, stdout=subprocess.PIPE, text=True)
    without = subprocess.Popen(waiting, env={k: v for k, v in os.environ.items() if k != SESSION_ENV},
                               stdout=subprocess.PIPE, text=True)
    try:
        assert with_session.stdout.readline() == without.stdout.readline() == "running\n"
        assert daemon_session(with_session.pid) == "pipeline-0123"
        assert daemon_session(without.pid) is None
    finally:
        for process in (with_session, without):
            process.kill()
            process.wait()
            process.stdout.close()
    assert daemon_session(with_session.pid) is None  # gone


def test_profile_help_says_nsys_cannot_attach() -> None:
    result = subprocess.run([sys.executable, str(TOOL), "--help"], capture_output=True, text=True, timeout=20)
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "nsys cannot attach to a process that is already running" in text
    assert "pipeline start --nsys" in text
