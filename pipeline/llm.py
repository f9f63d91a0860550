"""Offline generation in one process: `LLM(model=DIR).generate(prompts, params)`."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer

from pipeline.engine import Engine, RequestOutput, RunnerLike

__all__ = ["LLM", "RequestOutput"]
from pipeline.sampling_params import SamplingParams
from stages.gpu_runner.offload import OffloadConnectorWorker
from stages.scheduler.config import SchedulerConfig
from stages.scheduler.offload import OffloadConnectorScheduler
from stages.scheduler.scheduler import Scheduler
from stages.tokenizer.prompt_check import check_prompt

if TYPE_CHECKING:
    from stages.gpu_runner.runner import ModelRunner

Prompt = str | Sequence[int]
KV_CONNECTORS = ("offload",)


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}")
    return device


def build_runner(model: str | Path, *, device: str, dtype: str, block_size: int, num_kv_blocks: int | None,
                 max_num_seqs: int, max_model_len: int | None, max_num_batched_tokens: int,
                 kv_connector: OffloadConnectorWorker | None, seed: int | None) -> ModelRunner:
    """The model runner as LLM and the runner stage build it."""
    from stages.gpu_runner.runner import ModelRunner  # the model stack is heavy; only when used

    return ModelRunner(
        model, device=_resolve_device(device), dtype=dtype, block_size=block_size,
        num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens, kv_connector=kv_connector, seed=seed)


def serving_max_model_len(runner_max_model_len: int, num_kv_blocks: int, block_size: int,
                          max_model_len: int | None) -> int:
    """The longest sequence served: the KV pool bounds a sequence as much as the model does."""
    if max_model_len is not None:
        return max_model_len
    return min(runner_max_model_len, num_kv_blocks * block_size)


def build_scheduler(*, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                    enable_prefix_caching: bool, num_kv_blocks: int, block_size: int, eos_token_ids: list[int],
                    num_host_blocks: int | None) -> Scheduler:
    """The scheduler as LLM and the scheduler stage build it; num_host_blocks set means the
    offload KV connector is on."""
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching)
    connector = None if num_host_blocks is None else OffloadConnectorScheduler(num_host_blocks)
    return Scheduler(config, num_kv_blocks, block_size, eos_token_ids, connector)


class LLM:
    """Builds a ModelRunner for `model` (or drives an already-built runner-like object, given
    with `runner=`; then `eos_token_ids`, `num_kv_blocks`, `max_model_len`, `vocab_size` are
    read from it and `tokenizer_path` is optional)."""

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        device: str = "auto",
        dtype: str = "auto",
        async_scheduling: bool = True,
        enable_prefix_caching: bool = True,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_model_len: int | None = None,
        num_kv_blocks: int | None = None,
        kv_connector: str | None = None,
        kv_offload_num_blocks: int | None = None,
        seed: int | None = None,
        runner: RunnerLike | None = None,
    ) -> None:
        if kv_connector is not None and kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_connector must be None or one of {KV_CONNECTORS}, got {kv_connector!r}")
        worker = OffloadConnectorWorker(kv_offload_num_blocks) if kv_connector == "offload" else None
        if runner is None:
            if model is None:
                raise ValueError("LLM needs a model directory (model=...) or a runner")
            runner = build_runner(
                model, device=device, dtype=dtype, block_size=block_size, num_kv_blocks=num_kv_blocks,
                max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens, kv_connector=worker, seed=seed)
        elif worker is not None:
            raise ValueError("kv_connector is set up by LLM only when it builds the runner itself")
        self.runner = runner
        self.vocab_size: int = runner.vocab_size
        self.max_model_len = serving_max_model_len(runner.max_model_len, runner.num_kv_blocks, block_size,
                                                   max_model_len)
        self.scheduler = build_scheduler(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=self.max_model_len, enable_prefix_caching=enable_prefix_caching,
            num_kv_blocks=runner.num_kv_blocks, block_size=block_size, eos_token_ids=runner.eos_token_ids,
            num_host_blocks=None if worker is None else worker.num_host_blocks)
        path = getattr(runner, "tokenizer_path", None)
        self.tokenizer = None if path is None else Tokenizer.from_file(str(path))
        self.engine = Engine(runner, self.scheduler, async_scheduling=async_scheduling,
                             tokenizer=self.tokenizer, connector_worker=worker)
        self._next_req_id = 0

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """One output per prompt, in order. A prompt is text or a list of token ids."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and
                                        all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        token_lists = [self._tokenize(index, prompt) for index, prompt in enumerate(prompts)]
        first_id = self._next_req_id
        for offset, (token_ids, request_params) in enumerate(zip(token_lists, params)):
            self.engine.add_request(first_id + offset, token_ids, request_params)
        self._next_req_id += len(token_lists)
        return self.engine.run()

    def _tokenize(self, index: int, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; this runner has none")
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        else:
            token_ids = [int(t) for t in prompt]
        problem = check_prompt(token_ids, self.vocab_size, self.max_model_len, f"prompt {index}")
        if problem is not None:
            raise ValueError(problem.message)
        return token_ids
