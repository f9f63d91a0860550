"""Resuming the requests in flight when a stage dies, and the poison guard that stops one request
from crashing the stages again and again.

When a stage dies the daemon parks every request in flight instead of failing it; once fresh
stages run, it resubmits each one as its prompt plus the outputs already delivered to the client,
with the same params. The stages admit it as they re-admit a preempted request, so max_tokens,
min_tokens, penalties, seeded sampling (a function of seed and output position) and stop strings
carry on exactly: the client's stream pauses, and goes on as if nothing had happened.

A request in flight during two crashes in a row of the same stage, with no output delivered
between them, may be what crashes it: the guard fails it, and the others resume. One that the
fresh stages served (a token delivered after its resubmission) went past whatever it met at the
first crash, so the second is not counted against it. Only deaths count: the supervisor parks
requests when a stage process has exited, never when one is merely slow (a stall verdict,
stalls.py, is no crash). A tokenizer worker holds a request only until it passes it on, so a
tokenizer crash suspects only requests the stages have not answered since they were (last)
submitted; every other stage holds every request in flight.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from pipeline.engine.backend import Backend
from pipeline.errors import Overloaded, PipelineError, StageFailed
from shm.ring import RecordTooLarge
from stages.contracts.params import InvalidParams, SamplingParams

INTAKE_STAGE = "tokenizer"  # a stage whose name starts so passes each request on before it runs
UNKNOWN_STAGE = "unknown"  # the guard's name for a failure that named no stage


@dataclass(slots=True)
class ResumeState:
    """What resuming one request needs besides its delivered outputs, and its record with the guard."""

    prompt: str | list[int]  # as the client sent it; text is resubmitted only until its ids are known
    params: SamplingParams
    submitted: bool = False  # to the backend now serving (a parked request waits for fresh stages)
    answered: bool = False  # the backend now serving has sent an event for it: it is past the tokenizer
    last_suspected_crash: int = 0  # the crash (counted from 1) it was last in flight for; 0: none
    tokens_at_suspected_crash: int = 0  # the outputs it had delivered at that crash


class Resumable(Protocol):
    """A daemon request as recovery sees it."""

    req_id: int
    prompt_token_ids: list[int]  # empty until known
    token_ids: list[int]  # every output token delivered to the client so far
    resume: ResumeState


R = TypeVar("R", bound=Resumable)


class Recovery:
    """Counts crashes, decides which parked requests the guard fails, and resubmits the rest.
    Runs on the daemon's event loop only."""

    def __init__(self) -> None:
        self.num_crashes = 0
        self.num_resumed = 0  # resubmissions to fresh stages (a request resumed twice counts twice)
        self.num_failed_by_guard = 0
        self._last_crash_stage: str | None = None
        self._backlog: deque[int] = deque()  # req_ids whose resubmission found the request ring full

    def park(self, stage: str | None, in_flight: Iterable[R]) -> list[R]:
        """Counts a crash of `stage` (None: unknown) with `in_flight` requests; returns those the
        guard fails: in flight during the previous crash too, which was of the same stage, with no
        output delivered since. The others wait for `resume`."""
        stage = stage or UNKNOWN_STAGE
        self.num_crashes += 1
        repeated = stage == self._last_crash_stage
        self._last_crash_stage = stage
        self._backlog.clear()
        failed = []
        for request in in_flight:
            state = request.resume
            if state.submitted and not (state.answered and stage.startswith(INTAKE_STAGE)):
                delivered = len(request.token_ids)
                if (repeated and state.last_suspected_crash == self.num_crashes - 1
                        and delivered == state.tokens_at_suspected_crash):
                    failed.append(request)
                state.last_suspected_crash, state.tokens_at_suspected_crash = self.num_crashes, delivered
            state.submitted = state.answered = False
        self.num_failed_by_guard += len(failed)
        return failed

    @staticmethod
    def guard_message(reason: str, stage: str | None) -> str:
        return (f"{reason}; the request was in flight during this crash and the one before it, both of stage "
                f"{stage or UNKNOWN_STAGE!r}, with no output delivered between them, so it is not resumed: it may "
                f"be what crashes it")

    def resume(self, backend: Backend, parked: dict[int, R]) -> list[tuple[R, str]]:
        """Resubmits every parked request (by req_id, in the order they came) to fresh stages; a
        full request ring keeps the rest for `retry`. Returns the requests the stages refused,
        each with why."""
        self._backlog.extend(parked)
        return self.retry(backend, parked)

    def retry(self, backend: Backend, requests: dict[int, R]) -> list[tuple[R, str]]:
        """Resubmits what still waits for room (call it whenever the stages have made progress)."""
        refused = []
        while self._backlog:
            request = requests.get(self._backlog[0])
            if request is None:  # aborted or disconnected while it waited
                self._backlog.popleft()
                continue
            state = request.resume
            prompt = request.prompt_token_ids or state.prompt
            try:
                backend.submit(request.req_id, prompt, state.params, request.token_ids)
            except Overloaded:
                return refused  # the tokenizer is that far behind; its progress brings another retry
            except StageFailed:
                return refused  # these stages die too: the supervisor parks everything again
            except (PipelineError, InvalidParams, RecordTooLarge) as exc:
                refused.append((request, f"the request could not be resumed after a stage restart: {exc}"))
            else:
                state.submitted = True
                self.num_resumed += 1
            self._backlog.popleft()
        return refused

    @property
    def num_waiting(self) -> int:
        """Parked requests whose resubmission waits for room in a request ring."""
        return len(self._backlog)
