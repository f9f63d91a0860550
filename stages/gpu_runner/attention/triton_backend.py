"""The triton attention backend: paged attention that reads each row's blocks in place, with the kernels
of `stages/gpu_runner/triton_kernels/` (compiled on CUDA, interpreted on CPU).

Its metadata is the step's rows' block tables, their context lengths (int32) and, for prefill and
mixed steps, where each row's queries start; a decode-only step needs no query starts. The static
decode metadata reads only the static buffers and has bucket-fixed shapes, so it is captured in
the decode graphs with the forward. The same metadata serves windowed layers: the kernels take
the window as a scalar and skip the blocks before it themselves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from stages.gpu_runner.attention.interface import triton_takes_block_size
from stages.gpu_runner.inputs.step_layout import StepLayout

if TYPE_CHECKING:
    from stages.gpu_runner.inputs.input_batch import InputBatch
    from stages.gpu_runner.inputs.static_decode import StaticDecodeInputs


@dataclass(slots=True)
class TritonMetadata:
    slot_mapping: torch.Tensor  # int64 [num_tokens]: where each new token's K/V goes
    block_tables: torch.Tensor  # int32 [n, max_blocks]: the step's rows' block tables
    seq_lens: torch.Tensor  # int32 [n]: each row's context once this step's tokens are written (0: padding)
    query_start_loc: torch.Tensor | None  # int32 [n + 1]; None when every row has one query token
    max_query_len: int


class TritonBackend:
    name = "triton"

    def __init__(self, device: torch.device, block_size: int) -> None:
        from stages.gpu_runner import triton_kernels

        if not triton_takes_block_size(block_size):
            raise ValueError(f"attention_backend 'triton' needs a block_size that is a power of two >= 16, "
                             f"got {block_size}")
        self.kernels = triton_kernels.load(device)
        self.block_size = block_size

    def host_arrays(self, layout: StepLayout) -> list[np.ndarray]:
        # Context lengths and query starts side by side: one int32 conversion on the device.
        return [layout.rows, np.concatenate([layout.context, layout.query_start])]

    def step_metadata(self, layout: StepLayout, arrays: list[torch.Tensor], slot_mapping: torch.Tensor,
                      batch: InputBatch, shift: torch.Tensor | None = None) -> TritonMetadata:
        rows, lens_and_starts = arrays
        n = len(layout.rows)
        if shift is not None:  # the kernels place each row's queries at the end of its context
            lens_and_starts = torch.cat([lens_and_starts[:n] - shift, lens_and_starts[n:]])
        lens_and_starts = lens_and_starts.to(torch.int32)
        num_blocks = -(-int(layout.context.max()) // self.block_size) if n else 0
        max_query_len = int(layout.scheduled.max()) if n else 0
        return TritonMetadata(
            slot_mapping=slot_mapping,
            block_tables=batch.block_table.narrow(1, 0, num_blocks).index_select(0, rows),
            seq_lens=lens_and_starts[:n],
            query_start_loc=None if max_query_len == 1 else lens_and_starts[n:],
            max_query_len=max_query_len)

    def decode_metadata(self, rows: torch.Tensor, context: torch.Tensor, max_context: int,
                        slot_mapping: torch.Tensor, block_table: torch.Tensor) -> TritonMetadata:
        num_blocks = -(-max_context // self.block_size)
        return TritonMetadata(slot_mapping=slot_mapping,
                              block_tables=block_table.narrow(1, 0, num_blocks).index_select(0, rows),
                              seq_lens=context.to(torch.int32), query_start_loc=None, max_query_len=1)

    def static_decode_metadata(self, inputs: StaticDecodeInputs, num_rows: int, max_context: int) -> TritonMetadata:
        # The full table width, whatever the step's contexts: the shapes depend on the bucket alone.
        return TritonMetadata(
            slot_mapping=inputs.slot_mapping[:num_rows],
            block_tables=inputs.block_table.index_select(0, inputs.rows[:num_rows]),
            seq_lens=inputs.seq_lens[:num_rows].to(torch.int32),
            query_start_loc=None, max_query_len=1)

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                  meta: TritonMetadata, scale: float, window: int | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        if sinks is not None:
            raise ValueError("the triton attention kernels have no attention sinks (gpt-oss); "
                             "serve this model with --attention-backend torch")
        self.kernels.store_kv(kv_cache, key, value, meta.slot_mapping)
        if meta.query_start_loc is None:
            return self.kernels.paged_decode_attention(query, kv_cache, meta.block_tables, meta.seq_lens, scale,
                                                       window=window)
        return self.kernels.paged_prefill_attention(query, kv_cache, meta.block_tables, meta.seq_lens,
                                                    meta.query_start_loc, meta.max_query_len, scale, window=window)
