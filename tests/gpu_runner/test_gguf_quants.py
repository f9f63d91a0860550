"""GGUF dequantization: every supported type decodes bit for bit like gguf's own numpy reference."""
from __future__ import annotations

import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType

from stages.gpu_runner.loaders import gguf_quants
from stages.gpu_runner.loaders.gguf_quants import SUPPORTED_TYPES, UnsupportedQuantType, dequantize

# Byte offsets of each block's float16 fields (scales, mins); every other byte is free quant data.
F16_FIELDS = {
    QType.Q8_0: (0,), QType.Q4_0: (0,), QType.Q4_1: (0, 2), QType.Q5_0: (0,), QType.Q5_1: (0, 2),
    QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,),
}
QUANT_TYPES = tuple(F16_FIELDS)
# gguf.quants can quantize these itself, so they are also checked on data a quantizer produced.
QUANTIZABLE = (QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1)


def random_blocks(qtype: QType, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """Random valid data for `shape`: any quant bytes, and float16 fields over the whole finite
    range (subnormals, signed zeros, large values), as GGUFReader gives it: [rows, row_bytes]."""
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    num_blocks = shape[0] * shape[1] // block_size
    blocks = rng.integers(0, 256, (num_blocks, block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        bits = rng.integers(0, 1 << 16, num_blocks, dtype=np.uint16)
        # An all-ones exponent is inf or NaN; clearing its top bit leaves a finite value.
        bits[(bits & 0x7C00) == 0x7C00] ^= 0x4000
        blocks[:, offset:offset + 2] = bits.view(np.uint8).reshape(num_blocks, 2)
    return blocks.reshape(shape[0], -1)


def reference(raw: np.ndarray, qtype: QType) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype))


def test_supported_types_are_the_float_and_decoded_quant_types():
    assert SUPPORTED_TYPES == {QType.F32, QType.F16, QType.BF16, *QUANT_TYPES}


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_random_blocks_match_reference_exactly(qtype: QType):
    block_size = GGML_QUANT_SIZES[qtype][0]
    shape = (3, 2 * block_size)
    raw = random_blocks(qtype, shape)
    out = dequantize(raw, qtype, shape, torch.float32, "blk.0.ffn_up.weight")
    assert out.dtype == torch.float32 and out.shape == shape
    assert torch.equal(out, reference(raw, qtype))


@pytest.mark.parametrize("qtype", (QType.Q4_K, QType.Q6_K, QType.Q8_0), ids=lambda t: t.name)
def test_tensor_spanning_several_cpu_steps_matches_reference(qtype: QType):
    # More than two decoding steps and a partial last one, so no block is dropped or doubled.
    cols = 1024
    shape = (2 * gguf_quants._CPU_CHUNK_VALUES // cols + 3, cols)
    raw = random_blocks(qtype, shape, seed=1)
    assert torch.equal(dequantize(raw, qtype, shape, torch.float32, "token_embd.weight"), reference(raw, qtype))


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_weights_match_reference_and_the_original(qtype: QType):
    weights = np.random.default_rng(2).standard_normal((16, 256)).astype(np.float32)
    raw = gguf.quants.quantize(weights, qtype)
    out = dequantize(raw, qtype, weights.shape, torch.float32, "output.weight")
    assert torch.equal(out, reference(raw, qtype))
    # Within a quantization step of the weights: 1/127 of the range for 8 bits, 1/15-1/8 for 4.
    step = 1 / 127 if qtype == QType.Q8_0 else 1 / 7
    amax = float(np.abs(weights).max())
    assert (out - torch.from_numpy(weights)).abs().max().item() <= step * amax


def test_f32_and_f16_arrays_round_trip_into_a_tensor_of_their_own():
    weights = np.random.default_rng(3).standard_normal((4, 6)).astype(np.float32)
    out = dequantize(weights, QType.F32, (4, 6), torch.float32, "output_norm.weight")
    assert torch.equal(out, torch.from_numpy(weights))
    out.add_(1)  # writing to the result must not reach the checkpoint's (read-only) map
    assert torch.equal(torch.from_numpy(weights) + 1, out)

    halves = weights.astype(np.float16)
    out = dequantize(halves, QType.F16, (4, 6), torch.float32, "blk.0.attn_norm.weight")
    assert torch.equal(out, torch.from_numpy(halves.astype(np.float32)))


def test_bf16_bytes_decode_to_float32_and_back_to_the_same_bits():
    weights = np.random.default_rng(4).standard_normal((4, 8)).astype(np.float32)
    raw = gguf.quants.quantize(weights, QType.BF16)
    assert raw.dtype == np.uint8
    assert torch.equal(dequantize(raw, QType.BF16, (4, 8), torch.float32, "w"), reference(raw, QType.BF16))
    out = dequantize(raw, QType.BF16, (4, 8), torch.bfloat16, "w")
    assert out.dtype == torch.bfloat16
    assert torch.equal(out.view(torch.uint8), torch.from_numpy(raw))


@pytest.mark.parametrize("qtype", (QType.Q4_K, QType.Q6_K, QType.F16), ids=lambda t: t.name)
def test_bf16_output_is_the_float32_result_rounded(qtype: QType):
    shape = (2, 512)
    raw = random_blocks(qtype, shape) if qtype in F16_FIELDS else np.ones(shape, np.float16) / 3
    out = dequantize(raw, qtype, shape, torch.bfloat16, "w")
    assert out.dtype == torch.bfloat16 and out.shape == shape
    assert torch.equal(out, dequantize(raw, qtype, shape, torch.float32, "w").to(torch.bfloat16))


def test_torch_bytes_decode_like_numpy_bytes():
    raw = random_blocks(QType.Q5_K, (2, 256))
    out = dequantize(torch.from_numpy(raw), QType.Q5_K, (2, 256), torch.float32, "w")
    assert torch.equal(out, reference(raw, QType.Q5_K))


def test_tensors_read_from_a_gguf_file_decode_without_warnings(tmp_path: Path):
    path = tmp_path / "tiny.gguf"
    weights = np.random.default_rng(5).standard_normal((8, 64)).astype(np.float32)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("q8", gguf.quants.quantize(weights, QType.Q8_0), raw_dtype=QType.Q8_0)
    writer.add_tensor("f16", weights.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name, tensor in tensors.items():
            # GGUF lists dims innermost first; torch order is the reverse.
            shape = tuple(reversed(tensor.shape.tolist()))
            out = dequantize(tensor.data, tensor.tensor_type, shape, torch.float32, name)
            assert torch.equal(out, reference(tensor.data, tensor.tensor_type).reshape(shape))
    assert out.shape == weights.shape


def test_unsupported_type_names_the_tensor_and_the_type():
    raw = np.zeros(GGML_QUANT_SIZES[QType.IQ2_XXS][1], dtype=np.uint8)
    with pytest.raises(UnsupportedQuantType, match=r"blk\.0\.attn_q\.weight.*IQ2_XXS.*supported: F32, F16"):
        dequantize(raw, QType.IQ2_XXS, (1, 256), torch.float32, "blk.0.attn_q.weight")
    assert issubclass(UnsupportedQuantType, ValueError)


def test_wrong_byte_count_names_the_tensor():
    raw = random_blocks(QType.Q4_K, (2, 256))
    with pytest.raises(ValueError, match=r"tensor blk\.1\.ffn_down\.weight: 144 bytes .* needs 288"):
        dequantize(raw[:1], QType.Q4_K, (2, 256), torch.float32, "blk.1.ffn_down.weight")


def test_row_not_a_whole_number_of_blocks_names_the_tensor():
    # 576 columns cannot hold 256-value K-quant blocks; llama.cpp stores such tensors as Q8_0 etc.
    raw = np.zeros((1, 2 * GGML_QUANT_SIZES[QType.Q4_K][1]), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"tensor token_embd\.weight: row size 576"):
        dequantize(raw, QType.Q4_K, (1, 576), torch.float32, "token_embd.weight")
