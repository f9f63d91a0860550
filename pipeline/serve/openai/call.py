"""One HTTP call's requests, as a connection of the daemon server.

A completion or chat call asks for several choices (n per prompt, and a batch of prompts); each
is one engine request. The server sends each request's replies here (`send`, on the event loop,
never waiting); the response's task takes them in order with `next_replies`. Closing the call
(the response is done, or the client went away) aborts whatever still runs, as closing a socket
connection does.

A streamed response may make the frames of plain text deltas at once (`text_frame`): they queue
as bytes, and once per turn of the event loop (DaemonServer.flush_later, one callback for every
call) they are written straight to the connection (`attach_writer`) in one write, without waking
the response's task. Anything else in the queue (a finish, an error, logprobs), a full
connection buffer or no writer, and the task writes the queue in order instead.

With a stream interval above 1 (`pipeline start --stream-interval N`), a choice's plain text is
held until N tokens have gathered, then framed as one delta: a write per N tokens instead of one
per token. Its first token goes out at once, and what is held goes out before its end or error.

Choices of one prompt share it: only the first is started at once, the others once it has its
first token, by when the prompt's full KV blocks are committed to the prefix cache, so the
others compute only the prompt's last block instead of all of it.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.errors import PipelineError, error_from_wire
from pipeline.protocol import Delta, Done, Error, ServerMessage, TokenLogprobs
from pipeline.serve.openai.asgi import CHUNK_HEADS, NUM_CHUNK_HEADS, DirectWriter, chunk
from pipeline.serve.openai.params import ChoiceRequest
from pipeline.serve.openai.responses import encoder
from pipeline.serve.openai.sse import ChatStream, CompletionStream
from pipeline.serve.requests import Request
from pipeline.serve.server import DaemonServer

_encode, _join = encoder.encode, b"".join  # bound once: the batch loop calls them per token


@dataclass(slots=True)
class Choice:
    """One choice's progress."""

    index: int
    prompt: str | list[int]
    request: ChoiceRequest
    request_id: str | None = None
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    done: Done | None = None
    error: PipelineError | None = None
    held: list[str] = field(default_factory=list)  # text not yet framed (a stream interval above 1)
    held_tokens: int = 0
    framed: bool = False  # its text has had a frame (the first goes out at once)

    @property
    def finished(self) -> bool:
        return self.done is not None or self.error is not None

    @property
    def prompt_key(self) -> object:
        """Equal for choices of the same prompt."""
        return self.prompt if isinstance(self.prompt, str) else tuple(self.prompt)

    def hold(self, text: str, num_tokens: int, interval: int) -> str | None:
        """With a stream interval above 1: the text to frame now (what is held, with `text`),
        or None while `text` waits for the interval's tokens (a choice's first text goes at once)."""
        self.held.append(text)
        self.held_tokens += num_tokens
        if self.framed and self.held_tokens < interval:
            return None
        return self.take_held()

    def take_held(self) -> str:
        text = "".join(self.held)
        self.held.clear()
        self.held_tokens = 0
        self.framed = True
        return text


@dataclass(slots=True)
class Reply:
    """What a response shows next of one choice: new text (and its tokens' logprobs), or its end."""

    choice: Choice
    text: str
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    error: PipelineError | None = None
    token_ids: list[int] | None = None


class HttpCall:
    """Implements the server's Connection protocol for one HTTP call."""

    __slots__ = ("server", "stream_interval", "requests", "choices", "text_frame", "_keep_logprobs", "_by_request_id",
                 "_waiting", "_replies", "_num_unmade", "_taken", "_flush_due", "_write", "_changed", "_closed", "_stream",
                 "_chunk_before", "_chunk_after", "_chunk_size")

    def __init__(self, server: DaemonServer, choices: list[ChoiceRequest], *, keep_logprobs: bool,
                 stream_interval: int = 1) -> None:
        self.server = server
        self.stream_interval = stream_interval  # text frames hold this many tokens (DaemonConfig.stream_interval)
        self.requests: dict[str, Request] = {}  # the server's: this call's running requests
        self.choices = [Choice(c.index, c.prompt, c) for c in choices]
        self._keep_logprobs = keep_logprobs
        self._by_request_id: dict[str, Choice] = {}
        self._waiting: dict[int, list[Choice]] = {}  # lead choice index -> choices of its prompt not started
        self._replies: list[Reply | bytes] = []  # bytes: a frame made at once, written as it is
        self._num_unmade = 0  # Reply objects in _replies: frames the response's task has to make
        self._taken = False  # the task holds replies it has not written yet
        self._flush_due = False
        self._write: DirectWriter | None = None
        self._changed = asyncio.Event()
        self._closed = False
        # Set by a streamed response: the frame of a choice's plain text delta (b"" for none).
        self.text_frame: Callable[[int, str], bytes] | None = None
        self._stream: CompletionStream | ChatStream | None = None
        # The one choice's text chunk template, once the stream has made it (sse chunk_template):
        # the bytes before its text and after it; the size without the text, -1 before.
        self._chunk_before = self._chunk_after = b""
        self._chunk_size = -1

    # ---- starting

    def start(self) -> None:
        """Starts the first choice of every prompt; raises what refuses one (nothing then runs).
        The others start once their lead has its first token."""
        leads: dict[object, Choice] = {}
        for choice in self.choices:
            lead = leads.setdefault(choice.prompt_key, choice)
            if lead is not choice:
                self._waiting.setdefault(lead.index, []).append(choice)
        try:
            for lead in leads.values():
                self._start(lead)
        except PipelineError:
            self.close()
            raise

    def _start(self, choice: Choice) -> None:
        request = choice.request
        choice.request_id = self.server.start_request(self, request.prompt, request.params, stream=True,
                                                      resume_token_ids=request.resume_token_ids)
        self._by_request_id[choice.request_id] = choice
        if self._keep_logprobs and request.params.logprobs is not None:
            choice.logprobs = []

    def _start_followers(self, lead: Choice) -> None:
        for follower in self._waiting.pop(lead.index, ()):
            try:
                self._start(follower)
            except PipelineError as exc:
                self._finish(follower, error=exc)

    # ---- the server's Connection protocol

    def send(self, message: ServerMessage) -> None:
        choice = self._by_request_id.get(getattr(message, "request_id", None))
        if choice is None or self._closed:
            return
        if isinstance(message, Delta):
            if not message.logprobs:
                self.send_text(message.request_id, message.text, message.token_ids)
                return
            self._took_tokens(choice, message.text, message.token_ids)
            if choice.logprobs is not None:
                choice.logprobs.extend(message.logprobs)
            self._queue(Reply(choice, message.text, message.logprobs, token_ids=message.token_ids))
        elif isinstance(message, Done):
            self._release_held(choice)
            choice.done = message
            self._queue(Reply(choice, "", finish_reason=message.finish_reason))
            self._start_followers(choice)
        elif isinstance(message, Error):
            self._finish(choice, error=error_from_wire(message.code, message.message, message.field))
        self._changed.set()

    def send_text(self, request_id: str, text: str, token_ids: list[int]) -> None:
        """`send(Delta(request_id, text, token_ids))`: most of a stream, made into its frame here."""
        choice = self._by_request_id.get(request_id)
        if choice is None or self._closed:
            return
        self._took_tokens(choice, text, token_ids)
        if self.text_frame is not None:
            if self.stream_interval > 1:
                due = choice.hold(text, len(token_ids), self.stream_interval)
                if due is None:
                    return
                text = due
            self._queue_text_frame(choice, text)
            return
        self._queue(Reply(choice, text, token_ids=token_ids))
        self._changed.set()

    def _release_held(self, choice: Choice) -> None:
        """The frame of a choice's held text, before whatever ends it."""
        if choice.held:
            self._queue_text_frame(choice, choice.take_held())

    def _queue_text_frame(self, choice: Choice, text: str) -> None:
        frame = self.text_frame(choice.index, text)  # type: ignore[misc]  # set: the caller checked
        if frame:
            self.queue_frame(frame)

    def _took_tokens(self, choice: Choice, text: str, token_ids: list[int]) -> None:
        choice.text.append(text)
        choice.num_tokens += len(token_ids)
        if token_ids and choice.index in self._waiting:
            asyncio.get_running_loop().call_soon(self._start_followers, choice)

    def _finish(self, choice: Choice, *, error: PipelineError) -> None:
        self._release_held(choice)
        choice.error = error
        self._queue(Reply(choice, "", error=error))
        for follower in self._waiting.pop(choice.index, ()):  # they never started: they fail alike
            follower.error = error
            self._queue(Reply(follower, "", error=error))
        self._changed.set()

    def _queue(self, reply: Reply) -> None:
        self._replies.append(reply)
        self._num_unmade += 1

    # ---- frames written straight to the connection

    def frame_text(self, stream: CompletionStream | ChatStream) -> None:
        """From now on a plain text delta is framed at once, by the stream's `text_frame`. A call
        of one choice takes its deltas from the server's batch loop itself (`_take_text`)."""
        self.text_frame = stream.text_frame
        self._stream = stream
        if len(self.choices) == 1:
            request = self.requests.get(self.choices[0].request_id)  # type: ignore[arg-type]
            if request is not None:
                request.text_sink = self._take_text

    def _take_text(self, text: str, num_tokens: int, writes: list[tuple[Callable[[bytes], object], bytes]]) -> None:
        """`send_text` for the call's one choice, from the server's batch loop: when nothing
        waits before its frame and the connection takes it, the frame goes in `writes` as an
        HTTP chunk made from the stream's template (the server writes them back to back once
        the batch is routed); else it queues. What a row needs sits in this call and its
        choice, so a row touches few objects."""
        choice = self.choices[0]
        choice.num_tokens += num_tokens
        if self.stream_interval > 1:
            due = choice.hold(text, num_tokens, self.stream_interval)
            if due is None:
                return
            text = due
        writer = self._write
        if self._replies or self._taken or self._closed or writer is None or not writer.ready():
            if not self._closed:
                self._queue_text_frame(choice, text)
            return
        size = self._chunk_size
        if size < 0 or not text:  # the template is not made yet, or the text shows nothing
            frame = self.text_frame(choice.index, text)  # type: ignore[misc]  # set with the sink
            if frame:
                writes.append((writer.write_chunk, chunk(frame)))
            template = self._stream.chunk_template(choice.index)  # type: ignore[union-attr]
            if template is not None:
                self._chunk_before, self._chunk_after, self._chunk_size = template
            return
        body = _encode(text)
        size += len(body)
        writes.append((writer.write_chunk, _join((CHUNK_HEADS[size], self._chunk_before, body, self._chunk_after))
                       if size < NUM_CHUNK_HEADS else chunk(self.text_frame(choice.index, text))))  # type: ignore[misc]

    def queue_frame(self, frame: bytes) -> None:
        """Queues a ready frame; it is written at the end of this turn of the event loop."""
        self._replies.append(frame)
        if not self._flush_due:
            self._flush_due = True
            self.server.flush_later(self)

    def attach_writer(self, writer: DirectWriter | None) -> None:
        """`writer(body)` puts bytes on the response's connection at once, or returns False
        (when the connection is gone or its buffer is full): then the task writes them."""
        self._write = writer

    def flush(self) -> None:
        self._flush_due = False
        if not self._replies:
            return
        write = self._write
        if (write is not None and not self._num_unmade and not self._taken and not self._closed
                and write(b"".join(self._replies))):  # type: ignore[arg-type]  # only bytes queued
            self._replies.clear()
            return
        self._changed.set()

    def close(self) -> None:
        """The response is over: whatever still runs is aborted."""
        if not self._closed:
            self._closed = True
            self._write = None
            self._waiting.clear()
            self.server.drop_connection(self)
            self._changed.set()

    def abort(self) -> None:
        self.close()

    # ---- the response's side

    async def next_replies(self) -> list[Reply | bytes]:
        """The replies that came since the last call, waiting for one unless every choice has
        finished or the call was closed (then [] means there is nothing more). Bytes are frames
        made already. Until the next call, nothing is written straight to the connection: the
        caller is writing these."""
        self._taken = False
        while not self._replies and not all_finished(self.choices) and not self._closed:
            self._changed.clear()
            await self._changed.wait()
        replies, self._replies = self._replies, []
        self._num_unmade = 0
        self._taken = bool(replies)
        return replies

    async def wait_finished(self) -> None:
        while await self.next_replies():
            pass


def all_finished(choices: list[Choice]) -> bool:
    """Whether every choice has its end (a finish or an error)."""
    return all(choice.finished for choice in choices)


def token_usage(choices: list[Choice]) -> tuple[int, int]:
    """The call's prompt tokens (each distinct prompt counted once) and completion tokens."""
    prompt_tokens: dict[object, int] = {}
    for choice in choices:
        if choice.done is not None:
            prompt_tokens[choice.prompt_key] = choice.done.usage.prompt_tokens
    completion_tokens = sum(choice.done.usage.completion_tokens if choice.done else choice.num_tokens
                            for choice in choices)
    return sum(prompt_tokens.values()), completion_tokens
