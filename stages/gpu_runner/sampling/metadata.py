"""What the sampler reads of one step's sampled rows: their parameters as device tensors, and the
host-known flags that choose which sampling stages run (so a step never waits for the device)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from stages.contracts.params import SamplingParams
from stages.gpu_runner.inputs.input_batch import InputBatch, SamplingColumns
from stages.gpu_runner.inputs.step_inputs import to_device


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling inputs for one step's sampled rows, already on the device.

    Tensors are [n] unless noted; the bool/int fields are host-known and choose the work.
    """

    num_rows: int
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_penalty: bool
    max_top_k: int  # largest top_k asked (0 when none)
    max_num_tokens: int  # longest history among the rows (prompt + outputs so far)
    max_num_logprobs: int | None  # None: no row asked for logprobs
    num_seeded: int
    greedy: torch.Tensor  # bool
    temperature: torch.Tensor  # float32; 1.0 on greedy rows so nothing divides by zero
    top_k: torch.Tensor  # int64; 0 = off (-1 is stored as 0)
    top_p: torch.Tensor  # float32
    min_p: torch.Tensor  # float32
    repetition_penalty: torch.Tensor  # float32
    presence_penalty: torch.Tensor  # float32
    frequency_penalty: torch.Tensor  # float32
    rows: torch.Tensor  # int64: token_table rows
    num_tokens: torch.Tensor  # int64
    num_prompt_tokens: torch.Tensor  # int64
    seeded_rows: torch.Tensor  # int64 [num_seeded]: indices (into the n rows) of seeded rows
    seeds: torch.Tensor  # int64 [num_seeded]
    seeded_output_pos: torch.Tensor  # int64 [num_seeded]
    blocked_token_ids: torch.Tensor | None  # int64 [n, s], -1 padded: ids barred by min_tokens
    token_table: torch.Tensor  # the runner's [max_num_seqs, max_model_len] int32 table

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        output_pos: np.ndarray,
        rows: np.ndarray,
        num_tokens: np.ndarray,
        num_prompt_tokens: np.ndarray,
        token_table: torch.Tensor,
        eos_token_ids: list[int],
        device: torch.device,
    ) -> SamplingMetadata:
        """params[i] belongs to sampled row rows[i]; output_pos[i] is the index, among that
        request's outputs, of the token being sampled now (0 for the first);
        num_tokens[i] is how many of token_table[rows[i]] are known (prompt + outputs before
        this one); num_prompt_tokens[i] how many of those are prompt. token_table is the
        runner's device table [max_num_seqs, max_model_len] int32, read for penalties.

        The table is read when the sampler runs (in stream order), not here, so tokens the
        runner writes into it after this call and before sampling are counted.
        """
        return cls._from_columns(SamplingColumns.of(params), params.__getitem__, output_pos, rows, num_tokens,
                                 num_prompt_tokens, token_table, eos_token_ids, device)

    @classmethod
    def for_rows(cls, batch: InputBatch, rows: np.ndarray, num_tokens: np.ndarray,
                 eos_token_ids: list[int]) -> SamplingMetadata:
        """The metadata of sampling the persistent batch's `rows` (int32 [m]), row i having
        num_tokens[i] known tokens; its params are those the rows' requests were admitted with,
        gathered from the batch's columns (no Python loop over the rows)."""
        batch.check_held(rows)
        num_prompt_tokens = batch.num_prompt_tokens[rows]
        return cls._from_columns(batch.sampling.take(rows), lambda i: batch.params[rows[i]],
                                 num_tokens - num_prompt_tokens, rows, num_tokens, num_prompt_tokens,
                                 batch.token_table, eos_token_ids, batch.device)

    @classmethod
    def _from_columns(cls, columns: SamplingColumns, params_of: Callable[[int], SamplingParams],
                      output_pos: np.ndarray, rows: np.ndarray, num_tokens: np.ndarray,
                      num_prompt_tokens: np.ndarray, token_table: torch.Tensor, eos_token_ids: list[int],
                      device: torch.device) -> SamplingMetadata:
        """`columns` holds row i's params, also given whole by params_of(i) (read only for rows a
        min_tokens bars from stopping)."""
        n = len(columns.top_k)
        output_pos = np.asarray(output_pos, dtype=np.int64)
        rows = np.asarray(rows, dtype=np.int64)
        num_tokens = np.asarray(num_tokens, dtype=np.int64)
        num_prompt_tokens = np.asarray(num_prompt_tokens, dtype=np.int64)
        for name, array in (("output_pos", output_pos), ("rows", rows), ("num_tokens", num_tokens),
                            ("num_prompt_tokens", num_prompt_tokens)):
            if array.shape != (n,):
                raise ValueError(f"{name} must have shape ({n},) to match params, got {array.shape}")
        if n and int(num_tokens.max()) > token_table.shape[1]:
            raise ValueError(f"num_tokens {int(num_tokens.max())} exceeds token_table width {token_table.shape[1]}")
        if np.any(num_prompt_tokens > num_tokens):
            raise ValueError(f"num_prompt_tokens {num_prompt_tokens} exceeds num_tokens {num_tokens}")

        temperature, top_p, min_p, repetition, presence, frequency = columns.floats
        greedy = temperature == 0.0
        floats = np.stack([np.where(greedy, 1.0, temperature), top_p, min_p, repetition, presence,
                           frequency]).astype(np.float32)
        top_k = columns.top_k
        seeded_rows = np.flatnonzero(columns.seeded)
        ints = np.concatenate([greedy.astype(np.int64), top_k, rows, num_tokens, num_prompt_tokens, seeded_rows,
                               columns.seed[seeded_rows], output_pos[seeded_rows]])
        floats_dev = to_device(floats, device)
        ints_dev = to_device(ints, device)
        m = len(seeded_rows)
        cuts = np.cumsum([n, n, n, n, n, m, m])
        (greedy_dev, top_k_dev, rows_dev, num_tokens_dev, num_prompt_dev, seeded_rows_dev, seeds_dev,
         seeded_pos_dev) = torch.tensor_split(ints_dev, cuts.tolist())

        blocked = _min_tokens_blocked_ids(columns.min_tokens, output_pos, params_of, eos_token_ids)
        asked_logprobs = columns.logprobs[columns.logprobs >= 0]
        return cls(
            num_rows=n,
            all_greedy=bool(n) and bool(greedy.all()),
            any_greedy=bool(greedy.any()),
            any_top_k=bool((top_k > 0).any()),
            any_top_p=bool((top_p < 1.0).any()),
            any_min_p=bool((min_p > 0.0).any()),
            any_penalty=bool(((repetition != 1.0) | (presence != 0.0) | (frequency != 0.0)).any()),
            max_top_k=int(top_k.max()) if n else 0,
            max_num_tokens=int(num_tokens.max()) if n else 0,
            max_num_logprobs=int(asked_logprobs.max()) if len(asked_logprobs) else None,
            num_seeded=m,
            greedy=greedy_dev.bool(),
            temperature=floats_dev[0],
            top_p=floats_dev[1],
            min_p=floats_dev[2],
            repetition_penalty=floats_dev[3],
            presence_penalty=floats_dev[4],
            frequency_penalty=floats_dev[5],
            top_k=top_k_dev,
            rows=rows_dev,
            num_tokens=num_tokens_dev,
            num_prompt_tokens=num_prompt_dev,
            seeded_rows=seeded_rows_dev,
            seeds=seeds_dev,
            seeded_output_pos=seeded_pos_dev,
            blocked_token_ids=None if blocked is None else to_device(blocked, device),
            token_table=token_table,
        )


def _min_tokens_blocked_ids(min_tokens: np.ndarray, output_pos: np.ndarray,
                            params_of: Callable[[int], SamplingParams],
                            eos_token_ids: list[int]) -> np.ndarray | None:
    """[n, s] ids each row may not sample yet (-1 padded), or None when no row is blocked.

    While output_pos < min_tokens a row may not produce a token that would stop it: its
    stop_token_ids, and EOS unless ignore_eos (with ignore_eos EOS does not stop the request,
    so it stays an ordinary token).
    """
    blocked_rows = np.flatnonzero(output_pos < min_tokens).tolist()
    blocked = []
    for row in blocked_rows:
        p = params_of(row)
        blocked.append(list(p.stop_token_ids) + ([] if p.eos_ignored else list(eos_token_ids)))
    width = max((len(ids) for ids in blocked), default=0)
    if width == 0:
        return None
    table = np.full((len(min_tokens), width), -1, dtype=np.int64)
    for row, ids in zip(blocked_rows, blocked):
        table[row, :len(ids)] = ids
    return table
