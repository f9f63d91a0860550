"""Profiling a stage process: NVTX phase ranges, and the torch.profiler capture the daemon asks for.

Every stage marks its loop phases (`with ctx.range("step"):`) in its own NVTX domain
`pipeline.<stage>`, so an nsys trace of a daemon started with `pipeline start --nsys` shows each
process's step on one timeline. Without a tool attached, nvtx hands out a dummy domain and a
range makes no call at all: it costs about what an empty `with` does (tools/micro/bench_stage_range.py).

Where nsys is not used, the daemon asks every stage through the status board to capture with
torch's profiler (pipeline/serve/profile_control.py is the daemon's end; `StageProfiler.answer`
each stage's).
While a capture runs, each phase range also opens a `record_function` of the same name, so the
Chrome traces (`<directory>/<stage>.json`, one per stage) show the same phases as nsys.
torch is imported only when a capture starts: the tokenizer and detokenizer do not need it.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import nvtx

from stages.status import ProfileAnswer, ProfileOutcome, ProfileRequest

DOMAIN_PREFIX = "pipeline."


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
