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
from dataclasses import dataclass

import numpy as np

from stages.contracts.params import SamplingParams
from stages.contracts.config import EngineConfig, ModelLimits
from stages.contracts.connector import KVConnectorScheduler
from stages.contracts.outputs import FinishReason, HostStepOutput, StepUpdate
from stages.contracts.plan import NewRequest, StepPlan
from stages.scheduler.block_manager import hash_block
from stages.scheduler.kv_groups import KVGroups
from stages.scheduler.request import Request, RequestStatus
from stages.scheduler.row_table import RowTable
from stages.scheduler.speculation import Speculation
from stages.scheduler.stats import SchedulerStats
from stages.scheduler.step_entries import plain_entries, speculative_entries


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
        self._eos_token_ids = sorted(set(int(t) for t in limits.eos_token_ids))
        self._rows = RowTable(self.max_num_seqs, self.max_model_len)
        self._row_request: list[Request | None] = [None] * self.max_num_seqs
        self._free_rows = list(range(self.max_num_seqs - 1, -1, -1))
        self._rows_to_free: list[int] = []
        self._requests: dict[int, Request] = {}
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._running_rows: np.ndarray | None = None  # cache of the running requests' rows
        self._num_draining = 0
        self._connector_pins: list[int] = []  # blocks a pending connector save will read
        self._in_flight: deque[StepPlan] = deque()  # scheduled, not yet updated, oldest first
        self._first_admitted: deque[list[tuple[int, int]]] = deque()  # per step in flight: (req_id, ns)
        self._next_step = 0
        self.spec = None if config.speculative is None else \
            Speculation(config.speculative, self.max_num_seqs, self.max_model_len)
        self.num_preemptions = 0
        self.num_prefix_queried_tokens = 0
        self.num_prefix_hit_tokens = 0

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

    def stats(self) -> SchedulerStats:
        manager = self.block_manager
        return SchedulerStats(len(self._waiting), len(self._running), self._num_draining,
                              manager.num_free_blocks, manager.num_used_blocks,
                              manager.num_cached_blocks, self.num_preemptions, self.num_prefix_queried_tokens,
                              self.num_prefix_hit_tokens, *(() if self.spec is None else self.spec.counts()))

    def num_computed_tokens(self, req_id: int) -> int:
        row = self._requests[req_id].row
        return int(self._rows.num_computed[row]) if row >= 0 else 0

    # ---- planning

    def schedule(self) -> StepPlan | None:
        """Plan the next step, or None when nothing can run now."""
        if len(self._in_flight) >= 2:
            raise RuntimeError("at most one plan ahead: update() the oldest step before scheduling another")
        rows_t = self._rows
        budget = self.max_num_batched_tokens
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        new_block_ids: list[list[int]] = [[] for _ in self.kv.groups]  # per KV group
        preempted = False

        if self._running:
            rows = self._running_row_array()
            num_computed = rows_t.num_computed[rows]
            logical = rows_t.num_known[rows] + rows_t.num_placeholders[rows]
            # max-tokens guard: a request whose outputs (known + placeholders) already reach a
            # limit would only produce tokens that are discarded.
            useful = (logical - rows_t.num_prompt[rows] < rows_t.max_tokens[rows]) & (logical < self.max_model_len)
            need = np.where(useful, logical - num_computed, 0)
            # Decodes first, so a long prefill chunk never starves running generations.
            is_decode = need == 1
            num_new = np.where(is_decode, _greedy_fill(np.where(is_decode, need, 0), budget), 0)
            budget -= int(num_new.sum())
            drafts = None
            if self.spec is not None:  # then the drafts of decoding rows, before any prefill chunk
                drafts = self.spec.choose(rows, is_decode, num_new, num_computed,
                                          rows_t.num_known[rows] - rows_t.num_prompt[rows], rows_t.min_tokens[rows],
                                          budget)
                num_new += drafts
                budget -= int(drafts.sum())
            num_new += _greedy_fill(np.where(is_decode, 0, need), budget)
            blocks_needed = np.maximum(-(-(num_computed + num_new) // self.block_size) - rows_t.num_blocks[rows], 0)
            if int(blocks_needed.sum()) > self.kv.num_free_blocks:
                preempted = True
                rows, num_new, blocks_needed = self._make_room(rows, num_new, blocks_needed)
                if drafts is not None:
                    drafts = np.where(num_new > 0, drafts[:len(rows)], 0)
                num_computed, logical = rows_t.num_computed[rows], rows_t.num_known[rows] + rows_t.num_placeholders[rows]
            budget = self.max_num_batched_tokens - int(num_new.sum())
            scheduled = num_new > 0
            if scheduled.any():
                rows, num_computed, num_new, blocks_needed = (
                    rows[scheduled], num_computed[scheduled], num_new[scheduled], blocks_needed[scheduled])
                if drafts is not None:
                    drafts = drafts[scheduled]
                sample = num_computed + num_new == logical[scheduled] + (0 if drafts is None else drafts)
                new_block_ids = self.kv.allocate(int(blocks_needed.sum()))
                if new_block_ids[0]:
                    start = 0
                    for row, count in zip(rows[blocks_needed > 0].tolist(), blocks_needed[blocks_needed > 0].tolist()):
                        for block_ids, new in zip(self.kv.lists(self._row_request[row]), new_block_ids):
                            block_ids.extend(new[start:start + count])
                        start += count
                    rows_t.num_blocks[rows] += blocks_needed
                parts.append((rows, num_computed, num_new, sample, blocks_needed,
                              np.zeros(len(rows), np.int64) if drafts is None else drafts))

        new_requests: list[NewRequest] = []
        first_admissions: set[int] = set()
        if not preempted:
            admitted = self._admit(budget, new_requests, new_block_ids, first_admissions)
            if admitted is not None:
                parts.append(admitted)

        if not parts:
            return None
        rows, num_computed, num_new, sample, num_new_blocks, drafts = (np.concatenate(p) for p in zip(*parts))
        num_draft_tokens = lagged = None
        if self.spec is not None:
            num_draft_tokens, lagged = drafts.astype(np.int32), self.spec.lagged(rows)
            self.spec.drafts_in_flight[rows] += drafts
        # Advance optimistically (every draft accepted): the next plan continues where this one stops.
        rows_t.num_computed[rows] += num_new
        rows_t.num_in_flight[rows] += num_new
        rows_t.num_steps_in_flight[rows] += 1
        rows_t.num_placeholders[rows[sample]] += 1 + drafts[sample]

        meta = None
        if self.connector is not None:
            meta, read_blocks = self.connector.build_meta()
            self._unpin(read_blocks)
        new_ids, window_ids = self.kv.plan_ids(new_block_ids)
        plan = StepPlan(
            step=self._next_step,
            new_requests=new_requests,
            rows=rows.astype(np.int32),
            num_computed_tokens=num_computed.astype(np.int32),
            num_scheduled_tokens=num_new.astype(np.int32),
            sample=sample.astype(np.bool_),
            num_new_blocks=num_new_blocks.astype(np.int32),
            new_block_ids=new_ids,
            freed_rows=np.asarray(self._rows_to_free, dtype=np.int32),
            connector_meta=meta,
            window_block_ids=window_ids,
        )
        if num_draft_tokens is not None:
            plan.num_draft_tokens, plan.lagged = num_draft_tokens, lagged
        self._rows_to_free = []
        self._next_step += 1
        self._in_flight.append(plan)
        now_ns = time.monotonic_ns()
        self._first_admitted.append([(new.req_id, now_ns) for new in new_requests if new.req_id in first_admissions])
        return plan

    def _admit(self, budget: int, new_requests: list[NewRequest], new_block_ids: list[list[int]],
               first_admissions: set[int]):
        """Admit waiting requests in order while rows, token budget and blocks allow; the ids of
        those admitted for the first time go into `first_admissions`."""
        rows_t, kv, size = self._rows, self.kv, self.block_size
        entries: list[tuple[int, int, int, bool, int]] = []
        while self._waiting and budget > 0 and self._free_rows:
            request = self._waiting[0]
            token_ids = np.concatenate([request.prompt_token_ids, request.output_token_ids])
            num_tokens = token_ids.shape[0]
            # At least one token is computed, so hits stop a block short of a full-block end.
            hashes = self._block_hashes(request, token_ids, (num_tokens - 1) // size)[:(num_tokens - 1) // size]
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
            self.num_prefix_queried_tokens += num_tokens
            self.num_prefix_hit_tokens += len(hit_blocks) * size
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
            return None
        rows, num_computed, num_new, sample, num_blocks = zip(*entries)
        return (np.array(rows, np.int64), np.array(num_computed, np.int64), np.array(num_new, np.int64),
                np.array(sample, np.bool_), np.array(num_blocks, np.int64), np.zeros(len(rows), np.int64))

    def _make_room(self, rows: np.ndarray, num_new: np.ndarray, blocks_needed: np.ndarray):
        """Preempt from the back of the running list until the rest fit. Victims with a step
        in flight free their blocks only once drained, so until then only the rows whose
        blocks fit in what is free now run."""
        keep, num_pending = len(rows), 0
        while keep:
            short = int(blocks_needed[:keep].sum()) - self.kv.num_free_blocks
            if short <= num_pending:
                break
            num_pending += self._preempt(self._running[keep - 1])
            keep -= 1
        rows, num_new, blocks_needed = rows[:keep], num_new[:keep], blocks_needed[:keep]
        fits = (np.cumsum(blocks_needed) <= self.kv.num_free_blocks) | (blocks_needed == 0)
        return rows, np.where(fits, num_new, 0), np.where(fits, blocks_needed, 0)

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

    def _stop_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
        """Which of `token_ids` (sampled for `rows`) are EOS their request heeds or one of its stop ids."""
        rows_t = self._rows
        stop = np.zeros(token_ids.shape[0], np.bool_)
        for eos_token_id in self._eos_token_ids:  # one or two ids: cheaper than np.isin
            stop |= token_ids == eos_token_id
        stop &= ~rows_t.ignore_eos[rows]
        for i in np.flatnonzero(rows_t.has_stop_ids[rows]).tolist():
            stop[i] |= int(token_ids[i]) in self._row_request[rows[i]].params.stop_token_ids
        return stop

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
            hashes = self._block_hashes(request, rows_t.token_ids[row], num_done)
            for index in range(first, num_done):
                block_id = request.block_ids[index]
                self.kv.commit(request, index, hashes[index])
                if self.connector is not None and self.connector.on_commit(hashes[index], block_id):
                    self.block_manager.take([block_id])
                    self._connector_pins.append(block_id)
            rows_t.num_committed_blocks[row] = num_done

    def _block_hashes(self, request: Request, token_ids: np.ndarray, num_blocks: int) -> list[bytes]:
        """The request's hash list, extended to at least `num_blocks` entries."""
        hashes, size = request.block_hashes, self.block_size
        for index in range(len(hashes), num_blocks):
            hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[index * size:(index + 1) * size]))
        return hashes

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
        self.kv.free(request)
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

    def _unpin(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self._connector_pins.remove(block_id)
        self.block_manager.free(block_ids)

    def flush_connector(self) -> object | None:
        """When no plan will follow (the engine is idle), hand back the pending connector copies
        so the caller runs them directly (all steps are done, so the blocks are complete)."""
        if self.connector is None or self._in_flight:
            return None
        meta, read_blocks = self.connector.build_meta()
        self._unpin(read_blocks)
        return meta

    def _running_row_array(self) -> np.ndarray:
        if self._running_rows is None:
            self._running_rows = np.fromiter((r.row for r in self._running), np.int64, len(self._running))
        return self._running_rows
