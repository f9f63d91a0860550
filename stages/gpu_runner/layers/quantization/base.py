"""The linear-method interface (vLLM's LinearMethodBase shape) and the weight a quantized method holds.

A linear layer's weight is a dense tensor, a `QuantizedWeight`, or (a merged layer whose parts are
stored in different types) a tuple of them; layers/linear.py picks the method that multiplies it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A [rows, cols] weight as GGUF blocks: `blocks` uint8 [rows, row_bytes], each row its own run
    of blocks of ggml type `qtype` (a GGMLQuantizationType number), exactly as the file stores them.
    `int8_activations`: a decode step's few activation rows are quantized to 8 bits for this weight's
    products (gguf.py, --quantized-activations)."""

    qtype: int
    blocks: torch.Tensor
    shape: tuple[int, int]
    int8_activations: bool = False

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def select_rows(self, rows: torch.Tensor | slice) -> QuantizedWeight:
        """The weight of the chosen rows (a permutation, or a range): rows of blocks move whole."""
        blocks = self.blocks[rows].contiguous()
        return QuantizedWeight(self.qtype, blocks, (blocks.shape[0], self.shape[1]), self.int8_activations)

    @staticmethod
    def stack(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
        """One weight of the parts' rows in order, where all share a type (and activations); else None."""
        if len({(part.qtype, part.int8_activations) for part in parts}) != 1:
            return None
        blocks = torch.cat([part.blocks for part in parts])
        return QuantizedWeight(parts[0].qtype, blocks, (blocks.shape[0], parts[0].shape[1]), parts[0].int8_activations)


class LinearMethod:
    """Multiplies activations by a weight held in one form, picking the kernel by device and rows."""

    def apply(self, weight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., cols] -> x @ weight.T + bias, [..., rows], in x's dtype."""
        raise NotImplementedError

    def embed(self, weight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the weight (an embedding lookup), in `dtype`."""
        raise NotImplementedError
