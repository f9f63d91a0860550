"""GGUF blocks multiplied in place (cpu_ops/quant.c through layers/quantization/gguf.py) equal
"dequantize, then multiply in float32", for every block type the kernels take, on random blocks and
on the real SmolLM2 file's tensors; the engine serving the default model with --quantization gguf
gives the dequantized engine's greedy text and, along it, its log-probabilities.

Decoding is exact: every decoded value is loaders/gguf_quants.py's float32, bit for bit. A product
differs only in the order its dot products are summed (SIMD lanes and FMA against torch's matmul).
For any order, a float32 dot of length K is within gamma_K * sum_k |x_k w_k| of the exact value,
gamma_K = K u / (1 - K u), u = 2^-24 (Higham, Accuracy and Stability, 3.1): the tolerance below is
that bound, held against the exact (float64) product of the same float32 values; the float32
reference matmul is checked against the same bound, so both lie within float32 rounding of it.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType
from real_models import gemma3_gguf, smollm2_gguf

from stages.gpu_runner import cpu_ops
from stages.gpu_runner.cpu_ops import quant
from stages.gpu_runner.cpu_ops import build as cpu_build
from stages.gpu_runner.layers.linear import MergedColumnLinear, linear, method_for
from stages.gpu_runner.layers.quantization.base import QuantizedWeight
from stages.gpu_runner.layers.quantization import gguf as gguf_method
from stages.gpu_runner.layers.quantization.gguf import FUSED_ROWS, FUSED_ROWS_K, K_TYPES, TILED_ROWS
from stages.gpu_runner.loaders.gguf_file import GGUFFile
from stages.gpu_runner.loaders.gguf_quants import dequantize

pytestmark = pytest.mark.timeout(120)

TYPES = [QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K]
# Byte offsets of each type's float16 scale fields (d, and m/dmin where the type has one).
_SCALES = {QType.Q4_0: (0,), QType.Q4_1: (0, 2), QType.Q5_0: (0,), QType.Q5_1: (0, 2), QType.Q8_0: (0,),
           QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,)}
U = 2.0 ** -24


@pytest.fixture(autouse=True, scope="module")
def built() -> None:
    """Where a C compiler exists the kernels must build: a failed build fails these tests, never skips them."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the GGUF method is not offered (weights are dequantized at load)")
    assert cpu_ops.library() is not None, "the CPU kernels failed to build (see the log)"


def random_weight(qtype: QType, rows: int, cols: int, seed: int) -> QuantizedWeight:
    """Blocks of random bytes (every quant bit pattern), their scale fields finite float16."""
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // block_values, block_bytes), dtype=np.uint8)
    for offset in _SCALES[qtype]:
        scales = rng.uniform(-0.05, 0.05, blocks.shape[0]).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return QuantizedWeight(qtype.value, torch.from_numpy(blocks).reshape(rows, -1).contiguous(), (rows, cols))


def dequantized(weight: QuantizedWeight) -> torch.Tensor:
    return dequantize(weight.blocks, QType(weight.qtype), weight.shape, torch.float32, "w")


def assert_within_float32_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """got ~ x @ w.T: within gamma_K * (|x| @ |w|.T) of the exact product, as the float32 matmul is."""
    k = x.shape[-1]
    exact = x.double() @ w.double().T
    bound = k * U / (1 - k * U) * (x.double().abs() @ w.double().abs().T)
    assert ((x @ w.T).double() - exact).abs().le(bound).all()  # the reference itself
    excess = ((got.double() - exact).abs() - bound).max().item()
    assert excess <= 0, f"off by {excess} beyond the float32 bound"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_decoded_rows_equal_the_reference_decoder_bit_for_bit(qtype):
    weight = random_weight(qtype, rows=24, cols=512, seed=qtype.value)
    reference = dequantized(weight)
    assert torch.equal(quant.dequantize_rows(weight.blocks, weight.qtype, 512, start=0, count=24), reference)
    ids = torch.tensor([[5, 0], [23, 5]])
    embedded = method_for(weight).embed(weight, ids, torch.float32)
    assert embedded.shape == (2, 2, 512) and torch.equal(embedded, reference[ids])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_fused_kernel_decodes_each_weight_exactly(qtype):
    """Rows of the identity as activations: each product is one decoded weight times 1 plus zeros,
    so the fused kernel's out must be the reference decoder's weights to the bit, transposed."""
    weight = random_weight(qtype, rows=24, cols=512, seed=qtype.value + 100)
    reference = dequantized(weight)
    rows = FUSED_ROWS_K if qtype in K_TYPES else FUSED_ROWS
    for start in range(0, 512, rows):
        eye = torch.eye(512)[start:start + rows].contiguous()
        assert torch.equal(quant.matmul(eye, weight.blocks, weight.qtype, 512), reference[:, start:start + rows].T)


# Activation rows: 1, FUSED_ROWS_K, 7 and FUSED_ROWS (the fused kernel for 32-value types; 3 and up
# are quant_gemm.c's for K types), 3 and 9 (a partial block of MR rows for quant_gemm.c), 32, 33 and
# TILED_ROWS (quant_gemm.c), TILED_ROWS + 1 and 300 (tiles for torch's matmul).
ROW_COUNTS = sorted({1, FUSED_ROWS_K, 3, 7, FUSED_ROWS, FUSED_ROWS + 1, 32, 33, TILED_ROWS, TILED_ROWS + 1, 300})


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_quantized_matmul_equals_dequantize_then_multiply(qtype, monkeypatch):
    """Every kernel the method picks, by the number of rows; the torch path here in tiles of 16
    weight rows (the last one partial)."""
    monkeypatch.setattr(gguf_method, "TILE_VALUES", 16 * 768)
    weight = random_weight(qtype, rows=70, cols=768, seed=qtype.value)
    reference = dequantized(weight)
    bias = torch.randn(70)
    for num_rows in ROW_COUNTS:
        x = torch.randn(num_rows, 768, generator=torch.Generator().manual_seed(num_rows))
        got = linear(x, weight, bias)
        assert got.shape == (num_rows, 70) and got.dtype == torch.float32
        assert_within_float32_rounding(got - bias, x, reference)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_tiles_of_any_size_over_any_rows(qtype):
    """quant_gemm.c with tiles that do not divide the weight's rows (nor its micro-kernel's 4), over
    row counts that leave partial blocks, and columns split in passes (2,560: five of 512)."""
    for rows, cols, tile_rows, num_rows in [(37, 512, 5, 1), (37, 512, 12, 6), (9, 2560, 0, 11), (64, 256, 64, 5)]:
        weight = random_weight(qtype, rows=rows, cols=cols, seed=rows + tile_rows)
        x = torch.randn(num_rows, cols, generator=torch.Generator().manual_seed(num_rows))
        got = quant.matmul_tiled(x, weight.blocks, weight.qtype, cols, tile_rows)
        assert_within_float32_rounding(got, x, dequantized(weight))


@pytest.mark.parametrize("types", [(QType.Q4_1, QType.Q4_1, QType.Q4_1), (QType.Q5_0, None, QType.Q8_0)],
                         ids=["one type: stacked", "mixed with a dense part: a tuple"])
def test_a_merged_layer_of_quantized_parts(types):
    """q, k and v of one block type become one weight; of several (or with a dense part), a tuple
    of parts, each multiplied by its own method; either way forward returns the parts."""
    sizes = [16, 16, 32]
    layer = MergedColumnLinear(256, sizes, bias=True)
    parts = []
    for index, (qtype, size) in enumerate(zip(types, sizes)):
        part = torch.randn(size, 256) if qtype is None else random_weight(qtype, size, 256, seed=index)
        layer.load_part(index, "weight", part)
        layer.load_part(index, "bias", torch.full((size,), float(index)))
        parts.append(part if qtype is None else dequantized(part))
    assert isinstance(layer.weight, QuantizedWeight if types[1] is not None else tuple)
    x = torch.randn(3, 256)
    got = layer(x)
    assert [tuple(part.shape) for part in got] == [(3, size) for size in sizes]
    for index, (out, weight) in enumerate(zip(got, parts)):
        assert_within_float32_rounding(out - index, x, weight)


def test_bfloat16_activations_get_bfloat16_results():
    weight = random_weight(QType.Q4_1, rows=16, cols=256, seed=1)
    x = torch.randn(2, 3, 256).to(torch.bfloat16)
    got = linear(x, weight, None)
    want = (x.float().reshape(6, 256) @ dequantized(weight).T).to(torch.bfloat16).reshape(2, 3, 16)
    assert got.dtype == torch.bfloat16 and (got.float() - want.float()).abs().max() <= want.float().abs().max() / 64


def test_bad_inputs_raise_naming_the_problem():
    weight = random_weight(QType.Q8_0, rows=4, cols=64, seed=0)
    with pytest.raises(IndexError, match="row ids"):
        quant.dequantize_rows(weight.blocks, weight.qtype, 64, ids=torch.tensor([4]))
    with pytest.raises(ValueError, match="activations"):
        quant.matmul(torch.zeros(1, 32), weight.blocks, weight.qtype, 64)
    with pytest.raises(ValueError, match="blocks of type"):
        quant.matmul(torch.zeros(1, 64), weight.blocks[:, :-1], weight.qtype, 64)
    with pytest.raises(ValueError, match="activations"):
        quant.matmul_tiled(torch.zeros(3, 63), weight.blocks, weight.qtype, 64)
    with pytest.raises(ValueError, match="tile_rows"):
        quant.matmul_tiled(torch.zeros(3, 64), weight.blocks, weight.qtype, 64, tile_rows=-1)


@pytest.mark.parametrize("file_of, name, qtype", [
    # The default model: its Q8_0 embedding (also its tied head) and Q4_1 projections.
    (smollm2_gguf, "token_embd.weight", QType.Q8_0), (smollm2_gguf, "blk.0.attn_q.weight", QType.Q4_1),
    (smollm2_gguf, "blk.3.ffn_down.weight", QType.Q4_1), (smollm2_gguf, "blk.29.ffn_gate.weight", QType.Q4_1),
    # Gemma-3-270M Q4_K_M: every block type it holds.
    (gemma3_gguf, "blk.0.attn_q.weight", QType.Q5_0), (gemma3_gguf, "blk.0.attn_output.weight", QType.Q4_K),
    (gemma3_gguf, "blk.0.ffn_down.weight", QType.Q6_K), (gemma3_gguf, "blk.0.attn_v.weight", QType.Q8_0)],
    ids=lambda value: value.__name__ if callable(value) else str(value))
def test_real_tensors(file_of, name, qtype):
    file = GGUFFile(file_of())
    info = file.tensors[name]
    raw = torch.from_numpy(np.array(file.raw(name), copy=True).reshape(-1).view(np.uint8))
    weight = QuantizedWeight(info.qtype.value, raw.view(info.shape[0], -1), tuple(info.shape))
    assert QType(weight.qtype) == qtype
    weight = weight.select_rows(slice(0, 2048))  # of the 49,152-row embedding: enough, and fast
    reference = dequantized(weight)
    assert torch.equal(quant.dequantize_rows(weight.blocks, weight.qtype, weight.shape[1], start=0,
                                             count=weight.shape[0]), reference)
    for num_rows in (1, 4, 33, TILED_ROWS + 3):
        x = torch.randn(num_rows, weight.shape[1], generator=torch.Generator().manual_seed(num_rows))
        assert_within_float32_rounding(linear(x, weight, None), x, reference)


def test_default_model_quantized_equals_dequantized_float32_engine():
    """Greedy text equal on a real prompt; along it (the same tokens: teacher-forced), every step's
    top-5 log-probabilities within LOGPROB_TOLERANCE of the dequantized engine's.

    Both engines hold the same float32 weight values; only each dot's order of summation differs,
    ~1e-6 relative per dot, carried through 30 layers: the largest difference measured (AVX-512) is
    2e-5 nats. 1e-3 nats leaves 50x that for other summation orders (AVX2, scalar, other thread
    counts)."""
    from pipeline import LLM, SamplingParams
    from pipeline.models.checkpoints import resolve_model

    checkpoint = resolve_model(smollm2_gguf())
    prompt = "The three primary colours of light are"
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=5)
    outputs = {}
    for quantization in ("none", "gguf"):
        llm = LLM(checkpoint, device="cpu", dtype="float32", quantization=quantization, num_kv_blocks=16,
                  max_model_len=256)
        model = llm.runner.model
        held = [model.embed_tokens.weight, model.layers[0].self_attn.qkv_proj.weight,
                model.layers[0].mlp.gate_up_proj.weight, model.layers[29].mlp.down_proj.weight]
        assert all(isinstance(weight, QuantizedWeight) == (quantization == "gguf") for weight in held)
        outputs[quantization] = llm.generate([prompt], params)[0]
        llm.close()
    dense, quantized = outputs["none"], outputs["gguf"]
    assert quantized.token_ids == dense.token_ids and quantized.text == dense.text
    worst = 0.0
    for want, got in zip(dense.logprobs, quantized.logprobs):
        assert set(got) == set(want)
        worst = max(worst, max(abs(got[token] - want[token]) for token in want))
    assert worst <= LOGPROB_TOLERANCE, worst


LOGPROB_TOLERANCE = 1e-3


def test_gguf_quantization_is_refused_under_tensor_parallelism():
    from stages.contracts.config import EngineConfig

    with pytest.raises(ValueError, match="quantization gguf"):
        EngineConfig(model="m", quantization="gguf", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model="m", quantization="q8")


def quant_library(flags: list[str], built: Path, prefix: str = "quant") -> object:
    """The C files of cpu_ops whose names start with `prefix`, compiled for this CPU less what
    `flags` turn off, as a ctypes library at `built`."""
    import ctypes
    import subprocess

    sources = [str(path) for path in cpu_build.C_SOURCES if path.name.startswith((prefix, "pool"))]  # pool.c: their threads
    compiler = shutil.which("cc") or shutil.which("gcc")
    subprocess.run([compiler, "-O3", "-march=native", *flags, "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC",
                    "-std=c11", *sources, "-o", str(built), "-lm"], check=True, capture_output=True)
    return ctypes.CDLL(str(built))


@pytest.mark.parametrize("flags", [["-mno-avx512f"], ["-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c"]],
                         ids=["avx2", "scalar"])
def test_the_paths_for_other_cpus_decode_multiply_and_quantize_the_same(flags, tmp_path):
    """The quant*.c kernels built without AVX-512 (AVX2 decoding, fused products and micro-kernel) and
    without any vector extension (scalar decoding): the same decoded values and blocks bit for
    bit, products within the same bound."""
    import ctypes
    import platform

    from gguf.quants import quantize

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the flags name x86 extensions")
    lib = quant_library(flags, tmp_path / "quant.so")
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.quant_dequantize_rows.argtypes = [pointer, ctypes.c_int, size, size, pointer, size, size, pointer]
    lib.quant_matmul.argtypes = [pointer, ctypes.c_int, size, size, size, pointer, size, pointer]
    lib.quant_matmul_tiled.argtypes = [pointer, ctypes.c_int, size, size, size, pointer, size, pointer, size]
    lib.quant_quantize_rows.argtypes = [pointer, ctypes.c_int, size, size, pointer]
    for qtype in TYPES:
        weight = random_weight(qtype, rows=9, cols=512, seed=qtype.value)
        blocks, reference = weight.blocks.data_ptr(), dequantized(weight)
        decoded = torch.empty(9, 512)
        lib.quant_dequantize_rows(blocks, int(qtype), weight.blocks.shape[1], 512, None, 0, 9, decoded.data_ptr())
        assert torch.equal(decoded, reference), qtype.name
        x = torch.randn(5, 512)
        for tiled in (False, True):
            out = torch.empty(5, 9)
            if tiled:
                lib.quant_matmul_tiled(blocks, int(qtype), weight.blocks.shape[1], 9, 512, x.data_ptr(), 5,
                                       out.data_ptr(), 4)
            else:
                lib.quant_matmul(blocks, int(qtype), weight.blocks.shape[1], 9, 512, x.data_ptr(), 5, out.data_ptr())
            assert_within_float32_rounding(out, x, reference)
        # Rows of the identity: each weight decoded exactly, through every count of rows a pass takes
        # (AVX2's fused products: passes of 4, then 1, 2 or 3).
        for start, count in ((0, 1), (1, 2), (3, 3), (6, 4), (10, 6), (16, 7)):
            eye = torch.eye(512)[start:start + count].contiguous()
            out = torch.empty(count, 9)
            lib.quant_matmul(blocks, int(qtype), weight.blocks.shape[1], 9, 512, eye.data_ptr(), count, out.data_ptr())
            assert torch.equal(out, reference[:, start:start + count].T), (qtype.name, count)
    values = torch.randn(6, 256)
    for qtype in (QType.Q8_0, QType.Q4_0):
        made = torch.empty(6, 256 // 32 * GGML_QUANT_SIZES[qtype][1], dtype=torch.uint8)
        lib.quant_quantize_rows(values.data_ptr(), int(qtype), 6, 256, made.data_ptr())
        assert np.array_equal(made.numpy(), quantize(values.numpy(), qtype)), qtype.name
    # AVX2 has an 8-bit activation kernel (test_quant_x8.py checks its products); without any vector
    # extension there is none: it says so and writes nothing.
    lib.quant_matmul_x8.argtypes = lib.quant_matmul.argtypes
    if "-mno-avx2" not in flags:
        assert all(lib.quant_x8_available(int(qtype)) == 1 for qtype in TYPES)
        return
    weight = random_weight(QType.Q4_1, rows=9, cols=512, seed=0)
    out = torch.full((5, 9), 7.0)
    assert lib.quant_x8_available(int(QType.Q4_1)) == 0
    assert lib.quant_matmul_x8(weight.blocks.data_ptr(), int(QType.Q4_1), weight.blocks.shape[1], 9, 512,
                               torch.randn(5, 512).data_ptr(), 5, out.data_ptr()) == -1
    assert torch.equal(out, torch.full((5, 9), 7.0))
