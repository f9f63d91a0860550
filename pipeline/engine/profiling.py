"""The stages' torch.profiler captures, started and stopped from the daemon's side.

Requests go through the status board; each stage answers on its next tick
(stages/profiling.py). Used where the daemon does not run under nsys.
"""
from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pipeline.errors import InvalidRequest, StageFailed
from stages.status import ProfileAnswer, ProfileOutcome, StatusBoard

ANSWER_TIMEOUT_S = 60.0  # a first start imports torch; a stop writes a trace of the whole window
ANSWER_POLL_S = 0.01


def check_trace_directory(directory: str) -> str:
    """The real path of a directory the stages may write traces into, or InvalidRequest saying why
    not: it must be given as an absolute path, exist, be a directory of this user, and be
    writable by no one else (who could plant a link where a stage writes its trace)."""
    if not isinstance(directory, str) or not os.path.isabs(directory):
        raise InvalidRequest("directory", f"must be an absolute path, got {directory!r}")
    real = os.path.realpath(directory)
    try:
        info = os.stat(real)
    except FileNotFoundError:
        raise InvalidRequest("directory", f"{directory!r} does not exist") from None
    if not stat.S_ISDIR(info.st_mode):
        raise InvalidRequest("directory", f"{directory!r} is not a directory")
    if info.st_uid != os.getuid():
        raise InvalidRequest("directory", f"{directory!r} is owned by uid {info.st_uid}, not by the daemon's "
                                          f"user (uid {os.getuid()})")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        raise InvalidRequest("directory", f"{directory!r} has mode {mode:04o}; it must be writable by its "
                                          f"owner only (tools/profiling/profile_daemon.py makes it 0700)")
    return real


class ProfileControl:
    """The daemon's end: posts start and stop requests on the status board and gathers the answers
    of every live stage (`live_stages()`: index -> name). One request at a time."""

    def __init__(self, board: StatusBoard, live_stages: Callable[[], dict[int, str]],
                 timeout_s: float = ANSWER_TIMEOUT_S) -> None:
        self._board = board
        self._live_stages = live_stages
        self._timeout_s = timeout_s
        self._lock = threading.Lock()

    def start(self, directory: str) -> None:
        """Returns once every live stage captures. InvalidRequest for a bad directory or a capture
        already running; StageFailed naming the stages that could not start (the others stop)."""
        with self._exclusive():
            if self._board.profile.active:
                raise InvalidRequest("action", "a profile capture is already running; stop it first")
            real = check_trace_directory(directory)
            try:
                generation = self._board.profile.request(real)
            except ValueError as exc:  # the path does not fit the board
                raise InvalidRequest("directory", str(exc)) from None
            try:
                answers = self._gather(generation, "start")
            except StageFailed:
                self._stop_quietly()
                raise
            failed = {name: a.message for name, a in answers.items() if a.outcome != ProfileOutcome.STARTED}
            if failed:
                self._stop_quietly()
                raise StageFailed("profiling could not start in "
                                  + "; ".join(f"{name}: {message}" for name, message in failed.items()))

    def stop(self) -> list[str]:
        """Ends the capture; returns the trace each live stage wrote. InvalidRequest when none
        runs; StageFailed naming the stages that wrote none."""
        with self._exclusive():
            if not self._board.profile.active:
                raise InvalidRequest("action", "no profile capture is running; start one first")
            answers = self._gather(self._board.profile.request(None), "stop")
            paths = sorted(a.message for a in answers.values() if a.outcome == ProfileOutcome.WRITTEN)
            failed = {name: a.message for name, a in answers.items() if a.outcome == ProfileOutcome.FAILED}
            if failed:
                raise StageFailed("no trace from " + "; ".join(f"{name}: {message}" for name, message in failed.items())
                                  + (f" (written: {', '.join(paths)})" if paths else ""))
            return paths

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        if not self._lock.acquire(blocking=False):
            raise InvalidRequest("action", "another profile request is in progress")
        try:
            yield
        finally:
            self._lock.release()

    def _gather(self, generation: int, what: str) -> dict[str, ProfileAnswer]:
        """Every live stage's answer to request `generation`, or StageFailed naming the late ones."""
        deadline = time.monotonic() + self._timeout_s
        while True:
            answers = {name: self._board.profile.answer_of(index) for index, name in self._live_stages().items()}
            late = [name for name, answer in answers.items() if answer.generation != generation]
            if not late:
                return answers
            if time.monotonic() > deadline:
                raise StageFailed(f"stages {late} did not answer the profile {what} request within "
                                  f"{self._timeout_s:g} s")
            time.sleep(ANSWER_POLL_S)  # a control request, seconds long: polling costs nothing here

    def _stop_quietly(self) -> None:
        """After a failed start: the stages that did start stop (their traces are not reported)."""
        try:
            self._gather(self._board.profile.request(None), "stop")
        except StageFailed:
            pass
