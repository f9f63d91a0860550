"""Driving a StageBackend in a test: submit requests and collect each one's whole output."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from device_choice import engine_device

from pipeline.engine.multiprocess import StageBackend
from stages.contracts.config import EngineConfig
from stages.contracts.outputs import OutputEvent
from stages.contracts.params import SamplingParams
from shm.naming import list_entries, new_instance_id

MakeBackend = Callable[..., StageBackend]
SMALL = dict(max_num_seqs=8, num_kv_blocks=96, block_size=4, max_model_len=128,
             max_num_batched_tokens=64)


def start_backend(model: Path, **options: object) -> StageBackend:
    return StageBackend(EngineConfig(model=str(model), **{"device": engine_device(), **SMALL, **options}),
                        new_instance_id())


def assert_cleaned_up(backend: StageBackend) -> None:
    """After close(): no stage process left, no /dev/shm entry of the instance."""
    assert all(not process.is_alive() for _, process in backend.processes.procs)
    assert not [e for e in list_entries() if backend.instance in e]


@dataclass
class Collected:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: OutputEvent | None = None
    prompt_token_ids: list[int] | None = None
    logprobs: list[np.ndarray] = field(default_factory=list)
    num_events: int = 0


def collect(backend: StageBackend, req_ids: list[int], timeout_s: float = 30.0) -> dict[int, Collected]:
    """Read events until every request in `req_ids` has ended (finish or error)."""
    results = {req_id: Collected() for req_id in req_ids}
    pending = set(req_ids)
    deadline = time.monotonic() + timeout_s
    while pending:
        assert time.monotonic() < deadline, f"requests {sorted(pending)} did not finish within {timeout_s} s"
        for event in backend.read_events(0.5):
            result = results.get(event.req_id)
            if result is None:
                continue
            assert event.req_id in pending, f"event after the end of request {event.req_id}: {event}"
            result.num_events += 1
            result.token_ids.extend(event.token_ids.tolist())
            result.text += event.text
            if event.prompt_token_ids is not None:
                result.prompt_token_ids = event.prompt_token_ids.tolist()
            if event.logprobs is not None:
                result.logprobs.append(event.logprobs)
            if event.error_code is not None:
                result.error = event
            if event.finish_reason is not None:
                result.finish_reason = event.finish_reason
            if event.finish_reason is not None or event.error_code is not None:
                pending.discard(event.req_id)
    return results


def generate(backend: StageBackend, first_id: int, prompts: list, params: list[SamplingParams]) -> list[Collected]:
    ids = list(range(first_id, first_id + len(prompts)))
    for req_id, prompt, request_params in zip(ids, prompts, params):
        backend.submit(req_id, prompt, request_params)
    results = collect(backend, ids)
    return [results[req_id] for req_id in ids]


def wait_for(condition, timeout_s: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s} s"
        time.sleep(0.02)
