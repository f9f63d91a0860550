"""8-bit activations for GGUF blocks (cpu_ops/quant_x8.c, `--quantized-activations int8`).

Each block of 32 activations is quantized as d = max|x| / 127, q = round(x / d), so |x - d q| <= d / 2;
the dot of q with the weight block's integers is exact, then scaled in float32. So a product is
(1) within float32 rounding of "the weight, dequantized, times d q" (the quantized activations,
emulated here in numpy with the kernel's float32 operations), and (2) within sum over blocks of
d / 2 * sum |w| (plus float32 rounding) of the float32 product. (1) checks the kernel bit by bit
of its arithmetic; (2) is the bound users get.

On the real files the int8 engine's greedy text follows the float32 engine's until two tokens are
close: measured on the suite's real prompts (SmolLM2's 4, Gemma-3's 3, 32 tokens each), 5 of the 7
texts parted, where float32's two best log-probabilities were 0.008-0.094 nats apart, and before
that every top-5 log-probability was within 0.07-0.37 nats of float32's on an AVX-512 VNNI CPU.
The activations' rounding moves a logit by an absolute amount, so a token far down the top 5 moves
its log-probability most and its probability least: on an AVX2 CPU (quant_x8_avx2.c, another order
of summation, so other roundings downstream) one SmolLM2 token at float32 log-probability -7.7
(0.04%) moved by 0.86 nats, while every top-5 token above LIKELY (-6, 0.25%) stayed within 0.44
(SmolLM2) and 0.10 (Gemma-3). So the log-probabilities compared are those above LIKELY, within
LOGPROB_TOLERANCE (1.7 times the worst of both CPUs); GAP_TOLERANCE, for a parting, is twice the
widest gap measured.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from real_models import gemma3_gguf, smollm2_gguf
from test_quant_kernels import built, dequantized, quant_library, random_weight  # noqa: F401 (built: the module's fixture)

from stages.contracts.config import EngineConfig
from stages.gpu_runner.cpu_ops import quant
from stages.gpu_runner.layers.linear import linear
from stages.gpu_runner.layers.quantization import gguf as gguf_method
from stages.gpu_runner.layers.quantization.base import QuantizedWeight

pytestmark = pytest.mark.timeout(300)

TYPES = [QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K]
K_TYPES = (QType.Q4_K, QType.Q5_K, QType.Q6_K)
U = 2.0 ** -24
GAP_TOLERANCE = 0.2
LOGPROB_TOLERANCE = 0.75
LIKELY = -6.0

needs_x8 = pytest.mark.skipif(not quant.x8_available(QType.Q8_0),
                              reason="this CPU has neither AVX-512 VNNI nor AVX2: the int8 kernel is not built "
                                     "(test below)")


def quantized_activations(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's 8-bit activations, in numpy float32: (d q as float64 [n, cols], d per block [n, blocks])."""
    blocks = x.numpy().astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint((blocks * inverse).astype(np.float32)), -128, 127)  # round half to even, as the kernel
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape), d[..., 0].astype(np.float64)


def check_product(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    dq, d = quantized_activations(x)
    w64 = w.double().numpy()
    k = x.shape[1]
    # (1) the kernel's arithmetic: within float32 rounding of w . (d q)
    emulated = dq @ w64.T
    slack = (k + 8) * U * (np.abs(dq) @ np.abs(w64).T)
    off = np.abs(got.double().numpy() - emulated) - slack
    assert off.max() <= 0, f"{off.max()} beyond float32 rounding of the emulated 8-bit product"
    # (2) the users' bound: within sum_b d_b / 2 * sum_b |w| of the float product (and float32 rounding)
    exact = x.double().numpy() @ w64.T
    abs_w_blocks = np.abs(w64).reshape(w64.shape[0], -1, 32).sum(axis=2)  # [rows, blocks]
    bound = (d / 2) @ abs_w_blocks.T * (1 + 1e-6) + (k + 8) * U * (np.abs(x.double().numpy()) @ np.abs(w64).T) * 2
    excess = (np.abs(got.double().numpy() - exact) - bound).max()
    assert excess <= 0, f"{excess} beyond the activations' rounding bound"


@needs_x8
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("cols", [544, 768], ids=["odd-blocks", "even-blocks"])
def test_int8_products_are_the_quantized_activations_times_the_weight(qtype, cols):
    if qtype in K_TYPES:
        cols = 512 if cols == 544 else 768  # whole 256-value blocks: an even and an odd count of them
    weight = dataclass_int8(random_weight(qtype, rows=37, cols=cols, seed=qtype.value))
    w = dequantized(weight)
    for rows in range(1, gguf_method.X8_ROWS + 1):
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)) * 3
        x[0, :32] = 0  # a block of zeros: d = 0
        x[-1, 32:64] *= 1e4  # a block far larger than the others
        got = linear(x, weight, None)
        assert got.shape == (rows, 37)
        check_product(got, x, w)
        assert not torch.equal(got, linear(x, QuantizedWeight(weight.qtype, weight.blocks, weight.shape), None)), \
            "the int8 path was not taken"


@needs_x8
def test_more_rows_than_x8_rows_stay_exact():
    weight = dataclass_int8(random_weight(QType.Q4_1, rows=20, cols=256, seed=1))
    x = torch.randn(gguf_method.X8_ROWS + 1, 256, generator=torch.Generator().manual_seed(0))
    plain = QuantizedWeight(weight.qtype, weight.blocks, weight.shape)
    assert torch.equal(linear(x, weight, None), linear(x, plain, None))


@needs_x8
@pytest.mark.parametrize("file_of, name, qtype", [
    (smollm2_gguf, "blk.0.attn_q.weight", QType.Q4_1), (smollm2_gguf, "token_embd.weight", QType.Q8_0),
    (gemma3_gguf, "blk.0.attn_q.weight", QType.Q5_0), (gemma3_gguf, "blk.0.attn_output.weight", QType.Q4_K),
    (gemma3_gguf, "blk.0.ffn_down.weight", QType.Q6_K)], ids=lambda value: getattr(value, "__name__", str(value)))
def test_real_tensors(file_of, name, qtype):
    from stages.gpu_runner.loaders.gguf_file import GGUFFile

    file = GGUFFile(file_of())
    info = file.tensors[name]
    raw = torch.from_numpy(np.array(file.raw(name), copy=True).reshape(-1).view(np.uint8))
    weight = QuantizedWeight(info.qtype.value, raw.view(info.shape[0], -1), tuple(info.shape), True)
    weight = weight.select_rows(slice(0, 1024))
    assert QType(weight.qtype) == qtype and weight.int8_activations
    x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(3))
    check_product(linear(x, weight, None), x, dequantized(weight))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_avx2_products_are_the_quantized_activations_times_the_weight(qtype, avx2_x8):
    """quant_x8_avx2.c, built without AVX-512 (what the operators build where the CPU has only AVX2),
    on every type: an odd count of 32-value blocks (a lone last block), 1-9 rows (passes of 4 and
    the rest), a block of zeros and a block far larger than the others."""
    import ctypes

    cols = 512 if qtype in K_TYPES else 544
    weight = random_weight(qtype, rows=37, cols=cols, seed=qtype.value)
    w = dequantized(weight)
    assert avx2_x8.quant_x8_available(int(qtype)) == 1
    for rows in (1, 2, 3, 4, 5, 9):
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)) * 3
        x[0, :32] = 0
        x[-1, 32:64] *= 1e4
        out = torch.full((rows, 37), float("nan"))
        assert avx2_x8.quant_matmul_x8(ctypes.c_void_p(weight.blocks.data_ptr()), int(qtype), weight.blocks.shape[1],
                                       37, cols, ctypes.c_void_p(x.data_ptr()), rows,
                                       ctypes.c_void_p(out.data_ptr())) == 0
        check_product(out, x, w)


@pytest.fixture(scope="module")
def avx2_x8(tmp_path_factory):
    """quant_x8*.c compiled with AVX-512 turned off, as a ctypes library."""
    import ctypes
    import platform

    from stages.gpu_runner.cpu_ops import build as cpu_build

    if platform.machine() not in ("x86_64", "AMD64") or "avx2" not in cpu_build.instruction_set().split():
        pytest.skip("needs an x86 CPU with AVX2")
    lib = quant_library(["-mno-avx512f"], tmp_path_factory.mktemp("x8") / "quant_x8_avx2.so", prefix="quant_x8")
    size = ctypes.c_int64
    lib.quant_matmul_x8.argtypes = [ctypes.c_void_p, ctypes.c_int, size, size, size, ctypes.c_void_p, size,
                                    ctypes.c_void_p]
    return lib


def dataclass_int8(weight: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(weight.qtype, weight.blocks, weight.shape, True)


def test_int8_is_refused_where_the_kernel_is_not_built(monkeypatch):
    monkeypatch.setattr(quant, "x8_available", lambda qtype: False)
    with pytest.raises(ValueError, match="quantized_activations int8 needs .*AVX-512 VNNI or AVX2"):
        gguf_method.check_int8_activations("int8")
    gguf_method.check_int8_activations("float32")
    assert not gguf_method.int8_activations_for("int8", QType.Q4_1)


@needs_x8
def test_the_operator_checks_its_blocks():
    weight = random_weight(QType.Q4_K, rows=4, cols=256, seed=0)
    with pytest.raises(ValueError, match="blocks of type 12 for 512 columns"):
        quant.matmul_x8(torch.zeros(1, 512), weight.blocks, weight.qtype, 512)
    with pytest.raises(ValueError, match="activations must be CPU float32"):
        quant.matmul_x8(torch.zeros(1, 256, dtype=torch.float64), weight.blocks, weight.qtype, 256)


def test_the_setting_is_checked():
    assert EngineConfig(model="m").quantized_activations == "float32"
    with pytest.raises(ValueError, match=r"quantized_activations must be one of \['float32', 'int8'\]"):
        EngineConfig(model="m", quantized_activations="int4")


@needs_x8
@pytest.mark.parametrize("file_of, tokens", [(smollm2_gguf, 32), (gemma3_gguf, 16)], ids=["smollm2", "gemma3"])
def test_int8_engine_follows_the_float32_engine_until_a_near_tie(file_of, tokens):
    """On the suite's real prompts: the same greedy tokens until float32's two best are within
    GAP_TOLERANCE, and until then every top-5 log-probability above LIKELY within LOGPROB_TOLERANCE."""
    from pipeline import LLM, SamplingParams
    from real_models import gemma3_prompts, smollm2_prompts

    prompts = smollm2_prompts() if file_of is smollm2_gguf else gemma3_prompts()
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    outputs = {}
    for mode in ("float32", "int8"):
        llm = LLM(str(file_of()), device="cpu", dtype="float32", quantized_activations=mode, max_model_len=1024,
                  num_kv_blocks=4 * 1024 // 16)
        held = llm.runner.model.layers[0].mlp.down_proj.weight
        assert isinstance(held, QuantizedWeight)
        assert held.int8_activations == (mode == "int8" and held.qtype in gguf_method.X8_TYPES)
        assert ("8-bit activations" in llm.runner.runs_in) == (mode == "int8")
        outputs[mode] = llm.generate([list(p) for p in prompts], params)
        llm.close()
    followed = 0
    for exact, int8 in zip(outputs["float32"], outputs["int8"]):
        for position, (want, got) in enumerate(zip(exact.token_ids, int8.token_ids)):
            lp_exact, lp_int8 = exact.logprobs[position], int8.logprobs[position]
            worst = max((abs(lp_exact[t] - lp_int8[t]) for t in set(lp_exact) & set(lp_int8) if lp_exact[t] > LIKELY),
                        default=0.0)
            assert worst <= LOGPROB_TOLERANCE, (position, worst)
            if want != got:
                gap = lp_exact[want] - lp_exact.get(got, float("-inf"))
                assert gap <= GAP_TOLERANCE, f"parted at {position} where float32's gap was {gap:.3f} nats"
                break
            followed += 1
    assert followed >= len(prompts) * 4  # not parted at once everywhere
