"""The compiled CPU attention kernel (cpu_ops) against attention computed in float64 with plain
torch: decode and verify rows over block-paged slots, GQA and MHA, prefix and window masks, rows
that see nothing, torch's thread count, what it refuses, its build cache, and the torch fallback
that takes over when it is switched off."""
from __future__ import annotations

import ctypes
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from stages.gpu_runner import cpu_ops
from stages.gpu_runner.attention.cpu_attention import native_attends
from stages.gpu_runner.attention.torch_backend import TorchBackend, paged_attention
from stages.gpu_runner.attention.torch_metadata import AttentionMetadata, verify_batch
from stages.gpu_runner.cpu_ops import build, sample_logits
from stages.gpu_runner.layers.norm import rms_norm as layer_rms_norm
from stages.gpu_runner.layers.rotary import apply_rotary

if build.compilers() is None:
    pytest.skip("no C/C++ compiler: the CPU kernels are not built", allow_module_level=True)


@pytest.fixture(autouse=True, scope="module")
def built() -> None:
    """Where compilers exist the operators must build: a failed build fails these tests, never skips them."""
    assert cpu_ops.library() is not None, f"the CPU operators failed to build: {cpu_ops.describe()}"

BLOCK_SIZE = 16
CONTEXTS = (3, 17, 40, 64)
WINDOW = 20


def paged_case(*, queries: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
               window: int | None = None, contexts: tuple[int, ...] = CONTEXTS, seed: int = 0):
    """(query, flat_cache, slots, mask): each row's keys in scattered blocks, its `queries` queries at
    the last positions of its context, each seeing the keys up to itself (and within `window`)."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(contexts)
    blocks_per_row = -(-max(contexts) // BLOCK_SIZE)
    num_blocks = rows * blocks_per_row + 3
    blocks = torch.randperm(num_blocks, generator=gen)[:rows * blocks_per_row].view(rows, blocks_per_row)
    slots = (blocks.unsqueeze(-1) * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten(1)
    key_pos = torch.arange(slots.shape[1]).view(1, 1, -1)
    query_pos = (torch.tensor(contexts).view(-1, 1) - queries + torch.arange(queries)).unsqueeze(2)
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    flat_cache = torch.randn(2, num_blocks * BLOCK_SIZE, kv_heads, head_dim, generator=gen).to(dtype)
    query = torch.randn(rows, queries, heads, head_dim, generator=gen).to(dtype)
    return query, flat_cache, slots, mask


def reference(query: torch.Tensor, flat_cache: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
              scale: float) -> torch.Tensor:
    """float64 attention of query [rows, queries, heads, head_dim] over the keys at `slots`; a query
    that sees no key gets zeros."""
    group = query.shape[2] // flat_cache.shape[2]
    keys = flat_cache[0][slots].double().repeat_interleave(group, dim=2)
    values = flat_cache[1][slots].double().repeat_interleave(group, dim=2)
    scores = torch.einsum("rqhd,rkhd->rqhk", query.double(), keys) * scale
    scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    probs = scores.softmax(-1).nan_to_num(0.0)
    return torch.einsum("rqhk,rkhd->rqhd", probs, values)


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.fixture
def fresh_library(monkeypatch: pytest.MonkeyPatch):
    cpu_ops.library.cache_clear()
    yield monkeypatch
    cpu_ops.library.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("queries", [1, 3], ids=["decode", "verify"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (2, 2)], ids=["gqa", "mha"])
@pytest.mark.parametrize("head_dim", [64, 16])
@pytest.mark.parametrize("window", [None, WINDOW], ids=["full", "window"])
def test_matches_float64_reference(dtype, queries, heads, kv_heads, head_dim, window) -> None:
    query, flat_cache, slots, mask = paged_case(queries=queries, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                                dtype=dtype, window=window)
    scale = head_dim ** -0.5
    out = cpu_ops.paged_attention(query, flat_cache, slots, mask, scale)
    assert out.shape == query.shape and out.dtype == dtype
    assert_close(out, reference(query, flat_cache, slots, mask, scale), dtype)


def test_window_masks_keys_at_the_start() -> None:
    query, flat_cache, slots, mask = paged_case(queries=1, heads=6, kv_heads=2, head_dim=16, window=WINDOW)
    assert not mask[-1, 0, :CONTEXTS[-1] - WINDOW].any() and mask[-1, 0, CONTEXTS[-1] - WINDOW:].all()
    windowed = cpu_ops.paged_attention(query, flat_cache, slots, mask, 0.25)
    prefix = torch.arange(slots.shape[1]) < torch.tensor(CONTEXTS).view(-1, 1, 1)
    full = cpu_ops.paged_attention(query, flat_cache, slots, prefix, 0.25)
    assert not torch.allclose(windowed[-1], full[-1])
    assert_close(windowed, reference(query, flat_cache, slots, mask, 0.25), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_query_that_sees_nothing_gets_zeros(dtype) -> None:
    query, flat_cache, slots, mask = paged_case(queries=3, heads=6, kv_heads=2, head_dim=16, dtype=dtype)
    mask[1, 2] = False
    mask[3, 0] = False
    out = cpu_ops.paged_attention(query, flat_cache, slots, mask, 0.25)
    assert not out.isnan().any()
    assert torch.equal(out[1, 2], torch.zeros_like(out[1, 2])) and torch.equal(out[3, 0], torch.zeros_like(out[3, 0]))
    assert_close(out, reference(query, flat_cache, slots, mask, 0.25), dtype)


def test_bf16_output_rounds_to_nearest_even() -> None:
    query, flat_cache, slots, _ = paged_case(queries=1, heads=6, kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    query = torch.zeros_like(query)
    mask = torch.zeros(slots.shape[0], 1, slots.shape[1], dtype=torch.bool)
    mask[:, :, 5] = mask[:, :, 12] = True
    out = cpu_ops.paged_attention(query, flat_cache, slots, mask, 0.125)
    values = flat_cache[1][slots[:, [5, 12]]].float().repeat_interleave(3, dim=2)
    assert torch.equal(out[:, 0], values.mean(1).bfloat16())


def test_non_contiguous_query_and_mask() -> None:
    query, flat_cache, slots, mask = paged_case(queries=3, heads=6, kv_heads=2, head_dim=16)
    strided_query = query.transpose(1, 2).contiguous().transpose(1, 2)
    strided_mask = mask.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided_query.is_contiguous() and not strided_mask.is_contiguous()
    out = cpu_ops.paged_attention(strided_query, flat_cache, slots, strided_mask, 0.25)
    assert torch.equal(out, cpu_ops.paged_attention(query, flat_cache, slots, mask, 0.25))


def test_follows_torch_thread_count() -> None:
    query, flat_cache, slots, mask = paged_case(queries=3, heads=6, kv_heads=2, head_dim=64,
                                                contexts=(3, 17, 40, 64, 9, 33, 50, 21))
    runtime = ctypes.CDLL("libgomp.so.1")
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert runtime.omp_get_max_threads() == threads
            results.append(cpu_ops.paged_attention(query, flat_cache, slots, mask, 0.125))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(results[0], results[1])


def test_supports() -> None:
    assert cpu_ops.supports(torch.float32, 64) and cpu_ops.supports(torch.bfloat16, 16)
    assert not cpu_ops.supports(torch.float16, 64)
    assert not cpu_ops.supports(torch.float32, 40)
    assert not cpu_ops.supports(torch.bfloat16, 40)


@pytest.mark.parametrize("queries", [1, 3])
def test_a_bfloat16_cache_under_float32_queries_is_read_widened(queries: int) -> None:
    """kv_cache_dtype bfloat16: the kernel widens each key and value as it reads them, so the result
    is exactly what the same values give from a float32 cache."""
    query, flat_cache, slots, mask = paged_case(queries=queries, heads=6, kv_heads=2, head_dim=16)
    narrow = flat_cache.bfloat16()
    out = cpu_ops.paged_attention(query, narrow, slots, mask, 0.25)
    assert out.dtype == torch.float32
    assert torch.equal(out, cpu_ops.paged_attention(query, narrow.float(), slots, mask, 0.25))


def test_refuses_what_it_does_not_support() -> None:
    query, flat_cache, slots, mask = paged_case(queries=1, heads=6, kv_heads=2, head_dim=16)
    with pytest.raises(ValueError):
        cpu_ops.paged_attention(query, flat_cache.half(), slots, mask, 0.25)
    with pytest.raises(ValueError):
        cpu_ops.paged_attention(query.half(), flat_cache.half(), slots, mask, 0.25)
    with pytest.raises(ValueError):
        cpu_ops.paged_attention(query[:, :, :5], flat_cache, slots, mask, 0.25)
    query40, cache40, slots40, mask40 = paged_case(queries=1, heads=2, kv_heads=2, head_dim=40)
    with pytest.raises(ValueError):
        cpu_ops.paged_attention(query40, cache40, slots40, mask40, 0.25)


def test_a_fresh_process_loads_the_cached_build_without_compiling() -> None:
    library = cpu_ops.library_path()
    assert library is not None and (library.parent / "built").exists()
    stamp = library.stat().st_mtime_ns
    script = ("from stages.gpu_runner import cpu_ops\nassert cpu_ops.library() is not None\n"
              "print(cpu_ops.library_path(), cpu_ops.describe())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split()[0] == str(library) and "built (torch ops" in done.stdout
    assert "compiling" not in done.stderr and library.stat().st_mtime_ns == stamp
    query, flat_cache, slots, mask = paged_case(queries=1, heads=6, kv_heads=2, head_dim=16)
    assert_close(cpu_ops.paged_attention(query, flat_cache, slots, mask, 0.25),
                 reference(query, flat_cache, slots, mask, 0.25), torch.float32)


def decode_step(heads: int, kv_heads: int, head_dim: int = 16, contexts: tuple[int, ...] = (1, 17, 40, 64)):
    gen = torch.Generator().manual_seed(1)
    rows = len(contexts)
    blocks_per_row = -(-max(contexts) // BLOCK_SIZE)
    num_blocks = rows * blocks_per_row + 2
    block_table = torch.randperm(num_blocks, generator=gen)[:rows * blocks_per_row].view(rows, -1).to(torch.int32)
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=gen)
    context = torch.tensor(contexts)
    last = context - 1
    slot_mapping = block_table[torch.arange(rows), last // BLOCK_SIZE].to(torch.int64) * BLOCK_SIZE + last % BLOCK_SIZE
    meta = TorchBackend(BLOCK_SIZE).decode_metadata(torch.arange(rows), context, max(contexts), slot_mapping,
                                                    block_table)
    query = torch.randn(rows, heads, head_dim, generator=gen)
    return query, kv_cache, meta


def verify_step(heads: int, kv_heads: int, head_dim: int = 16, num_queries: int = 3,
                contexts: tuple[int, ...] = (3, 17, 40, 64)):
    query, kv_cache, meta = decode_step(heads, kv_heads, head_dim, contexts)
    rows = len(contexts)
    start = torch.tensor(contexts) - num_queries
    verify = verify_batch(meta.block_table, torch.arange(rows), start, num_queries, max(contexts), BLOCK_SIZE,
                          torch.arange(rows * num_queries))
    meta = AttentionMetadata(slot_mapping=torch.zeros(rows * num_queries, dtype=torch.int64), decode=None, prefills=[],
                             block_table=meta.block_table, block_size=BLOCK_SIZE, max_context=max(contexts),
                             verify=[verify])
    query = torch.randn(rows * num_queries, heads, head_dim, generator=torch.Generator().manual_seed(2))
    return query, kv_cache, meta


@pytest.mark.parametrize("step", [decode_step, verify_step])
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (8, 8)], ids=["gqa", "mha8"])
def test_torch_fallback_when_switched_off(fresh_library, step, heads, kv_heads) -> None:
    query, kv_cache, meta = step(heads, kv_heads)
    assert native_attends(query, kv_cache)
    native = paged_attention(query, kv_cache, meta, 0.25)
    fresh_library.setenv(cpu_ops.ENABLE_VARIABLE, "0")
    cpu_ops.library.cache_clear()
    assert cpu_ops.library() is None and not native_attends(query, kv_cache)
    fallback = paged_attention(query, kv_cache, meta, 0.25)
    torch.testing.assert_close(fallback, native, atol=1e-5, rtol=1e-5)


def test_sample_logits_inverts_the_cumulative_distribution_at_each_point() -> None:
    probs = torch.tensor([0.25, 0.0, 0.5, 0.25])
    logits = probs.log()  # -inf where the probability is 0
    points = torch.tensor([0.0, 0.1, 0.26, 0.74, 0.76, 0.999999], dtype=torch.float64)
    tokens = sample_logits(logits.repeat(len(points), 1), torch.ones(len(points)), points)
    assert tokens.tolist() == [0, 0, 2, 2, 3, 3]


def test_sample_logits_applies_the_temperature() -> None:
    logits = torch.tensor([[0.0, math.log(3.0)]] * 4)
    # t = 1: [1/4, 3/4]; t = 2: [1/(1 + sqrt 3), sqrt 3/(1 + sqrt 3)] = [0.366, 0.634]
    temperature = torch.tensor([1.0, 1.0, 2.0, 2.0])
    points = torch.tensor([0.24, 0.26, 0.36, 0.37], dtype=torch.float64)
    assert sample_logits(logits, temperature, points).tolist() == [0, 1, 0, 1]


def test_sample_logits_over_many_blocks_follows_the_distribution() -> None:
    generator = torch.Generator().manual_seed(5)
    vocab = 1000  # many of the kernel's 64-token blocks; most of the mass late in the vocabulary
    logits = torch.randn(vocab, generator=generator) * 2
    logits[:500] = float("-inf")
    num_draws = 20000
    points = torch.rand(num_draws, generator=generator, dtype=torch.float64)
    tokens = sample_logits(logits.repeat(num_draws, 1), torch.full((num_draws,), 0.7), points)
    assert tokens.min() >= 500
    expected = (logits / 0.7).softmax(-1).double()
    counts = torch.bincount(tokens, minlength=vocab).double()
    likely = expected * num_draws >= 5
    chi_square = (((counts - expected * num_draws) ** 2) / (expected * num_draws))[likely].sum().item()
    assert chi_square < 1.5 * int(likely.sum())  # the chi-square statistic sits near its degrees of freedom


def test_sample_logits_refuses_other_dtypes() -> None:
    with pytest.raises(ValueError, match="float32"):
        sample_logits(torch.zeros(2, 4, dtype=torch.bfloat16), torch.ones(2), torch.zeros(2, dtype=torch.float64))


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_equals_the_torch_path(unit_offset: bool, with_residual: bool) -> None:
    generator = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(7, 96, generator=generator).to(dtype)
        residual = torch.randn(7, 96, generator=generator).to(dtype)
        weight = (0.5 + torch.rand(96, generator=generator)).to(dtype)
        total = x + residual if with_residual else x
        want = layer_rms_norm(total, weight, 1e-6, unit_offset)
        got, got_residual = cpu_ops.rms_norm(x, weight, 1e-6, unit_offset, residual if with_residual else None)
        if with_residual:
            assert torch.equal(got_residual, total)
        else:
            assert got_residual is None
        if dtype == torch.bfloat16:  # every rounding where torch rounds: equal
            assert torch.equal(got, want)
        else:  # the RMS sum's order may differ in its last bit
            torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


def test_silu_and_mul_equals_the_torch_path_on_views_of_one_projection() -> None:
    generator = torch.Generator().manual_seed(12)
    for dtype in (torch.float32, torch.bfloat16):
        merged = (torch.randn(64, 2 * 256, generator=generator) * 4).to(dtype)
        gate, up = merged.split([256, 256], dim=-1)  # strided views, as the merged projection gives
        got = cpu_ops.silu_and_mul(gate, up)
        want = F.silu(gate) * up
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)
        else:  # exp's last bit may differ
            torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


def test_rotary_equals_the_torch_path_on_a_strided_query() -> None:
    generator = torch.Generator().manual_seed(13)
    for dtype in (torch.float32, torch.bfloat16):
        qkv = torch.randn(5, 10 * 32, generator=generator).to(dtype)
        query = qkv[:, :6 * 32].view(5, 6, 32)  # heads contiguous, tokens at the fused projection's stride
        cos = torch.randn(5, 1, 32, generator=generator).to(dtype)
        sin = torch.randn(5, 1, 32, generator=generator).to(dtype)
        assert torch.equal(cpu_ops.rotary(query, cos, sin), apply_rotary(query, cos, sin))


def test_elementwise_kernels_take_only_cpu_tensors_of_one_supported_dtype() -> None:
    x = torch.zeros(2, 16)
    assert cpu_ops.elementwise_ready(x, x.bfloat16().float())
    assert not cpu_ops.elementwise_ready(x, x.bfloat16())
    assert not cpu_ops.elementwise_ready(x.half(), x.half())
