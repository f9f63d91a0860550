"""The GGUF linear method: a weight kept as the file's blocks (a `QuantizedWeight`), on the CPU.

One place picks the kernel by the number of activation rows n (tools/micro/bench_quant_matmul.py
measures the three against the dense float32 matmul on the real models' shapes):
  - n <= fused_rows(type) (a few decode streams, or one verifying drafts): cpu_ops/quant.c's fused
    dequantize-and-dot, each block decoded in registers and dotted with up to 8 rows at once (4
    for the 256-value K types): the step is bound by reading the blocks;
  - n <= TILED_ROWS (a decode batch, a short prefill): cpu_ops/quant_gemm.c, tiles of weight rows
    decoded into an L2-sized float32 buffer per thread and multiplied by a register-blocked kernel;
  - more (a long prefill): tiles of TILE_VALUES decoded by quant.c and multiplied by torch's matmul,
    whose GEMM is faster than quant_gemm.c's once the decoding is spread over that many rows.
Embedding lookups decode just the rows they gather. Every path equals "dequantize, then multiply in
float32" up to the order of the dot's summation (decoding is exact), except where a weight takes
8-bit activations (`QuantizedWeight.int8_activations`, set at load by loaders/quantization.py's
`with_activations`):
then up to X8_ROWS rows are quantized to 8 bits a block of 32 and dotted in integers
(cpu_ops/quant_x8.c), within the activations' rounding of that.
"""
from __future__ import annotations

import torch

from stages.gpu_runner.cpu_ops import quant
from stages.gpu_runner.layers.quantization.base import LinearMethod, QuantizedWeight

# Thresholds measured on a 2-core AVX-512 machine (SmolLM2 and Gemma-3 shapes, one thread, thread CPU
# time, tools/micro/bench_quant_matmul.py --rows 1 2 3 4 5 6 8 12 16): the fused kernel is ahead at
# 1-2 rows for every type, and for the 32-value types up to 8 (the heads above all, whose tiles
# quant_gemm.c decodes for every call: Gemma-3's Q8_0 head at 5 rows 51 ms fused, 101 ms tiled; at 8,
# 71 and 90; at 12 even), which a row verifying 4 drafts, or a few streams, needs; K types go to
# quant_gemm.c from 3 rows (Q4_K 640x1024 at 3: 0.37 ms fused, 0.32 tiled). quant_gemm.c is ahead of
# decoding tiles for torch's matmul up to ~128 rows; above ~192 rows torch's GEMM wins.
# With --quantized-activations int8 (on a CPU with AVX-512 VNNI or AVX2), up to X8_ROWS rows of every
# type go through quant_x8.c: 8-bit activations and integer dots, all the rows in one pass over the
# blocks. One forward step's products (tools/micro/bench_quant_matmul.py --rows 1 2 4 5 6 8, one
# thread, thread CPU ms, float32 kernels / x8): SmolLM2 at 1 row 28.6 / 15.8, 4 rows 41.9 / 32.5,
# 5 rows 46.1 / 36.5, 8 rows 65.1 / 57.3; Gemma-3 at 1 row 55.3 / 38.6, 5 rows 84.3 / 67.2, 8 rows
# 103.4 / 93.7 (some K-type shapes lose at 8 rows; the step does not). A verify step of one row and
# 4 drafts (5 rows) takes it too. On an AVX2 CPU without AVX-512 (an AMD EPYC; 4 rows a pass): SmolLM2
# at 1 row 34.0 / 10.3, 4 rows 59.5 / 18.3.
X8_ROWS = 8
FUSED_ROWS = 8  # 32-value types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
FUSED_ROWS_K = 2  # 256-value types: Q4_K, Q5_K, Q6_K
K_TYPES = frozenset({12, 13, 14})
TILED_ROWS = 128
# float32 values of one decoded tile for torch's matmul (4 MiB): bounded even for a 262,144-row head.
TILE_VALUES = 1 << 20


# The kernels a product runs by (kernel_for): also what layers/decoder_stack.py hands cpu_ops/decoder.c.
FUSED, X8, TILED, TORCH_TILES = 0, 1, 2, 3


def kernel_for(weight: QuantizedWeight, num_rows: int, dtype: torch.dtype) -> int:
    """The kernel `num_rows` activation rows of `dtype` are multiplied by `weight` with (see above)."""
    if weight.int8_activations and num_rows <= X8_ROWS and dtype == torch.float32:
        return X8
    if num_rows <= (FUSED_ROWS_K if weight.qtype in K_TYPES else FUSED_ROWS):
        return FUSED
    return TILED if num_rows <= TILED_ROWS else TORCH_TILES


class GGUFMethod(LinearMethod):
    def apply(self, weight: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows, cols = weight.shape
        if not x.is_cpu:
            raise ValueError(f"GGUF blocks are multiplied on the CPU only, not {x.device}")
        flat = x if x.dim() == 2 else x.reshape(-1, cols)
        kernel = kernel_for(weight, flat.shape[0], x.dtype)
        if kernel == X8:
            out = quant.matmul_x8(flat, weight.blocks, weight.qtype, cols)
        elif kernel == FUSED and x.dtype == torch.float32:
            # A decode step's path, in as few Python steps as it can be: every layer of every token takes it.
            out = quant.matmul_float32(flat, weight.blocks, weight.qtype, cols)
        elif kernel == FUSED:
            out = quant.matmul(flat, weight.blocks, weight.qtype, cols).to(x.dtype)
        elif kernel == TILED:
            out = quant.matmul_tiled(flat, weight.blocks, weight.qtype, cols).to(x.dtype)
        else:
            out = self._torch_tiles(flat.to(torch.float32), weight).to(x.dtype)
        if bias is not None:
            out = out + bias
        return out if x.dim() == 2 else out.view(*x.shape[:-1], rows)

    @staticmethod
    def _torch_tiles(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
        rows, cols = weight.shape
        step = max(1, TILE_VALUES // cols)
        out = torch.empty(x.shape[0], rows, dtype=torch.float32)
        for start in range(0, rows, step):
            count = min(step, rows - start)
            tile = quant.dequantize_rows(weight.blocks, weight.qtype, cols, start=start, count=count)
            out[:, start:start + count] = x @ tile.t()
        return out

    def embed(self, weight: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows = quant.dequantize_rows(weight.blocks, weight.qtype, weight.shape[1], ids=ids)
        return rows.to(dtype).view(*ids.shape, weight.shape[1])


def int8_activations_for(mode: str, qtype: int) -> bool:
    """Whether a weight of `qtype` takes 8-bit activations under --quantized-activations `mode`
    (int8: where quant_x8.c has the type on this CPU; float32: never)."""
    return mode == "int8" and quant.x8_available(qtype)


def check_int8_activations(mode: str) -> None:
    """ValueError where int8 is asked for on a CPU whose kernels cannot take it."""
    if mode == "int8" and not any(quant.x8_available(qtype) for qtype in X8_TYPES):
        raise ValueError("quantized_activations int8 needs the CPU kernels built for AVX-512 VNNI or AVX2, "
                         "which this CPU or build lacks; use float32")


X8_TYPES = (2, 3, 6, 7, 8, 12, 13, 14)  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K
