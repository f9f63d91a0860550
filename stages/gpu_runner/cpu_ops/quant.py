"""GGUF block-quantized weights on the CPU (quant.c): decode chosen rows, or the fused
dequantize-and-dot of a few activation rows. `blocks` is a uint8 [rows, row_bytes] tensor of one
ggml block type (`qtype`, its GGMLQuantizationType number); activations and results are float32."""
from __future__ import annotations

import torch

from stages.gpu_runner.cpu_ops import library, operators


def block_bytes(qtype: int) -> int:
    """Bytes of one block of `qtype`; 0 where quant.c does not decode it or the kernels are not built."""
    ops = library()
    return 0 if ops is None else ops.quant_block_bytes(int(qtype))


def dequantize_rows(blocks: torch.Tensor, qtype: int, cols: int, ids: torch.Tensor | None = None,
                    start: int = 0, count: int | None = None) -> torch.Tensor:
    """float32 [n, cols]: rows `ids` (int64, each checked in range) of the weight, or rows
    start .. start + count."""
    if ids is not None:
        ids = ids.to(torch.int64)
    elif count is None:
        raise IndexError(f"dequantize_rows: rows from {start}: a count is needed without ids")
    return operators().quant_dequantize_rows(blocks, int(qtype), cols, ids, start, 0 if count is None else count)


def matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """x [n, cols] times the weight [rows, cols] transposed: float32 [n, rows], each weight row
    decoded once for all n rows."""
    return operators().quant_matmul(x.to(torch.float32), blocks, int(qtype), cols)
