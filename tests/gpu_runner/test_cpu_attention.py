"""The torch backend's paged attention against attention computed row by row in float64: decode
rows of unequal contexts (padded keys masked), GQA, sliding windows, prefill chunks over a cached
prefix, mixed steps, and low-precision caches, also under float32 queries (kv_cache_dtype)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from stages.gpu_runner.attention.torch_backend import TorchBackend, paged_attention, write_kv
from stages.gpu_runner.attention.torch_metadata import step_attention_metadata
from stages.gpu_runner.inputs.step_layout import StepLayout

BLOCK_SIZE = 4
NUM_BLOCKS = 64


class Step:
    """One step's rows: `context[i]` positions each, the last `scheduled[i]` of them computed now."""

    def __init__(self, context: list[int], scheduled: list[int], *, num_heads: int = 6, num_kv_heads: int = 2,
                 head_dim: int = 16, dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None,
                 seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.context, self.scheduled = context, scheduled
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        num_rows = len(context)
        blocks_per_row = -(-max(context) // BLOCK_SIZE)
        # Rows own scattered blocks, as a long-running cache hands them out.
        perm = torch.randperm(NUM_BLOCKS, generator=gen)[:num_rows * blocks_per_row]
        self.block_table = perm.view(num_rows, blocks_per_row).to(torch.int32)
        self.cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(kv_dtype or dtype)
        num_tokens = sum(scheduled)
        self.query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
        self.rows = np.arange(num_rows)

    def slots(self, row: int, positions: range) -> torch.Tensor:
        return torch.tensor([int(self.block_table[row, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                             for p in positions], dtype=torch.int64)

    def metadata(self):
        scheduled = np.array(self.scheduled, dtype=np.int64)
        context = np.array(self.context, dtype=np.int64)
        query_start = np.concatenate([[0], np.cumsum(scheduled)])
        layout = StepLayout(rows=self.rows, computed=context - scheduled, scheduled=scheduled, query_start=query_start)
        arrays = [torch.from_numpy(np.asarray(a, dtype=np.int64)) for a in TorchBackend(BLOCK_SIZE).host_arrays(layout)]
        slot_mapping = torch.cat([self.slots(i, range(c - s, c)) for i, (c, s) in
                                  enumerate(zip(self.context, self.scheduled))])
        return step_attention_metadata(layout, arrays, slot_mapping, self.block_table, BLOCK_SIZE)

    def reference(self, window: int | None) -> torch.Tensor:
        """float64 attention, each query over its row's keys up to its own position (and window)."""
        out = torch.empty(self.query.shape, dtype=torch.float64)
        group = self.num_heads // self.num_kv_heads
        token = 0
        for row, (ctx, num) in enumerate(zip(self.context, self.scheduled)):
            slots = self.slots(row, range(ctx))
            keys = self.cache[0].flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
            values = self.cache[1].flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
            for pos in range(ctx - num, ctx):
                first = 0 if window is None else max(0, pos - window + 1)
                scores = torch.einsum("hd,khd->hk", self.query[token].double(), keys[first:pos + 1]) * self.scale
                out[token] = torch.einsum("hk,khd->hd", scores.softmax(-1), values[first:pos + 1])
                token += 1
        return out

    def attend(self, window: int | None = None) -> torch.Tensor:
        return paged_attention(self.query, self.cache, self.metadata().for_window(window), self.scale)


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_of_unequal_contexts(dtype: torch.dtype) -> None:
    step = Step([1, 7, 16, 23, 9], [1, 1, 1, 1, 1], dtype=dtype)
    assert_close(step.attend(), step.reference(None), dtype)


@pytest.mark.parametrize("num_kv_heads", [1, 3, 6])
def test_grouped_and_multi_head_keys(num_kv_heads: int) -> None:
    step = Step([5, 12, 30], [1, 1, 1], num_kv_heads=num_kv_heads)
    assert_close(step.attend(), step.reference(None), torch.float32)


@pytest.mark.parametrize("window", [1, 4, 6, 13, 64])
def test_decode_rows_in_a_sliding_window(window: int) -> None:
    step = Step([3, 9, 17, 30], [1, 1, 1, 1])
    assert_close(step.attend(window), step.reference(window), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_chunks_over_a_cached_prefix(dtype: torch.dtype) -> None:
    step = Step([10, 21], [10, 6], dtype=dtype)
    assert_close(step.attend(), step.reference(None), dtype)


@pytest.mark.parametrize("window", [None, 5])
def test_mixed_step(window: int | None) -> None:
    step = Step([8, 19, 3, 26], [1, 7, 3, 1])
    assert_close(step.attend(window), step.reference(window), torch.float32)


def test_written_keys_are_read_back() -> None:
    step = Step([6, 11], [1, 1])
    meta = step.metadata()
    key = torch.randn(2, step.num_kv_heads, step.head_dim)
    value = torch.randn(2, step.num_kv_heads, step.head_dim)
    write_kv(step.cache, key, value, meta.slot_mapping)
    assert_close(step.attend(), step.reference(None), torch.float32)


@pytest.mark.parametrize("num_kv_heads", [1, 2, 6])
def test_float32_queries_over_a_bfloat16_cache_read_it_widened(num_kv_heads: int) -> None:
    """kv_cache_dtype bfloat16 under a float32 model: decode rows (the compiled kernel, or spread
    decode), prefill chunks and a mixed step read the cache's bfloat16 values widened to float32,
    so they equal float64 attention over those values within float32 rounding."""
    for context, scheduled in (([1, 7, 16, 23, 9], [1, 1, 1, 1, 1]), ([12, 20], [5, 20]), ([9, 14, 3], [1, 6, 3])):
        step = Step(context, scheduled, num_kv_heads=num_kv_heads, kv_dtype=torch.bfloat16, seed=len(context))
        out = step.attend()
        assert out.dtype == torch.float32
        assert_close(out, step.reference(None), torch.float32)


def test_keys_written_into_a_bfloat16_cache_are_rounded_to_nearest() -> None:
    cache = torch.zeros(2, 4, BLOCK_SIZE, 1, 16, dtype=torch.bfloat16)
    key = torch.randn(3, 1, 16)
    value = torch.randn(3, 1, 16)
    write_kv(cache, key, value, torch.tensor([0, 5, 9]))
    flat = cache.flatten(1, 2)
    assert torch.equal(flat[0, [0, 5, 9]], key.to(torch.bfloat16)) and torch.equal(flat[1, [0, 5, 9]],
                                                                                  value.to(torch.bfloat16))


def chunked_step(contexts: list[int], window: int | None, *, kv_heads: int = 3, heads: int = 9, head_dim: int = 64,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode rows over long contexts, straight for the compiled kernel: (query [rows, 1, heads,
    head_dim], flat cache [2, slots, kv_heads, head_dim], slots [rows, num_keys] (each row's keys
    scattered over the cache, padding masked), mask [rows, 1, num_keys] (the last `window` keys))."""
    generator = torch.Generator().manual_seed(seed)
    num_keys = max(contexts)
    cache = torch.randn(2, len(contexts) * num_keys, kv_heads, head_dim, generator=generator)
    order = torch.randperm(cache.shape[1], generator=generator)
    slots = order.view(len(contexts), num_keys).clone()
    mask = torch.zeros(len(contexts), 1, num_keys, dtype=torch.bool)
    for row, context in enumerate(contexts):
        first = 0 if window is None else max(0, context - window)
        mask[row, 0, first:context] = True
    query = torch.randn(len(contexts), 1, heads, head_dim, generator=generator)
    return query, cache, slots, mask


def chunked_reference(query, cache, slots, mask, scale):
    out = torch.zeros(query.shape, dtype=torch.float64)
    group = query.shape[2] // cache.shape[2]
    for row in range(query.shape[0]):
        seen = slots[row][mask[row, 0]]
        keys = cache[0, seen].double().repeat_interleave(group, dim=1)  # [keys, heads, head_dim]
        values = cache[1, seen].double().repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,khd->hk", query[row, 0].double() * scale, keys), dim=-1)
        out[row, 0] = torch.einsum("hk,khd->hd", weights, values)
    return out


@pytest.mark.parametrize("window", [None, 5, 70])
def test_long_rows_are_attended_in_key_chunks(window: int | None) -> None:
    """Rows of more keys than a chunk (64): split, each chunk softmaxed alone, merged; with a window
    some chunks see no key at all. Equal to float64 attention within float32 rounding."""
    from stages.gpu_runner.cpu_ops import paged_attention as compiled

    query, cache, slots, mask = chunked_step([200, 64, 65, 129, 1], window)
    out = compiled(query, cache, slots, mask, 0.125)
    assert_close(out, chunked_reference(query, cache, slots, mask, 0.125), torch.float32)


def test_a_rows_attention_depends_on_neither_its_batch_nor_the_threads() -> None:
    """A long row's chunks may be shared by the threads; its result is the same float alone, beside
    other rows, and on one thread or two (the chunks are fixed, and merged in order)."""
    from stages.gpu_runner.cpu_ops import paged_attention as compiled

    query, cache, slots, mask = chunked_step([300, 200, 77], None, seed=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = compiled(query, cache, slots, mask, 0.125)
        alone = [compiled(query[i:i + 1], cache, slots[i:i + 1], mask[i:i + 1], 0.125) for i in range(3)]
        torch.set_num_threads(1)
        one_thread = compiled(query, cache, slots, mask, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(torch.cat(alone), together) and torch.equal(one_thread, together)
