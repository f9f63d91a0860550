"""A simulated device for benchmarks: the runner's host work, with the model replaced by a timeline.

Not a device to serve with: it exists to measure whether host work ever makes the device wait
(tools/bench/bench_overhead.py), on machines where a real model would eat the CPU it is measured on.
`EngineConfig.simulated_device_ms = T` selects it. Everything a real runner does on the host
stays: applying the plan to the persistent batch, building the step's inputs and its sampling
metadata, writing the sampled tokens into the token table. The forward and the sampler become
one stream of T ms steps that use no CPU: step N starts at max(its launch, step N-1's end) and
its tokens are ready T ms later. `execute` returns at once, as a launch does; the step's
`ready_at_ns` goes with its tokens into the mailbox, whose readers sleep until then.

Tokens are the same for every row of a step and encode the step (steps.py), never an
EOS id, so a client can tell which step a streamed token came from. No logprobs are produced.

Rows with a grammar (sampling/constraints.py) do the real runner's host work: after the launch, wait for
the row's previous token (its step's `ready_ns`), advance the matcher and fill the bitmask. The
step's sampling needs that mask, so its tokens are ready at max(start + T, mask done): host time
past the step's end shows as the device waiting. Such a row's token is an allowed one picked
from the mask (standing in for the device's masked sampling; its time is not charged to the
step), so it does not name its step.
With `simulated_device_trace` set, each step's times are recorded in that file (steps.py).
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import numpy as np
import torch

from shm.clock import now_ns
from stages.contracts.config import EngineConfig
from stages.contracts.plan import StepPlan
from stages.gpu_runner.attention.kv_cache import num_blocks_for_budget
from stages.gpu_runner.attention.torch_backend import TorchBackend
from stages.gpu_runner.inputs.input_batch import InputBatch
from stages.gpu_runner.inputs.output import StepOutput
from stages.gpu_runner.inputs.step_inputs import prepare_step, to_device
from stages.gpu_runner.loaders.loader import tokenizer_path
from stages.gpu_runner.models.config import load_model_config, resolve_device, resolve_dtype, served_max_model_len
from stages.gpu_runner.sampling.constraints import RowConstraints
from stages.gpu_runner.sampling.metadata import SamplingMetadata
from stages.gpu_runner.simulated.steps import SimulatedTokens, StepTimeline


class SimulatedDeviceRunner:
    """Runner-like (see ModelRunner): `execute(plan)` does the host work and returns the step's
    tokens with the time they will be ready on the simulated stream."""

    def __init__(self, config: EngineConfig) -> None:
        if config.simulated_device_ms is None:
            raise ValueError("the simulated device needs EngineConfig.simulated_device_ms")
        if config.kv_connector is not None:
            raise ValueError(f"the simulated device has no KV cache to connect; got kv_connector {config.kv_connector!r}")
        self.step_ns = round(config.simulated_device_ms * 1e6)
        self.device = torch.device(resolve_device(config.device))
        if self.device.type == "cpu":
            # The tables stand in for device memory, where each op is a launch. Here every op is
            # small, and after each one torch's intra-op threads would spin on the other cores:
            # 11 ms of CPU per step at batch 256 on two cores, against 0.7 ms with one thread.
            torch.set_num_threads(1)
        model = load_model_config(config.model)
        self.tokenizer_path: Path = tokenizer_path(config.model)
        self.vocab_size = model.vocab_size
        self.eos_token_ids = list(model.eos_token_ids)
        self.max_model_len = served_max_model_len(model, config.max_model_len)
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.num_kv_blocks = config.num_kv_blocks or num_blocks_for_budget(
            model, config.block_size, resolve_dtype(config.dtype, model, self.device), self.device,
            config.kv_cache_memory_bytes)
        self.kv_connector = None
        self.batch = InputBatch(config.max_num_seqs, self.max_model_len, config.block_size, self.device)
        self.attention_backend = TorchBackend(config.block_size)  # its metadata is host work a step does
        self.tokens = SimulatedTokens(self.vocab_size, self.eos_token_ids)
        self.constraints = RowConstraints(self.max_num_seqs, self.vocab_size, self.eos_token_ids, self.tokenizer_path,
                                          self.device)
        self.timeline = None if config.simulated_device_trace is None else StepTimeline(config.simulated_device_trace)
        self._device_free_ns = 0  # when the last launched step ends
        self.phase: Callable[[str], AbstractContextManager] = nullcontext

    @torch.inference_mode()  # as the model runner's: its ops then skip autograd's bookkeeping
    def execute(self, plan: StepPlan) -> StepOutput:
        plan_ns = now_ns()
        with self.phase("prepare_inputs"):
            inputs = prepare_step(plan, self.batch, self.max_num_batched_tokens, self.attention_backend)
            self.constraints.apply(plan)
        rows = inputs.sampled_rows
        host_tokens = torch.full((len(rows),), self.tokens.for_step(plan.step), dtype=torch.int32)
        if len(rows):
            with self.phase("sample"):
                # The sampler's host work; the sampling itself is the simulated device's.
                SamplingMetadata.for_rows(self.batch, rows, inputs.sampled_num_tokens, self.eos_token_ids)
        launch_ns = now_ns()
        start_ns = max(launch_ns, self._device_free_ns)
        ready_ns = start_ns + (self.step_ns if plan.num_rows else 0)
        if len(rows) and self.constraints.constrains(rows):
            with self.phase("sample"):
                grammar_index, bitmask = self.constraints.step_bitmask(rows)
                ready_ns = max(ready_ns, now_ns())  # sampling waits for the masks
                if grammar_index:
                    host_tokens[grammar_index] = torch.from_numpy(pick_allowed(bitmask, plan.step))
                self.constraints.sampled(rows, host_tokens, ready_at_ns=ready_ns)
        self._device_free_ns = ready_ns
        token_ids = to_device(host_tokens.numpy(), self.device)
        if len(rows):
            self.batch.token_table.view(-1).index_copy_(0, inputs.sampled_token_index, token_ids)
        if self.timeline is not None:
            self.timeline.record(plan.step, plan_ns, launch_ns, start_ns, ready_ns, len(rows))
        return StepOutput(step=plan.step, rows=rows, token_ids=token_ids, logprobs=None, logprob_token_ids=None,
                          host_token_ids=host_tokens, host_logprobs=None, host_logprob_token_ids=None, ready=None,
                          ready_at_ns=ready_ns)


def pick_allowed(bitmask: np.ndarray, step: int) -> np.ndarray:
    """int32 [g]: for each row of `bitmask` (int32 bit words, bit t = token t allowed) an allowed
    token: the lowest one in the first non-empty word from a position that varies with the row and
    step, so outputs wander through the grammar instead of always taking its first choice."""
    num_rows, num_words = bitmask.shape
    start = (np.arange(num_rows) * 7 + step * 13) % num_words
    order = (start[:, None] + np.arange(num_words)[None, :]) % num_words
    words = np.take_along_axis(bitmask, order, axis=1)
    first = np.argmax(words != 0, axis=1)
    word_index = order[np.arange(num_rows), first]
    word = bitmask[np.arange(num_rows), word_index].astype(np.int64) & 0xFFFFFFFF
    lowest_bit = np.log2(word & -word).astype(np.int64)
    return (word_index * 32 + lowest_bit).astype(np.int32)
