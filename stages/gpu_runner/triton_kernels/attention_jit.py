"""Triton kernels of paged attention: split-KV decode (partial + reduce) and ragged causal prefill.

Loaded through triton_kernels.loading, never imported directly. Softmax runs in base 2 on scores
pre-multiplied by scale * log2(e). Masked scores are a large negative finite number, not -inf,
so a tile or split with nothing to attend yields zero weight instead of NaN.

`window` is a runtime scalar: a query at position p attends keys p - window + 1..p (a window at
least as long as the context, as the wrappers pass for none, is full causal attention). Loops
start at the block holding the first key in a window, so windowed layers read O(window) keys;
the keys before it in that block are masked.
"""
import triton
import triton.language as tl

from stages.gpu_runner.triton_kernels.loading import jit_module_in_loading_mode

_common = jit_module_in_loading_mode("common")
round_to = _common.round_to
dot = _common.dot
sum_over = _common.sum_over
max_over = _common.max_over

MASKED = tl.constexpr(-1.0e30)


@triton.jit
def load_kv_block(k_ptr, v_ptr, block_table, b, seq_len, kv_head, stride_kb, stride_kt, stride_kh,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The row's b-th block: keys, values [BLOCK_SIZE, BLOCK_D] (zeros past seq_len), positions, in-context mask."""
    block_id = tl.load(block_table + b).to(tl.int64)
    n = tl.arange(0, BLOCK_SIZE)
    d = tl.arange(0, BLOCK_D)
    pos = b * BLOCK_SIZE + n
    in_context = pos < seq_len
    offsets = block_id * stride_kb + n[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
    kv_mask = in_context[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + offsets, mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + offsets, mask=kv_mask, other=0.0)
    return k, v, pos, in_context


@triton.jit
def attend_block(q, m_i, l_i, acc, k, v, valid, qk_scale, DOT_FP32: tl.constexpr):
    """One online-softmax step over a block of keys: q [M, D], k/v [N, D], valid [M, N]."""
    s = dot(q, tl.trans(k), DOT_FP32) * qk_scale
    s = tl.where(valid, s, MASKED)
    m_new = tl.maximum(m_i, max_over(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + sum_over(p, 1)
    acc = acc * alpha[:, None] + dot(round_to(p, v.dtype), v, DOT_FP32)
    return m_new, l_i, acc


@triton.jit
def decode_partial_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, m_ptr, l_ptr, acc_ptr,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
    qk_scale, num_heads, blocks_per_split, window,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Program (row, kv head, split): every query head of the kv head over the split's blocks.
    The splits divide the row's window, from the block holding its first key on."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + row)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], MASKED, tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    window_start = tl.maximum(seq_len - window, 0)
    first = window_start // BLOCK_SIZE + split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE)
    block_table = block_tables_ptr + row.to(tl.int64) * stride_bt
    for b in range(first, last):
        k, v, pos, in_context = load_kv_block(k_ptr, v_ptr, block_table, b, seq_len, kv_head,
                                              stride_kb, stride_kt, stride_kh, HEAD_DIM, BLOCK_D, BLOCK_SIZE)
        valid = in_context & (pos >= window_start)
        m_i, l_i, acc = attend_block(q, m_i, l_i, acc, k, v, valid[None, :], qk_scale, DOT_FP32)
    partial = (row.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
    tl.store(m_ptr + partial, m_i, mask=g_mask)
    tl.store(l_ptr + partial, l_i, mask=g_mask)
    tl.store(acc_ptr + partial[:, None] * HEAD_DIM + d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def decode_reduce_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, stride_ot, stride_oh, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Program (row, head): merge the splits' partial softmaxes. A row with no keys gets zeros."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < NUM_SPLITS
    d_mask = d < HEAD_DIM
    partial = (row.to(tl.int64) * num_heads + head) * NUM_SPLITS + s
    m = tl.load(m_ptr + partial, mask=s_mask, other=MASKED)
    l = tl.load(l_ptr + partial, mask=s_mask, other=0.0)
    acc = tl.load(acc_ptr + partial[:, None] * HEAD_DIM + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    weight = tl.exp2(m - max_over(m, 0))
    total = sum_over(l * weight, 0)
    out = sum_over(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    out_ptrs = out_ptr + row.to(tl.int64) * stride_ot + head * stride_oh + d
    tl.store(out_ptrs, round_to(out, out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_bt, qk_scale, window,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Program (row, query tile, kv head): causal attention of BLOCK_Q of the row's queries for every
    query head of the kv head, so each key block is read once per group. Tile row i is query
    token i // BLOCK_G of the tile, head i % BLOCK_G of the group."""
    row = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + row)
    q_len = tl.load(query_start_loc_ptr + row + 1) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + row)
    i = tl.arange(0, BLOCK_Q * BLOCK_G)
    token = tile * BLOCK_Q + i // BLOCK_G
    g = i % BLOCK_G
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    m_mask = (token < q_len) & (g < GROUP)
    d_mask = d < HEAD_DIM
    q_pos = seq_len - q_len + token
    q_offsets = (q_start + token).to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_Q * BLOCK_G], MASKED, tl.float32)
    l_i = tl.full([BLOCK_Q * BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_Q * BLOCK_G, BLOCK_D], 0.0, tl.float32)
    kv_end = tl.minimum(seq_len, seq_len - q_len + (tile + 1) * BLOCK_Q)  # past the tile's last query: masked
    # From the tile's first query's window start. A later query's first blocks may be wholly
    # outside its window: their made-up weight is wiped (alpha = 0) by its first real key.
    kv_start = tl.maximum(seq_len - q_len + tile * BLOCK_Q - window + 1, 0)
    block_table = block_tables_ptr + row.to(tl.int64) * stride_bt
    for b in range(kv_start // BLOCK_SIZE, (kv_end + BLOCK_SIZE - 1) // BLOCK_SIZE):
        k, v, pos, in_context = load_kv_block(k_ptr, v_ptr, block_table, b, seq_len, kv_head,
                                              stride_kb, stride_kt, stride_kh, HEAD_DIM, BLOCK_D, BLOCK_SIZE)
        valid = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window) & in_context[None, :]
        m_i, l_i, acc = attend_block(q, m_i, l_i, acc, k, v, valid, qk_scale, DOT_FP32)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_offsets = (q_start + token).to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + out_offsets, round_to(out, out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, stride_ch, num_kv_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """Program (token): its K and V, every kv head, into the cache at its slot; a negative slot writes nothing."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < num_kv_heads)[:, None] & (d < HEAD_DIM)[None, :]
    cache = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + h[:, None] * stride_ch + d[None, :]
    key = tl.load(key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    value = tl.load(value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(k_cache_ptr + cache, key, mask=mask)
    tl.store(v_cache_ptr + cache, value, mask=mask)
