"""Sliding-window attention in both backends against a dense reference at the window's edge.

The reference gathers each row's keys position by position and masks an explicit [query, key]
matrix built from positions (a query at p sees keys p - window + 1..p), in float64. The torch
path and the Triton kernels (interpreted on CPU, compiled on CUDA) must match it for windows
smaller than a block, equal to one, not a multiple of one, and longer than every context, which
must equal full attention. Shapes are tiny: the interpreter runs each program in Python.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from stages.gpu_runner.attention.interface import window_blocks
from stages.gpu_runner.attention.torch_backend import TorchBackend, paged_attention
from stages.gpu_runner.attention.torch_metadata import step_attention_metadata
from stages.gpu_runner.inputs.step_layout import StepLayout

triton = pytest.importorskip("triton", minversion="3.7")  # the interpreter runs the kernels (loading.py)

from stages.gpu_runner import triton_kernels as kernels  # noqa: E402
from stages.gpu_runner.attention.triton_backend import TritonBackend  # noqa: E402
from stages.gpu_runner.triton_kernels.attention import decode_num_splits  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_SIZES = [16, 32]
BACKENDS = ["torch", "triton"]


def _windows(block_size: int) -> list[int]:
    """Smaller than a block, one block, not a multiple of the block size."""
    return [5, block_size, block_size + 7]


class Step:
    """A step's rows over a paged cache with shuffled blocks: query_lens[i] queries ending at
    position context_lens[i] - 1. Entries past a row's blocks name a block no row owns."""

    def __init__(self, query_lens: list[int], context_lens: list[int], block_size: int, *, num_kv_heads: int = 2,
                 group: int = 2, head_dim: int = 16, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.query_lens, self.context_lens, self.block_size = query_lens, context_lens, block_size
        needed = [-(-n // block_size) for n in context_lens]
        max_blocks = max(needed) + 1
        num_blocks = sum(needed) + 2
        pool = torch.randperm(num_blocks, generator=generator).tolist()
        spare = pool.pop()
        table = torch.full((len(context_lens), max_blocks), spare, dtype=torch.int32)
        for row, count in enumerate(needed):
            table[row, :count] = torch.tensor(pool[:count], dtype=torch.int32)
            pool = pool[count:]
        self.table = table.to(DEVICE)
        self.cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(DEVICE)
        self.query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=generator).to(DEVICE)
        self.scale = head_dim ** -0.5
        computed = np.array(context_lens) - np.array(query_lens)
        self.layout = StepLayout(rows=np.arange(len(context_lens)), computed=computed, scheduled=np.array(query_lens),
                                 query_start=np.concatenate(([0], np.cumsum(query_lens))))

    def _int32(self, values) -> torch.Tensor:
        return torch.tensor(np.asarray(values), dtype=torch.int32, device=DEVICE)

    def reference(self, window: int | None) -> torch.Tensor:
        """Dense float64 attention with an explicit position mask, row by row."""
        out, start, bs = [], 0, self.block_size
        group = self.query.shape[1] // self.cache.shape[3]
        for row, (q_len, ctx) in enumerate(zip(self.query_lens, self.context_lens)):
            key_pos = torch.arange(ctx, device=DEVICE)
            blocks = self.table[row, key_pos // bs].long()
            keys = self.cache[0, blocks, key_pos % bs].double().repeat_interleave(group, dim=1)
            values = self.cache[1, blocks, key_pos % bs].double().repeat_interleave(group, dim=1)
            query_pos = torch.arange(ctx - q_len, ctx, device=DEVICE).unsqueeze(1)
            mask = key_pos <= query_pos
            if window is not None:
                mask &= key_pos > query_pos - window
            scores = torch.einsum("qhd,khd->hqk", self.query[start:start + q_len].double(), keys) * self.scale
            weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            out.append(torch.einsum("hqk,khd->qhd", weights, values))
            start += q_len
        return torch.cat(out).float()

    def torch_metadata(self):
        arrays = [torch.from_numpy(a).to(DEVICE) for a in TorchBackend(self.block_size).host_arrays(self.layout)]
        return step_attention_metadata(self.layout, arrays, torch.empty(0, dtype=torch.int64, device=DEVICE),
                                       self.table, self.block_size)

    def attend(self, backend: str, window: int | None, num_splits: int | None = None) -> torch.Tensor:
        """The step through the torch path or the Triton kernels (decode kernel when every row has one query)."""
        if backend == "torch":
            return paged_attention(self.query, self.cache, self.torch_metadata().for_window(window), self.scale)
        lens = self._int32(self.context_lens)
        if max(self.query_lens) == 1:
            return kernels.paged_decode_attention(self.query, self.cache, self.table, lens, self.scale, window=window,
                                                  num_splits=num_splits)
        return kernels.paged_prefill_attention(self.query, self.cache, self.table, lens,
                                               self._int32(self.layout.query_start), max(self.query_lens), self.scale,
                                               window=window)


def _assert_matches(out: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def _edge_decodes(window: int, block_size: int) -> list[int]:
    """Contexts just below, at and just above the window, one whose window starts on a block's
    last key, one short and one long row."""
    return sorted({max(window - 1, 1), window, window + 1, window + 2 * block_size - 1, 2, 3 * block_size + 5})


def _mixed_step(window: int, block_size: int, seed: int) -> Step:
    """Decodes below, at and above the window; a first chunk longer than the window; a chunk
    starting at window - 1 whose queries' windows start at positions 0 to 6; a chunk whose first
    query's window starts on a block's last key; a chunk starting far past the window, whose
    first blocks are skipped; a long decode."""
    w = min(window, 2 * block_size + 3)  # a window longer than every context keeps these shapes
    query_lens = [1, 1, 1, w + 4, 7, 3, 5, 1]
    context_lens = [max(w - 1, 1), w, w + 1, w + 4, w + 6, w + 2 * block_size + 1, 2 * block_size + 6,
                    3 * block_size + 5]
    return Step(query_lens, context_lens, block_size, seed=seed)


# --- the mask at the window's edge ------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_decode_rows_at_the_window_edge(backend: str, block_size: int) -> None:
    for window in _windows(block_size):
        contexts = _edge_decodes(window, block_size)
        step = Step([1] * len(contexts), contexts, block_size, seed=window)
        expected = step.reference(window)
        for num_splits in ((None, 3) if backend == "triton" else (None,)):  # 3: more splits than the window's blocks
            _assert_matches(step.attend(backend, window, num_splits), expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_mixed_step_with_chunks_crossing_the_window_edge(backend: str, block_size: int) -> None:
    for window in _windows(block_size):
        step = _mixed_step(window, block_size, seed=block_size + window)
        _assert_matches(step.attend(backend, window), step.reference(window))


@pytest.mark.parametrize("backend", BACKENDS)
def test_blocks_before_the_window_are_never_read(backend: str) -> None:
    """Blocks wholly before each row's earliest window hold NaN: reading one would poison the
    output, masked or not. (A torch decode row gathers as many blocks as a window can span, so
    it may read the block before its window's: that one stays.)"""
    for window in (5, 23):
        step = _mixed_step(window, 16, seed=window)
        expected = step.reference(window)
        poisoned = 0
        for row, (q_len, ctx) in enumerate(zip(step.query_lens, step.context_lens)):
            unread = max(max(ctx - q_len - window + 1, 0) // 16 - (q_len == 1), 0)
            step.cache[:, step.table[row, :unread].long()] = float("nan")
            poisoned += unread
        assert poisoned >= 1
        _assert_matches(step.attend(backend, window), expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_window_longer_than_every_context_is_full_attention(backend: str) -> None:
    for step in (_mixed_step(40, 16, seed=1), Step([1, 1, 1], [3, 40, 53], 16, seed=2)):
        full = step.attend(backend, None)
        _assert_matches(full, step.reference(None))
        _assert_matches(step.attend(backend, 10_000), full)


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_dim_256(backend: str) -> None:
    """Gemma 3's head size, one kv head of two query heads, a window not a multiple of the block."""
    for query_lens, context_lens in (([1, 1, 1], [19, 20, 45]), ([1, 9, 3], [30, 27, 40])):
        step = Step(query_lens, context_lens, 16, num_kv_heads=1, group=2, head_dim=256, seed=len(query_lens))
        _assert_matches(step.attend(backend, 20), step.reference(20))


# --- the backends: one metadata per step, windowed and full layers ----------------------------------


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_one_metadata_serves_windowed_and_full_layers(backend_name: str) -> None:
    """Layers of one step alternate window 21 and full attention over the same metadata, each
    writing this step's K/V first; the torch path builds the windowed variant once."""
    step = _mixed_step(21, 16, seed=3)
    backend = TorchBackend(16) if backend_name == "torch" else TritonBackend(DEVICE, 16)
    arrays = [torch.from_numpy(a).to(DEVICE) for a in backend.host_arrays(step.layout)]
    positions = np.concatenate([np.arange(c - q, c) for q, c in zip(step.query_lens, step.context_lens)])
    rows = np.repeat(step.layout.rows, step.query_lens)
    slots = step.table.cpu().numpy()[rows, positions // 16].astype(np.int64) * 16 + positions % 16
    slot_mapping = torch.from_numpy(slots).to(DEVICE)
    meta = backend.step_metadata(step.layout, arrays, slot_mapping, SimpleNamespace(block_table=step.table))
    generator = torch.Generator().manual_seed(4)
    for window in (21, None, 21, None):
        key, value = (torch.randn(len(slots), 2, 16, generator=generator).to(DEVICE) for _ in range(2))
        out = backend.attention(step.query, key, value, step.cache, meta, step.scale, window=window)
        _assert_matches(out, step.reference(window))  # the reference reads the cache as just written
    if backend_name == "torch":
        assert meta.for_window(21) is meta.for_window(21) is not meta
        assert meta.for_window(10_000) is meta and meta.for_window(None) is meta


def test_torch_windowed_layers_read_only_the_windows_blocks() -> None:
    """A decode row of 200 keys with window 21 gathers 3 blocks of 16, not 13; a chunk's keys
    start at its first query's window start."""
    step = Step([1, 1, 6], [200, 7, 150], 16)
    windowed = step.torch_metadata().for_window(21)
    assert windowed.decode.key_slots.shape == (2, 3 * 16)
    (chunk,) = windowed.prefills
    assert chunk.first_key == 144 - 20 and chunk.key_slots.shape == (150 - 124,)
    _assert_matches(paged_attention(step.query, step.cache, windowed, step.scale), step.reference(21))


def test_windows_must_be_positive_ints() -> None:
    step = Step([1], [5], 16)
    for window in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="window must be a positive int or None"):
            step.torch_metadata().for_window(window)
        with pytest.raises(ValueError, match="window must be a positive int or None"):
            step.attend("triton", window)


# --- the static decode path -------------------------------------------------------------------------


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_static_decode_metadata_with_a_window(backend_name: str) -> None:
    """A bucket of 4 rows, the last padding (context 0, the scratch row of the table)."""
    bs, window, contexts = 16, 21, [20, 22, 60]
    step = Step([1, 1, 1], contexts, bs, seed=5)
    table = torch.cat([step.table, step.table[:1]])  # the scratch row
    inputs = SimpleNamespace(rows=torch.arange(4, device=DEVICE), block_table=table,
                             seq_lens=torch.tensor([*contexts, 0], device=DEVICE),
                             slot_mapping=torch.full((4,), -1, dtype=torch.int64, device=DEVICE))
    backend = TorchBackend(bs) if backend_name == "torch" else TritonBackend(DEVICE, bs)
    meta = backend.static_decode_metadata(inputs, 4, max(contexts))
    query = torch.cat([step.query, torch.zeros_like(step.query[:1])])
    if backend_name == "torch":
        out = paged_attention(query, step.cache, meta.for_window(window), step.scale)
    else:
        out = kernels.paged_decode_attention(query, step.cache, meta.block_tables, meta.seq_lens, step.scale,
                                             window=window)
        assert torch.equal(out[3], torch.zeros_like(out[3]))
    _assert_matches(out[:3], step.reference(window))


def test_window_blocks_is_the_most_blocks_a_window_spans() -> None:
    for block_size in BLOCK_SIZES:
        for window in range(1, 3 * block_size):
            spans = {(end - 1) // block_size - max(end - window, 0) // block_size + 1 for end in range(1, 5 * block_size)}
            assert window_blocks(window, block_size, 10**6) == max(spans)
    assert window_blocks(None, 16, 7) == window_blocks(10_000, 16, 7) == 7


def test_decode_splits_follow_the_windows_blocks() -> None:
    """A windowed layer (Gemma 3: 512) splits the 33 blocks its window spans, not the table."""
    assert decode_num_splits(window_blocks(None, 16, 2048), 16, num_rows=1, num_kv_heads=8) == 32
    assert decode_num_splits(window_blocks(512, 16, 2048), 16, num_rows=1, num_kv_heads=8) == 3
