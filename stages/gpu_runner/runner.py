"""The model runner: executes step plans in order, returning before the device has finished.

execute(plan) applies the plan to the persistent batch, gathers inputs on the device, runs the
model over the step's flattened tokens, samples the sampled rows, writes the new tokens into
the device token table (where the next step's decode inputs are read), starts a non-blocking
copy of them into a fresh pinned host buffer and records an event after it. Nothing in it waits
for the device: every size and index comes from the plan and host-side mirrors.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import numpy as np
import torch

from stages.contracts.config import EngineConfig
from stages.contracts.connector import KVConnectorWorker
from stages.contracts.plan import StepPlan
from stages.gpu_runner.input_batch import InputBatch
from stages.gpu_runner.kv_cache import allocate_kv_caches, num_blocks_for_budget
from stages.gpu_runner.loader import load_model, tokenizer_path
from stages.gpu_runner.model_config import (
    ModelConfig, load_model_config, resolve_device, resolve_dtype, served_max_model_len,
)
from stages.gpu_runner.output import StepOutput
from stages.gpu_runner.sampler import Sampler, SamplerOutput, SamplingMetadata
from stages.gpu_runner.step_inputs import prepare_step


class ModelRunner:
    """Owns the model, the paged KV cache, the persistent batch and the sampler.

    `kv_caches[layer]` is [2, num_kv_blocks, block_size, num_kv_heads, head_dim]: keys at
    index 0, values at 1; position p of a row is at block block_table[row][p // block_size],
    offset p % block_size.
    """

    def __init__(self, config: EngineConfig, *, kv_connector: KVConnectorWorker | None = None) -> None:
        self.device = torch.device(resolve_device(config.device))
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.config: ModelConfig = load_model_config(config.model)
        self.tokenizer_path: Path = tokenizer_path(config.model)
        self.dtype = resolve_dtype(config.dtype, self.config, self.device)

        self.max_model_len = served_max_model_len(self.config, config.max_model_len)
        self.max_num_batched_tokens = config.max_num_batched_tokens

        self.model = load_model(config.model, device=self.device, dtype=self.dtype,
                                max_positions=self.max_model_len, config=self.config)
        num_kv_blocks = config.num_kv_blocks
        if num_kv_blocks is None:
            num_kv_blocks = num_blocks_for_budget(self.config, self.block_size, self.dtype, self.device,
                                                  config.kv_cache_memory_bytes)
        self.num_kv_blocks = num_kv_blocks
        self.kv_caches = allocate_kv_caches(self.config, self.num_kv_blocks, self.block_size, self.dtype, self.device)
        self.batch = InputBatch(self.max_num_seqs, self.max_model_len, self.block_size, self.device)
        generator = None
        if config.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.sampler = Sampler(generator)
        self.kv_connector = kv_connector
        if kv_connector is not None:
            kv_connector.bind(self.kv_caches, self.block_size)
        # Marks the phases of a step (a stage process sets its NVTX/profiler ranges here).
        self.phase: Callable[[str], AbstractContextManager] = nullcontext

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.config.eos_token_ids)

    @property
    def token_table(self) -> torch.Tensor:
        """Device [max_num_seqs, max_model_len] int32: every known token of each row."""
        return self.batch.token_table

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        with self.phase("prepare_inputs"):
            inputs = prepare_step(plan, self.batch, self.max_num_batched_tokens)
        connector_meta = plan.connector_meta if self.kv_connector is not None else None
        if connector_meta is not None:
            self.kv_connector.load(connector_meta)
        sampled = None
        if plan.num_rows:
            with self.phase("forward"):
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attention)
            if len(inputs.sampled_rows):
                with self.phase("sample"):
                    sampled = self._sample(hidden[inputs.logits_index], inputs.sampled_rows,
                                           inputs.sampled_num_tokens)
                    self.batch.token_table.view(-1).index_copy_(0, inputs.sampled_token_index, sampled.token_ids)
        if connector_meta is not None:
            self.kv_connector.save(connector_meta)
        if sampled is None:
            sampled = SamplerOutput(torch.zeros(0, dtype=torch.int32, device=self.device), None, None)
        return self._output(plan.step, inputs.sampled_rows, sampled)

    def _sample(self, hidden: torch.Tensor, rows: np.ndarray, num_tokens: np.ndarray) -> SamplerOutput:
        meta = SamplingMetadata.for_rows(self.batch, rows, num_tokens, self.config.eos_token_ids)
        return self.sampler(self.model.compute_logits(hidden), meta)

    def _output(self, step: int, rows: np.ndarray, sampled: SamplerOutput) -> StepOutput:
        if self.device.type == "cpu":
            host = (sampled.token_ids, sampled.logprobs, sampled.logprob_token_ids)
            ready = None
        else:
            # A fresh pinned buffer per step: one still being filled is never rewritten.
            host = tuple(None if t is None else _pinned_copy(t) for t in
                         (sampled.token_ids, sampled.logprobs, sampled.logprob_token_ids))
            ready = torch.cuda.Event()
            ready.record()
        return StepOutput(
            step=step, rows=rows, token_ids=sampled.token_ids, logprobs=sampled.logprobs,
            logprob_token_ids=sampled.logprob_token_ids, host_token_ids=host[0], host_logprobs=host[1],
            host_logprob_token_ids=host[2], ready=ready)


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
