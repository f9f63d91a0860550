"""OpenAI-shaped errors: the exception a handler raises and the JSON body it answers with.

The official `openai` SDK picks its exception class from the HTTP status alone (400
BadRequestError, 401 AuthenticationError, 404 NotFoundError, 413 and other 4xx APIStatusError,
429 RateLimitError, >= 500 InternalServerError) and reads `message`, `type`, `param` and `code`
from the body, so every error carries all four.
"""
from __future__ import annotations

import msgspec

from pipeline.errors import (
    InvalidRequest,
    Overloaded,
    PipelineError,
    PromptTooLong,
    RequestAborted,
    RequestNotFound,
    StageFailed,
)
from stages.contracts.params import InvalidParams

# The `type` OpenAI's API sends for each status, used when a raiser does not name one.
DEFAULT_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class OpenAIError(Exception):
    """An error answered as `{"error": {...}}` with HTTP `status`; `param` names the bad field."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,  # noqa: A002 - the body's field is called `type`
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        if not 400 <= status <= 599:
            raise ValueError(f"an error status must be in [400, 599], got {status}")
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or DEFAULT_ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> OpenAIError:
        return cls(400, message, param=param)

    @classmethod
    def from_invalid_params(cls, exc: InvalidParams, param: str | None = None) -> OpenAIError:
        """A 400 for a sampling parameter out of range; `param` renames `exc.field` when the
        request spells the field differently (max_completion_tokens for max_tokens)."""
        message = str(exc)
        if param is not None and param != exc.field:
            message = param + message[len(exc.field) :] if message.startswith(exc.field) else message
        return cls(400, message, param=param or exc.field)


class _ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class _ErrorBody(msgspec.Struct):
    error: _ErrorDetail


_encoder = msgspec.json.Encoder()


def error_body(error: OpenAIError) -> bytes:
    """`{"error": {"message", "type", "param", "code"}}`, every key present (null when unset)."""
    return _encoder.encode(_ErrorBody(_ErrorDetail(error.message, error.type, error.param, error.code)))


def from_pipeline_error(exc: PipelineError) -> OpenAIError:
    """The HTTP error for what the daemon or the client library reported about a request."""
    if isinstance(exc, InvalidRequest):
        return OpenAIError.from_invalid_params(exc)
    if isinstance(exc, PromptTooLong):
        return OpenAIError(400, exc.message, code="context_length_exceeded")
    if isinstance(exc, Overloaded):
        # 503, not 429: the server is full for everyone, not this client over a quota.
        return OpenAIError(503, exc.message, code="overloaded")
    if isinstance(exc, RequestNotFound):
        return OpenAIError(404, exc.message)
    if isinstance(exc, RequestAborted):
        return OpenAIError(503, exc.message, code="aborted")
    if isinstance(exc, StageFailed):
        return OpenAIError(503, exc.message, code="stage_failed")
    code = exc.code.value if exc.code is not None else None
    return OpenAIError(500, exc.message, code=code)
