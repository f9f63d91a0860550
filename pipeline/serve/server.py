"""The daemon's routing: requests from connections to the backend, output events back.

Each `Generate` gets a small integer `req_id` (the backend's name for it) and a public request
id nobody can guess (what clients see). The stage supervisor's thread (supervisor.py) blocks in
`backend.read_events` and hands each batch of events to the event loop, which fans them out to
the connections; when a stage dies it restarts the stages, and the requests in flight resume on
the fresh ones where they were (recovery.py). Nothing on the event loop waits: a write to a
connection only grows that client's transport buffer (past `max_unread_bytes` the daemon drops
the connection, aborting its requests, rather than let one slow reader hold memory or stall the
others), and a request that finds no room (`max_num_seqs + max_waiting` requests in flight, or a
full request ring) is refused with `overloaded` at once.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from enum import Enum
from importlib import metadata
from typing import Protocol

from pipeline.errors import ErrorCode, Overloaded, PipelineError
from pipeline.protocol import (
    Abort,
    Aborted,
    Accepted,
    ClientMessage,
    Delta,
    Done,
    Error,
    Generate,
    Health,
    HealthReply,
    Profile,
    ServerMessage,
    Stats,
    StatsReply,
    TokenLogprobs,
    Usage,
    error_for,
    new_request_id,
)
from pipeline.engine.backend import Backend
from pipeline.serve.profile_control import answer_profile
from pipeline.serve.recovery import Recovery, ResumeState
from pipeline.serve.supervisor import RestartPolicy
from shm.ring import RecordTooLarge
from stages.contracts.outputs import OutputEvent
from stages.contracts.params import InvalidParams
from stages.process import IDLE_TICK_S

log = logging.getLogger("pipeline.serve")

DEFAULT_MAX_UNREAD_BYTES = 64 * 1024 * 1024
DEFAULT_GRACE_S = 30.0
MIN_STALL_S = 2 * IDLE_TICK_S
DEFAULT_STALL_S = 30.0  # generous: one CPU step of a large batch can take seconds
DEFAULT_MAX_WAITING = 1024


def _version() -> str:
    try:
        return metadata.version("pipeline")
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass(slots=True)
class DaemonConfig:
    """How the daemon serves, as opposed to how the engine runs (EngineConfig)."""

    grace_s: float = DEFAULT_GRACE_S  # on SIGTERM, how long requests in flight may take to finish
    stall_s: float = DEFAULT_STALL_S  # a stage whose loop has not gone round for this long is stuck
    max_waiting: int = DEFAULT_MAX_WAITING  # requests admitted beyond max_num_seqs
    max_restarts: int = 5  # stage restarts allowed within restart_window_s
    restart_window_s: float = 600.0
    max_unread_bytes: int = DEFAULT_MAX_UNREAD_BYTES  # per connection, before it is dropped

    def check(self) -> None:
        """Raises ValueError naming the first bad value."""
        if not self.grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s!r}")
        if not self.stall_s >= MIN_STALL_S:
            raise ValueError(f"stall_s must be at least {MIN_STALL_S:g} s (an idle stage beats every "
                             f"{IDLE_TICK_S:g} s), got {self.stall_s!r}")
        for name in ("max_waiting", "max_unread_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "max_unread_bytes" else 0):
                raise ValueError(f"{name} must be a {'positive' if name == 'max_unread_bytes' else 'non-negative'} "
                                 f"integer, got {value!r}")
        self.restart_policy().check()

    def restart_policy(self) -> RestartPolicy:
        return RestartPolicy(self.max_restarts, self.restart_window_s)


class Connection(Protocol):
    """One client's end, as the server sees it: replies go out through `send`, which never waits."""

    requests: dict[str, Request]  # this connection's running requests by public id

    def send(self, message: ServerMessage) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


class BackendState(Enum):
    SERVING = "serving"
    RESTARTING = "restarting"  # a stage died; the supervisor is starting fresh ones, requests wait
    DOWN = "down"  # a stage died and the supervisor gave up restarting


@dataclass(slots=True)
class Request:
    req_id: int
    request_id: str
    connection: Connection
    stream: bool
    num_logprobs: int | None
    resume: ResumeState
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # every output delivered: a restart resumes after them
    # Text and logprobs, kept only for requests that are not streamed (Done carries them).
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)


def _token_logprobs(event: OutputEvent) -> list[TokenLogprobs] | None:
    if event.logprobs is None or event.logprob_token_ids is None:
        return None
    logprobs = event.logprobs.tolist()
    token_ids = event.logprob_token_ids.tolist()
    return [TokenLogprobs(ids[0], lps[0], ids[1:], lps[1:]) for ids, lps in zip(token_ids, logprobs)]


class DaemonServer:
    """Routing between connections and the backend. Runs on the event loop's thread only."""

    def __init__(self, backend: Backend, max_num_seqs: int, config: DaemonConfig | None = None) -> None:
        config = config or DaemonConfig()
        config.check()
        self.config = config
        self.backend: Backend | None = backend  # None while the stages restart or stay down
        self.max_unread_bytes = config.max_unread_bytes
        self.max_num_seqs = max_num_seqs
        self.max_in_flight_requests = max_num_seqs + config.max_waiting
        self.connections: set[Connection] = set()
        self.started_at = time.monotonic()
        self.state = BackendState.SERVING
        self.last_failure: str | None = None  # why the stages last died
        self.down_reason: str | None = None  # why they were not restarted (state DOWN)
        self.num_restarts = 0
        self.recovery = Recovery()
        self.shutting_down = False
        self._requests: dict[int, Request] = {}  # by backend req_id: accepted and not finished
        self._idle = asyncio.Event()  # no request in flight
        self._idle.set()
        self._next_req_id = 0
        self._num_finished = 0
        self._num_overloaded = 0
        self._num_prompt_tokens = 0
        self._num_generated_tokens = 0

    # ---- client messages

    def handle(self, connection: Connection, message: ClientMessage) -> None:
        if isinstance(message, Generate):
            self._generate(connection, message)
        elif isinstance(message, Abort):
            self._abort(connection, message.request_id)
        elif isinstance(message, Health):
            connection.send(self._health())
        elif isinstance(message, Stats):
            connection.send(self._stats())
        elif isinstance(message, Profile):
            answer_profile(self.backend, message, connection.send)

    def _generate(self, connection: Connection, message: Generate) -> None:
        try:
            params = message.params.to_params()
        except InvalidParams as exc:
            connection.send(error_for(exc))
            return
        refusal = self._unavailable() or self._overloaded()
        if refusal is not None:
            connection.send(refusal)
            return
        request_id = new_request_id()
        req_id = self._next_req_id
        self._next_req_id += 1
        request = Request(req_id, request_id, connection, message.stream, params.logprobs,
                          ResumeState(message.prompt, params, submitted=True))
        if isinstance(message.prompt, list):
            request.prompt_token_ids = list(message.prompt)
        try:
            self.backend.submit(req_id, message.prompt, params)
        except Overloaded as exc:
            self._num_overloaded += 1
            connection.send(error_for(exc))
            return
        except (PipelineError, InvalidParams) as exc:
            connection.send(error_for(exc))
            return
        except RecordTooLarge:  # far longer than any max_model_len: refused before tokenizing
            unit = "characters" if isinstance(message.prompt, str) else "token ids"
            connection.send(Error(ErrorCode.PROMPT_TOO_LONG.value,
                                  f"prompt of {len(message.prompt)} {unit} is too large to queue"))
            return
        self._requests[req_id] = request
        self._idle.clear()
        connection.requests[request_id] = request
        connection.send(Accepted(request_id))

    def _unavailable(self) -> Error | None:
        """The error for a new request when the daemon cannot take one at all, or None."""
        if self.shutting_down:
            return Error(ErrorCode.ABORTED.value, "the daemon is shutting down and accepts no new requests")
        if self.state is BackendState.RESTARTING:
            return Error(ErrorCode.STAGE_FAILED.value, f"stages are restarting after: {self.last_failure}; retry")
        if self.state is BackendState.DOWN:
            return Error(ErrorCode.STAGE_FAILED.value,
                         f"stages failed ({self.last_failure}) and are not restarted: {self.down_reason}")
        return None

    def _overloaded(self) -> Error | None:
        """Error(overloaded) when as many requests are in flight as admission allows, else None."""
        if len(self._requests) < self.max_in_flight_requests:
            return None
        self._num_overloaded += 1
        return Error(ErrorCode.OVERLOADED.value,
                     f"the daemon is at its limit of {self.max_in_flight_requests} requests in flight "
                     f"(max_num_seqs {self.max_num_seqs} + max_waiting {self.config.max_waiting}); retry later")

    def _abort(self, connection: Connection, request_id: str) -> None:
        # Only the connection that made a request may abort it by message.
        request = connection.requests.get(request_id)
        if request is None:
            connection.send(Error(ErrorCode.NOT_FOUND.value, f"no running request {request_id} on this connection",
                                  None, request_id))
            return
        self._forget(request)
        self._abort_in_backend(request.req_id)
        connection.send(Error(ErrorCode.ABORTED.value, "aborted by the client", None, request_id))
        connection.send(Aborted(request_id))

    def drop_connection(self, connection: Connection) -> None:
        """A closed connection aborts every request still running on it."""
        self.connections.discard(connection)
        for request in list(connection.requests.values()):
            self._forget(request)
            self._abort_in_backend(request.req_id)

    def _abort_in_backend(self, req_id: int) -> None:
        if self.backend is None:
            return  # the stages died: nothing runs there any more
        try:
            self.backend.abort(req_id)
        except PipelineError as exc:  # a stage died; the supervisor ends every request in a moment
            log.warning("could not abort request %d: %s", req_id, exc.message)

    def _forget(self, request: Request) -> None:
        self._requests.pop(request.req_id, None)
        request.connection.requests.pop(request.request_id, None)
        if not self._requests:
            self._idle.set()

    # ---- backend output

    def on_events(self, events: list[OutputEvent]) -> None:
        for event in events:
            request = self._requests.get(event.req_id)
            if request is None:
                continue  # aborted or dropped meanwhile: its last tokens go nowhere
            self._on_event(request, event)
        if self.recovery.num_waiting and self.backend is not None:
            self._end_stage_failed(self.recovery.retry(self.backend, self._requests))

    def _on_event(self, request: Request, event: OutputEvent) -> None:
        connection = request.connection
        request.resume.answered = True
        if event.prompt_token_ids is not None:
            request.prompt_token_ids = event.prompt_token_ids.tolist()
        if event.error_code is not None:
            self._forget(request)
            connection.send(Error(event.error_code, event.error_message or event.error_code, event.error_field,
                                  request.request_id))
            return
        token_ids = event.token_ids.tolist()
        request.token_ids.extend(token_ids)
        self._num_generated_tokens += len(token_ids)
        logprobs = _token_logprobs(event) if request.num_logprobs is not None else None
        if request.stream:
            if event.text or token_ids:
                connection.send(Delta(request.request_id, event.text, token_ids, logprobs))
        else:
            request.texts.append(event.text)
            if logprobs:
                request.logprobs.extend(logprobs)
        if event.finish_reason is None:
            return
        self._forget(request)
        if event.finish_reason not in ("stop", "length"):
            connection.send(Error(ErrorCode.ABORTED.value, f"request ended: {event.finish_reason}", None,
                                  request.request_id))
            return
        self._num_finished += 1
        self._num_prompt_tokens += len(request.prompt_token_ids)
        usage = Usage(len(request.prompt_token_ids), len(request.token_ids))
        if request.stream:
            done = Done(request.request_id, event.finish_reason, request.prompt_token_ids, usage,
                        stop_reason=event.stop_reason)
        else:
            done = Done(request.request_id, event.finish_reason, request.prompt_token_ids, usage,
                        text="".join(request.texts), token_ids=request.token_ids,
                        logprobs=request.logprobs if request.num_logprobs is not None else None,
                        stop_reason=event.stop_reason)
        connection.send(done)

    # ---- the supervisor's (called on the loop; see pipeline/supervisor.py)

    def on_backend_failed(self, reason: str, stage: str | None = None) -> None:
        """A stage died: the requests in flight wait for fresh stages (but those the poison guard
        fails end with stage_failed), new ones are refused until then, and the backend is no
        longer touched (the supervisor closes it)."""
        log.error("stages failed: %s", reason)
        self.backend = None
        self.state = BackendState.RESTARTING
        self.last_failure = reason
        self._end_stage_failed([(request, self.recovery.guard_message(reason, stage))
                                for request in self.recovery.park(stage, self._requests.values())])

    def on_backend_restarted(self, backend: Backend) -> None:
        """Fresh stages run: every parked request resumes on them, in the order it came."""
        self.backend = backend
        self.state = BackendState.SERVING
        self.num_restarts += 1
        self._end_stage_failed(self.recovery.resume(backend, self._requests))

    def on_restarts_stopped(self, reason: str) -> None:
        """No fresh stages will come: the parked requests end with stage_failed."""
        self.state = BackendState.DOWN
        self.down_reason = reason
        self._end_stage_failed([(request, f"stages failed ({self.last_failure}) and are not restarted: {reason}")
                                for request in self._requests.values()])

    def _end_stage_failed(self, ended: list[tuple[Request, str]]) -> None:
        for request, message in ended:
            self._forget(request)
            request.connection.send(Error(ErrorCode.STAGE_FAILED.value, message, None, request.request_id))

    # ---- shutting down

    def begin_shutdown(self) -> None:
        """New requests are refused from now on; those in flight go on."""
        self.shutting_down = True

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    async def wait_idle(self) -> None:
        """Returns once no request is in flight."""
        await self._idle.wait()

    def shut_down(self) -> None:
        """Ends every request still running with `aborted`, then closes every connection."""
        for request in list(self._requests.values()):
            self._forget(request)
            request.connection.send(Error(
                ErrorCode.ABORTED.value,
                f"the daemon shut down before the request finished (grace period {self.config.grace_s:g} s)",
                None, request.request_id))
        for connection in list(self.connections):
            connection.close()

    # ---- health and stats

    def _health(self) -> HealthReply:
        """"ok" only while every stage lives and none has stalled, with no restart under way."""
        reply = HealthReply("ok", _version(), time.monotonic() - self.started_at, num_restarts=self.num_restarts,
                            last_failure=self.last_failure, shutdown_grace_s=self.config.grace_s)
        problems = ["the daemon is shutting down"] if self.shutting_down else []
        if self.state is BackendState.RESTARTING:
            problems.append(f"stages are restarting after: {self.last_failure}")
        elif self.state is BackendState.DOWN:
            problems.append(f"stages failed ({self.last_failure}) and are not restarted: {self.down_reason}")
        if self.backend is not None:
            reply.instance = getattr(self.backend, "instance", None)
            try:
                stages = self.backend.health()
            except Exception as exc:  # noqa: BLE001 - a broken backend is what health must report
                stages = []
                problems.append(f"the stages' health is unreadable: {exc}")
            for stage in stages:
                reply.stages[stage.name] = (f"{'alive' if stage.alive else 'dead'} pid {stage.pid} "
                                            f"heartbeat {stage.heartbeat_age_s:.2f}s")
                reply.stage_pids[stage.name] = stage.pid
                if not stage.alive:
                    problems.append(f"stage {stage.name!r} is dead")
                elif stage.heartbeat_age_s > self.config.stall_s:
                    problems.append(f"stage {stage.name!r} has not gone round its loop for "
                                    f"{stage.heartbeat_age_s:.1f} s (stall limit {self.config.stall_s:g} s)")
        if problems:
            reply.status = "degraded"
            reply.reason = "; ".join(problems)
            if self.state is not BackendState.SERVING:
                reply.stages["backend"] = f"failed: {self.last_failure}; {self.state.value}"
        return reply

    def _stats(self) -> StatsReply:
        uptime_s = time.monotonic() - self.started_at
        reply = StatsReply(
            num_finished_requests=self._num_finished,
            num_prompt_tokens_total=self._num_prompt_tokens,
            num_generated_tokens_total=self._num_generated_tokens,
            uptime_s=uptime_s,
            num_restarts=self.num_restarts,
            num_overloaded_requests=self._num_overloaded,
            max_in_flight_requests=self.max_in_flight_requests,
            num_resumed_requests=self.recovery.num_resumed,
            num_guard_failed_requests=self.recovery.num_failed_by_guard,
        )
        if self.backend is None:
            return reply
        try:
            stats = self.backend.stats()
        except Exception:  # noqa: BLE001 - the daemon's own counters still answer
            return reply
        reply.num_running_requests = stats.num_running
        reply.num_waiting_requests = stats.num_waiting
        reply.kv_blocks_used = stats.kv_blocks_used
        reply.kv_blocks_total = stats.kv_blocks_used + stats.kv_blocks_free
        reply.generated_tokens_per_s = stats.generated_tokens_per_s
        reply.prefix_cache_hit_rate = stats.prefix_cache_hit_rate
        return reply
