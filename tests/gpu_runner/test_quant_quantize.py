"""Quantize at load (cpu_ops/quant_encode.c through quant.quantize_rows): float32 rows into Q8_0 and
Q4_0 blocks equal, byte for byte, the gguf package's reference quantizer (gguf.quants.quantize,
itself bit-exact with ggml's quantize_row_*_ref), and the blocks go through the same kernels."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import quantize

from stages.gpu_runner import cpu_ops
from stages.gpu_runner.cpu_ops import quant
from stages.gpu_runner.layers.linear import linear
from stages.gpu_runner.layers.quantization.base import QuantizedWeight
from stages.gpu_runner.loaders.gguf_quants import dequantize

pytestmark = pytest.mark.timeout(120)
MADE = [QType.Q8_0, QType.Q4_0]


@pytest.fixture(autouse=True, scope="module")
def built() -> None:
    """Where a C compiler exists the kernels must build: a failed build fails these tests, never skips them."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: quantize at load is not offered")
    assert cpu_ops.library() is not None, "the CPU kernels failed to build (see the log)"


def assert_reference_blocks(weight: torch.Tensor, qtype: QType) -> torch.Tensor:
    got = quant.quantize_rows(weight, qtype)
    want = quantize(weight.numpy(), qtype)
    assert got.shape == want.shape and got.dtype == torch.uint8
    differ = np.flatnonzero((got.numpy() != want).any(axis=1))
    assert differ.size == 0, f"{qtype.name}: rows {differ[:5]} differ from the reference"
    return got


@pytest.mark.parametrize("qtype", MADE, ids=lambda t: t.name)
@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e-5, 3e4], ids=lambda s: f"scale {s:g}")
def test_random_rows_equal_the_reference_bit_for_bit(qtype, scale):
    """Magnitudes from normal weights to ones whose scale is a float16 subnormal (~3e-5 / 127) or
    near float16's top (3e4 * 4 / 8)."""
    weight = torch.randn(33, 320, generator=torch.Generator().manual_seed(qtype.value)) * scale
    assert_reference_blocks(weight, qtype)


@pytest.mark.parametrize("qtype", MADE, ids=lambda t: t.name)
def test_edge_blocks_equal_the_reference(qtype):
    """Zero blocks (+0 and -0 first), ties in magnitude (the first wins in Q4_0), values exactly
    halfway between two steps (rounded away from zero in Q8_0), a block that is one value."""
    weight = torch.zeros(6, 32)
    weight[1, 0] = -0.0
    weight[2, 5], weight[2, 9] = -1.0, 1.0
    weight[3] = torch.tensor([0.5, -0.5] * 16)
    weight[4] = torch.arange(32) - 15.5
    weight[5, 31] = -3.0
    assert_reference_blocks(weight, qtype)


def test_scales_round_to_float16_as_numpy_does():
    """Q4_0's scale is its largest-magnitude value / -8, exact for these: each block's scale is a
    float32 of its own (normal, subnormal in float16, halfway between two float16 values, past the
    largest float16), so the float16 rounding is checked on its own, ties to even included."""
    rng = np.random.default_rng(0)
    bits = np.concatenate([rng.integers(0x33000000, 0x47800000, 4000, dtype=np.uint32),  # 2^-25 .. 2^16
                           # halfway between two float16 normals (the 13 bits it drops are 0x1000)
                           (rng.integers(0x38800000 >> 13, 0x47800000 >> 13, 1000, dtype=np.uint32) << 13) | 0x1000])
    scales = bits.view(np.float32)
    weight = torch.zeros(scales.size, 32)
    weight[:, 0] = torch.from_numpy(scales * np.float32(-8.0))
    assert_reference_blocks(weight, QType.Q4_0)


@pytest.mark.parametrize("qtype", MADE, ids=lambda t: t.name)
def test_made_blocks_multiply_like_file_blocks(qtype):
    """The blocks made at load are ordinary blocks: decoded exactly as the reference decoder does,
    and multiplied by the method's kernels like any."""
    weight = torch.randn(40, 256, generator=torch.Generator().manual_seed(1))
    quantized = QuantizedWeight(qtype.value, quant.quantize_rows(weight, qtype), (40, 256))
    reference = dequantize(quantized.blocks, qtype, (40, 256), torch.float32, "w")
    assert torch.equal(quant.dequantize_rows(quantized.blocks, qtype, 256, start=0, count=40), reference)
    error = (reference - weight).abs().max().item()
    assert 0 < error <= weight.abs().max().item() / (8 if qtype == QType.Q4_0 else 127)
    x = torch.randn(3, 256)
    assert torch.allclose(linear(x, quantized, None), x @ reference.T, rtol=1e-4, atol=1e-4)


def test_bad_inputs_raise_naming_the_problem():
    with pytest.raises(ValueError, match="block type"):
        quant.quantize_rows(torch.zeros(2, 32), QType.Q4_K)
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize_rows(torch.zeros(2, 40), QType.Q8_0)
    with pytest.raises(ValueError, match="float32"):
        quant.quantize_rows(torch.zeros(2, 32, dtype=torch.float64), QType.Q8_0)
    with pytest.raises(ValueError, match="inf or nan"):
        quant.quantize_rows(torch.full((2, 32), float("nan")), QType.Q4_0)
