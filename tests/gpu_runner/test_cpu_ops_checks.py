"""The CPU operators (torch.ops.pipeline.*) check what they are given before the C kernels read
it: a slot or row id outside its table, a wrong dtype, shape, device or layout raises a Python
exception that names the argument, and the process goes on (nothing is read out of bounds)."""
from __future__ import annotations

import pytest
import torch

from stages.gpu_runner import cpu_ops
from stages.gpu_runner.cpu_ops import build, quant

if build.compilers() is None:
    pytest.skip("no C/C++ compiler: the CPU kernels are not built", allow_module_level=True)

Q8_0 = 8  # ggml's type id: 34-byte blocks of 32 values


@pytest.fixture(autouse=True, scope="module")
def ops():
    """torch.ops.pipeline; where compilers exist a failed build fails these tests, never skips them."""
    assert cpu_ops.library() is not None, f"the CPU operators failed to build: {cpu_ops.describe()}"
    return torch.ops.pipeline


def attention_case(num_slots: int = 32, rows: int = 2, num_keys: int = 8):
    query = torch.randn(rows, 1, 4, 16)
    cache = torch.randn(2, num_slots, 2, 16)
    slots = torch.arange(rows * num_keys).view(rows, num_keys) % num_slots
    mask = torch.ones(rows, 1, num_keys, dtype=torch.bool)
    return query, cache, slots, mask


@pytest.mark.parametrize("bad", [32, 1 << 40, -1], ids=["one-past", "huge", "negative"])
def test_a_slot_outside_the_cache_raises_naming_it(bad: int) -> None:
    query, cache, slots, mask = attention_case()
    slots[1, 5] = bad
    with pytest.raises(IndexError, match=rf"slot {bad} \(row 1, key 5\) is outside the cache's 32 slots"):
        cpu_ops.paged_attention(query, cache, slots, mask, 0.25)
    with pytest.raises(IndexError, match="outside the cache"):  # the operator itself checks, not the wrapper
        torch.ops.pipeline.paged_attention(query, cache, slots, mask, 0.25)


def test_a_masked_slot_is_never_read_so_it_may_be_anything() -> None:
    query, cache, slots, mask = attention_case()
    out = cpu_ops.paged_attention(query, cache, slots, mask, 0.25)
    slots[1, 5], mask[1, 0, 5] = 1 << 40, False  # padding past a row's context
    changed = cpu_ops.paged_attention(query, cache, slots, mask, 0.25)
    assert torch.equal(changed[0], out[0]) and not torch.equal(changed[1], out[1])


@pytest.mark.parametrize(("change", "message"), [
    (lambda q, c, s, m: (q, c, s.int(), m), "slots must be int64, not int32"),
    (lambda q, c, s, m: (q, c, s, m.float()), "mask must be bool, not float32"),
    (lambda q, c, s, m: (q.half(), c.half(), s, m), "query must be float32 or bfloat16, not float16"),
    (lambda q, c, s, m: (q, c.half(), s, m), "the cache must be float32 or bfloat16, not float16"),
    (lambda q, c, s, m: (q[0], c, s, m), r"query must be \[rows, queries, heads, head_dim\]"),
    (lambda q, c, s, m: (q, c[:, :, :1].expand(2, 32, 2, 16), s, m), "the cache must be contiguous"),
    (lambda q, c, s, m: (q, c, s[:1], m), r"slots \[1, 8\] and mask \[2, 1, 8\] must be"),
    (lambda q, c, s, m: (q, c, s, m[..., :4]), r"and mask \[2, 1, 4\] must be"),
    (lambda q, c, s, m: (q[..., :3, :], c, s, m), "3 query heads of size 16 over 2 KV heads"),
])
def test_paged_attention_names_what_is_wrong(change, message: str) -> None:
    args = change(*attention_case())
    with pytest.raises(ValueError, match=message):
        cpu_ops.paged_attention(*args, 0.25)


def test_a_tensor_on_another_device_is_refused() -> None:
    query, cache, slots, mask = attention_case()
    with pytest.raises(NotImplementedError, match="pipeline::paged_attention.*Meta"):
        cpu_ops.paged_attention(query.to("meta"), cache, slots, mask, 0.25)


@pytest.mark.parametrize("bad", [4, -1, 1 << 40])
def test_a_row_id_outside_the_weight_raises_naming_it(bad: int) -> None:
    blocks = torch.zeros(4, 2 * 34, dtype=torch.uint8)
    with pytest.raises(IndexError, match=rf"row ids must be in \[0, 4\), got {bad} at position 1"):
        quant.dequantize_rows(blocks, Q8_0, 64, ids=torch.tensor([0, bad, 2]))
    with pytest.raises(IndexError, match=r"rows 3 \+ 2 out of \[0, 4\)"):
        quant.dequantize_rows(blocks, Q8_0, 64, start=3, count=2)
    with pytest.raises(IndexError, match=r"rows -1 \+ 1"):
        torch.ops.pipeline.quant_dequantize_rows(blocks, Q8_0, 64, None, -1, 1)


def test_quant_blocks_and_activations_are_checked() -> None:
    blocks = torch.zeros(4, 2 * 34, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"blocks of type 8 for 64 columns must be contiguous CPU uint8 \[rows, 68\], "
                                         r"not int8 \[4, 68\]"):
        quant.matmul(torch.zeros(1, 64), blocks.view(torch.int8), Q8_0, 64)
    with pytest.raises(ValueError, match="a type these kernels do not decode"):
        quant.matmul(torch.zeros(1, 64), blocks, 99, 64)
    with pytest.raises(ValueError, match=r"not contiguous|must be contiguous"):
        quant.matmul(torch.zeros(1, 64), torch.zeros(68, 4, dtype=torch.uint8).t(), Q8_0, 64)
    with pytest.raises(ValueError, match=r"activations must be CPU float32 \[n, 64\], not float32 \[1, 32\]"):
        quant.matmul(torch.zeros(1, 32), blocks, Q8_0, 64)
    assert quant.block_bytes(Q8_0) == 34 and quant.block_bytes(99) == 0


def test_sampling_checks_its_rows() -> None:
    logits = torch.zeros(3, 10)
    with pytest.raises(ValueError, match="3 rows need as many temperatures and points, not 2 and 3"):
        cpu_ops.sample_logits(logits, torch.ones(2), torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="points must be float64, not float32"):
        cpu_ops.sample_logits(logits, torch.ones(3), torch.zeros(3))
    with pytest.raises(ValueError, match="at least one token"):
        cpu_ops.sample_logits(torch.zeros(3, 0), torch.ones(3), torch.zeros(3, dtype=torch.float64))


def test_elementwise_operators_check_shapes_and_dtypes() -> None:
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="weight must hold 32 values, not shape"):
        cpu_ops.rms_norm(x, torch.ones(31), 1e-6, False)
    with pytest.raises(ValueError, match=r"residual \[4, 31\] must be shaped like x \[4, 32\]"):
        cpu_ops.rms_norm(x, torch.ones(32), 1e-6, False, torch.zeros(4, 31))
    with pytest.raises(ValueError, match="weight must be float32 like x, not bfloat16"):
        cpu_ops.rms_norm(x, torch.ones(32, dtype=torch.bfloat16), 1e-6, False)
    with pytest.raises(ValueError, match=r"up \[4, 16\] must be shaped like gate \[4, 32\]"):
        cpu_ops.silu_and_mul(x, x[:, :16])
    with pytest.raises(ValueError, match=r"cos and sin must be \[4, 1, 16\]"):
        cpu_ops.rotary(x.view(4, 2, 16), torch.zeros(3, 1, 16), torch.zeros(4, 1, 16))
    with pytest.raises(ValueError, match="head_dim must be even"):
        cpu_ops.rotary(torch.zeros(4, 2, 15), torch.zeros(4, 1, 15), torch.zeros(4, 1, 15))


def test_the_process_goes_on_after_a_refused_call() -> None:
    query, cache, slots, mask = attention_case()
    bad = slots.clone()
    bad[0, 0] = 10 ** 9
    for _ in range(3):
        with pytest.raises(IndexError):
            cpu_ops.paged_attention(query, cache, bad, mask, 0.25)
    assert cpu_ops.paged_attention(query, cache, slots, mask, 0.25).isfinite().all()
