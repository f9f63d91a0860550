"""GGUF tensor data to torch: dequantize the float and block-quantized types a GGUF checkpoint stores.

Each quantized type is a run of fixed-size blocks; every block is decoded at once with torch ops on a
[num_blocks, block_bytes] uint8 view. Arithmetic is float32, one rounding per operation in the order
`gguf.quants` uses (never a fused multiply-add), so a float32 result is bit for bit that reference;
only the final copy converts to the requested dtype.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType as QType

# Values decoded per step on CPU: large enough to amortize per-op overhead, small enough to stay in cache.
_CPU_CHUNK_VALUES = 1 << 19


class UnsupportedQuantType(ValueError):
    """A tensor's GGUF type that this module cannot decode."""


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 field at byte `start` of every block, as float32 [num_blocks, 1]."""
    return blocks[:, start:start + 2].view(torch.float16).float()


def _unpack(fields: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """Split packed `bits`-wide fields: each run of `group` bytes yields 8 // bits runs of `group`
    values, lowest bits first; returns uint8 [num_blocks, fields_per_block]."""
    num_blocks = fields.shape[0]
    runs = fields.reshape(num_blocks, -1, 1, group)
    mask = (1 << bits) - 1
    # One scalar shift per field beats a broadcast shift tensor several times over on CPU.
    parts = [(runs >> shift) & mask for shift in range(0, 8, bits)]
    return torch.cat(parts, dim=2).reshape(num_blocks, -1)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].view(torch.int8).float() * _f16(blocks, 0)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _unpack(blocks[:, 2:], 16, 4).float().sub_(8)
    return q.mul_(_f16(blocks, 0))


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _unpack(blocks[:, 4:], 16, 4).float()
    return q.mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def _q5_values(blocks: torch.Tensor, qh_start: int) -> torch.Tensor:
    """Q5_0/Q5_1's 5-bit values: bit i of the little-endian uint32 at `qh_start` is value i's
    fifth bit, the 16 bytes after it the low nibbles (values 0-15, then 16-31): uint8 [n, 32]."""
    high_bits = _unpack(blocks[:, qh_start:qh_start + 4], 1, 1)
    return _unpack(blocks[:, qh_start + 4:], 16, 4) | (high_bits << 4)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    return _q5_values(blocks, 2).float().sub_(16).mul_(_f16(blocks, 0))


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    return _q5_values(blocks, 4).float().mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's eight 6-bit scales and mins per block, packed in bytes 4..16, times the block's
    d and dmin: float32 [num_blocks, 8, 1] each."""
    packed = blocks[:, 4:16].reshape(-1, 3, 4)
    low, high, mixed = packed[:, 0], packed[:, 1], packed[:, 2]
    # Sub-blocks 0-3 hold 6 bits in one byte; 4-7 take 4 bits from `mixed` and the 2 top bits
    # left over in `low` (scales) or `high` (mins).
    scales = torch.cat([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], dim=-1)
    mins = torch.cat([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], dim=-1)
    d = (_f16(blocks, 0) * scales.float()).unsqueeze(-1)
    dmin = (_f16(blocks, 2) * mins.float()).unsqueeze(-1)
    return d, dmin


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dmin = _k_scales(blocks)
    q = _unpack(blocks[:, 16:], 32, 4).float().view(-1, 8, 32)
    return q.mul_(d).sub_(dmin).view(-1, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dmin = _k_scales(blocks)
    # Bit i of the 32 bytes at 16..48 is the fifth bit of sub-block i's 32 values.
    high_bits = _unpack(blocks[:, 16:48], 32, 1)
    q = (_unpack(blocks[:, 48:], 32, 4) | (high_bits << 4)).float().view(-1, 8, 32)
    return q.mul_(d).sub_(dmin).view(-1, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    low = _unpack(blocks[:, :128], 64, 4)
    high = _unpack(blocks[:, 128:192], 32, 2)
    # 6-bit values stored with an offset of 32; sixteen sub-blocks of 16 share an int8 scale.
    q = (low | (high << 4)).view(torch.int8).sub_(32).float().view(-1, 16, 16)
    d = (_f16(blocks, 208) * blocks[:, 192:208].view(torch.int8).float()).unsqueeze(-1)
    return q.mul_(d).view(-1, QK_K)


_DECODERS: dict[QType, Callable[[torch.Tensor], torch.Tensor]] = {
    # Plain floats are blocks of one value; the copy into the output converts them.
    QType.F32: lambda blocks: blocks.view(torch.float32),
    QType.F16: lambda blocks: blocks.view(torch.float16),
    QType.BF16: lambda blocks: blocks.view(torch.bfloat16),
    QType.Q8_0: _q8_0, QType.Q4_0: _q4_0, QType.Q4_1: _q4_1, QType.Q5_0: _q5_0, QType.Q5_1: _q5_1,
    QType.Q4_K: _q4_k, QType.Q5_K: _q5_k, QType.Q6_K: _q6_k,
}

SUPPORTED_TYPES: frozenset[QType] = frozenset(_DECODERS)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized tensor; on CPU backed by numpy, which asks the kernel for transparent huge
    pages on large buffers where torch's allocator does not (unless THP_MEM_ALLOC_ENABLE is set):
    faulting in a 100 MB output 4 KiB at a time costs more than decoding into it."""
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    num_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return torch.from_numpy(np.empty(num_bytes, dtype=np.uint8)).view(dtype).view(shape)


def _as_bytes(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    """`raw` as a flat uint8 tensor sharing its memory."""
    if isinstance(raw, np.ndarray):
        # GGUFReader maps the file read-only; torch warns because it cannot mark the tensor
        # read-only, but nothing here writes to it.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            raw = torch.from_numpy(raw)
    return raw.reshape(-1).view(torch.uint8)


def dequantize(raw: np.ndarray | torch.Tensor, qtype: QType, shape: tuple[int, ...],
               dtype: torch.dtype, name: str) -> torch.Tensor:
    """Decode tensor `name`'s stored data (uint8 bytes, or the typed array GGUFReader gives for
    F32/F16) into a new tensor of `shape` (torch order: rows x columns) and `dtype`."""
    if qtype not in SUPPORTED_TYPES:
        supported = ", ".join(t.name for t in sorted(SUPPORTED_TYPES))
        raise UnsupportedQuantType(
            f"tensor {name} has quant type {qtype.name}, which is not supported; supported: {supported}")
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    row_size = shape[-1] if shape else 1
    if row_size % block_size != 0:
        raise ValueError(f"tensor {name}: row size {row_size} of shape {tuple(shape)} is not a multiple "
                         f"of the {qtype.name} block size {block_size}")
    data = _as_bytes(raw)
    num_blocks = int(np.prod(shape, dtype=np.int64)) // block_size
    if data.numel() != num_blocks * block_bytes:
        raise ValueError(f"tensor {name}: {data.numel()} bytes of {qtype.name} data, but shape "
                         f"{tuple(shape)} needs {num_blocks * block_bytes}")
    blocks = data.view(num_blocks, block_bytes)
    decode = _DECODERS[qtype]
    out = _empty((num_blocks, block_size), dtype, blocks.device)
    # On CPU, decoding a cache-sized run of blocks at a time keeps the float32 intermediates in
    # cache and never allocates a full-size one; a GPU takes the whole tensor in one go.
    step = max(1, _CPU_CHUNK_VALUES // block_size) if blocks.device.type == "cpu" else max(1, num_blocks)
    for start in range(0, num_blocks, step):
        out[start:start + step] = decode(blocks[start:start + step])
    return out.view(shape)
