"""The model runner: executes step plans in order, returning before the device has finished.

execute(plan) applies the plan to the persistent batch, gathers inputs on the device, runs the
model over the step's flattened tokens, samples the sampled rows, writes the new tokens into
the device token table (where the next step's decode inputs are read) and, when asked to
(`copy_to_host`, for the offline engine), starts a non-blocking copy of them into a fresh pinned
host buffer and records an event after it. Nothing in it waits for the device: every size and
index comes from the plan and host-side mirrors.

A decode-only step that fits a bucket takes the static path (inputs/static_decode.py): persistent
buffers, padded rows, and on CUDA with the triton backend a replayed graph (inputs/decode_graphs.py).
Prefill and mixed steps, and every step when the static path is off, take the dynamic path.

Under tensor parallelism (`tp`) every rank runs this same runner on its shard (parallel/) and
its own KV cache shard over the same block tables; rank 0 samples, and the sampled ids reach the
other ranks by a broadcast on the device, so every rank's token table holds them. Ranks take the
dynamic path only.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from stages.contracts.config import EngineConfig
from stages.contracts.connector import KVConnectorWorker
from stages.contracts.plan import StepPlan
from stages.gpu_runner.attention.kv_cache import allocate_kv_caches, kv_pool_sizes, resolve_kv_dtype
from stages.gpu_runner.attention.selector import (
    make_attention_backend, model_attention_backend, resolve_attention_backend,
)
from stages.gpu_runner.inputs.decode_graphs import DecodeGraphs
from stages.gpu_runner.inputs.input_batch import InputBatch
from stages.gpu_runner.inputs.output import StepOutput
from stages.gpu_runner.inputs.static_decode import StaticDecodeInputs, is_decode_only
from stages.gpu_runner.inputs.step_inputs import check_budget, check_plan, prepare_step, upload_table_writes
from stages.gpu_runner.inputs.step_layout import step_layout
from stages.gpu_runner.layers.kernels import make_layer_kernels
from stages.gpu_runner.layers.quantization.summary import describe_runs_in
from stages.gpu_runner.loaders.loader import load_model, tokenizer_path
from stages.gpu_runner.models.config import (
    ModelConfig, load_model_config, resolve_device, resolve_dtype, served_max_model_len,
)
from stages.gpu_runner.parallel.group import PlanBroadcast, TensorParallel
from stages.gpu_runner.parallel.sharding import check_tensor_parallel
from stages.gpu_runner.sampling.constraints import RowConstraints
from stages.gpu_runner.sampling.metadata import SamplingMetadata
from stages.gpu_runner.sampling.sampler import Sampler, SamplerOutput
from stages.gpu_runner.speculative.speculator import Speculator, shift_meta
from stages.gpu_runner.speculative.verify_cost import StepCosts, start_up_costs
from stages.messages import encode_plan

if TYPE_CHECKING:
    from stages.gpu_runner.speculative.draft_model import DraftModelProposer

log = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, the paged KV cache, the persistent batch and the sampler.

    `kv_caches[layer]` is [2, num_kv_blocks, block_size, num_kv_heads, head_dim]: keys at
    index 0, values at 1; position p of a row is at block block_table[row][p // block_size],
    offset p % block_size.
    """

    def __init__(self, config: EngineConfig, *, kv_connector: KVConnectorWorker | None = None,
                 static_decode: bool | None = None, tp: TensorParallel | None = None) -> None:
        """static_decode: run decode-only steps over the static bucketed buffers (None: on CUDA only,
        where they are what a graph replays; on the CPU padding rows only add work).
        tp: this rank's place in the tensor-parallel group (None: the whole model on one device)."""
        self.device = torch.device(resolve_device(config.device))
        if tp is not None and self.device.type == "cuda":
            self.device = torch.device("cuda", tp.local_rank)
        if self.device.type == "cuda":
            # cuDNN SDPA builds a new execution plan for every new (batch, key length) shape, a
            # host stall of tens of ms inside a step every few tokens; the other SDPA kernels do not.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.config: ModelConfig = load_model_config(config.model)
        self.tp = tp
        if tp is not None:
            check_tensor_parallel(self.config, tp.size, self.device.type, config.ranks_per_node,
                                  config.enable_expert_parallel)
        # Rank 0 sends each plan to the ranks that read no plan ring before running it.
        self.plan_broadcast = None
        if tp is not None and tp.is_driver and tp.plan_group is not None:
            self.plan_broadcast = PlanBroadcast(tp.plan_group)
        self.tokenizer_path: Path = tokenizer_path(config.model)
        self.dtype = resolve_dtype(config.dtype, self.config, self.device)

        self.max_model_len = served_max_model_len(self.config, config.max_model_len)
        self.max_num_batched_tokens = config.max_num_batched_tokens

        self.model = load_model(config.model, device=self.device, dtype=self.dtype,
                                max_positions=self.max_model_len, config=self.config, tp=tp,
                                quantization=config.quantization, expert_parallel=config.enable_expert_parallel,
                                quantized_activations=config.quantized_activations)
        shard = self.model.shard
        backend = resolve_attention_backend(model_attention_backend(config.attention_backend,
                                                                    self.config.attention_sinks),
                                            self.device, self.block_size)
        self.attention_backend = make_attention_backend(backend, self.device, self.block_size)
        self.layer_kernels = make_layer_kernels(backend, self.device)
        self.model.use_kernels(self.attention_backend, self.layer_kernels)
        self.kv_group_windows = self.config.kv_group_windows
        # A draft model is loaded before the KV pool is sized: its weights and its KV per block count.
        draft = load_draft(config, self)
        extra = 0 if draft is None else draft.block_bytes(self.block_size, self.dtype)
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype, backend)
        num_kv_blocks, num_window_blocks = kv_pool_sizes(shard, config, self.kv_dtype, self.device, extra)
        if tp is not None:  # the block tables are shared: every rank holds as many blocks
            num_kv_blocks, num_window_blocks = tp.agree_min(num_kv_blocks), tp.agree_min(num_window_blocks)
        self.num_kv_blocks, self.num_window_blocks = num_kv_blocks, num_window_blocks
        if kv_connector is not None and any(w is not None for w in self.kv_group_windows):
            raise ValueError("a KV connector does not support models with sliding-window layers")
        # One block more than each pool: the scratch block where padding rows write their KV. The
        # model gets the whole tensors; everyone else sees the pools alone.
        pool = [num_kv_blocks if shard.kv_group(i) == 0 else num_window_blocks for i in range(shard.num_layers)]
        self._kv_storage = allocate_kv_caches(shard, [n + 1 for n in pool], self.block_size, self.kv_dtype,
                                              self.device)
        self.kv_caches = [cache[:, :n] for cache, n in zip(self._kv_storage, pool)]
        # What each part runs in: logged here, published on the status board (`pipeline status`).
        self.runs_in = describe_runs_in(self.model, self.model.quantization.reason, self.dtype, self.kv_dtype,
                                        (num_kv_blocks + num_window_blocks) * self.block_size)
        log.info("%s", self.runs_in)
        self.batch = InputBatch(self.max_num_seqs, self.max_model_len, self.block_size, self.device,
                                window_table=num_window_blocks > 0)
        generator = None
        if config.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.sampler = Sampler(generator)
        self.constraints = RowConstraints(self.max_num_seqs, self.vocab_size, self.eos_token_ids, self.tokenizer_path,
                                          self.device)
        self.speculator: Speculator | None = None
        # What drafts cost on this device (speculative/verify_cost.py), for the scheduler to weigh them by.
        self.step_costs = StepCosts(None)
        if config.speculative is not None:
            self.speculator = make_speculator(config, self, draft)
            if tp is None:
                draft_step = None if draft is None else partial(self._cost_step, model=draft.model,
                                                                 kv_caches=draft.kv_caches)
                self.step_costs = start_up_costs(self._cost_step, self.max_num_seqs,
                                                 config.speculative.num_speculative_tokens, self.device, draft_step)
        # A draft model whose drafts can never pay is not run at all (it would decode every step to keep
        # its KV, for drafts the scheduler never asks for): speculation is then off.
        self.draft_runs = draft is not None and self.step_costs.draft_pays
        if draft is not None and not self.draft_runs:
            log.warning("the draft model is not run: at every batch measured, decoding a draft costs at least "
                        "what verifying it saves (%s: rows, F, e0, e1), so no draft can pay here; speculation is off",
                        self.step_costs.by_batch)
        self.kv_connector = kv_connector
        if kv_connector is not None:
            kv_connector.bind(self.kv_caches, self.block_size)
        # Marks the phases of a step (a stage process sets its NVTX/profiler ranges here).
        self.phase: Callable[[str], AbstractContextManager] = nullcontext
        # The offline engine reads each step's tokens through StepOutput.to_host(); the runner
        # stage reads them from the mailbox and turns this off.
        self.copy_to_host = True

        if static_decode is None:
            # The static buffers hold one block table: a model with two KV groups runs dynamically.
            static_decode = self.device.type == "cuda" and tp is None and not num_window_blocks
        if static_decode and num_window_blocks:
            raise ValueError("static_decode is not supported for a model with local and global layers (two KV groups)")
        if static_decode and tp is not None:
            # Untested: collectives inside captured graphs. The ranks stay on the dynamic path.
            raise ValueError("static_decode is not supported under tensor parallelism (tensor_parallel_size > 1)")
        self.static: StaticDecodeInputs | None = None
        self.decode_graphs: DecodeGraphs | None = None
        if static_decode:
            self.static = StaticDecodeInputs(self.batch, scratch_slot=num_kv_blocks * self.block_size)
            # Only the triton kernels read nothing but the static buffers (the torch backend sizes
            # its key gather by the step's longest context), so only they are captured.
            capture = (self.device.type == "cuda" and not config.enforce_eager
                       and backend == "triton")
            # One logits buffer for every bucket: captured graphs keep their outputs alive (and the
            # eager path runs the same code).
            self._decode_logits = torch.empty(self.max_num_seqs, self.vocab_size, dtype=torch.float32,
                                              device=self.device)
            self.decode_graphs = DecodeGraphs(self._static_decode_forward, self.static.buckets, self.device,
                                              capture=capture)

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
        if self.plan_broadcast is not None:
            self.plan_broadcast.send(encode_plan(plan))
        if self.speculator is not None:
            self.speculator.apply(plan)
        if self.static is not None and is_decode_only(plan):
            return self._execute_static_decode(plan)
        speculator = self.speculator
        with self.phase("prepare_inputs"):
            inputs = prepare_step(plan, self.batch, self.max_num_batched_tokens, self.attention_backend,
                                  None if speculator is None else speculator.lag)
            if self.tp is None or self.tp.is_driver:  # the rank that samples keeps the grammars
                self.constraints.apply(plan)
            if inputs.spec is not None:
                speculator.propose(inputs)
        connector_meta = plan.connector_meta if self.kv_connector is not None else None
        if connector_meta is not None:
            self.kv_connector.load(connector_meta)
        sampled = None
        if plan.num_rows:
            with self.phase("forward"):
                hidden = self.model(inputs.input_ids, inputs.positions, self._kv_storage, inputs.attention)
                if self.draft_runs:
                    speculator.draft.observe(inputs.input_ids, inputs.positions, inputs.attention)
            if inputs.spec is not None and len(inputs.logits_index):
                with self.phase("sample"):
                    logits = self.model.compute_logits(hidden[inputs.logits_index])
                    sampled = speculator.sample(
                        logits, inputs, self.sampler, eos_token_ids=self.config.eos_token_ids,
                        sample_plain=lambda plain: self._sample(plain, inputs.sampled_rows, inputs.sampled_num_tokens,
                                                                inputs.spec.plain_shift),
                        share=None if self.tp is None else self.tp.broadcast_tokens)
            elif len(inputs.sampled_rows):
                with self.phase("sample"):
                    logits = self.model.compute_logits(hidden[inputs.logits_index])
                    sampled = self._sample(logits, inputs.sampled_rows, inputs.sampled_num_tokens)
                    if self.tp is not None:
                        sampled = self._share_sampled(sampled, len(inputs.sampled_rows))
                    self.batch.token_table.view(-1).index_copy_(0, inputs.sampled_token_index, sampled.token_ids)
        if connector_meta is not None:
            self.kv_connector.save(connector_meta)
        if sampled is None:
            sampled = SamplerOutput(torch.zeros(0, dtype=torch.int32, device=self.device), None, None)
        return self._output(plan.step, plan.output_rows if inputs.spec is not None else inputs.sampled_rows, sampled)

    def _execute_static_decode(self, plan: StepPlan) -> StepOutput:
        """A decode-only step over the static buffers, padded to its bucket; sampled inside the
        (graph's) forward when every row is a bare argmax, after it otherwise."""
        static = self.static
        with self.phase("prepare_inputs"):
            check_budget(plan, self.max_num_batched_tokens)
            writes = self.batch.apply(plan)
            check_plan(plan, self.batch)
            layout = step_layout(plan)
            upload_table_writes(self.batch, writes)
            static.fill(layout)
            num_rows = plan.num_rows
            bucket = static.bucket(num_rows)
            context = layout.context
            self.batch.check_held(plan.rows)
            self.constraints.apply(plan)
            plain_greedy = (self.batch.sampling.plain_greedy(plan.rows, context - self.batch.num_prompt_tokens[plan.rows])
                            and not self.constraints.constrains(plan.rows))
        connector_meta = plan.connector_meta if self.kv_connector is not None else None
        if connector_meta is not None:
            self.kv_connector.load(connector_meta)
        with self.phase("forward"):
            logits, greedy = self.decode_graphs.run(bucket, int(context.max()))
        if plain_greedy:
            # A graph's outputs are rewritten by its next replay; the step's tokens must outlive it.
            token_ids = greedy[:num_rows].clone() if self.decode_graphs.captured else greedy[:num_rows]
            sampled = SamplerOutput(token_ids, None, None)
        else:
            with self.phase("sample"):
                sampled = self._sample(logits[:num_rows], plan.rows, context)
                self.batch.token_table.view(-1).index_copy_(0, static.sampled_index[:num_rows], sampled.token_ids)
        if connector_meta is not None:
            self.kv_connector.save(connector_meta)
        return self._output(plan.step, plan.rows, sampled)

    def _static_decode_forward(self, num_rows: int, max_context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step over the first num_rows static rows -> (float32 logits [num_rows, vocab],
        greedy tokens int32 [num_rows], also written into the token table). On CUDA with the triton
        backend this is what each bucket's graph records: it reads only the static buffers."""
        static = self.static
        input_ids = static.token_table.view(-1).index_select(0, static.gather_index[:num_rows])
        meta = self.attention_backend.static_decode_metadata(static, num_rows, max_context)
        positions = static.positions[:num_rows]
        hidden = self.model(input_ids, positions, self._kv_storage, meta)
        if self.draft_runs:
            # Rows that verify nothing this step still extend the draft's KV (a graph records both).
            self.speculator.draft.observe(input_ids, positions, meta)
        logits = self.model.compute_logits(hidden, out=self._decode_logits[:num_rows])
        greedy = logits.argmax(dim=-1).to(torch.int32)
        static.token_table.view(-1).index_copy_(0, static.sampled_index[:num_rows], greedy)
        return logits, greedy

    @property
    def verify_free_tokens(self) -> float | None:
        """F = c0 / c1 of a step's cost (None: not measured)."""
        return self.step_costs.free_tokens

    @torch.inference_mode()
    def _cost_step(self, num_tokens: int, model: torch.nn.Module | None = None,
                   kv_caches: list[torch.Tensor] | None = None) -> None:
        """The model (the target, or a draft model with its KV), its logits and a greedy draw over
        `num_tokens` single-token rows that write only the scratch block and attend to one key: what
        a step costs for its tokens (verify_cost.py)."""
        model = self.model if model is None else model
        batch, device = self.batch, self.device
        ones = torch.ones(num_tokens, dtype=torch.int64, device=device)
        slots = torch.full((num_tokens,), self.num_kv_blocks * self.block_size, dtype=torch.int64, device=device)
        backend = self.attention_backend
        meta = backend.decode_metadata(ones * batch.scratch_row, ones, 1, slots, batch.padded_block_table)
        if kv_caches is None and self.num_window_blocks:  # the local layers' group: its own scratch block
            local_slots = torch.full_like(slots, self.num_window_blocks * self.block_size)
            meta = (meta, backend.decode_metadata(ones * 0, ones, 1, local_slots, batch.window_block_table))
        hidden = model(ones, ones - 1, self._kv_storage if kv_caches is None else kv_caches, meta)
        logits = model.compute_logits(hidden)
        if logits is not None:  # a greedy draw at each position: what verifying them costs at least
            logits.argmax(dim=-1)

    def _sample(self, logits: torch.Tensor | None, rows: np.ndarray, num_tokens: np.ndarray,
                shift: torch.Tensor | None = None) -> SamplerOutput | None:
        """Sample `rows`; their grammar masks and logit biases are applied to the logits first (the
        host waits there for the grammar rows' previous tokens, while this step's forward runs).
        A tensor-parallel rank other than 0 has no logits and samples nothing. `shift`: how many
        fewer tokens each row really has than num_tokens says (a speculative step's lagged rows)."""
        if logits is None:
            return None
        if shift is None and not self.constraints.constrains(rows) and self.batch.sampling.plain_greedy(
                rows, num_tokens - self.batch.num_prompt_tokens[rows]):
            # A bare argmax (the sampler's own for such rows) without building the metadata: on
            # one stream of a small model that building cost about a millisecond a step.
            self.batch.check_held(rows)
            return SamplerOutput(logits.argmax(dim=-1).to(torch.int32), None, None)
        meta = SamplingMetadata.for_rows(self.batch, rows, num_tokens, self.config.eos_token_ids)
        if shift is not None:
            shift_meta(meta, shift)
        constrain = None
        if self.constraints.constrains(rows):
            constrain = lambda processed: self.constraints.constrain(processed, rows)  # noqa: E731
        sampled = self.sampler(logits, meta, constrain)
        self.constraints.sampled(rows, sampled.token_ids)
        return sampled

    def _share_sampled(self, sampled: SamplerOutput | None, num_rows: int) -> SamplerOutput:
        """Rank 0's sampled ids, broadcast on the device to every rank (which has no logits to
        sample from: `sampled` None). Logprobs stay on rank 0, the only rank that publishes."""
        if sampled is None:
            sampled = SamplerOutput(torch.empty(num_rows, dtype=torch.int32, device=self.device), None, None)
        self.tp.broadcast_tokens(sampled.token_ids)
        return sampled

    def _output(self, step: int, rows: np.ndarray, sampled: SamplerOutput) -> StepOutput:
        tensors = (sampled.token_ids, sampled.logprobs, sampled.logprob_token_ids)
        ready = None
        if not self.copy_to_host:
            host = (None, None, None)
        elif self.device.type == "cpu":
            host = tensors
        else:
            # A fresh pinned buffer per step: one still being filled is never rewritten.
            host = tuple(None if t is None else _pinned_copy(t) for t in tensors)
            ready = torch.cuda.Event()
            ready.record()
        return StepOutput(
            step=step, rows=rows, token_ids=sampled.token_ids, logprobs=sampled.logprobs,
            logprob_token_ids=sampled.logprob_token_ids, host_token_ids=host[0], host_logprobs=host[1],
            host_logprob_token_ids=host[2], ready=ready)


def load_draft(config: EngineConfig, runner: ModelRunner) -> DraftModelProposer | None:
    """The draft model of method draft_model, loaded whole on rank 0 (which proposes), else None."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model" or not (runner.tp is None or runner.tp.is_driver):
        return None
    from stages.gpu_runner.speculative.draft_model import DraftModelProposer, DraftTarget

    target = DraftTarget(device=runner.device, dtype=runner.dtype, max_model_len=runner.max_model_len,
                         vocab_size=runner.vocab_size, attention_backend=runner.attention_backend,
                         layer_kernels=runner.layer_kernels)
    return DraftModelProposer(spec, target)


def make_speculator(config: EngineConfig, runner: ModelRunner, draft: DraftModelProposer | None) -> Speculator:
    """The speculator of `config.speculative`, proposing with `draft` (load_draft) for draft_model."""
    spec, tp = config.speculative, runner.tp
    if draft is not None:
        draft.bind(runner.batch, runner.num_kv_blocks)
    # A tensor-parallel rank other than 0 has no draft model (proposer None): it receives the drafts.
    return Speculator(spec, runner.batch, draft, share=None if tp is None else tp.broadcast_tokens,
                      constraints=runner.constraints)


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
