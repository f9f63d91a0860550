"""Error codes: how a refused or failed request is named on every ring and on the wire."""
from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    """`Error.code` on the wire; each maps to one client exception class (pipeline/errors.py)."""

    INVALID_PARAMS = "invalid_params"
    PROMPT_TOO_LONG = "prompt_too_long"
    OVERLOADED = "overloaded"
    STAGE_FAILED = "stage_failed"
    ABORTED = "aborted"
    NOT_FOUND = "not_found"
    PROTOCOL = "protocol"
