"""The Triton kernels against the torch path the engine runs today, on CPU under the Triton interpreter.

Sizes are tiny (head_dim 16, a few heads, contexts under a hundred tokens): the interpreter
runs every program in Python. The same cases run compiled on CUDA when a device is present.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("triton", minversion="3.7")  # the interpreter runs the kernels (loading.py)

from stages.gpu_runner import triton_kernels as kernels  # noqa: E402
from stages.gpu_runner.attention.torch_backend import TorchBackend, paged_attention, write_kv  # noqa: E402
from stages.gpu_runner.attention.torch_metadata import AttentionMetadata, step_attention_metadata  # noqa: E402
from stages.gpu_runner.inputs.step_layout import StepLayout  # noqa: E402
from stages.gpu_runner.layers.norm import RMSNorm  # noqa: E402
from stages.gpu_runner.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402
from stages.gpu_runner.models.config import RopeScaling  # noqa: E402
from stages.gpu_runner.triton_kernels.attention import decode_num_splits  # noqa: E402
from stages.gpu_runner.triton_kernels.loading import jit_module  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HEAD_DIM = 16
SCALE = HEAD_DIM ** -0.5
# bf16 attention: inputs rounded to bf16 (8 bits of mantissa), probabilities rounded before P @ V.
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def _kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, HEAD_DIM, generator=generator)
    return cache.to(dtype).to(DEVICE)


def _block_table(context_lens: list[int], block_size: int, max_blocks: int, seed: int) -> tuple[torch.Tensor, int]:
    """Each row's blocks drawn from a shuffled pool (not contiguous, not in order); unused entries
    name a block no row owns. -> (int32 [rows, max_blocks], number of blocks in the cache)."""
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(needed) + 3  # a few blocks no row owns
    pool = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    table = torch.full((len(context_lens), max_blocks), pool.pop(), dtype=torch.int32)
    for row, count in enumerate(needed):
        table[row, :count] = torch.tensor(pool[:count], dtype=torch.int32)
        pool = pool[count:]
    return table.to(DEVICE), num_blocks


def _torch_metadata(table: torch.Tensor, context_lens: list[int], query_lens: list[int],
                    block_size: int) -> AttentionMetadata:
    """The torch backend's metadata for these rows (row i is table row i; one-token rows as decodes)."""
    layout = StepLayout(rows=np.arange(len(query_lens)), computed=np.subtract(context_lens, query_lens),
                        scheduled=np.array(query_lens), query_start=np.concatenate(([0], np.cumsum(query_lens))))
    arrays = [torch.from_numpy(a).to(DEVICE) for a in TorchBackend(block_size).host_arrays(layout)]
    return step_attention_metadata(layout, arrays, torch.empty(0, dtype=torch.int64, device=DEVICE), table,
                                   block_size)


def _torch_attention(query: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, context_lens: list[int],
                     query_lens: list[int], block_size: int, window: int | None = None) -> torch.Tensor:
    """The engine's torch path, in float32 from the same (possibly bf16-rounded) inputs."""
    meta = _torch_metadata(table, context_lens, query_lens, block_size)
    return paged_attention(query.float(), cache.float(), meta.for_window(window), SCALE)


def _int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


# --- decode -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_matches_torch_path(block_size: int, group: int) -> None:
    """A ragged batch, contexts ending mid-block and on a block edge, shuffled blocks, GQA."""
    num_kv_heads = 2 if group < 8 else 1
    context_lens = [1, 2 * block_size, block_size + 7, 3 * block_size - 5]
    table, num_blocks = _block_table(context_lens, block_size, max_blocks=4, seed=block_size + group)
    cache = _kv_cache(num_blocks, block_size, num_kv_heads, torch.float32, seed=group)
    query = torch.randn(len(context_lens), num_kv_heads * group, HEAD_DIM,
                        generator=torch.Generator().manual_seed(7)).to(DEVICE)
    expected = _torch_attention(query, cache, table, context_lens, [1] * len(context_lens), block_size)
    for num_splits in (None, 1, 3):  # 3 splits of 2 blocks over a 4-block table: one split is always empty
        out = kernels.paged_decode_attention(query, cache, table, _int32(context_lens), SCALE, num_splits=num_splits)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_decode_batch_of_one_bf16() -> None:
    block_size, context_lens = 16, [45]
    table, num_blocks = _block_table(context_lens, block_size, max_blocks=3, seed=1)
    cache = _kv_cache(num_blocks, block_size, 2, torch.bfloat16, seed=2)
    query = torch.randn(1, 8, HEAD_DIM, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(DEVICE)
    expected = _torch_attention(query, cache, table, context_lens, [1], block_size)
    for num_splits in (1, 2):
        out = kernels.paged_decode_attention(query, cache, table, _int32(context_lens), SCALE, num_splits=num_splits)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), expected, **BF16_TOL)


def test_decode_padding_rows_give_zeros_and_out_is_filled() -> None:
    """Rows with seq_lens 0 (a static batch's padding) read nothing, even with garbage block ids."""
    block_size, context_lens = 16, [20, 0, 33, 0]
    table, num_blocks = _block_table(context_lens, block_size, max_blocks=3, seed=4)
    table[1] = 10**6  # never read
    table = torch.cat([table, torch.full_like(table, 10**6)])  # more table rows than batch rows
    cache = _kv_cache(num_blocks, block_size, 1, torch.float32, seed=5)
    query = torch.randn(4, 4, HEAD_DIM, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    out = torch.full_like(query, float("nan"))
    returned = kernels.paged_decode_attention(query, cache, table, _int32(context_lens), SCALE, out=out,
                                              num_splits=2)
    assert returned is out
    assert torch.equal(out[[1, 3]], torch.zeros_like(out[[1, 3]]))
    live = [0, 2]
    expected = _torch_attention(query[live], cache, table[live], [20, 33], [1, 1], block_size)
    torch.testing.assert_close(out[live], expected, atol=1e-5, rtol=1e-5)


def test_decode_splits_come_from_host_sizes() -> None:
    """Small batches with long tables split the KV for parallelism; big batches and short tables do not."""
    assert decode_num_splits(max_blocks_per_row=2048, block_size=16, num_rows=1, num_kv_heads=8) == 32
    assert decode_num_splits(max_blocks_per_row=2048, block_size=16, num_rows=256, num_kv_heads=8) == 1
    assert decode_num_splits(max_blocks_per_row=8, block_size=16, num_rows=1, num_kv_heads=8) == 1
    assert decode_num_splits(max_blocks_per_row=64, block_size=16, num_rows=4, num_kv_heads=8) == 4


# --- prefill ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_mixed_step_matches_torch_path(block_size: int, group: int) -> None:
    """One launch over: a first chunk, a decode, a prefix-cached chunk ending mid-block, another decode."""
    num_kv_heads = 2 if group == 1 else 1
    query_lens = [19, 1, 6, 1]
    context_lens = [19, block_size + 3, 2 * block_size + 5, 2]
    table, num_blocks = _block_table(context_lens, block_size, max_blocks=3, seed=block_size * group)
    cache = _kv_cache(num_blocks, block_size, num_kv_heads, torch.float32, seed=group + 10)
    query = torch.randn(sum(query_lens), num_kv_heads * group, HEAD_DIM,
                        generator=torch.Generator().manual_seed(8)).to(DEVICE)
    query_start_loc = _int32([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    out = kernels.paged_prefill_attention(query, cache, table, _int32(context_lens), query_start_loc,
                                          max(query_lens), SCALE)
    expected = _torch_attention(query, cache, table, context_lens, query_lens, block_size)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_prefill_one_long_row_over_several_query_tiles() -> None:
    """70 queries on a 10-token cached prefix: two query tiles, the second ending mid-tile."""
    block_size, query_lens, context_lens = 16, [70], [80]
    table, num_blocks = _block_table(context_lens, block_size, max_blocks=5, seed=9)
    cache = _kv_cache(num_blocks, block_size, 1, torch.float32, seed=11)
    query = torch.randn(70, 2, HEAD_DIM, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    out = kernels.paged_prefill_attention(query, cache, table, _int32(context_lens), _int32([0, 70]), 70, SCALE)
    expected = _torch_attention(query, cache, table, context_lens, query_lens, block_size)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_prefill_ragged_batch_bf16_into_out() -> None:
    block_size, query_lens, context_lens = 32, [5, 12, 1], [5, 40, 9]
    table, num_blocks = _block_table(context_lens, block_size, max_blocks=2, seed=13)
    cache = _kv_cache(num_blocks, block_size, 2, torch.bfloat16, seed=14)
    query = torch.randn(18, 8, HEAD_DIM, generator=torch.Generator().manual_seed(15)).to(torch.bfloat16).to(DEVICE)
    out = torch.empty_like(query)
    kernels.paged_prefill_attention(query, cache, table, _int32(context_lens), _int32([0, 5, 17, 18]), 12, SCALE,
                                    out=out)
    expected = _torch_attention(query, cache, table, context_lens, query_lens, block_size)
    torch.testing.assert_close(out.float(), expected, **BF16_TOL)


def test_sliding_window_bf16_matches_torch_path() -> None:
    """A window of 20 (not a multiple of the block) in bf16: decodes in the decode kernel, then
    with a prefix-cached chunk crossing the window's edge in one prefill launch."""
    block_size, window = 16, 20
    query_lens, context_lens = [1, 1, 9, 1], [19, 21, 30, 64]
    table, num_blocks = _block_table(context_lens, block_size, max_blocks=4, seed=24)
    cache = _kv_cache(num_blocks, block_size, 2, torch.bfloat16, seed=25)
    query = torch.randn(12, 4, HEAD_DIM, generator=torch.Generator().manual_seed(26)).to(torch.bfloat16).to(DEVICE)
    decodes = [0, 1, 3]
    decode_query, decode_table = query[[0, 1, 11]], table[decodes]
    decode_lens = [context_lens[i] for i in decodes]
    out = kernels.paged_decode_attention(decode_query, cache, decode_table, _int32(decode_lens), SCALE, window=window)
    expected = _torch_attention(decode_query, cache, decode_table, decode_lens, [1, 1, 1], block_size, window)
    torch.testing.assert_close(out.float(), expected, **BF16_TOL)
    out = kernels.paged_prefill_attention(query, cache, table, _int32(context_lens), _int32([0, 1, 2, 11, 12]), 9,
                                          SCALE, window=window)
    expected = _torch_attention(query, cache, table, context_lens, query_lens, block_size, window)
    torch.testing.assert_close(out.float(), expected, **BF16_TOL)


def test_attention_rejects_bad_inputs() -> None:
    cache = _kv_cache(4, 16, 2, torch.float32, seed=0)
    query = torch.zeros(2, 4, HEAD_DIM, device=DEVICE)
    table, lens = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE), _int32([3, 4])
    with pytest.raises(ValueError, match="block_tables must be int32"):
        kernels.paged_decode_attention(query, cache, table.long(), lens, SCALE)
    with pytest.raises(ValueError, match="num_heads 3 is not a multiple of num_kv_heads 2"):
        kernels.paged_decode_attention(query[:, :3], cache, table, lens, SCALE)
    with pytest.raises(ValueError, match="block_size must be a power of two >= 16"):
        kernels.paged_decode_attention(query, cache[:, :, :12], table, lens, SCALE)
    with pytest.raises(ValueError, match=r"query_start_loc must be int32 \[3\]"):
        kernels.paged_prefill_attention(query, cache, table, lens, _int32([0, 2]), 1, SCALE)
    with pytest.raises(ValueError, match="window must be a positive int or None, got 0"):
        kernels.paged_prefill_attention(query, cache, table, lens, _int32([0, 1, 2]), 1, SCALE, window=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_write_kv_and_skips_padding(dtype: torch.dtype) -> None:
    cache = _kv_cache(6, 16, 2, dtype, seed=22)
    expected = cache.clone()
    generator = torch.Generator().manual_seed(23)
    key = torch.randn(5, 2, HEAD_DIM, generator=generator).to(dtype).to(DEVICE)
    value = torch.randn(5, 2, HEAD_DIM, generator=generator).to(dtype).to(DEVICE)
    slots = torch.tensor([17, 3, -1, 95, 40], device=DEVICE)  # token 2 is padding
    live = torch.tensor([0, 1, 3, 4], device=DEVICE)
    write_kv(expected, key[live], value[live], slots[live])
    kernels.store_kv(cache, key, value, slots)
    assert torch.equal(cache, expected)


# --- RMSNorm ------------------------------------------------------------------------------------------


def _assert_same_rounding(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-equal on CPU. Compiled on CUDA, the sum of squares adds up in another order than torch's
    mean, so a value within an ulp of a bf16 rounding midpoint may round the other way: one ulp there."""
    if DEVICE.type == "cpu":
        assert torch.equal(out, expected)
    else:
        torch.testing.assert_close(out, expected, atol=0, rtol=2 ** -7)


def _rms_norm_module(size: int, dtype: torch.dtype, generator: torch.Generator) -> RMSNorm:
    """The model's RMSNorm with random weights, in `dtype`."""
    norm = RMSNorm(size, 1e-6)
    norm.weight.data = torch.randn(size, generator=generator)
    return norm.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_module(dtype: torch.dtype) -> None:
    """bf16 included to the bit: the kernel rounds where the module rounds."""
    generator = torch.Generator().manual_seed(16)
    norm = _rms_norm_module(48, dtype, generator)
    x = torch.randn(2, 3, 48, generator=generator).to(dtype).to(DEVICE)
    with torch.no_grad():
        expected = norm(x)
    out = kernels.rms_norm(x, norm.weight.detach(), norm.eps)
    assert out.shape == x.shape and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    else:
        _assert_same_rounding(out, expected)


def test_rms_norm_float32_weight_on_bf16_activations_promotes() -> None:
    generator = torch.Generator().manual_seed(17)
    weight = torch.randn(32, generator=generator).to(DEVICE)
    x = torch.randn(5, 32, generator=generator).to(torch.bfloat16).to(DEVICE)
    norm = RMSNorm(32, 1e-5).to(DEVICE)
    norm.weight.data = weight
    with torch.no_grad():
        expected = norm(x)
    out = kernels.rms_norm(x, weight, 1e-5)
    assert out.dtype == expected.dtype == torch.float32
    _assert_same_rounding(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_updates_residual_in_place(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(18)
    norm = _rms_norm_module(40, dtype, generator)
    x = torch.randn(6, 40, generator=generator).to(dtype).to(DEVICE)
    residual = torch.randn(6, 40, generator=generator).to(dtype).to(DEVICE)
    summed = x + residual
    with torch.no_grad():
        expected = norm(summed)
    out, returned = kernels.fused_add_rms_norm(x, residual, norm.weight.detach(), norm.eps)
    assert returned is residual
    assert torch.equal(residual, summed)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    else:
        _assert_same_rounding(out, expected)


# --- rotary -------------------------------------------------------------------------------------------


def _rotary_tables(max_positions: int) -> RotaryEmbedding:
    config = SimpleNamespace(head_dim=HEAD_DIM, rope_theta=10000.0, rope_scaling=RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64))
    return RotaryEmbedding(config, max_positions, DEVICE)


def _qkv(num_tokens: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype,
         seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as the model has them: views into one fused projection output (strided rows)."""
    width = (num_heads + 2 * num_kv_heads) * HEAD_DIM
    qkv = torch.randn(num_tokens, width, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)
    q, k, _ = qkv.split([num_heads * HEAD_DIM, num_kv_heads * HEAD_DIM, num_kv_heads * HEAD_DIM], dim=-1)
    return q.view(num_tokens, num_heads, HEAD_DIM), k.view(num_tokens, num_kv_heads, HEAD_DIM)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_apply_rotary_to_the_bit(dtype: torch.dtype) -> None:
    rope = _rotary_tables(300)
    positions = torch.tensor([0, 5, 299, 64, 17], device=DEVICE)
    q, k = _qkv(5, 8, 2, dtype, seed=19)
    cos, sin = rope(positions, dtype)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    kernels.rotary_embedding_(q, k, positions, rope.cos, rope.sin)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rotary_matches_norm_then_rotary(dtype: torch.dtype) -> None:
    rope = _rotary_tables(100)
    positions = torch.tensor([3, 0, 99, 42], device=DEVICE)
    q, k = _qkv(4, 4, 1, dtype, seed=20)
    generator = torch.Generator().manual_seed(21)
    q_norm, k_norm = _rms_norm_module(HEAD_DIM, dtype, generator), _rms_norm_module(HEAD_DIM, dtype, generator)
    cos, sin = rope(positions, dtype)
    with torch.no_grad():
        expected_q, expected_k = apply_rotary(q_norm(q), cos, sin), apply_rotary(k_norm(k), cos, sin)
    kernels.qk_norm_rotary_(q, k, q_norm.weight.detach(), k_norm.weight.detach(), 1e-6, positions, rope.cos, rope.sin)
    if dtype == torch.float32:
        torch.testing.assert_close(q, expected_q, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k, expected_k, atol=1e-5, rtol=1e-5)
    else:
        _assert_same_rounding(q, expected_q)
        _assert_same_rounding(k, expected_k)


# --- loading ------------------------------------------------------------------------------------------


def test_load_builds_each_mode_beside_the_other() -> None:
    """CPU kernels are interpreted, CUDA ones compiled (defining them needs no GPU); both in one process."""
    loaded = kernels.load("cpu")
    assert loaded.rms_norm is kernels.rms_norm
    assert type(jit_module("attention", True).prefill_kernel).__name__ == "InterpretedFunction"
    assert type(jit_module("attention", False).prefill_kernel).__name__ == "JITFunction"
    with pytest.raises(ValueError, match="not on device meta"):
        kernels.load("meta")


_INTERPRETED_PROCESS = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import triton  # Triton's own library decorated interpreted, before the kernels exist
    import torch
    from stages.gpu_runner import triton_kernels as kernels
    from stages.gpu_runner.triton_kernels.loading import jit_module
    from stages.gpu_runner.layers.norm import RMSNorm
    x, norm = torch.randn(3, 32), RMSNorm(32, 1e-6)
    assert torch.allclose(kernels.rms_norm(x, norm.weight.detach(), 1e-6), norm(x), atol=1e-5)
    table, lens = torch.arange(4, dtype=torch.int32).view(2, 2), torch.tensor([5, 0], dtype=torch.int32)
    out = kernels.paged_decode_attention(torch.randn(2, 2, 16), torch.randn(2, 4, 16, 1, 16), table, lens, 0.25)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and out[0].abs().sum() > 0
    try:
        jit_module("norm", False)
    except RuntimeError as error:
        print(error)
""")


def test_cpu_kernels_run_in_a_process_that_imported_triton_interpreted() -> None:
    """The other import order from this process's (which imported triton compiled): the CPU kernels
    still run, and asking for compiled kernels there fails with a clear error."""
    result = subprocess.run([sys.executable, "-c", _INTERPRETED_PROCESS], capture_output=True, text=True,
                            timeout=120, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert result.returncode == 0, result.stderr
    assert "triton was imported with TRITON_INTERPRET=1" in result.stdout


def test_an_interpreter_too_old_for_the_kernels_is_named_with_the_way_out() -> None:
    from stages.gpu_runner.triton_kernels.loading import check_interpreter

    check_interpreter("3.7.0")
    check_interpreter("3.9.0+git1234")
    with pytest.raises(RuntimeError, match=r"needs triton>=3.7 \(this is 3.6.0\); use attention_backend 'torch'"):
        check_interpreter("3.6.0")
