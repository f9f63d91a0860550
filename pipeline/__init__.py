"""pipeline: an LLM serving engine whose stages run as separate processes.

Every public name is loaded on first use, so `import pipeline.<module>` loads only what that
module needs: the client never loads torch, and `LLM` loads the model stack only when used.
"""
from __future__ import annotations

from importlib import import_module

_HOMES = {
    "AsyncClient": "pipeline.client", "Client": "pipeline.client", "Completion": "pipeline.client",
    "StreamDelta": "pipeline.client",
    "DaemonNotRunning": "pipeline.errors", "InvalidRequest": "pipeline.errors", "Overloaded": "pipeline.errors",
    "PipelineError": "pipeline.errors", "PromptTooLong": "pipeline.errors", "ProtocolError": "pipeline.errors",
    "RequestAborted": "pipeline.errors", "StageFailed": "pipeline.errors",
    "EngineConfig": "stages.contracts.config",
    "InvalidParams": "stages.contracts.params", "SamplingParams": "stages.contracts.params",
    "LLM": "pipeline.engine.llm", "RequestOutput": "pipeline.engine.llm",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    return getattr(import_module(home), name)


def __dir__() -> list[str]:
    return __all__
