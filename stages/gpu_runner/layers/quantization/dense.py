"""The dense linear method: a float weight [out, in], multiplied by F.linear.

On the CPU a projection runs through oneDNN with its weight reordered once into oneDNN's own
blocked layout: at a decode step's shapes that is 1.3-1.7x the speed of the plain matmul (MKL's,
for float32), which reorders nothing but has no AVX-512 path on every CPU. oneDNN's bfloat16 path
needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: on a CPU without them (AVX2 only) a bfloat16 weight
takes F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.gpu_runner.layers.quantization.base import LinearMethod

# The batch size oneDNN picks the packed layout for: a decode step's; any batch size may use it.
PACK_BATCH_HINT = 32


def _packed_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes oneDNN's packed linear runs in on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return ()
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


_PACKED_DTYPES = _packed_dtypes()


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] in oneDNN's blocked layout, made once per version of the weight."""
    # Inference tensors keep no version counter: they cannot be written outside inference mode.
    version = 0 if weight.is_inference() else weight._version
    packed = getattr(weight, "onednn_packed", None)
    if packed is None or packed[0] != version:
        with torch.no_grad():
            packed = (version, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT))
        weight.onednn_packed = packed
    return packed[1]


class DenseMethod(LinearMethod):
    def apply(self, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """F.linear; on the CPU through oneDNN with `weight` packed for it (kept on the weight itself,
        repacked when the weight is written in place)."""
        if x.device.type != "cpu" or weight.dtype not in _PACKED_DTYPES:
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight(weight), bias, "none", [], "")

    def embed(self, weight: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return F.embedding(ids, weight).to(dtype)
