"""The torch.profiler fallback against a live daemon: tools/profiling/profile_daemon.py says why nsys is
not used and writes one Chrome trace per stage holding that stage's loop phases; bad requests are refused."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from live_daemon import REAL_BACKEND, LiveDaemon
from profiled_daemon import NUM_TOKENIZERS

from pipeline.client import Client
from pipeline.errors import InvalidRequest

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not REAL_BACKEND, reason="profiling needs the real stage processes")]

TOOL = Path(__file__).resolve().parents[2] / "tools" / "profiling" / "profile_daemon.py"
PHASES = {
    "runner": {"step", "execute", "prepare_inputs", "forward", "sample", "publish"},
    "scheduler": {"drain_inputs", "schedule", "write_plan", "apply_step"},
    "detokenizer": {"manifest", "detokenize", "emit"},
    **{f"tokenizer{i}": {"tokenize"} for i in range(NUM_TOKENIZERS)},
}


@contextmanager
def requests_running(daemon: LiveDaemon, num_clients: int = 2) -> Iterator[None]:
    """Clients generating back to back until the block ends, so every stage works in the window."""
    stop = threading.Event()
    failures: list[BaseException] = []

    def load() -> None:
        try:
            with Client(daemon.socket_path, timeout_s=30) as client:
                while not stop.is_set():
                    client.generate("profile me", {"max_tokens": 8, "ignore_eos": True})
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)

    threads = [threading.Thread(target=load) for _ in range(num_clients)]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    assert not failures, failures


def annotations(path: Path) -> set[str]:
    """The record_function names in a Chrome trace (json.load fails on an invalid one)."""
    events = json.loads(path.read_text())["traceEvents"]
    return {event["name"] for event in events if event.get("cat") == "user_annotation"}


def test_tool_falls_back_to_one_trace_per_stage_with_its_phases(profiled_daemon: LiveDaemon,
                                                                 tmp_path: Path) -> None:
    output = tmp_path / "capture" / "step"
    with requests_running(profiled_daemon):
        result = subprocess.run(
            [sys.executable, str(TOOL), "--socket", str(profiled_daemon.socket_path), "--seconds", "1", "-o",
             str(output) + ".nsys-rep"], capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr
    # Neither nsys nor a daemon under `nsys launch` here: the tool says so, then falls back.
    assert "the daemon was not started with `pipeline start --nsys`" in result.stderr
    if not any((Path(d) / "nsys").exists() for d in os.environ.get("PATH", "").split(os.pathsep) if d):
        assert "nsys not found on PATH" in result.stderr
    assert stat.S_IMODE(output.stat().st_mode) == 0o700
    paths = [Path(line) for line in result.stdout.split()]
    assert sorted(paths) == sorted(output / f"{stage}.json" for stage in PHASES)
    for path in paths:
        stage = path.stem
        assert PHASES[stage] <= annotations(path), f"{stage} trace lacks some of its phases"


def test_profile_requests_are_refused_with_the_reason(profiled_daemon: LiveDaemon, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with Client(profiled_daemon.socket_path, timeout_s=90) as client:
        refusals = {
            "relative/dir": "must be an absolute path",
            str(tmp_path / "missing"): "does not exist",
            str(a_file): "is not a directory",
            str(shared): "writable by its owner only",
        }
        for directory, reason in refusals.items():
            with pytest.raises(InvalidRequest, match=reason) as refused:
                client.profile("start", directory)
            assert refused.value.field == "directory"
        with pytest.raises(InvalidRequest, match="no profile capture is running"):
            client.profile("stop")
        with pytest.raises(InvalidRequest, match="must be 'start' or 'stop'"):
            client.profile("pause")

        private = tmp_path / "private"
        private.mkdir(mode=0o700)
        client.profile("start", private)
        with pytest.raises(InvalidRequest, match="already running"):
            client.profile("start", private)
        paths = client.profile("stop")
        # Refusals changed nothing: the daemon still serves, and every stage wrote a valid trace.
        assert client.generate("still serving", {"max_tokens": 4}).usage.completion_tokens == 4
    assert sorted(paths) == sorted(str(private / f"{stage}.json") for stage in PHASES)
    for path in paths:
        annotations(Path(path))
