"""Keeps the daemon's stages serving: gets their output to the event loop, restarts them when one dies.

A backend whose events ring wakes a descriptor (StageBackend: `events_fd`) is read on the event
loop itself (`LoopReader`): the loop waits on that descriptor with everything else, so a step's
events reach the connections with no thread in between. Other backends are read by the
supervisor's thread, which hands each batch to the loop.

One thread does the rest, in order: watch the stages (or read events) until one fails; hand the
failure to the event loop, which parks the requests in flight and lets go of the backend; where
the backend can restart the dead stage's group alone (`restart_stage`: the frontend, whose crash
leaves the engine and its prefix cache running), do that and hand the same backend back;
otherwise close the dead backend (its processes and /dev/shm entries) and start a fresh one under
a new instance id. The loop then resumes the parked requests (and those that came meanwhile). A start that fails (the forkserver died with it, a stage crashed while loading) is tried
again after a backoff. Restarts are bounded, so a broken model does not loop for ever: more than
`max_restarts` restarts (tries included) within `window_s` leave the daemon degraded with the
reason (and end the parked requests), as does a failure once the daemon is shutting down.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pipeline.errors import StageFailed
from pipeline.engine.backend import LIVENESS_CHECK_S, Backend, BackendFactory
from pipeline.serve.stalls import StallJudge
from shm.naming import new_instance_id
from stages.contracts.config import EngineConfig
from stages.contracts.outputs import OutputEvent, TokenTexts

log = logging.getLogger("pipeline.serve.supervisor")

EVENT_POLL_S = 0.1  # how long one read_events call blocks: bounds how late the thread sees a stop
LOOP_CALL_POLL_S = 0.1
LOOP_CALL_STOP_S = 1.0  # how long a stopping supervisor waits for the loop to stop reading
FIRST_RETRY_S = 0.1  # after a restart that failed; doubled after each further failure
MAX_RETRY_S = 5.0


class BackendEvents(Protocol):
    """What the supervisor reports, each call made on the daemon's event loop."""

    def on_events(self, events: list[OutputEvent | TokenTexts]) -> None: ...

    def on_backend_failed(self, reason: str, stage: str | None) -> None:
        """A stage died (`stage` names it, where known): park the requests in flight; let go of
        the backend."""

    def on_backend_restarted(self, backend: Backend) -> None:
        """Fresh stages run: resume the parked requests on them."""

    def on_restarts_stopped(self, reason: str) -> None:
        """No restart is allowed (or it failed): the daemon stays down, saying why."""


@dataclass(slots=True)
class RestartPolicy:
    max_restarts: int = 5  # restarts allowed within window_s; 0 never restarts
    window_s: float = 600.0

    def check(self) -> None:
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be a non-negative integer, got {self.max_restarts!r}")
        if not self.window_s > 0:
            raise ValueError(f"restart window_s must be positive, got {self.window_s!r}")


class RestartBudget:
    """The restarts a RestartPolicy still allows, counted over a sliding window."""

    def __init__(self, policy: RestartPolicy) -> None:
        policy.check()
        self._policy = policy
        self._restart_times_s: deque[float] = deque()

    def take(self, now_s: float) -> str | None:
        """Counts a restart at `now_s` and returns None, or returns why none is allowed now."""
        refusal = self.refusal(now_s)
        if refusal is None:
            self._restart_times_s.append(now_s)
        return refusal

    def refusal(self, now_s: float) -> str | None:
        """Why no restart is allowed at `now_s`, or None if one is (without counting it)."""
        policy = self._policy
        while self._restart_times_s and now_s - self._restart_times_s[0] >= policy.window_s:
            self._restart_times_s.popleft()
        if len(self._restart_times_s) >= policy.max_restarts:
            return (f"{len(self._restart_times_s)} restarts within {policy.window_s:g} s already "
                    f"(the limit is {policy.max_restarts})")
        return None


class LoopReader:
    """Reads a backend's events on the event loop, woken by its events descriptor: each wake-up
    routes what the ring holds, then arms the ring again (or, when more came meanwhile, reads on
    in the next turn of the loop, so connections are written between batches). `start` and
    `stop` run on the loop; a failure to read sets `failed` for the supervisor's thread."""

    def __init__(self, backend: Backend, server: BackendEvents, loop: asyncio.AbstractEventLoop) -> None:
        self._backend = backend
        self._server = server
        self._loop = loop
        self._fd: int | None = None
        self.failed = threading.Event()
        self.failure: StageFailed | None = None

    def start(self) -> None:
        self._fd = self._backend.events_fd()  # type: ignore[attr-defined]
        self._loop.add_reader(self._fd, self._read)
        self._read()  # what came before the ring was armed

    def stop(self) -> None:
        if self._fd is not None:
            self._loop.remove_reader(self._fd)
            self._fd = None

    def _read(self) -> None:
        if self._fd is None:
            return  # stopped: a turn scheduled before that finds nothing to do
        backend = self._backend
        try:
            events = backend.poll_outputs()  # type: ignore[attr-defined]
        except StageFailed as exc:
            self._fail(exc)
            return
        except Exception as exc:  # noqa: BLE001 - any reader failure leaves the requests unserved
            log.exception("reading backend events failed")
            self._fail(StageFailed(f"{type(exc).__name__}: {exc}"))
            return
        if events:
            try:
                self._server.on_events(events)
            except Exception:  # noqa: BLE001 - as the loop's handler would: the next events still come
                log.exception("routing backend events failed")
        if not backend.arm_events():  # type: ignore[attr-defined]
            self._loop.call_soon(self._read)

    def _fail(self, failure: StageFailed) -> None:
        self.stop()
        self.failure = failure
        self.failed.set()


class StageSupervisor:
    """Owns the daemon's backends from the first one on: pumps, restarts, and finally closes them."""

    def __init__(self, backend: Backend, factory: BackendFactory, config: EngineConfig, policy: RestartPolicy,
                 server: BackendEvents, loop: asyncio.AbstractEventLoop, stalls: StallJudge | None = None) -> None:
        self._backend: Backend | None = backend
        self._stalls = stalls  # shown the stages' heartbeats on every look at them
        self._factory = factory
        self._config = config
        self._budget = RestartBudget(policy)
        self._server = server
        self._loop = loop
        self._stopping = threading.Event()
        self._no_restarts = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipeline-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop_restarting(self) -> None:
        """From now on a failed backend stays down (the daemon is shutting down)."""
        self._no_restarts.set()

    def stop(self, timeout_s: float) -> None:
        """Stops the thread and closes the current backend. Blocks: call it off the event loop.

        A restart in progress is waited for up to `timeout_s`; if it takes longer, the thread
        closes that backend itself once its start returns.
        """
        self._stopping.set()
        self._no_restarts.set()
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("stages still starting %.0f s after the stop; leaving them to close themselves", timeout_s)
                return
        backend, self._backend = self._backend, None
        if backend is not None:
            backend.close()

    def _run(self) -> None:
        while (backend := self._backend) is not None:
            failure = self._pump(backend)
            if failure is None:
                return  # stopping: stop() closes the backend
            # The loop parks the requests and lets go of the backend.
            self._call_on_loop(self._server.on_backend_failed, failure.message, failure.stage)
            if self._restart_alone(backend, failure):
                continue
            self._backend = None
            backend.close()
            self._backend = self._restart(failure.message)

    def _pump(self, backend: Backend) -> StageFailed | None:
        """Gets events to the loop until a stage fails (returns the failure) or the daemon stops (None)."""
        if hasattr(backend, "events_fd"):
            return self._watch(backend)
        read = getattr(backend, "read_outputs", backend.read_events)  # see Backend.read_events
        while not self._stopping.is_set():
            try:
                events = read(EVENT_POLL_S)
            except StageFailed as exc:
                return exc
            except Exception as exc:  # noqa: BLE001 - any reader failure leaves the requests unserved
                log.exception("reading backend events failed")
                return StageFailed(f"{type(exc).__name__}: {exc}")
            if events:
                self._loop.call_soon_threadsafe(self._server.on_events, events)
        return None

    def _watch(self, backend: Backend) -> StageFailed | None:
        """The loop reads `backend`'s events while this thread looks at its stages every
        LIVENESS_CHECK_S, until a stage fails or the loop's reading does (returns the failure),
        or the daemon stops (None). The loop has stopped reading when this returns. A stage
        fails when its process has exited (by its exit status or its pid, never by time); one
        that lives but does not go round gets a stall verdict from the judge, and runs on."""
        reader = LoopReader(backend, self._server, self._loop)
        self._call_on_loop(reader.start)
        try:
            while not self._stopping.is_set():
                try:
                    backend.check_stages()  # type: ignore[attr-defined]
                except StageFailed as exc:
                    return exc
                if self._stalls is not None:
                    self._stalls.observe(backend.health())
                if reader.failed.wait(LIVENESS_CHECK_S):
                    return reader.failure
            return None
        finally:
            self._call_on_loop(reader.stop, even_when_stopping=True)

    def _restart_alone(self, backend: Backend, failure: StageFailed) -> bool:
        """Restarts only the dead stage's group, where the backend can (StageBackend.restart_stage)
        and a restart is allowed; True once the loop has the backend back. When it fails the whole
        backend restarts next, which is the restart the budget counts."""
        restart_stage = getattr(backend, "restart_stage", None)
        if restart_stage is None or failure.stage is None or self._no_restarts.is_set():
            return False
        if self._budget.refusal(time.monotonic()) is not None:
            return False  # the whole restart says so, and gives up
        log.warning("restarting the group of stage %r after: %s", failure.stage, failure.message)
        try:
            restarted = restart_stage(failure.stage)
        except Exception as exc:  # noqa: BLE001 - the whole backend restarts instead
            message = exc.message if isinstance(exc, StageFailed) else f"{type(exc).__name__}: {exc}"
            log.error("restarting the group of stage %r failed (%s); restarting every stage", failure.stage, message)
            return False
        if not restarted:
            return False
        self._budget.take(time.monotonic())
        self._call_on_loop(self._server.on_backend_restarted, backend)
        return True

    def _restart(self, reason: str) -> Backend | None:
        """A fresh backend, or None (with the loop told why) when no restart is allowed. A start
        that fails is tried again after a backoff, each try taking one restart of the budget."""
        delay_s = FIRST_RETRY_S
        last_failure = ""
        while True:
            if self._no_restarts.is_set():
                self._give_up("the daemon is shutting down")
                return None
            refusal = self._budget.take(time.monotonic())
            if refusal is not None:
                self._give_up(f"not restarting after {refusal}" + last_failure)
                return None
            instance = new_instance_id()
            log.warning("restarting the stages as instance %s after: %s", instance, reason)
            try:
                backend = self._factory(self._config, instance)
            except Exception as exc:  # noqa: BLE001 - a model that cannot start spends the budget, then stays down
                message = exc.message if isinstance(exc, StageFailed) else f"{type(exc).__name__}: {exc}"
                last_failure = f"; the last restart failed: {message}"
                log.error("the restart failed (%s); trying again in %.1f s", message, delay_s)
                if self._no_restarts.wait(delay_s):
                    continue  # shutting down: said at the top
                delay_s = min(2 * delay_s, MAX_RETRY_S)
                continue
            if self._no_restarts.is_set():  # the daemon began to stop while the stages started
                backend.close()
                self._give_up("the daemon is shutting down")
                return None
            self._call_on_loop(self._server.on_backend_restarted, backend)
            log.warning("stages restarted as instance %s", instance)
            return backend

    def _give_up(self, reason: str) -> None:
        log.error("stages stay down: %s", reason)
        self._call_on_loop(self._server.on_restarts_stopped, reason)

    def _call_on_loop(self, function: Callable[..., None], *args: object, even_when_stopping: bool = False) -> None:
        """Runs `function(*args)` on the event loop and waits until it has run (or a stop; with
        `even_when_stopping`, up to LOOP_CALL_STOP_S more)."""
        done = threading.Event()

        def call() -> None:
            try:
                function(*args)
            finally:
                done.set()

        try:
            self._loop.call_soon_threadsafe(call)
        except RuntimeError:  # the loop is closed: the daemon is exiting
            return
        while not done.wait(LOOP_CALL_POLL_S):
            if self._stopping.is_set():
                if even_when_stopping:
                    done.wait(LOOP_CALL_STOP_S)
                return
