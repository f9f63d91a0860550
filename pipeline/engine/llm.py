"""Offline generation in one process: `LLM(model=DIR).generate(prompts, params)`."""
from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from pipeline.engine.loop import Engine
from pipeline.engine.ranks import WorkerRanks
from pipeline.models.checkpoints import resolve_model, resolve_speculative_config
from stages.contracts.config import EngineConfig, ModelLimits
from stages.contracts.outputs import OutputEvent
from stages.contracts.params import SamplingParams
from stages.grammar import check_guided
from stages.gpu_runner.build import (build_runner, cost_limits, cpu_kernels, model_limits, serving_max_model_len,
                                     window_limits)
from stages.gpu_runner.models.config import load_model_config, resolve_device
from stages.gpu_runner.parallel.sharding import check_tensor_parallel
from stages.scheduler.build import build_scheduler
from stages.scheduler.step_loop import RunnerLike
from stages.tokenizer.encoding import PromptEncoder
from stages.tokenizer.prompt_check import check_prompt

Prompt = str | Sequence[int]


@dataclass(slots=True)
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it; None for EOS
    # Per output token: {token_id: logprob}, the sampled token first, then the top `logprobs`.
    logprobs: list[dict[int, float]] | None = None

    def add(self, event: OutputEvent) -> None:
        """Fold in one output event of this request."""
        self.token_ids.extend(event.token_ids.tolist())
        self.text += event.text
        if self.logprobs is not None and event.logprobs is not None:
            for ids, values in zip(event.logprob_token_ids.tolist(), event.logprobs.tolist()):
                self.logprobs.append(dict(zip(ids, values)))
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
            self.stop_reason = event.stop_reason


class LLM:
    """Builds a ModelRunner for `model` with the engine options of `EngineConfig` (device, dtype,
    async_scheduling, block_size, max_num_seqs, ...), or drives an already-built runner-like
    object given with `runner=` (then `eos_token_ids`, `num_kv_blocks`, `max_model_len`,
    `vocab_size` are read from it and `tokenizer_path` is optional). With `tensor_parallel_size`
    N > 1 the model is split over N ranks: this process is rank 0, the others are spawned
    processes that `close()` (or the end of the interpreter) stops."""

    def __init__(self, model: str | Path | None = None, *, runner: RunnerLike | None = None, **options: object) -> None:
        if model is not None:
            model = resolve_model(model)
        if "speculative_config" in options:
            options["speculative_config"] = resolve_speculative_config(options["speculative_config"])
        self.config = EngineConfig(model="" if model is None else str(model), **options).with_rendezvous_port()
        self._ranks: WorkerRanks | None = None
        if runner is None:
            if model is None:
                raise ValueError("LLM needs a model directory (model=...) or a runner")
            tp = None
            if self.config.tensor_parallel_size > 1:
                check_tensor_parallel(load_model_config(self.config.model), self.config.tensor_parallel_size,
                                      resolve_device(self.config.device),
                                      expert_parallel=self.config.enable_expert_parallel)
                self._ranks = WorkerRanks(self.config)
                tp = self._ranks.tp
            try:
                runner = build_runner(self.config, tp)
            except BaseException:
                if self._ranks is not None:
                    self._ranks.close(lambda: None)
                raise
            limits = model_limits(runner, self.config)
        else:
            if self.config.kv_connector is not None:
                raise ValueError("kv_connector is set up by LLM only when it builds the runner itself")
            max_model_len = serving_max_model_len(runner.max_model_len, runner.num_kv_blocks,
                                                  self.config.block_size, self.config.max_model_len)
            limits = ModelLimits(runner.num_kv_blocks, max_model_len, runner.vocab_size, list(runner.eos_token_ids),
                                 **cost_limits(runner), **window_limits(runner), cpu_kernels=cpu_kernels(runner))
        self.runner = runner
        self.limits = limits
        self.vocab_size: int = limits.vocab_size
        self.max_model_len = limits.max_model_len
        self.scheduler = build_scheduler(self.config, limits)
        path = getattr(runner, "tokenizer_path", None)
        self.tokenizer = None if path is None else Tokenizer.from_file(str(path))
        self.prompt_encoder = None if self.tokenizer is None else PromptEncoder(self.tokenizer)
        self.engine = Engine(runner, self.scheduler, async_scheduling=self.config.async_scheduling,
                             tokenizer=self.tokenizer, connector_worker=getattr(runner, "kv_connector", None))
        self._next_req_id = 0
        # What was built (torch, the model's modules: hundreds of thousands of objects) leaves the
        # garbage collector, as in a stage process (stages/process.py: ready): a full collection
        # would otherwise walk it again in the middle of a step (~190 ms for SmolLM2).
        gc.freeze()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do at tensor_parallel_size 1)."""
        if self._ranks is not None:
            self._ranks.close(self.runner.plan_broadcast.stop)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        for request_params in params:
            request_params.validate()  # it may have been changed since it was made
            check_guided(request_params)
            request_params.check_vocab(self.vocab_size)
        token_lists = [self.tokenize(index, prompt) for index, prompt in enumerate(prompts)]
        outputs: dict[int, RequestOutput] = {}
        for token_ids, request_params in zip(token_lists, params):
            req_id = self._next_req_id
            self._next_req_id += 1
            outputs[req_id] = RequestOutput(req_id, list(token_ids),
                                            logprobs=[] if request_params.logprobs is not None else None)
            self.engine.add_request(req_id, token_ids, request_params)
        while self.engine.busy:
            for event in self.engine.step():
                outputs[event.req_id].add(event)
        self.engine.flush_connector()
        return list(outputs.values())

    def tokenize(self, index: int, prompt: Prompt) -> list[int]:
        """The prompt's token ids; ValueError naming prompt `index` if the model cannot serve it."""
        if isinstance(prompt, str):
            if self.prompt_encoder is None:
                raise ValueError("text prompts need a tokenizer; this runner has none")
            token_ids = self.prompt_encoder.encode(prompt)
        else:
            token_ids = [int(t) for t in prompt]
        problem = check_prompt(token_ids, self.vocab_size, self.max_model_len, f"prompt {index}")
        if problem is not None:
            raise ValueError(problem.message)
        return token_ids
