"""The errors a client can see, and the wire codes that carry them from the daemon."""
from __future__ import annotations

from pathlib import Path

from stages.contracts.errors import ErrorCode
from stages.contracts.params import InvalidParams


class PipelineError(Exception):
    """Base of every error the client library raises."""

    code: ErrorCode | None = None  # the wire code, for errors the daemon reports

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id


class DaemonNotRunning(PipelineError):
    """Nothing listens on the socket: no file there, or a stale one."""

    def __init__(self, socket_path: Path | str) -> None:
        super().__init__(f"no pipeline daemon is listening on {socket_path} (start one with `pipeline start`)")
        self.socket_path = Path(socket_path)


class ConnectionLost(PipelineError):
    """The daemon closed the connection while a reply was still due."""


class InvalidRequest(PipelineError, InvalidParams):
    """A request field is out of its allowed range; `field` names it (the message gives the range).

    Also an `InvalidParams`, so one `except` catches it whether the client or the daemon found it.
    """

    code = ErrorCode.INVALID_PARAMS

    def __init__(self, field_name: str, message: str, request_id: str | None = None) -> None:
        InvalidParams.__init__(self, field_name, message)
        self.message = str(self)
        self.request_id = request_id

    @classmethod
    def from_invalid_params(cls, exc: InvalidParams, request_id: str | None = None) -> InvalidRequest:
        return cls(exc.field, _without_field_prefix(str(exc), exc.field), request_id)


class PromptTooLong(PipelineError):
    code = ErrorCode.PROMPT_TOO_LONG


class Overloaded(PipelineError):
    """The daemon has no room for another request now; retry later."""

    code = ErrorCode.OVERLOADED


class StageFailed(PipelineError):
    """A stage process died or reported an internal error while serving the request.

    `stage` names the stage that failed when the daemon knows it (the poison guard counts crashes
    per stage); None on the client side and for failures of no one stage.
    """

    code = ErrorCode.STAGE_FAILED

    def __init__(self, message: str, request_id: str | None = None, stage: str | None = None) -> None:
        super().__init__(message, request_id)
        self.stage = stage


class RequestAborted(PipelineError):
    """The request was aborted (by `abort`, or by the daemon shutting down) before it finished."""

    code = ErrorCode.ABORTED


class RequestNotFound(PipelineError):
    """No running request of this connection has that id: it finished, never existed, or is
    another client's (a client can abort only its own requests)."""

    code = ErrorCode.NOT_FOUND


class ProtocolError(PipelineError):
    """Bytes on the socket are not a valid frame or message; the message says what is wrong."""

    code = ErrorCode.PROTOCOL


class UnsafeSocketDirectory(PipelineError):
    """The socket's directory could let another user connect or replace the socket."""


_BY_CODE: dict[ErrorCode, type[PipelineError]] = {
    cls.code: cls
    for cls in (PromptTooLong, Overloaded, StageFailed, RequestAborted, RequestNotFound, ProtocolError)
    if cls.code is not None
}


def error_from_wire(code: str, message: str, field: str | None = None, request_id: str | None = None) -> PipelineError:
    """The exception for an `Error` message; an unknown code (a newer daemon) gives PipelineError."""
    try:
        error_code = ErrorCode(code)
    except ValueError:
        return PipelineError(f"{code}: {message}", request_id)
    if error_code is ErrorCode.INVALID_PARAMS:
        name = field or "request"
        return InvalidRequest(name, _without_field_prefix(message, name), request_id)
    return _BY_CODE[error_code](message, request_id)


def _without_field_prefix(message: str, field_name: str) -> str:
    """InvalidParams messages read "field: problem"; InvalidRequest adds the prefix itself."""
    prefix = f"{field_name}: "
    return message[len(prefix) :] if message.startswith(prefix) else message
