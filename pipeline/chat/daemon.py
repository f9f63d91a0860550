"""The daemon a chat talks to: the one already on the socket, or one started for the chat and
stopped when it ends (unless asked to keep it)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.client import Client
from pipeline.errors import DaemonNotRunning, PipelineError
from pipeline.options import resolved_model
from pipeline.paths import ensure_socket_dir
from stages.progress import Progress

START_TIMEOUT_S = 300.0  # building a GGUF's metadata directory, the kernels and the stages
STOP_TIMEOUT_S = 60.0
POLL_S = 0.1
LOG_TAIL_LINES = 15
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(,\d+)? ")


class ChatDaemon:
    """`connect()` gives a client of the daemon on `socket_path`, starting one on `model` (None:
    the default model) if none answers there; `close()` stops the one it started unless `keep`."""

    def __init__(self, socket_path: Path, model: str | None, keep: bool) -> None:
        self.socket_path = socket_path
        self.model = model
        self.keep = keep
        self.process: subprocess.Popen | None = None  # the daemon started for the chat
        self.log_path = socket_path.with_name(socket_path.name + ".log")

    def connect(self) -> Client:
        client = Client(self.socket_path)
        try:
            client.health()
        except DaemonNotRunning:
            client.close()
            self._start()
            client = Client(self.socket_path)
            client.health()
        return client

    def _start(self) -> None:
        if self.model is not None:
            resolved_model(self.model)  # a path that names no model fails here, before any process starts
        ensure_socket_dir(self.socket_path)
        command = [sys.executable, "-m", "pipeline.cli", "start", "--socket", str(self.socket_path)]
        if self.model is not None:
            command += ["--model", self.model]
        with open(self.log_path, "wb") as log_file:
            # A session of its own: the chat's Ctrl-C stops an answer, never the daemon.
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                                            start_new_session=True)
        what = f"starting a daemon for {self.model or 'the default model'} (log {self.log_path})"
        with Progress(what) as progress:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not self._serving():
                if self.process.poll() is not None:
                    self._failed(f"the daemon exited with status {self.process.returncode}")
                if time.monotonic() > deadline:
                    self._stop_process()
                    self._failed(f"the daemon did not serve within {START_TIMEOUT_S:.0f} s")
                progress.update(self._last_log_line())
                time.sleep(POLL_S)

    def _serving(self) -> bool:
        try:
            with Client(self.socket_path, timeout_s=5.0) as client:
                client.health()
            return True
        except (DaemonNotRunning, OSError, PipelineError):
            return False

    def _failed(self, why: str) -> None:
        """Raises PipelineError with `why` and the end of the daemon's log, which is then removed."""
        self.process = None
        tail = self._log_lines()[-LOG_TAIL_LINES:]
        self.log_path.unlink(missing_ok=True)
        raise PipelineError(f"{why}; the end of its log:\n" + "\n".join(tail))

    def _log_lines(self) -> list[str]:
        try:
            return self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []

    def _last_log_line(self) -> str:
        """The log's last line, its timestamp left out, cut to fit a terminal line."""
        lines = self._log_lines()
        return TIMESTAMP.sub("", lines[-1])[:60] if lines else ""

    def close(self) -> str | None:
        """Stops the daemon the chat started (unless `keep`); what to tell the user, if anything."""
        if self.process is None:
            return None
        if self.keep:
            return f"the daemon keeps running on {self.socket_path} (log {self.log_path}); `pipeline stop` ends it"
        self._stop_process()
        self.log_path.unlink(missing_ok=True)
        return None

    def _stop_process(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        os.kill(process.pid, signal.SIGTERM)  # it stops its stages and removes its shared memory
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
