"""The daemon's end of profiling: a client's `Profile` message starts or stops the stages' capture.

The backend does the work (pipeline/engine/profiling.py for the stage processes); this answers
the message without blocking the event loop.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from pipeline.engine.backend import Backend
from pipeline.errors import ErrorCode, PipelineError
from pipeline.protocol import Error, Profile, ProfileReply, ServerMessage, error_for
from stages.contracts.params import InvalidParams


def answer_profile(backend: Backend | None, message: Profile, send: Callable[[ServerMessage], None]) -> None:
    """Starts or stops a capture as a client's `Profile` message asks; the reply goes to `send`.

    A start or stop waits on every stage (a stop writes their traces: seconds), so it runs on a
    worker thread of the running event loop, and the reply goes out when it is done.
    """
    if backend is None:
        send(Error(ErrorCode.STAGE_FAILED.value, "no stages to profile: they are restarting or down"))
        return

    def call() -> list[str]:
        if message.action == "start":
            backend.start_profile(message.directory)
            return []
        return backend.stop_profile()

    future = asyncio.get_running_loop().run_in_executor(None, call)
    future.add_done_callback(lambda done: send(_profile_reply(message.action, done)))


def _profile_reply(action: str, done: asyncio.Future) -> ServerMessage:
    if done.cancelled():
        return Error(ErrorCode.STAGE_FAILED.value, f"profile {action} was cancelled: the daemon is shutting down")
    exc = done.exception()
    if exc is None:
        return ProfileReply(action, done.result())
    if isinstance(exc, (PipelineError, InvalidParams)):
        return error_for(exc)
    return Error(ErrorCode.STAGE_FAILED.value, f"profile {action} failed: {type(exc).__name__}: {exc}")
