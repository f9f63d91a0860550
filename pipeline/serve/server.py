"""The daemon's routing: requests from connections to the backend, output events back.

Each request gets a small integer `req_id` (the backend's name for it) and a public request id
nobody can guess (what clients see). A connection is anything that takes replies without
waiting (requests.py): a Unix-socket client (socket_connection.py) or one HTTP call
(openai/call.py), which turn their clients' messages into `start_request`, `abort_request` and
`drop_connection`. The event loop reads the stages' events as their ring's doorbell wakes it
(supervisor.py, LoopReader) and fans them out to the connections (a step's plain tokens through
token_routing.py); the stage supervisor's thread watches the stages, and when one dies it
restarts them, and the requests in flight resume on the fresh ones where they were
(recovery.py). Health and stats replies are status.py's. Nothing on the event loop waits: a
write to a connection only grows that client's buffer, and a request that finds no room
(`max_num_seqs + max_waiting` requests in flight, or a full request ring) is refused with
`overloaded` at once. Every request's life is recorded in the daemon's metrics (metrics.py).
"""
from __future__ import annotations

import asyncio
import logging
import time
from enum import Enum

from pipeline.engine.backend import Backend
from pipeline.errors import InvalidRequest, Overloaded, PipelineError, PromptTooLong, RequestAborted, StageFailed
from pipeline.protocol import Aborted, Delta, Done, Error, ServerMessage, TokenLogprobs, Usage, new_request_id
from pipeline.serve.config import DaemonConfig
from pipeline.serve.metrics import Metrics
from pipeline.serve.model import ServedModel
from pipeline.serve.recovery import Recovery, ResumeState
from pipeline.serve.requests import Connection, FlushLater, Request
from pipeline.serve.stalls import StallJudge
from pipeline.serve.status import health_reply, stats_reply
from pipeline.serve.token_routing import route_token_texts
from shm.ring import RecordTooLarge
from stages.contracts.errors import ErrorCode
from stages.contracts.outputs import OutputEvent, TokenTexts
from stages.contracts.params import InvalidParams, SamplingParams

log = logging.getLogger("pipeline.serve")


class BackendState(Enum):
    SERVING = "serving"
    RESTARTING = "restarting"  # a stage died; the supervisor is starting fresh ones, requests wait
    DOWN = "down"  # a stage died and the supervisor gave up restarting


def _token_logprobs(event: OutputEvent) -> list[TokenLogprobs] | None:
    if event.logprobs is None or event.logprob_token_ids is None:
        return None
    logprobs = event.logprobs.tolist()
    token_ids = event.logprob_token_ids.tolist()
    return [TokenLogprobs(ids[0], lps[0], ids[1:], lps[1:]) for ids, lps in zip(token_ids, logprobs)]


class DaemonServer:
    """Routing between connections and the backend. Runs on the event loop's thread only."""

    def __init__(self, backend: Backend, max_num_seqs: int, config: DaemonConfig | None = None,
                 model: ServedModel | None = None) -> None:
        config = config or DaemonConfig()
        config.check()
        self.config = config
        self.backend: Backend | None = backend  # None while the stages restart or stay down
        self.model = model
        self.metrics = Metrics(model.name if model is not None else "default")
        self.recovery = Recovery()
        self.stalls = StallJudge(config.stall_s)  # the supervisor's thread and health() feed it
        self.max_unread_bytes = config.max_unread_bytes
        self.max_num_seqs = max_num_seqs
        self.max_in_flight_requests = max_num_seqs + config.max_waiting
        self.connections: set[Connection] = set()
        self.started_at = time.monotonic()
        self.state = BackendState.SERVING
        self.last_failure: str | None = None  # why the stages last died
        self.down_reason: str | None = None  # why they were not restarted (state DOWN)
        self.num_restarts = 0
        self.shutting_down = False
        self.http_url: str | None = None  # where the HTTP API listens, once it does
        self._requests: dict[int, Request] = {}  # by backend req_id: accepted and not finished
        self._idle = asyncio.Event()  # no request in flight
        self._idle.set()
        self.flush_later = FlushLater()  # flush_later(connection): its flush() at the end of this turn
        self._next_req_id = 0
        self.num_finished = 0
        self.num_overloaded = 0
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0

    # ---- requests from connections

    def start_request(self, connection: Connection, prompt: str | list[int], params: SamplingParams,
                      stream: bool, resume_token_ids: list[int] | None = None, *, delta_frames: bool = False) -> str:
        """Hands a request to the backend for `connection`, which then gets its Delta (when
        streamed) and Done or Error messages; returns its public id. `resume_token_ids` are
        outputs delivered elsewhere (by a replica that died) that it continues after, as a
        request resumed after a crash does. With `delta_frames` its plain deltas go in `Deltas`
        frames (the connection must read them). Raises InvalidRequest (a logit_bias id outside the
        vocabulary), Overloaded, StageFailed, RequestAborted (shutting down) or PromptTooLong when
        it is refused."""
        self._check_available()
        if self.model is not None and self.model.vocab_size:
            try:
                params.check_vocab(self.model.vocab_size)
            except InvalidParams as exc:
                raise InvalidRequest.from_invalid_params(exc) from None
        if len(self._requests) >= self.max_in_flight_requests:
            self.num_overloaded += 1
            raise Overloaded(f"the daemon is at its limit of {self.max_in_flight_requests} requests in flight "
                             f"(max_num_seqs {self.max_num_seqs} + max_waiting {self.config.max_waiting}); retry later")
        req_id = self._next_req_id
        self._next_req_id += 1
        restarting = self.state is BackendState.RESTARTING
        request = Request(req_id, new_request_id(), connection, stream, stream and delta_frames, params.logprobs,
                          self.metrics.request_arrived(), ResumeState(prompt, params, submitted=not restarting))
        if isinstance(prompt, list):
            request.prompt_token_ids = list(prompt)
        if resume_token_ids:
            request.token_ids = list(resume_token_ids)
        if not restarting:  # else it waits with the parked requests and starts with them on the fresh stages
            try:
                self.backend.submit(req_id, prompt, params, request.token_ids)
            except Overloaded:
                self.num_overloaded += 1
                raise
            except RecordTooLarge:  # far longer than any max_model_len: refused before tokenizing
                unit = "characters" if isinstance(prompt, str) else "token ids"
                raise PromptTooLong(f"prompt of {len(prompt)} {unit} is too large to queue") from None
        self._requests[req_id] = request
        self._idle.clear()
        connection.requests[request.request_id] = request
        return request.request_id

    def _check_available(self) -> None:
        """Raises why the daemon cannot take a request at all now, if it cannot."""
        if self.shutting_down:
            raise RequestAborted("the daemon is shutting down and accepts no new requests")
        if self.state is BackendState.DOWN:
            raise StageFailed(f"stages failed ({self.last_failure}) and are not restarted: {self.down_reason}")

    def abort_request(self, connection: Connection, request_id: str) -> None:
        """A client's Abort: only the connection that made a request may abort it by message."""
        request = connection.requests.get(request_id)
        if request is None:
            connection.send(Error(ErrorCode.NOT_FOUND.value, f"no running request {request_id} on this connection",
                                  None, request_id))
            return
        self._end(request, "abort")
        self._abort_in_backend(request.req_id)
        connection.send(Error(ErrorCode.ABORTED.value, "aborted by the client", None, request_id))
        connection.send(Aborted(request_id))

    def drop_connection(self, connection: Connection) -> None:
        """A closed connection aborts every request still running on it."""
        self.connections.discard(connection)
        for request in list(connection.requests.values()):
            self._end(request, "abort")
            self._abort_in_backend(request.req_id)

    def _abort_in_backend(self, req_id: int) -> None:
        if self.backend is None:
            return  # the stages died: nothing runs there any more
        try:
            self.backend.abort(req_id)
        except PipelineError as exc:  # a stage died; the supervisor ends every request in a moment
            log.warning("could not abort request %d: %s", req_id, exc.message)

    def _end(self, request: Request, reason: str) -> None:
        """The request is over for the daemon ("stop", "length", "abort" or "error")."""
        self._requests.pop(request.req_id, None)
        request.connection.requests.pop(request.request_id, None)
        if not self._requests:
            self._idle.set()
        self.metrics.request_finished(request.timeline, reason, num_prompt_tokens=len(request.prompt_token_ids),
                                      queue_time_s=request.queue_time_s)

    # ---- backend output

    def on_events(self, events: list[OutputEvent | TokenTexts]) -> None:
        for event in events:
            if isinstance(event, TokenTexts):
                self.num_generated_tokens += route_token_texts(event, self._requests, self.metrics)
                continue
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
        if event.scheduled_ns is not None:
            request.queue_time_s = max(0.0, event.scheduled_ns / 1e9 - request.timeline.arrival_s)
        if event.error_code is not None:
            self._end(request, "error")
            connection.send(Error(event.error_code, event.error_message or event.error_code, event.error_field,
                                  request.request_id))
            return
        token_ids = event.token_ids.tolist()
        if token_ids:
            request.token_ids.extend(token_ids)
            self.num_generated_tokens += len(token_ids)
            self.metrics.tokens_generated(request.timeline, len(token_ids))
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
        if event.finish_reason not in ("stop", "length"):
            self._end(request, "abort")
            connection.send(Error(ErrorCode.ABORTED.value, f"request ended: {event.finish_reason}", None,
                                  request.request_id))
            return
        self._end(request, event.finish_reason)
        self.num_finished += 1
        self.num_prompt_tokens += len(request.prompt_token_ids)
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

    # ---- the supervisor's (called on the loop; see pipeline/serve/supervisor.py)

    def on_backend_failed(self, reason: str, stage: str | None = None) -> None:
        """A stage died: the requests in flight wait for fresh stages (but those the poison guard
        fails end with stage_failed), new ones wait with them (within max_waiting), and the
        backend is no longer touched (the supervisor closes it)."""
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
            self._end(request, "error")
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
            self._end(request, "abort")
            request.connection.send(Error(
                ErrorCode.ABORTED.value,
                f"the daemon shut down before the request finished (grace period {self.config.grace_s:g} s)",
                None, request.request_id))
        for connection in list(self.connections):
            connection.close()

    # ---- health and stats (status.py)

    def health(self) -> ServerMessage:
        return health_reply(self)

    def stats(self) -> ServerMessage:
        return stats_reply(self)
