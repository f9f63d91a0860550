"""Profiling a stage process: NVTX phase ranges, and the torch.profiler capture the daemon asks for.

Every stage marks its loop phases (`with ctx.range("step"):`) in its own NVTX domain
`pipeline.<stage>`, so an nsys trace of a daemon started with `pipeline start --nsys` shows each
process's step on one timeline. Without a tool attached, nvtx hands out a dummy domain and a
range makes no call at all: it costs about what an empty `with` does (tools/bench_stage_range.py).

Where nsys is not used, the daemon asks every stage through the status board to capture with
torch's profiler (`ProfileControl`, the daemon's end; `StageProfiler.answer`, each stage's end).
While a capture runs, each phase range also opens a `record_function` of the same name, so the
Chrome traces (`<directory>/<stage>.json`, one per stage) show the same phases as nsys.
torch is imported only when a capture starts: the tokenizer and detokenizer do not need it.
"""
from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import nvtx

from pipeline.errors import InvalidRequest, StageFailed
from stages.status import ProfileAnswer, ProfileOutcome, ProfileRequest, StatusBoard

DOMAIN_PREFIX = "pipeline."
ANSWER_TIMEOUT_S = 60.0  # a first start imports torch; a stop writes a trace of the whole window
ANSWER_POLL_S = 0.01


class PhaseRange:
    """One named phase of a stage loop, as a context manager. A phase never nests inside itself."""

    __slots__ = ("name", "_domain", "_attributes", "_profiler", "_record")

    def __init__(self, name: str, domain: Any, profiler: StageProfiler) -> None:
        self.name = name
        self._domain = domain
        # Without a tool attached nvtx returns a dummy domain: the range then costs a test, not a call.
        self._attributes = domain.get_event_attributes(message=name) if isinstance(domain, nvtx.Domain) else None
        self._profiler = profiler
        self._record: Any = None  # the record_function opened by this entry, if a capture ran

    def __enter__(self) -> PhaseRange:
        if self._attributes is not None:
            self._domain.push_range(self._attributes)
        record_function = self._profiler.record_function
        if record_function is not None:
            self._record = record_function(self.name)
            self._record.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        # A capture may have started or stopped inside the phase (a tick in a blocked write):
        # close only what this entry opened.
        record = self._record
        if record is not None:
            self._record = None
            record.__exit__(None, None, None)
        if self._attributes is not None:
            self._domain.pop_range()


class StageProfiler:
    """One stage process's phase ranges and its torch.profiler capture (at most one at a time)."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.domain_name = DOMAIN_PREFIX + stage
        self._domain = nvtx.get_domain(self.domain_name)
        self._ranges: dict[str, PhaseRange] = {}
        self._capture: Any = None  # the running capture (torch.autograd.profiler.profile)
        self._trace_path: Path | None = None
        self.record_function: Callable[[str], Any] | None = None  # set while a capture runs

    def range(self, name: str) -> PhaseRange:
        """The phase called `name`; the same object every time, so a loop may fetch it once."""
        phase = self._ranges.get(name)
        if phase is None:
            phase = self._ranges[name] = PhaseRange(name, self._domain, self)
        return phase

    @property
    def nvtx_attached(self) -> bool:
        """Whether an NVTX tool (nsys) records this process's ranges."""
        return isinstance(self._domain, nvtx.Domain)

    @property
    def capturing(self) -> bool:
        return self._capture is not None

    def start(self, directory: Path) -> None:
        """Starts capturing (CPU, and CUDA where this process uses it) for `directory/<stage>.json`;
        a capture already running is dropped first."""
        import torch
        # The Kineto capture that torch.profiler.profile wraps: that wrapper's start imports
        # torch._inductor to read one flag, seconds per stage that a capture window would lose.
        from torch.autograd.profiler import profile, record_function

        self.discard()
        capture = profile(use_cpu=True, use_device="cuda" if torch.cuda.is_initialized() else None,
                          use_kineto=True)
        capture.__enter__()
        self._capture = capture
        self._trace_path = directory / f"{self.stage}.json"
        self.record_function = record_function

    def stop(self) -> Path | None:
        """Ends the capture and writes its Chrome trace; the path, or None if none was running."""
        capture, path = self._end()
        if capture is None or path is None:
            return None
        # torch logs a failed export and returns as if it had written: so the file must be new
        # and non-empty to count (an older one of the same name is removed first).
        path.unlink(missing_ok=True)
        capture.export_chrome_trace(str(path))
        if not path.is_file() or path.stat().st_size == 0:
            raise OSError(f"torch.profiler wrote no trace to {path}")
        return path

    def discard(self) -> None:
        """Ends a running capture without writing it."""
        self._end()

    def _end(self) -> tuple[Any, Path | None]:
        """Ends the running capture, if any; (that capture, its trace path), or (None, None)."""
        capture, path = self._capture, self._trace_path
        if capture is not None:
            self.record_function = None
            self._capture = self._trace_path = None
            capture.__exit__(None, None, None)
        return capture, path

    def answer(self, request: ProfileRequest) -> ProfileAnswer:
        """Does what a profile request asks and says how it went (a failure is an answer, not an
        exception: a stage must keep serving when its trace cannot be written)."""
        try:
            if request.directory is not None:
                self.start(Path(request.directory))
                return ProfileAnswer(request.generation, ProfileOutcome.STARTED, "")
            path = self.stop()
        except Exception as exc:  # noqa: BLE001 - reported to the daemon, which names this stage
            self.discard()
            return ProfileAnswer(request.generation, ProfileOutcome.FAILED, f"{type(exc).__name__}: {exc}")
        if path is None:
            return ProfileAnswer(request.generation, ProfileOutcome.NOT_CAPTURING, "")
        return ProfileAnswer(request.generation, ProfileOutcome.WRITTEN, str(path))


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
                                          f"owner only (tools/profile.py makes it 0700)")
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
            if self._board.profile_active:
                raise InvalidRequest("action", "a profile capture is already running; stop it first")
            real = check_trace_directory(directory)
            try:
                generation = self._board.request_profile(real)
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
            if not self._board.profile_active:
                raise InvalidRequest("action", "no profile capture is running; start one first")
            answers = self._gather(self._board.request_profile(None), "stop")
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
            answers = {name: self._board.profile_answer(index) for index, name in self._live_stages().items()}
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
            self._gather(self._board.request_profile(None), "stop")
        except StageFailed:
            pass
