"""The daemon's handle on the stage processes: submit requests, abort them, read their output.

INTERFACE STUB: the daemon codes against these signatures; the stage processes behind them
(tokenizer workers, scheduler, runner, detokenizer, joined by shm rings and the token mailbox)
implement them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineConfig:
    model: str  # checkpoint directory
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"
    max_num_seqs: int = 256
    max_model_len: int | None = None
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_kv_blocks: int | None = None
    num_tokenizers: int = 1
    async_scheduling: bool = True
    enable_prefix_caching: bool = True
    kv_connector: str | None = None  # None | "offload"


@dataclass(slots=True)
class OutputEvent:
    """New output of one request. The last event of a request has finish_reason or error set."""

    req_id: int
    text: str  # new text since the last event
    token_ids: np.ndarray  # int32: new token ids since the last event
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    prompt_token_ids: np.ndarray | None = None  # int32, in the request's first event
    logprobs: np.ndarray | None = None  # float32 [len(token_ids), 1 + k] when asked
    logprob_token_ids: np.ndarray | None = None  # int32 [len(token_ids), 1 + k]
    error_code: str | None = None  # wire error code when the request was refused
    error_message: str | None = None
    error_field: str | None = None


@dataclass(slots=True)
class StageHealth:
    name: str
    pid: int
    alive: bool
    heartbeat_age_s: float  # seconds since the stage's loop last went round


@dataclass(slots=True)
class BackendStats:
    num_waiting: int
    num_running: int
    kv_blocks_used: int
    kv_blocks_free: int
    generated_tokens_per_s: float
    num_restarts: int


class Backend:
    def __init__(self, config: EngineConfig, instance: str) -> None:
        """Creates the rings and the mailbox, spawns the stages, returns once all are ready."""
        raise NotImplementedError

    def submit(self, req_id: int, prompt: str | list[int], params: SamplingParams) -> None:
        raise NotImplementedError

    def abort(self, req_id: int) -> None:
        raise NotImplementedError

    def read_events(self, timeout_s: float) -> list[OutputEvent]:
        """Blocks up to timeout_s for output; raises StageFailed when a stage has died."""
        raise NotImplementedError

    def health(self) -> list[StageHealth]:
        raise NotImplementedError

    def stats(self) -> BackendStats:
        raise NotImplementedError

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops every stage and removes every shm entry of this instance."""
        raise NotImplementedError
