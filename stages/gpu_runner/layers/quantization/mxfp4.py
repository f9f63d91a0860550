"""MXFP4 (OCP microscaling FP4), as gpt-oss checkpoints store their experts: dequantized at load.

A `*_blocks` tensor [..., rows, groups, 16] uint8 packs 32 FP4 (e2m1) values per group, two per
byte (low nibble first); its `*_scales` [..., rows, groups] uint8 are each group's power-of-two
exponent, biased by 127. The dequantized [..., rows, groups * 32] is transposed into the
checkpoint's dense layout, as transformers' convert_moe_packed_tensors does.
"""
from __future__ import annotations

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# The stacked expert tensors stored as blocks and scales (their biases stay dense).
MXFP4_TENSORS = ("gate_up_proj", "down_proj")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [E, R, G, 16] uint8, scales [E, R, G] uint8 -> [E, G * 32, R] in `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)} "
                         "(blocks must be [..., groups, 16] over scales [..., groups])")
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    values = torch.empty(*blocks.shape[:-1], 32, dtype=dtype)
    values[..., 0::2] = lut[(blocks & 0x0F).long()]
    values[..., 1::2] = lut[(blocks >> 4).long()]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1))
    return values.flatten(-2).transpose(1, 2).contiguous()
