"""What an attention backend is: the object the attention layers call to write this step's KV into
the paged cache and attend, and that builds the per-step attention metadata those calls read.

Two implement it: `TorchBackend` (torch_backend.py, plain torch; the CPU product path) and
`TritonBackend` (triton_backend.py, the kernels of `stages/gpu_runner/triton_kernels/`);
selector.py picks one. A backend builds only the metadata it reads, from host-known numbers:
nothing here waits on the device. (RMSNorm and rotary are the layers' own: layers/kernels.py.)

Metadata comes from two places. A dynamic step (any plan) asks `host_arrays` for the numbers it
wants in the step's single packed upload and then `step_metadata` for the metadata over their
device copies. A bucketed decode step (inputs/static_decode.py) calls `static_decode_metadata`,
which reads only the persistent static buffers, so that on CUDA the call can be captured in a graph.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from stages.gpu_runner.inputs.step_layout import StepLayout

if TYPE_CHECKING:
    from stages.gpu_runner.inputs.input_batch import InputBatch
    from stages.gpu_runner.inputs.static_decode import StaticDecodeInputs


class AttentionBackend(Protocol):
    name: str

    def host_arrays(self, layout: StepLayout) -> list[np.ndarray]:
        """The int64 arrays this backend's metadata needs, appended to the step's packed upload."""

    def step_metadata(self, layout: StepLayout, arrays: list[torch.Tensor], slot_mapping: torch.Tensor,
                      batch: InputBatch, shift: torch.Tensor | None = None) -> Any:
        """The metadata of a dynamic step, from the device copies of `host_arrays(layout)`.

        `shift` (int64 [n] on the device, speculative steps only): how far each row's real
        positions trail the layout's (its previous step's rejected drafts); its contexts are that
        much shorter than the layout says, and the layout's are upper bounds."""

    def decode_metadata(self, rows: torch.Tensor, context: torch.Tensor, max_context: int,
                        slot_mapping: torch.Tensor, block_table: torch.Tensor) -> Any:
        """The metadata of one query token per row at position context - 1, all on the device
        (a draft model's decoding): `rows` int64 [d] of `block_table`, `context` int64 [d] >= 1,
        max_context a host-known upper bound of it."""

    def static_decode_metadata(self, inputs: StaticDecodeInputs, num_rows: int, max_context: int) -> Any:
        """The metadata of a decode step over the first `num_rows` rows of the static buffers;
        `max_context` is the longest context among the real rows (a backend that is captured in
        a graph must not depend on it)."""

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                  meta: Any, scale: float, window: int | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Write this step's key/value into the paged cache, then attend: [T, H, D] -> [T, H, D].

        `window` (sliding-window layers): a query at position p attends only the keys at
        max(0, p - window + 1)..p; None attends its whole causal context. One `meta` serves every
        layer of the step, windowed or not. `sinks` [H] (gpt-oss): each head's learned logit that
        joins its softmax denominator; None: plain attention."""


def window_blocks(window: int | None, block_size: int, max_blocks: int) -> int:
    """How many blocks the keys of one query's window can span, at most `max_blocks` (a row's
    whole table, which is also the answer for window None). W consecutive positions touch at
    most ceil((W - 1) / block_size) + 1 blocks: one more than W / block_size when unaligned."""
    if window is None:
        return max_blocks
    check_window(window)
    return min(max_blocks, -(-(window - 1) // block_size) + 1)


def check_window(window: int | None) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"an attention window must be a positive int or None, got {window!r}")


def triton_takes_block_size(block_size: int) -> bool:
    """The Triton kernels read a block per tile: its size must be a power of two >= 16."""
    return block_size >= 16 and not block_size & (block_size - 1)
