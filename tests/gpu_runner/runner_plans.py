"""A minimal plan maker for runner tests: chunked prefill, linear block allocation, prefix reuse.

It stands in for the scheduler: requests are admitted into free rows in order, prefill chunks
share a per-step token budget with decodes, blocks are handed out from a counter and never
reused (so shared prefix blocks stay intact), and a request is freed once it has sampled
`max_tokens` tokens. Plans depend only on token counts, never on token values, so steps can be
planned ahead of their results (async mode), as the real scheduler does.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from stages.contracts.config import EngineConfig
from stages.contracts.outputs import HostStepOutput
from stages.contracts.params import SamplingParams
from stages.contracts.plan import NewRequest, StepPlan
from stages.gpu_runner.runner import ModelRunner
from stages.scheduler.step_loop import LocalExecutor, StepLoop


def make_runner(model_dir: object, kv_connector: object = None, static_decode: bool | None = None,
                **options: object) -> ModelRunner:
    """A runner for `model_dir` on the CPU in float32 (what transformers is compared in) unless
    `options` (EngineConfig fields) say otherwise."""
    options.setdefault("device", "cpu")
    options.setdefault("dtype", "float32")
    return ModelRunner(EngineConfig(model=str(model_dir), **options), kv_connector=kv_connector,
                       static_decode=static_decode)


@dataclass
class PlannedRequest:
    prompt: list[int]
    max_tokens: int
    # (index of an earlier request, number of its leading full blocks this prompt reuses)
    prefix_from: tuple[int, int] | None = None
    params: SamplingParams | None = None
    row: int = -1
    num_computed: int = 0
    num_sampled: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_listed_blocks: int = 0  # block_ids already sent to the runner in a plan
    outputs: list[int] = field(default_factory=list)


class PlanMaker:
    """Plans steps for `requests` the way the scheduler would, for the engine's step loop: it
    admits, chunks and frees by token counts alone, and files each step's tokens as they come."""

    def __init__(self, runner: ModelRunner, requests: list[PlannedRequest], token_budget: int) -> None:
        self.requests = requests
        self.block_size = runner.block_size
        self.num_kv_blocks = runner.num_kv_blocks
        self.windowed = bool(getattr(runner, "num_window_blocks", 0))
        if self.windowed:
            self.num_kv_blocks = min(runner.num_kv_blocks, runner.num_window_blocks)
        self.token_budget = token_budget
        self.free_rows = list(range(runner.max_num_seqs))
        self.next_block = 0
        self.waiting = list(range(len(requests)))
        self.running: list[int] = []
        self.freed: list[int] = []
        self.owners: list[dict[int, int]] = []  # per step in flight: {row: request index}
        self.step = 0

    @property
    def num_steps_in_flight(self) -> int:
        return len(self.owners)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def update(self, output: HostStepOutput) -> None:
        owners = self.owners.pop(0)
        for row, token in zip(output.rows.tolist(), output.token_ids.tolist()):
            self.requests[owners[row]].outputs.append(token)

    def schedule(self) -> StepPlan | None:
        requests, bs = self.requests, self.block_size
        if not self.has_unfinished():
            return None
        new_requests = []
        for i in list(self.waiting):
            req = requests[i]
            if not self.free_rows:
                break
            if req.prefix_from is not None:
                src, num_blocks = req.prefix_from
                if requests[src].num_computed < num_blocks * bs:
                    break  # its prefix is not in the cache yet
                req.block_ids = requests[src].block_ids[:num_blocks]
                req.num_computed = num_blocks * bs
            req.row = self.free_rows.pop(0)
            params = req.params or SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
            new_requests.append(NewRequest(req_id=i, row=req.row, token_ids=np.asarray(req.prompt, np.int32),
                                           num_prompt_tokens=len(req.prompt), params=params))
            self.waiting.remove(i)
            self.running.append(i)

        rows, computed, scheduled, sample, num_new, new_blocks = [], [], [], [], [], []
        budget = self.token_budget
        for i in self.running:
            req = requests[i]
            if budget == 0:
                break
            if req.num_computed < len(req.prompt):
                num_tokens = min(len(req.prompt) - req.num_computed, budget)
            else:
                num_tokens = 1
            budget -= num_tokens
            end = req.num_computed + num_tokens
            added = list(range(self.next_block, self.next_block + max(0, -(-end // bs) - len(req.block_ids))))
            self.next_block += len(added)
            req.block_ids = req.block_ids + added
            listed = req.block_ids[req.num_listed_blocks:]
            req.num_listed_blocks = len(req.block_ids)
            rows.append(req.row)
            computed.append(req.num_computed)
            scheduled.append(num_tokens)
            sample.append(end >= len(req.prompt))
            num_new.append(len(listed))
            new_blocks.extend(listed)
            req.num_computed = end
        if self.next_block > self.num_kv_blocks:
            raise RuntimeError(f"test needs {self.next_block} KV blocks, runner has {self.num_kv_blocks}")

        plan = StepPlan(
            step=self.step, new_requests=new_requests, rows=np.asarray(rows, np.int32),
            num_computed_tokens=np.asarray(computed, np.int32), num_scheduled_tokens=np.asarray(scheduled, np.int32),
            sample=np.asarray(sample, bool), num_new_blocks=np.asarray(num_new, np.int32),
            new_block_ids=np.asarray(new_blocks, np.int32), freed_rows=np.asarray(self.freed, np.int32),
            # A model's local layers (KV group 1) get the same block ids in their own pool.
            window_block_ids=np.asarray(new_blocks if self.windowed else [], np.int32))
        self.freed = []
        owners = {requests[i].row: i for i in self.running}
        self.owners.append(owners)
        self.step += 1
        for i, did_sample in zip([owners[r] for r in rows], sample):
            if did_sample:
                requests[i].num_sampled += 1
                if requests[i].num_sampled == requests[i].max_tokens:
                    self.running.remove(i)
                    self.freed.append(requests[i].row)
                    self.free_rows.append(requests[i].row)
        return plan


def run_requests(runner: ModelRunner, requests: list[PlannedRequest], *, token_budget: int,
                 async_mode: bool = False) -> list[list[int]]:
    """Drive `runner` until every request has its tokens; returns each request's outputs. Sync
    mode reads each step before planning the next; async mode lags one step behind."""
    loop = StepLoop(PlanMaker(runner, requests, token_budget), LocalExecutor(runner), async_scheduling=async_mode)
    while loop.busy:
        loop.turn()
    return [req.outputs for req in requests]
