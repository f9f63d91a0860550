"""A streamed call through the router, with zero-loss failover.

The router asks its replica for each chunk's token ids (the `return_token_ids` extension) and
keeps, per choice, every token delivered to the client. When the replica's stream breaks before
`[DONE]` (the replica died or its connection did, or it was taken for hung: silent past its
deadline while its /health did not answer ok, stall.py), every unfinished choice is resubmitted to
another replica as its own request: the same body with n = 1, the choice's own seed and prompt,
and the delivered tokens as `resume_token_ids`, which the daemon continues exactly as it resumes
a request after a stage crash (seeded sampling, penalties, max_tokens and stop strings go on from
the output position). The resumed chunks are renumbered to the choice's index and the
response's id, so the client's stream goes on with no error and no token lost or repeated.

A choice in flight on two replicas that died is not resubmitted a third time: like the daemon's
poison guard, the router ends it with an error frame saying it may be what kills them. Only deaths
count: a replica taken for hung under it is not one (a slow machine proves nothing against the
request). A choice under MAX_STALLS hung replicas in a row is ended too, so that a request that
no replica serves does not go round the ring for ever.
"""
from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from enum import Enum

import msgspec

from pipeline.router.stall import Stalled
from pipeline.router.upstream import UNREACHABLE, Opened, Refused, Sender
from pipeline.serve.openai.errors import OpenAIError, error_body

MAX_REPLICA_DEATHS = 2  # deaths of replicas a choice was in flight on, before it is failed
MAX_STALLS = 3  # replicas taken for hung in a row under a choice, before it is failed
DONE = b"data: [DONE]\n\n"
_DATA = b"data: "
_TOKEN_IDS = re.compile(rb',"token_ids":\[[0-9,]*\]')  # JSON escapes quotes inside text: only the field matches


class _Delta(msgspec.Struct):
    content: str | None = None
    role: str | None = None


class _Choice(msgspec.Struct):
    index: int
    finish_reason: str | None = None
    token_ids: list[int] = []
    text: str | None = None  # completions
    delta: _Delta | None = None  # chat


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    error: dict | None = None


_chunk_decoder = msgspec.json.Decoder(_Chunk)


class End(Enum):
    """How an upstream stream ended."""

    DONE = "done"  # its [DONE] came
    DIED = "died"  # its connection ended or broke first: the replica died under it
    HUNG = "hung"  # its replica was taken for hung (stall.py): not a death


@dataclass(slots=True)
class ChoiceState:
    index: int
    resume_fields: dict  # what its own request changes in the body: n, seed, prompt
    token_ids: list[int] = field(default_factory=list)
    num_chars: int = 0  # of text delivered (completion logprobs' text_offset go on from it)
    finished: bool = False
    deaths: int = 0  # of replicas it was in flight on
    stalls: int = 0  # replicas taken for hung under it since it last made progress


def _given_up(choice: ChoiceState) -> tuple[str, str] | None:
    """(reason, message) when `choice` is not resubmitted again: too many deaths under it, or
    too many replicas in a row taken for hung."""
    if choice.deaths >= MAX_REPLICA_DEATHS:
        return "replica_deaths", (f"choice {choice.index} was in flight on {choice.deaths} replicas that died in a row; "
                                  "it is not resubmitted again: it may be what kills them")
    if choice.stalls >= MAX_STALLS:
        return "replica_stalls", (f"choice {choice.index} was on {choice.stalls} replicas in a row that went silent "
                                  "under it and were taken for hung; it is not resubmitted again")
    return None


@dataclass(slots=True)
class _Attempt:
    """One upstream stream: upstream choice index -> the client's, and how to rewrite its chunks."""

    opened: Opened
    choices: dict[int, ChoiceState]
    resumed: bool
    base_chars: dict[int, int] = field(default_factory=dict)  # resumed: choice index -> chars before


class StreamRelay:
    def __init__(self, sender: Sender, body: dict, choices: list[ChoiceState], *, client_wants_ids: bool,
                 include_usage: bool, max_tokens: int | None, count_prompt_tokens: Callable[[], int],
                 on_failover: Callable[[], None], on_failed: Callable[[str], None]) -> None:
        self.sender = sender
        self.body = body
        self.choices = choices
        self.client_wants_ids = client_wants_ids
        self.include_usage = include_usage
        self.max_tokens = max_tokens
        self.count_prompt_tokens = count_prompt_tokens
        self.on_failover = on_failover
        self.on_failed = on_failed  # with the reason the router ended a choice
        self.failed_over = False
        self.head: dict | None = None  # id, object, created, model of the response's chunks
        self._usage_frame: bytes | None = None
        # frames, or (attempt, end) when an upstream stream ended (attempt None: never opened)
        self._queue: asyncio.Queue[bytes | tuple[_Attempt | None, End]] = asyncio.Queue()
        self._tasks: set[asyncio.Task[None]] = set()
        self._num_running = 0  # upstream streams whose end is not yet taken from the queue
        self._first: _Attempt | None = None

    def upstream_body(self) -> bytes:
        body = dict(self.body, stream=True, return_token_ids=True)
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        return msgspec.json.encode(body)

    async def open(self) -> Refused | None:
        """Opens the first upstream stream; a refusal is the response the client gets instead."""
        opened = await self.sender.open(self.upstream_body(), stream=True)
        if isinstance(opened, Refused):
            return opened
        self._first = _Attempt(opened, {c.index: c for c in self.choices}, resumed=False)
        return None

    async def frames(self) -> AsyncIterator[bytes]:
        try:
            self._spawn(self._read(self._first))
            while self._num_running or not self._queue.empty():
                item = await self._queue.get()
                if isinstance(item, bytes):
                    yield item
                    continue
                self._num_running -= 1
                attempt, end = item
                if attempt is not None and end is not End.DONE:
                    for frame in self._fail_over(attempt, end):
                        yield frame
            if self.include_usage:
                yield self._usage()
            yield DONE
        finally:
            for task in self._tasks:
                task.cancel()

    # ---- upstream streams

    def _spawn(self, stream: Coroutine[None, None, None]) -> None:
        """Runs one upstream stream; it ends by putting (attempt, end) on the queue."""
        self._num_running += 1
        task = asyncio.ensure_future(stream)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _read(self, attempt: _Attempt) -> None:
        response, replica = attempt.opened.response, attempt.opened.replica
        end, why = End.DIED, "a stream from it broke before its end"
        progress_at = time.monotonic()  # of the last line read
        frame_at: float | None = None  # of the last frame read
        try:
            while line := await self.sender.wait(response.content.readline(), replica, progress_at):
                progress_at = time.monotonic()
                if not line.startswith(_DATA):
                    continue
                if frame_at is not None:
                    replica.pace.observe(progress_at - frame_at)
                frame_at = progress_at
                payload = line[len(_DATA):].rstrip(b"\r\n")
                if payload == b"[DONE]":
                    end = End.DONE
                    break
                frame = self._relay(attempt, payload)
                if frame:
                    self._queue.put_nowait(frame)
        except Stalled as stalled:
            end, why = End.HUNG, str(stalled)
        except UNREACHABLE:
            pass
        finally:
            if end is End.DONE:
                response.release()
            else:
                response.close()
            self.sender.end(replica)
        if end is End.DIED:
            self.sender.died(replica, why)
        elif end is End.HUNG:
            self.sender.router.replicas.mark(replica.url, False, why)
        self._queue.put_nowait((attempt, end))

    def _relay(self, attempt: _Attempt, payload: bytes) -> bytes | None:
        """The frame the client gets for one upstream chunk (None: nothing), and the choices'
        progress recorded."""
        chunk = _chunk_decoder.decode(payload)
        if chunk.error is not None:  # the replica failed the request itself: it stays failed
            for choice in attempt.choices.values():
                choice.finished = True
            return _DATA + payload + b"\n\n"
        if not chunk.choices:  # the usage chunk: sent at the end, from the router's count
            self._usage_frame = _DATA + payload + b"\n\n"
            return None
        if self.head is None:
            self.head = {name: value for name, value in msgspec.json.decode(payload).items()
                         if name in ("id", "object", "created", "model")}
        for upstream in chunk.choices:
            choice = attempt.choices[upstream.index]
            choice.token_ids.extend(upstream.token_ids)
            if upstream.token_ids:
                choice.stalls = 0
            text = upstream.text if upstream.delta is None else upstream.delta.content
            choice.num_chars += len(text or "")
            if upstream.finish_reason is not None:
                choice.finished = True
        if not attempt.resumed:
            return _DATA + (payload if self.client_wants_ids else _TOKEN_IDS.sub(b"", payload)) + b"\n\n"
        return self._rewrite(attempt, payload)

    def _rewrite(self, attempt: _Attempt, payload: bytes) -> bytes | None:
        """A resumed stream's chunk as the first stream would have sent it: the choice's index,
        the response's id, no second role, text offsets going on."""
        chunk = msgspec.json.decode(payload)
        kept = []
        for upstream in chunk["choices"]:
            choice = attempt.choices[upstream["index"]]
            upstream["index"] = choice.index
            ids = upstream.get("token_ids") or []
            if not self.client_wants_ids:
                upstream.pop("token_ids", None)
            delta = upstream.get("delta")
            if delta is not None:
                if delta.pop("role", None) is not None and not delta.get("content") and not ids \
                        and upstream.get("finish_reason") is None:
                    continue  # the resumed request's opening chunk: the client had it long ago
            logprobs = upstream.get("logprobs")
            if isinstance(logprobs, dict) and isinstance(logprobs.get("text_offset"), list):
                base = attempt.base_chars.get(choice.index, 0)
                logprobs["text_offset"] = [offset + base for offset in logprobs["text_offset"]]
            kept.append(upstream)
        if not kept:
            return None
        chunk["choices"] = kept
        chunk.update(self.head or {})
        return _DATA + msgspec.json.encode(chunk) + b"\n\n"

    # ---- failover

    def _fail_over(self, attempt: _Attempt, end: End) -> list[bytes]:
        """Resubmits the broken stream's unfinished choices elsewhere; returns frames to send now
        (the end of a choice that cannot go on). Only a death counts against a choice's poison
        guard; a replica taken for hung counts against MAX_STALLS, and only in a row."""
        frames = []
        for choice in attempt.choices.values():
            if choice.finished:
                continue
            if end is End.DIED:
                choice.deaths += 1
            else:
                choice.stalls += 1
            given_up = _given_up(choice)
            if given_up is not None:
                choice.finished = True
                self.on_failed(given_up[0])
                frames.append(self._error_frame(OpenAIError(503, given_up[1], code="stage_failed")))
            elif self.max_tokens is not None and len(choice.token_ids) >= self.max_tokens:
                choice.finished = True  # its last tokens came, its end did not
                frames.append(self._finish_frame(choice, "length"))
            else:
                self.failed_over = True
                self.on_failover()
                self._spawn(self._resume(choice))
        return frames

    async def _resume(self, choice: ChoiceState) -> None:
        body = dict(self.body, **choice.resume_fields, stream=True, return_token_ids=True,
                    resume_token_ids=list(choice.token_ids))
        body.pop("stream_options", None)
        body.pop("echo", None)
        opened = await self.sender.open(msgspec.json.encode(body), stream=True)
        if isinstance(opened, Refused):
            choice.finished = True
            self._queue.put_nowait(_DATA + opened.body + b"\n\n" if opened.body.startswith(b"{\"error\"") else
                                   self._error_frame(OpenAIError(503, f"resuming choice {choice.index} failed: "
                                                                      f"HTTP {opened.status}")))
            self._queue.put_nowait((None, End.DONE))
            return
        attempt = _Attempt(opened, {0: choice}, resumed=True, base_chars={choice.index: choice.num_chars})
        await self._read(attempt)

    # ---- frames of the router's own

    def _error_frame(self, error: OpenAIError) -> bytes:
        return _DATA + error_body(error) + b"\n\n"

    def _finish_frame(self, choice: ChoiceState, reason: str) -> bytes:
        head = self.head or {}
        if head.get("object") == "chat.completion.chunk":
            entry = {"index": choice.index, "delta": {}, "logprobs": None, "finish_reason": reason}
        else:
            entry = {"text": "", "index": choice.index, "logprobs": None, "finish_reason": reason}
        return _DATA + msgspec.json.encode({**head, "choices": [entry]}) + b"\n\n"

    def _usage(self) -> bytes:
        if not self.failed_over and self._usage_frame is not None:
            return self._usage_frame
        completion = sum(len(choice.token_ids) for choice in self.choices)
        prompt = self.count_prompt_tokens()
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        return _DATA + msgspec.json.encode({**(self.head or {}), "choices": [], "usage": usage}) + b"\n\n"
