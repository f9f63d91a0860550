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

from pipeline.sampling_params import SamplingParams
from stages.gpu_runner.runner import ModelRunner
from stages.scheduler.plan import NewRequest, StepPlan


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


def run_requests(runner: ModelRunner, requests: list[PlannedRequest], *, token_budget: int,
                 async_mode: bool = False) -> list[list[int]]:
    """Drive `runner` until every request has its tokens; returns each request's outputs."""
    bs = runner.block_size
    free_rows = list(range(runner.max_num_seqs))
    next_block = 0
    waiting = list(range(len(requests)))
    running: list[int] = []
    freed: list[int] = []
    pending = []  # (StepOutput, {row: request index}) not yet read back
    step = 0

    def collect(output, owners) -> None:
        host = output.to_host()
        for row, token in zip(host.rows.tolist(), host.token_ids.tolist()):
            requests[owners[row]].outputs.append(token)

    while waiting or running:
        new_requests = []
        for i in list(waiting):
            req = requests[i]
            if not free_rows:
                break
            if req.prefix_from is not None:
                src, num_blocks = req.prefix_from
                if requests[src].num_computed < num_blocks * bs:
                    break  # its prefix is not in the cache yet
                req.block_ids = requests[src].block_ids[:num_blocks]
                req.num_computed = num_blocks * bs
            req.row = free_rows.pop(0)
            params = req.params or SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
            new_requests.append(NewRequest(req_id=i, row=req.row, token_ids=np.asarray(req.prompt, np.int32),
                                           num_prompt_tokens=len(req.prompt), params=params))
            waiting.remove(i)
            running.append(i)

        rows, computed, scheduled, sample, num_new, new_blocks = [], [], [], [], [], []
        budget = token_budget
        for i in running:
            req = requests[i]
            if budget == 0:
                break
            if req.num_computed < len(req.prompt):
                num_tokens = min(len(req.prompt) - req.num_computed, budget)
            else:
                num_tokens = 1
            budget -= num_tokens
            end = req.num_computed + num_tokens
            added = list(range(next_block, next_block + max(0, -(-end // bs) - len(req.block_ids))))
            next_block += len(added)
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
        if next_block > runner.num_kv_blocks:
            raise RuntimeError(f"test needs {next_block} KV blocks, runner has {runner.num_kv_blocks}")

        plan = StepPlan(
            step=step, new_requests=new_requests, rows=np.asarray(rows, np.int32),
            num_computed_tokens=np.asarray(computed, np.int32), num_scheduled_tokens=np.asarray(scheduled, np.int32),
            sample=np.asarray(sample, bool), num_new_blocks=np.asarray(num_new, np.int32),
            new_block_ids=np.asarray(new_blocks, np.int32), freed_rows=np.asarray(freed, np.int32))
        freed = []
        owners = {requests[i].row: i for i in running}
        pending.append((runner.execute(plan), owners))
        step += 1
        for i, did_sample in zip([owners[r] for r in rows], sample):
            if did_sample:
                requests[i].num_sampled += 1
                if requests[i].num_sampled == requests[i].max_tokens:
                    running.remove(i)
                    freed.append(requests[i].row)
                    free_rows.append(requests[i].row)
        # Sync mode reads each step before planning the next; async mode lags one step behind.
        while len(pending) > (1 if async_mode else 0):
            collect(*pending.pop(0))
    for output, owners in pending:
        collect(output, owners)
    return [req.outputs for req in requests]
