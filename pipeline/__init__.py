"""pipeline: an LLM serving engine whose stages run as separate processes."""
from pipeline.client import AsyncClient, Client, Completion, StreamDelta
from pipeline.errors import (
    DaemonNotRunning,
    InvalidRequest,
    Overloaded,
    PipelineError,
    PromptTooLong,
    ProtocolError,
    RequestAborted,
    StageFailed,
)
from pipeline.sampling_params import InvalidParams, SamplingParams

__all__ = [
    "LLM", "AsyncClient", "Client", "Completion", "DaemonNotRunning", "InvalidParams",
    "InvalidRequest", "Overloaded", "PipelineError", "PromptTooLong", "ProtocolError",
    "RequestAborted", "RequestOutput", "SamplingParams", "StageFailed", "StreamDelta",
]


def __getattr__(name: str) -> object:
    # LLM pulls in torch and the model stack: loaded on first use, so the client and the
    # daemon's light modules import fast.
    if name in ("LLM", "RequestOutput"):
        from pipeline import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
