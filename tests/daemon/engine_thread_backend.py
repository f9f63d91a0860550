"""The in-process backend with a fault to inject, for daemon tests: a text prompt containing
FAIL_PROMPT makes the engine thread die, which the daemon sees as a stage failure."""
from __future__ import annotations

from collections.abc import Sequence

from pipeline.engine.inprocess import InProcessBackend
from stages.contracts.outputs import OutputEvent
from stages.contracts.params import SamplingParams

FAIL_PROMPT = "<<kill the engine>>"


class EngineThreadBackend(InProcessBackend):
    def add(self, req_id: int, prompt: str | list[int], params: SamplingParams,
            output_token_ids: Sequence[int] = ()) -> list[OutputEvent]:
        if isinstance(prompt, str) and FAIL_PROMPT in prompt:
            raise RuntimeError("asked to fail by the test prompt")
        return super().add(req_id, prompt, params, output_token_ids)
