"""Persistent batch state: one permanent row per running request, tables kept on the device.

A request keeps the row the scheduler gave it for its whole life, so nothing is ever moved or
compacted; a step's batch order is just `plan.rows`, and its inputs are gathered from the
tables by (row, position) on the device. The token table holds every known token of a row
(prompt, then each sampled token, written there on the device right after sampling), so the
next step's decode inputs never pass through the host.

Host mirrors of the block table and per-row counts let the runner compute positions and slots
without reading the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stages.contracts.params import SamplingParams
from stages.contracts.plan import StepPlan


class SamplingColumns:
    """Each row's sampling params as numpy columns, set when a request takes its row, so a step's
    sampling metadata is one gather by row instead of a Python loop over the step's rows.

    Numbers are kept as given (float64 holds a Python float exactly), so every test the sampler
    makes on them (greedy, top_p < 1, a penalty set) has the same outcome as on the params."""

    FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")

    def __init__(self, num_rows: int) -> None:
        self.floats = np.zeros((len(self.FLOATS), num_rows))  # one row per name in FLOATS
        self.top_k = np.zeros(num_rows, np.int64)  # 0 = off (-1 is stored as 0)
        self.seed = np.zeros(num_rows, np.int64)
        self.seeded = np.zeros(num_rows, bool)
        self.min_tokens = np.zeros(num_rows, np.int64)
        self.logprobs = np.full(num_rows, -1, np.int64)  # -1: none asked

    @classmethod
    def of(cls, params: list[SamplingParams]) -> SamplingColumns:
        columns = cls(len(params))
        for row, row_params in enumerate(params):
            columns.set(row, row_params)
        return columns

    def set(self, row: int, params: SamplingParams) -> None:
        self.floats[:, row] = [getattr(params, name) for name in self.FLOATS]
        self.top_k[row] = max(params.top_k, 0)
        self.seeded[row] = params.seed is not None
        self.seed[row] = params.seed or 0
        self.min_tokens[row] = params.min_tokens_held
        self.logprobs[row] = -1 if params.logprobs is None else params.logprobs

    def plain_greedy(self, rows: np.ndarray, output_pos: np.ndarray) -> bool:
        """Whether sampling `rows` (their next outputs at output_pos) is a bare argmax of the logits:
        greedy, no penalty, no logprobs, and no min_tokens still barring a stop."""
        temperature, _, _, repetition, presence, frequency = self.floats[:, rows]
        return bool(np.all(temperature == 0.0) and np.all(repetition == 1.0) and np.all(presence == 0.0)
                    and np.all(frequency == 0.0) and np.all(self.logprobs[rows] < 0)
                    and np.all(output_pos >= self.min_tokens[rows]))

    def take(self, rows: np.ndarray) -> SamplingColumns:
        """The columns of `rows`, in that order."""
        taken = SamplingColumns(0)
        taken.floats = self.floats[:, rows]
        for name in ("top_k", "seed", "seeded", "min_tokens", "logprobs"):
            setattr(taken, name, getattr(self, name)[rows])
        return taken


@dataclass(slots=True)
class TableWrites:
    """Flat (index, value) writes a plan makes to the device tables, applied in one copy each."""

    token_index: np.ndarray  # int64: row * max_model_len + position
    token_ids: np.ndarray  # int64
    block_index: np.ndarray  # int64: row * max_blocks_per_row + block number
    block_ids: np.ndarray  # int64
    window_block_ids: np.ndarray  # int64: the local layers' table at the same entries (empty: no such table)


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, device: torch.device,
                 window_table: bool = False) -> None:
        """`window_table`: a second block table, of the local layers' KV group (Gemma 3)."""
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks_per_row = -(-max_model_len // block_size)
        self.device = device
        # One scratch row past the last real row: padding rows of a bucketed decode step read and
        # write there (static_decode.py), never in a request's row.
        self.scratch_row = max_num_seqs
        # Flat token-table entries of the scratch row: a padding row reads its input id at the
        # first (it stays 0, a real token) and writes its sampled token at the second; what a step
        # throws away (a speculative row's unused drafts, the -1 of rejected ones) goes to the
        # third, where no padding row reads it.
        self.scratch_read = max_num_seqs * max_model_len
        self.scratch_sample = self.scratch_read + min(1, max_model_len - 1)
        self.scratch_discard = self.scratch_read + min(2, max_model_len - 1)
        self.padded_token_table = torch.zeros(max_num_seqs + 1, max_model_len, dtype=torch.int32, device=device)
        self.token_table = self.padded_token_table[:max_num_seqs]
        # Unused entries stay 0, a valid block id, so padded gathers read real (masked) memory.
        self.padded_block_table = torch.zeros(max_num_seqs + 1, self.max_blocks_per_row, dtype=torch.int32,
                                              device=device)
        self.block_table = self.padded_block_table[:max_num_seqs]
        self.block_table_host = np.zeros((max_num_seqs, self.max_blocks_per_row), dtype=np.int32)
        self.window_block_table = self.window_block_table_host = None
        if window_table:
            self.window_block_table = torch.zeros_like(self.block_table)
            self.window_block_table_host = np.zeros_like(self.block_table_host)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.req_ids = np.full(max_num_seqs, -1, dtype=np.int64)
        self.params: list[SamplingParams | None] = [None] * max_num_seqs
        self.sampling = SamplingColumns(max_num_seqs)  # the params of each held row, as columns

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_num_seqs:
            raise ValueError(f"row {row} is outside [0, max_num_seqs={self.max_num_seqs})")

    def check_held(self, rows: np.ndarray) -> None:
        """Refuse to sample rows that hold no request."""
        empty = self.req_ids[rows] == -1
        if np.any(empty):
            raise ValueError(f"plan samples rows {rows[empty].tolist()} that hold no request")

    def apply(self, plan: StepPlan) -> TableWrites:
        """Free, admit and extend rows as the plan says; return the device-table writes it implies."""
        for row in plan.freed_rows.tolist():
            self._check_row(row)
            self.req_ids[row] = -1
            self.params[row] = None
            self.num_blocks[row] = 0
            self.num_prompt_tokens[row] = 0

        token_index, token_ids = [], []
        for req in plan.new_requests:
            self._check_row(req.row)
            if self.req_ids[req.row] != -1:
                raise ValueError(f"row {req.row} is still held by request {self.req_ids[req.row]}; "
                                 f"request {req.req_id} cannot take it before it is freed")
            num_tokens = len(req.token_ids)
            if num_tokens > self.max_model_len:
                raise ValueError(f"request {req.req_id} has {num_tokens} tokens, more than max_model_len {self.max_model_len}")
            self.req_ids[req.row] = req.req_id
            self.params[req.row] = req.params
            self.sampling.set(req.row, req.params)
            self.num_prompt_tokens[req.row] = req.num_prompt_tokens
            self.num_blocks[req.row] = 0
            token_index.append(req.row * self.max_model_len + np.arange(num_tokens, dtype=np.int64))
            token_ids.append(np.asarray(req.token_ids, dtype=np.int64))

        rows = plan.rows.astype(np.int64)
        counts = plan.num_new_blocks.astype(np.int64)
        start = self.num_blocks[rows]
        if np.any(start + counts > self.max_blocks_per_row):
            bad = int(rows[np.argmax(start + counts > self.max_blocks_per_row)])
            raise ValueError(f"row {bad} would exceed {self.max_blocks_per_row} blocks (max_model_len {self.max_model_len})")
        # Block number of each new block within its row: start[row] + 0, 1, ...
        offsets = np.arange(counts.sum(), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        block_rows = np.repeat(rows, counts)
        block_numbers = np.repeat(start, counts) + offsets
        block_ids = plan.new_block_ids.astype(np.int64)
        self.block_table_host[block_rows, block_numbers] = block_ids
        window_block_ids = plan.window_block_ids.astype(np.int64)
        if self.window_block_table_host is not None:
            if window_block_ids.shape != block_ids.shape:
                raise ValueError(f"plan has {len(window_block_ids)} window block ids for {len(block_ids)} new blocks")
            self.window_block_table_host[block_rows, block_numbers] = window_block_ids
        self.num_blocks[rows] = start + counts

        return TableWrites(
            token_index=np.concatenate(token_index) if token_index else np.zeros(0, np.int64),
            token_ids=np.concatenate(token_ids) if token_ids else np.zeros(0, np.int64),
            block_index=block_rows * self.max_blocks_per_row + block_numbers,
            block_ids=block_ids,
            window_block_ids=window_block_ids if self.window_block_table is not None else np.zeros(0, np.int64),
        )

    def write_tables(self, token_index: torch.Tensor, token_ids: torch.Tensor,
                     block_index: torch.Tensor, block_ids: torch.Tensor,
                     window_block_ids: torch.Tensor | None = None) -> None:
        """Apply TableWrites once they are on the device."""
        if window_block_ids is not None and window_block_ids.numel():
            self.window_block_table.view(-1).index_copy_(0, block_index, window_block_ids.to(torch.int32))
        if token_index.numel():
            self.token_table.view(-1).index_copy_(0, token_index, token_ids.to(torch.int32))
        if block_index.numel():
            self.block_table.view(-1).index_copy_(0, block_index, block_ids.to(torch.int32))
