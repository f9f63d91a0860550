"""GGUF block-quantized weights on the CPU (quant.c, quant_gemm.c, quant_encode.c): decode chosen
rows, the fused dequantize-and-dot of a few activation rows, the tiled product for many, and float32
rows made into Q8_0 or Q4_0 blocks (quantize at load). `blocks` is a uint8 [rows, row_bytes] tensor
of one ggml block type (`qtype`, its GGMLQuantizationType number); activations and results are float32."""
from __future__ import annotations

import torch

from stages.gpu_runner.cpu_ops import library


def block_bytes(qtype: int) -> int:
    """Bytes of one block of `qtype`; 0 where quant.c does not decode it or the kernels are not built."""
    lib = library()
    return 0 if lib is None else lib.quant_block_bytes(int(qtype))


def _checked(blocks: torch.Tensor, qtype: int, cols: int, caller: str):
    lib = library()
    if lib is None:
        raise RuntimeError(f"{caller}: the CPU kernels are not built (see cpu_ops.library)")
    size = lib.quant_block_bytes(int(qtype))
    values = 256 if int(qtype) >= 10 else 32
    if size == 0 or blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous() \
            or blocks.device.type != "cpu" or cols % values or blocks.shape[1] != cols // values * size:
        raise ValueError(f"{caller}: blocks of type {qtype} for {cols} columns must be contiguous CPU uint8 "
                         f"[rows, {cols // values * size if size else '?'}], not {blocks.dtype} {tuple(blocks.shape)}")
    return lib


def dequantize_rows(blocks: torch.Tensor, qtype: int, cols: int, ids: torch.Tensor | None = None,
                    start: int = 0, count: int | None = None) -> torch.Tensor:
    """float32 [n, cols]: rows `ids` (int64, each checked in range) of the weight, or rows
    start .. start + count."""
    lib = _checked(blocks, qtype, cols, "dequantize_rows")
    rows = blocks.shape[0]
    if ids is not None:
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
            raise IndexError(f"dequantize_rows: row ids must be in [0, {rows}), got {ids.min()}..{ids.max()}")
        count = ids.numel()
    elif count is None or start < 0 or start + count > rows:
        raise IndexError(f"dequantize_rows: rows {start} + {count} out of [0, {rows})")
    out = torch.empty(count, cols, dtype=torch.float32)
    lib.quant_dequantize_rows(blocks.data_ptr(), int(qtype), blocks.shape[1], cols,
                              None if ids is None else ids.data_ptr(), start, count, out.data_ptr())
    return out


def _activations(x: torch.Tensor, cols: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != cols or x.device.type != "cpu":
        raise ValueError(f"quant matmul: activations must be CPU [n, {cols}], not {tuple(x.shape)} on {x.device}")
    return x.to(torch.float32).contiguous()


def matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """x [n, cols] times the weight [rows, cols] transposed: float32 [n, rows], each weight row
    decoded once for all n rows (the fused kernel: for a few rows)."""
    lib = _checked(blocks, qtype, cols, "quant matmul")
    x = _activations(x, cols)
    out = torch.empty(x.shape[0], blocks.shape[0], dtype=torch.float32)
    lib.quant_matmul(blocks.data_ptr(), int(qtype), blocks.shape[1], blocks.shape[0], cols, x.data_ptr(),
                     x.shape[0], out.data_ptr())
    return out


def matmul_tiled(x: torch.Tensor, blocks: torch.Tensor, qtype: int, cols: int, tile_rows: int = 0) -> torch.Tensor:
    """matmul for many activation rows: the weight decoded a tile of `tile_rows` rows at a time
    (0: sized for the L2 cache), each tile multiplied with all rows."""
    lib = _checked(blocks, qtype, cols, "quant matmul")
    if tile_rows < 0:
        raise ValueError(f"quant matmul: tile_rows must be >= 0 (0: the default), not {tile_rows}")
    x = _activations(x, cols)
    out = torch.empty(x.shape[0], blocks.shape[0], dtype=torch.float32)
    lib.quant_matmul_tiled(blocks.data_ptr(), int(qtype), blocks.shape[1], blocks.shape[0], cols, x.data_ptr(),
                           x.shape[0], out.data_ptr(), int(tile_rows))
    return out


QUANTIZABLE = {8: "Q8_0", 2: "Q4_0"}  # the block types quantize_rows makes (GGMLQuantizationType numbers)


def quantize_rows(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """float32 weight [rows, cols] (cols a multiple of 32) as ggml blocks of `qtype` (Q8_0 or Q4_0):
    uint8 [rows, cols // 32 * block bytes], bit for bit ggml's reference quantizer (gguf.quants.quantize)."""
    lib = library()
    if lib is None:
        raise RuntimeError("quantize_rows: the CPU kernels are not built (see cpu_ops.library)")
    if int(qtype) not in QUANTIZABLE:
        raise ValueError(f"quantize_rows: block type {qtype} is not one of {sorted(QUANTIZABLE.values())}")
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.shape[1] % 32:
        raise ValueError(f"quantize_rows: the weight must be CPU float32 [rows, cols], cols a multiple of 32, "
                         f"not {weight.dtype} {tuple(weight.shape)} on {weight.device}")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("quantize_rows: the weight holds inf or nan values")
    weight = weight.contiguous()
    rows, cols = weight.shape
    out = torch.empty(rows, cols // 32 * lib.quant_block_bytes(int(qtype)), dtype=torch.uint8)
    lib.quant_quantize_rows(weight.data_ptr(), int(qtype), rows, cols, out.data_ptr())
    return out
