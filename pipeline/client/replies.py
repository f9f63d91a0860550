"""What a client makes of a request and its replies: the Generate message, the deltas, the result.

The same for the blocking and the asyncio client. Sampling params are validated here (by
building `SamplingParams`) before anything is sent: the client is the edge where a request
enters, and the daemon checks the wire values once more on arrival.
"""
from __future__ import annotations

import dataclasses
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from pipeline.errors import InvalidRequest, ProtocolError, error_from_wire
from pipeline.protocol import (
    Accepted,
    Chat,
    ChatTurn,
    Delta,
    Done,
    Error,
    Generate,
    Profile,
    ServerMessage,
    TokenLogprobs,
    Usage,
    WireSamplingParams,
)
from stages.contracts.params import MAX_TOKEN_ID, InvalidParams, SamplingParams

C = TypeVar("C")

_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))

Prompt = str | list[int]
Params = SamplingParams | dict[str, Any] | None
Messages = list[dict[str, str]]  # [{"role": ..., "content": ...}, ...], as the HTTP chat API takes them


@dataclass(slots=True)
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" or "length"
    prompt_token_ids: list[int]
    usage: Usage  # prompt_tokens, completion_tokens
    logprobs: list[TokenLogprobs] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


@dataclass(slots=True)
class StreamDelta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None


def make_generate(prompt: Prompt, params: Params, stream: bool) -> Generate:
    """The Generate message; InvalidRequest (naming the field) before anything is sent."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt", "must not be empty")
    elif isinstance(prompt, list):
        if not prompt:
            raise InvalidRequest("prompt", "must not be empty")
        for token_id in prompt:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id <= MAX_TOKEN_ID:
                raise InvalidRequest("prompt", f"token ids must be integers in [0, {MAX_TOKEN_ID}], got {token_id!r}")
    else:
        raise InvalidRequest("prompt", f"must be a str or a list of token ids, got {type(prompt).__name__}")
    return Generate(prompt=prompt, params=_wire_params(params), stream=stream)


def make_chat(messages: Messages, params: Params, stream: bool) -> Chat:
    """The Chat message of a conversation; InvalidRequest (naming the field) before anything is sent."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages", "must be a non-empty list of {'role': ..., 'content': ...}")
    turns = []
    for i, message in enumerate(messages):
        role, content = (message.get("role"), message.get("content")) if isinstance(message, dict) else (None, None)
        if not isinstance(role, str) or not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}]", f"must be a dict with str 'role' and 'content', got {message!r}")
        turns.append(ChatTurn(role, content))
    return Chat(messages=turns, params=_wire_params(params), stream=stream)


def _wire_params(params: Params) -> WireSamplingParams:
    """`params` checked and as the wire takes them; InvalidRequest naming a bad field."""
    try:
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            unknown = sorted(set(params) - _SAMPLING_FIELDS)
            if unknown:
                raise InvalidRequest(unknown[0], f"not a sampling parameter (known: {', '.join(sorted(_SAMPLING_FIELDS))})")
            params = SamplingParams(**params)
        elif isinstance(params, SamplingParams):
            params.validate()  # it may have been changed since it was made
        else:
            raise InvalidRequest("params", f"must be SamplingParams, a dict or None, got {type(params).__name__}")
    except InvalidRequest:
        raise
    except InvalidParams as exc:
        raise InvalidRequest.from_invalid_params(exc) from None
    return WireSamplingParams.from_params(params)


def make_stream_generates(prompts: list[Prompt], params: Params | list[Params]) -> list[Generate]:
    """A streamed Generate per prompt, with `params` for all or `params[i]` for prompt i."""
    if isinstance(params, list):
        if len(params) != len(prompts):
            raise InvalidRequest("params", f"a list of params needs one per prompt: {len(params)} params "
                                           f"for {len(prompts)} prompts")
        return [make_generate(prompt, p, stream=True) for prompt, p in zip(prompts, params)]
    return [make_generate(prompt, params, stream=True) for prompt in prompts]


class RunningRequests(Generic[C]):
    """The connection of each request a client has running, by request id: where its Abort goes.

    Connections are held weakly, so a stream dropped without closing still closes its socket
    (and so aborts its request) when it is collected.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._connections: weakref.WeakValueDictionary[str, C] = weakref.WeakValueDictionary()

    def add(self, request_id: str, connection: C) -> None:
        with self._lock:
            self._connections[request_id] = connection

    def discard(self, request_id: str | None) -> None:
        if request_id is not None:
            with self._lock:
                self._connections.pop(request_id, None)

    def get(self, request_id: str) -> C | None:
        with self._lock:
            return self._connections.get(request_id)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._connections)


class RequestReplies:
    """Follows the replies to one Generate: the same logic for the blocking and asyncio clients."""

    __slots__ = ("request_id", "done", "completion", "_texts", "_token_ids", "_logprobs")

    def __init__(self) -> None:
        self.request_id: str | None = None
        self.done = False
        self.completion: Completion | None = None
        self._texts: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprobs] = []

    def result(self) -> Completion:
        if self.completion is None:
            raise ProtocolError(f"request {self.request_id} has no Done reply yet")
        return self.completion

    def on_message(self, message: ServerMessage) -> StreamDelta | None:
        """A delta to yield, or None; raises the request's error when the daemon reports one."""
        if type(message) is Delta and message.request_id == self.request_id:  # nearly every message
            self._texts.append(message.text)
            self._token_ids.extend(message.token_ids)
            if message.logprobs:
                self._logprobs.extend(message.logprobs)
            return StreamDelta(message.text, message.token_ids, message.logprobs)
        if isinstance(message, Error):
            self.done = True
            raise error_from_wire(message.code, message.message, message.field, message.request_id or self.request_id)
        if isinstance(message, Accepted) and self.request_id is None:
            self.request_id = message.request_id
            return None
        if isinstance(message, Done) and message.request_id == self.request_id:
            self.done = True
            streamed = message.text is None
            self.completion = Completion(
                request_id=message.request_id,
                text="".join(self._texts) if streamed else message.text,
                token_ids=self._token_ids if streamed else list(message.token_ids or []),
                finish_reason=message.finish_reason,
                prompt_token_ids=message.prompt_token_ids,
                usage=message.usage,
                logprobs=(self._logprobs or None) if streamed else message.logprobs,
                stop_reason=message.stop_reason,
            )
            return None
        raise ProtocolError(f"unexpected {type(message).__name__} for request {self.request_id}")


def profile_message(action: str, directory: str | Path | None) -> Profile:
    if action not in ("start", "stop"):
        raise InvalidRequest("action", f"must be 'start' or 'stop', got {action!r}")
    return Profile(action, None if directory is None else str(directory))


def unary_reply(message: ServerMessage, expected: type) -> Any:
    if isinstance(message, Error):
        raise error_from_wire(message.code, message.message, message.field, message.request_id)
    if not isinstance(message, expected):
        raise ProtocolError(f"expected {expected.__name__}, got {type(message).__name__}")
    return message
