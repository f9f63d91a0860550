"""The GGUF linear method: a weight kept as the file's blocks (a `QuantizedWeight`), on the CPU.

One place picks the kernel by the number of activation rows: up to DECODE_ROWS (a decode step's
batch) the fused dequantize-and-dot of cpu_ops/quant.c reads each block once for all rows; more
rows (a prefill) decode the weight a tile of rows at a time into a cache-sized float32 buffer and
multiply it with torch's matmul. Embedding lookups decode just the rows they gather. Results
equal "dequantize, then multiply in float32" up to the order of the dot's summation.
"""
from __future__ import annotations

import torch

from stages.gpu_runner.cpu_ops import quant
from stages.gpu_runner.layers.quantization.base import LinearMethod, QuantizedWeight

# Activation rows the fused kernel takes. Measured on a 2-core AVX-512 machine (SmolLM2's Q4_1
# projections and Q8_0 head, 2 threads), the fused kernel beats decoding tiles and multiplying them
# with torch's matmul up to 32 rows; a prefill's hundreds of rows go the tiled way. Both lose to the
# dense float32 matmul at many rows (tools/bench/bench_one_stream.py --batch 32: a third of its
# tokens/s), which is why --quantization none stays the default.
DECODE_ROWS = 32
# float32 values of one decoded tile (4 MiB): a bounded buffer even for a 262,144-row head.
TILE_VALUES = 1 << 20


class GGUFMethod(LinearMethod):
    def apply(self, weight: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows, cols = weight.shape
        if x.device.type != "cpu":
            raise ValueError(f"GGUF blocks are multiplied on the CPU only, not {x.device}")
        flat = x.reshape(-1, cols)
        if flat.shape[0] <= DECODE_ROWS:
            out = quant.matmul(flat, weight.blocks, weight.qtype, cols)
        else:
            out = self._tiled(flat.to(torch.float32), weight)
        out = out.to(x.dtype)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], rows)

    @staticmethod
    def _tiled(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
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
