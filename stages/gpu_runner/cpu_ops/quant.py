"""GGUF block-quantized weights on the CPU (quant.c, quant_gemm.c, quant_encode.c): decode chosen
rows, the fused dequantize-and-dot of a few activation rows, the tiled product for many, and float32
rows made into Q8_0 or Q4_0 blocks (quantize at load). `blocks` is a uint8 [rows, row_bytes] tensor
of one ggml block type (`qtype`, its GGMLQuantizationType number); activations and results are float32."""
from __future__ import annotations

import functools

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
    decoded once for all n rows (the fused kernel: for a few rows)."""
    return operators().quant_matmul(x.to(torch.float32), blocks, int(qtype), cols)


def matmul_float32(x: torch.Tensor, blocks: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """matmul for a float32 x [n, cols] and an int qtype, with nothing converted on the way: the
    decode step calls it for every layer of every token."""
    return _quant_matmul()(x, blocks, qtype, cols)


@functools.cache
def _quant_matmul():
    """The operator itself, looked up once (a RuntimeError, not cached, where it is not built)."""
    return operators().quant_matmul


def x8_available(qtype: int) -> bool:
    """Whether matmul_x8 takes `qtype` on this CPU (AVX-512 VNNI or AVX2; every type quant_x8.c takes)."""
    ops = library()
    return ops is not None and bool(ops.quant_x8_available(int(qtype)))


def matmul_x8(x: torch.Tensor, blocks: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """matmul with each activation row quantized to 8 bits per 32 values (quant_x8.c): faster on one
    stream, and within the activations' rounding of it, not within float32's."""
    return _quant_matmul_x8()(x, blocks, qtype, cols)


@functools.cache
def _quant_matmul_x8():
    return operators().quant_matmul_x8


def matmul_tiled(x: torch.Tensor, blocks: torch.Tensor, qtype: int, cols: int, tile_rows: int = 0) -> torch.Tensor:
    """matmul for many activation rows: the weight decoded a tile of `tile_rows` rows at a time
    (0: sized for the L2 cache), each tile multiplied with all rows."""
    return operators().quant_matmul_tiled(x.to(torch.float32), blocks, int(qtype), cols, int(tile_rows))


QUANTIZABLE = {8: "Q8_0", 2: "Q4_0"}  # the block types quantize_rows makes (GGMLQuantizationType numbers)


def quantize_rows(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """float32 weight [rows, cols] (cols a multiple of 32) as ggml blocks of `qtype` (Q8_0 or Q4_0):
    uint8 [rows, cols // 32 * block bytes], bit for bit ggml's reference quantizer (gguf.quants.quantize)."""
    if int(qtype) not in QUANTIZABLE:
        raise ValueError(f"quantize_rows: block type {qtype} is not one of {sorted(QUANTIZABLE.values())}")
    if weight.is_floating_point() and weight.device.type == "cpu" and not bool(torch.isfinite(weight).all()):
        raise ValueError("quantize_rows: the weight holds inf or nan values")
    return operators().quant_quantize_rows(weight, int(qtype))
