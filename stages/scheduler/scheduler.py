"""Continuous batching with chunked prefill, prefix caching, preemption and async scheduling.

One loop drives it (stages/scheduler/step_loop.py): `schedule()` builds plan N (possibly while
step N-1 still runs, never further ahead), `update(output)` applies the oldest unprocessed
step's sampled tokens, one step late.
Under async scheduling a request's `num_computed` advances when it is scheduled and its
sampled tokens are placeholders until their step is processed; the boundary of really
computed, host-known tokens is `num_computed - num_in_flight`. Rows and blocks are released
only when no step that used them is still unprocessed.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import replace

import numpy as np

from stages.contracts.config import EngineConfig, ModelLimits
from stages.contracts.connector import KVConnectorScheduler
from stages.contracts.counters import PrefixCacheCounts, SchedulerCounters, SpeculativeCounts
from stages.contracts.outputs import FinishReason, HostStepOutput, StepUpdate
from stages.contracts.params import SamplingParams
from stages.contracts.plan import NewRequest, StepPlan
from stages.scheduler.block_manager import extend_hashes
from stages.scheduler.connector_pins import PinnedConnector
from stages.scheduler.kv_groups import KVGroups
from stages.scheduler.request import Request, RequestStatus
from stages.scheduler.row_table import RowTable
from stages.scheduler.scheduled_rows import ScheduledRows
from stages.scheduler.speculation import Speculation
from stages.scheduler.step_entries import StopTokens, plain_entries, speculative_entries


def _greedy_fill(need: np.ndarray, budget: int) -> np.ndarray:
    """Give each entry, in order, min(need, what the budget still holds)."""
    return np.minimum(np.maximum(budget - (np.cumsum(need) - need), 0), need)


class Scheduler:
    def __init__(self, config: EngineConfig, limits: ModelLimits, connector: KVConnectorScheduler | None = None) -> None:
        """`limits.max_model_len` is the served one (the model's, bounded by the KV pool)."""
        block_size, num_kv_blocks = config.block_size, limits.num_kv_blocks
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = limits.max_model_len
        self.enable_prefix_caching = config.enable_prefix_caching
        self.kv = KVGroups(limits, block_size, config.enable_prefix_caching)
        self.block_manager = self.kv.groups[0].manager
        if connector is not None and self.kv.windowed:
            raise ValueError("a KV connector does not support models with sliding-window layers")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must leave room for a prompt token and an output, got {self.max_model_len}")
        if self.max_model_len > num_kv_blocks * block_size:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the KV cache: "
                f"{num_kv_blocks} blocks x {block_size} tokens = {num_kv_blocks * block_size}")
        self.block_size = block_size
        self.connector = connector
        self._pinned = None if connector is None else PinnedConnector(connector, self.block_manager)
        self._rows = RowTable(self.max_num_seqs, self.max_model_len)
        self._row_request: list[Request | None] = [None] * self.max_num_seqs
        self._stop_tokens = StopTokens(limits.eos_token_ids, self._rows, self._row_request)
        self._free_rows = list(range(self.max_num_seqs - 1, -1, -1))
        self._rows_to_free: list[int] = []
        self._freed_num_tokens: list[int] = []  # of each row to free: its known tokens when it left
        self._requests: dict[int, Request] = {}
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._running_rows: np.ndarray | None = None  # cache of the running requests' rows
        self._num_draining = 0
        self._in_flight: deque[StepPlan] = deque()  # scheduled, not yet updated, oldest first
        self._first_admitted: deque[list[tuple[int, int]]] = deque()  # per step in flight: (req_id, ns)
        self._next_step = 0
        self.spec = None if config.speculative is None else \
            Speculation(config.speculative, self.max_num_seqs, self.max_model_len, limits.verify_free_tokens,
                        limits.draft_step_tokens, limits.verify_costs_by_batch)
        self.num_preemptions = 0
        self.num_tokens_generated = 0
        self.prefix = PrefixCacheCounts()

    # ---- requests in and out

    def add_request(self, req_id: int, prompt_token_ids: np.ndarray | list[int], params: SamplingParams,
                    output_token_ids: np.ndarray | list[int] = ()) -> None:
        """Queue a request. `output_token_ids` are outputs it already has (a request resumed after
        a restart): it is admitted as a preempted request is, so max_tokens, min_tokens, penalties
        and the seeded-sampling position go on from them."""
        prompt = np.asarray(prompt_token_ids, dtype=np.int32)
        outputs = np.asarray(output_token_ids, dtype=np.int32)
        if req_id in self._requests:
            raise ValueError(f"request id {req_id} is already in use")
        if prompt.ndim != 1 or prompt.shape[0] == 0:
            raise ValueError("prompt must be a non-empty 1-D sequence of token ids")
        if outputs.ndim != 1 or outputs.shape[0] >= params.max_tokens:
            raise ValueError(f"a request may resume with fewer than max_tokens {params.max_tokens} outputs, "
                             f"got {outputs.shape[0]}")
        if prompt.shape[0] + outputs.shape[0] >= self.max_model_len:
            resumed = f" and {outputs.shape[0]} outputs" if outputs.shape[0] else ""
            raise ValueError(
                f"prompt has {prompt.shape[0]} tokens{resumed}; max_model_len {self.max_model_len} "
                f"allows at most {self.max_model_len - 1} so one token can be generated")
        request = Request(req_id, prompt, params, output_token_ids=outputs)
        self._requests[req_id] = request
        self._waiting.append(request)

    def abort(self, req_id: int) -> None:
        """Ends the request now; its outputs still in flight are discarded. Unknown ids are
        ignored (the request may have finished on its own meanwhile)."""
        request = self._requests.get(req_id)
        if request is not None:
            self._finish(request, FinishReason.ABORT)

    def finish(self, req_id: int, reason: FinishReason) -> None:
        """Finish from outside the scheduler (a stop string matched in the detokenizer)."""
        request = self._requests.get(req_id)
        if request is not None:
            self._finish(request, reason)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._num_draining)

    @property
    def num_steps_in_flight(self) -> int:
        """Plans scheduled whose tokens have not been applied by `update` yet (at most two)."""
        return len(self._in_flight)

    def stats(self) -> SchedulerCounters:
        """Queue lengths and KV blocks now, and the totals so far (a copy: later steps leave it be)."""
        manager = self.block_manager
        return SchedulerCounters(len(self._waiting), len(self._running), self._num_draining, manager.num_used_blocks,
                                 manager.num_free_blocks, manager.num_cached_blocks, self.num_tokens_generated,
                                 self.num_preemptions, replace(self.prefix),
                                 SpeculativeCounts() if self.spec is None else replace(self.spec.counts))

    def num_computed_tokens(self, req_id: int) -> int:
        row = self._requests[req_id].row
        return int(self._rows.num_computed[row]) if row >= 0 else 0

    # ---- planning

    def schedule(self) -> StepPlan | None:
        """Plan the next step, or None when nothing can run now: the running rows first (see
        `_schedule_running`), then waiting requests while tokens, rows and blocks allow, unless
        a running row had to be preempted."""
        if len(self._in_flight) >= 2:
            raise RuntimeError("at most one plan ahead: update() the oldest step before scheduling another")
        parts, new_block_ids, preempted = self._schedule_running()
        new_requests: list[NewRequest] = []
        first_admissions: set[int] = set()
        if not preempted:
            budget = self.max_num_batched_tokens - sum(int(part.num_new.sum()) for part in parts)
            parts += self._admit(budget, new_requests, new_block_ids, first_admissions)
        if not parts:
            return None
        return self._launch(ScheduledRows.concat(parts), new_requests, new_block_ids, first_admissions)

    def _schedule_running(self) -> tuple[list[ScheduledRows], list[list[int]], bool]:
        """The running rows' tokens this step: decodes first (a long prefill chunk never starves
        running generations), then the drafts of decoding rows, then prefill chunks. Where blocks
        run short, rows are preempted from the back. Returns the rows that run (none, or one
        part), their new blocks per KV group, and whether some row was preempted."""
        rows_t, budget = self._rows, self.max_num_batched_tokens
        new_block_ids: list[list[int]] = [[] for _ in self.kv.groups]
        if not self._running:
            return [], new_block_ids, False
        if self._running_rows is None:
            self._running_rows = np.fromiter((r.row for r in self._running), np.int64, len(self._running))
        rows = self._running_rows
        num_computed = rows_t.num_computed[rows]
        logical = rows_t.num_known[rows] + rows_t.num_placeholders[rows]
        # max-tokens guard: a request whose outputs (known + placeholders) already reach a
        # limit would only produce tokens that are discarded.
        useful = (logical - rows_t.num_prompt[rows] < rows_t.max_tokens[rows]) & (logical < self.max_model_len)
        need = np.where(useful, logical - num_computed, 0)
        is_decode = need == 1
        num_new = np.where(is_decode, _greedy_fill(np.where(is_decode, need, 0), budget), 0)
        drafts = np.zeros(len(rows), np.int64) if self.spec is None else self.spec.choose(
            rows, is_decode, num_new, num_computed, rows_t.num_known[rows] - rows_t.num_prompt[rows],
            rows_t.min_tokens[rows], budget - int(num_new.sum()), rows_t.token_ids, rows_t.num_known[rows])
        num_new += drafts
        num_new += _greedy_fill(np.where(is_decode, 0, need), budget - int(num_new.sum()))
        blocks_needed = np.maximum(-(-(num_computed + num_new) // self.block_size) - rows_t.num_blocks[rows], 0)
        preempted = int(blocks_needed.sum()) > self.kv.num_free_blocks
        if preempted:
            num_new, blocks_needed = self._make_room(num_new, blocks_needed)
        keep = len(num_new)  # the rows left once the victims are gone
        num_computed, logical, drafts = num_computed[:keep], logical[:keep], drafts[:keep]
        running = ScheduledRows(rows[:keep], num_computed, num_new, num_computed + num_new == logical + drafts,
                                blocks_needed, drafts).select(num_new > 0)
        if not len(running.rows):
            return [], new_block_ids, preempted
        new_block_ids = self.kv.allocate(int(running.num_new_blocks.sum()))
        start = 0
        grown = running.num_new_blocks > 0
        for row, count in zip(running.rows[grown].tolist(), running.num_new_blocks[grown].tolist()):
            for block_ids, new in zip(self.kv.lists(self._row_request[row]), new_block_ids):
                block_ids.extend(new[start:start + count])
            start += count
        rows_t.num_blocks[running.rows] += running.num_new_blocks
        return [running], new_block_ids, preempted

    def _launch(self, scheduled: ScheduledRows, new_requests: list[NewRequest], new_block_ids: list[list[int]],
                first_admissions: set[int]) -> StepPlan:
        """The plan of `scheduled`, in flight from now on. Rows advance as if every draft were
        accepted: the next plan continues where this one stops."""
        rows_t, rows, sample = self._rows, scheduled.rows, scheduled.sample
        rows_t.num_computed[rows] += scheduled.num_new
        rows_t.num_in_flight[rows] += scheduled.num_new
        rows_t.num_steps_in_flight[rows] += 1
        rows_t.num_placeholders[rows[sample]] += 1 + scheduled.drafts[sample]
        new_ids, window_ids = self.kv.plan_ids(new_block_ids)
        plan = StepPlan(
            step=self._next_step,
            new_requests=new_requests,
            rows=rows.astype(np.int32),
            num_computed_tokens=scheduled.num_computed.astype(np.int32),
            num_scheduled_tokens=scheduled.num_new.astype(np.int32),
            sample=sample.astype(np.bool_),
            num_new_blocks=scheduled.num_new_blocks.astype(np.int32),
            new_block_ids=new_ids,
            freed_rows=np.asarray(self._rows_to_free, dtype=np.int32),
            freed_num_tokens=np.asarray(self._freed_num_tokens, dtype=np.int32),
            connector_meta=None if self._pinned is None else self._pinned.build_meta(),
            window_block_ids=window_ids,
        )
        if self.spec is not None:
            plan.num_draft_tokens, plan.lagged = self.spec.scheduled(rows, scheduled.drafts)
        self._rows_to_free, self._freed_num_tokens = [], []
        self._next_step += 1
        self._in_flight.append(plan)
        now_ns = time.monotonic_ns()
        self._first_admitted.append([(new.req_id, now_ns) for new in new_requests if new.req_id in first_admissions])
        return plan

    def _admit(self, budget: int, new_requests: list[NewRequest], new_block_ids: list[list[int]],
               first_admissions: set[int]) -> list[ScheduledRows]:
        """Admit waiting requests in order while rows, token budget and blocks allow (none, or
        one part of rows); the ids of those admitted for the first time go into `first_admissions`."""
        rows_t, kv, size = self._rows, self.kv, self.block_size
        entries: list[tuple[int, int, int, bool, int]] = []
        while self._waiting and budget > 0 and self._free_rows:
            request = self._waiting[0]
            token_ids = np.concatenate([request.prompt_token_ids, request.output_token_ids])
            num_tokens = token_ids.shape[0]
            # At least one token is computed, so hits stop a block short of a full-block end.
            hashes = extend_hashes(request.block_hashes, token_ids, (num_tokens - 1) // size, size)
            hashes = hashes[:(num_tokens - 1) // size]
            hits = kv.match_prefix(hashes)
            hit_blocks = hits[0]
            num_loaded = 0
            if self.connector is not None:
                num_loaded = self.connector.num_hit_blocks(hashes[len(hit_blocks):])
            start = (len(hit_blocks) + num_loaded) * size
            num_new = min(num_tokens - start, budget)
            num_fresh_blocks = -(-(start + num_new) // size) - len(hit_blocks)
            if kv.num_free_after_taking(hits) < num_fresh_blocks:
                break
            self._waiting.popleft()
            kv.take(hits)
            self.prefix.num_queried_tokens += num_tokens
            self.prefix.num_hit_tokens += len(hit_blocks) * size
            fresh = kv.allocate(num_fresh_blocks)
            if num_loaded:
                self.connector.on_load(hashes[len(hit_blocks):len(hit_blocks) + num_loaded], fresh[0][:num_loaded])
            row = self._free_rows.pop()
            request.row, request.status = row, RequestStatus.RUNNING
            if not request.admitted:
                request.admitted = True
                first_admissions.add(request.req_id)
            for block_ids, group_hits, group_fresh, new in zip(kv.lists(request), hits, fresh, new_block_ids):
                block_ids[:] = group_hits + group_fresh
                new.extend(block_ids)
            self._row_request[row] = request
            rows_t.assign(row, request.req_id, token_ids, request.num_prompt_tokens, request.params)
            if self.spec is not None:
                self.spec.assign(row, request.params)
            rows_t.num_blocks[row] = len(request.block_ids)
            rows_t.num_committed_blocks[row] = len(hit_blocks)
            rows_t.num_computed[row] = start
            self._running.append(request)
            self._running_rows = None
            new_requests.append(NewRequest(request.req_id, row, token_ids, request.num_prompt_tokens, request.params))
            entries.append((row, start, num_new, start + num_new == num_tokens, len(request.block_ids)))
            budget -= num_new
        if not entries:
            return []
        rows, num_computed, num_new, sample, num_blocks = zip(*entries)
        return [ScheduledRows(np.array(rows, np.int64), np.array(num_computed, np.int64),
                              np.array(num_new, np.int64), np.array(sample, np.bool_), np.array(num_blocks, np.int64),
                              np.zeros(len(rows), np.int64))]

    def _make_room(self, num_new: np.ndarray, blocks_needed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Preempt from the back of the running list until the rest fit; returns the num_new and
        blocks_needed of the rows left, the first ones. Victims with a step in flight free their
        blocks only once drained, so until then only the rows whose blocks fit in what is free now run."""
        keep, num_pending = len(num_new), 0
        while keep:
            short = int(blocks_needed[:keep].sum()) - self.kv.num_free_blocks
            if short <= num_pending:
                break
            num_pending += self._preempt(self._running[keep - 1])
            keep -= 1
        num_new, blocks_needed = num_new[:keep], blocks_needed[:keep]
        fits = (np.cumsum(blocks_needed) <= self.kv.num_free_blocks) | (blocks_needed == 0)
        return np.where(fits, num_new, 0), np.where(fits, blocks_needed, 0)

    def _preempt(self, request: Request) -> int:
        """Give up a running request's row and blocks (recomputed on re-admission). Returns
        the blocks that will be freed once its in-flight steps drain (0 if freed now)."""
        self._running.remove(request)
        self._running_rows = None
        request.preempted = True
        request.num_preemptions += 1
        self.num_preemptions += 1
        return self._start_draining(request)

    # ---- results

    def update(self, output: HostStepOutput) -> StepUpdate:
        """Apply the sampled tokens of the oldest step in flight (steps are processed in order)."""
        if not self._in_flight:
            raise RuntimeError(f"update for step {output.step}, but no step is in flight")
        if output.step != self._in_flight[0].step:
            raise RuntimeError(f"update for step {output.step}, expected step {self._in_flight[0].step}")
        plan = self._in_flight.popleft()
        admitted = self._first_admitted.popleft()
        rows_t = self._rows
        rows = plan.rows.astype(np.int64)
        rows_t.num_in_flight[rows] -= plan.num_scheduled_tokens
        rows_t.num_steps_in_flight[rows] -= 1
        read = speculative_entries if plan.speculates else plain_entries
        entries = read(rows_t, self.spec, plan, output, self._stop_tokens, self.max_model_len)
        live, stop, length = entries.rows, entries.stop, entries.length
        result = StepUpdate(plan.step, rows_t.req_id[live], entries.token_ids, entries.index, [], output, admitted)
        self.num_tokens_generated += result.num_tokens
        self._commit_blocks(rows)  # before finishing: a finished request may release its blocks now
        if self.kv.windowed:  # then blocks behind a window: committed first, they stay cached
            next_positions = rows_t.num_computed[rows] - rows_t.num_in_flight[rows]
            for row, position in zip(rows.tolist(), next_positions.tolist()):
                self.kv.release_behind_window(self._row_request[row], position)
        for i in np.flatnonzero(stop | length).tolist():
            request = self._row_request[live[i]]
            reason = FinishReason.STOP if stop[i] else FinishReason.LENGTH
            result.finished.append((request.req_id, reason))
            self._finish(request, reason)
        for row in rows[rows_t.draining[rows] & (rows_t.num_steps_in_flight[rows] == 0)].tolist():
            self._release(self._row_request[row])
        return result

    def _commit_blocks(self, rows: np.ndarray) -> None:
        """Offer newly complete blocks to the prefix cache and the connector. Only blocks
        below num_computed - num_in_flight: computed by processed steps, all tokens known."""
        if not self.enable_prefix_caching and self.connector is None:
            return
        rows_t, size = self._rows, self.block_size
        num_done_blocks = (rows_t.num_computed[rows] - rows_t.num_in_flight[rows]) // size
        todo = num_done_blocks > rows_t.num_committed_blocks[rows]
        for row, num_done in zip(rows[todo].tolist(), num_done_blocks[todo].tolist()):
            request = self._row_request[row]
            first = int(rows_t.num_committed_blocks[row])
            hashes = extend_hashes(request.block_hashes, rows_t.token_ids[row], num_done, size)
            for index in range(first, num_done):
                self.kv.commit(request, index, hashes[index])
                if self._pinned is not None:
                    self._pinned.committed(hashes[index], request.block_ids[index])
            rows_t.num_committed_blocks[row] = num_done

    # ---- life-cycle transitions

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.is_finished:
            return
        request.finish_reason = reason
        if request.status is RequestStatus.WAITING:
            self._waiting.remove(request)
            request.status = RequestStatus.FINISHED
            del self._requests[request.req_id]
            return
        self._rows.finished[request.row] = True
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
            self._running_rows = None
            self._start_draining(request)

    def _start_draining(self, request: Request) -> int:
        request.status = RequestStatus.DRAINING
        self._rows.draining[request.row] = True
        self._num_draining += 1
        if self._rows.num_steps_in_flight[request.row] == 0:
            self._release(request)
            return 0
        return self.kv.num_held(request)

    def _release(self, request: Request) -> None:
        """Free the row and blocks of a drained request; re-queue it if it was preempted."""
        row, rows_t = request.row, self._rows
        if not request.is_finished:
            request.output_token_ids = rows_t.token_ids[row, request.num_prompt_tokens:rows_t.num_known[row]].copy()
        if self.spec is not None:
            self.spec.release(row, rows_t.token_ids[row, :rows_t.num_known[row]], request.num_prompt_tokens)
        self.kv.free(request)
        self._freed_num_tokens.append(int(rows_t.num_known[row]))
        rows_t.clear(row)
        self._row_request[row] = None
        self._free_rows.append(row)
        self._rows_to_free.append(row)
        request.row = -1
        self._num_draining -= 1
        if request.is_finished:
            request.status = RequestStatus.FINISHED
            del self._requests[request.req_id]
        else:
            request.status = RequestStatus.WAITING
            request.preempted = False
            self._waiting.appendleft(request)

    def flush_connector(self) -> object | None:
        """When no plan will follow (the engine is idle), hand back the pending connector copies
        so the caller runs them directly (all steps are done, so the blocks are complete)."""
        return None if self._pinned is None or self._in_flight else self._pinned.build_meta()
