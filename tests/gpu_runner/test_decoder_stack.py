"""The decode step's layers in one CPU operator (layers/decoder_stack.py, cpu_ops/decoder.c): the same
tokens and the same log-probabilities, to the bit, as the layer-by-layer forward; taken only where it
applies; its arguments checked."""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable

import pytest
import torch

from real_models import gemma3_gguf, gemma3_prompts, smollm2_gguf, smollm2_prompts

from pipeline import LLM, SamplingParams
from stages.gpu_runner import cpu_ops
from stages.gpu_runner.attention.torch_metadata import AttentionMetadata, DecodeBatch, VerifyBatch
from stages.gpu_runner.cpu_ops import quant
from stages.gpu_runner.layers import decoder_stack
from stages.gpu_runner.layers.decoder_stack import DecoderStack
from stages.gpu_runner.layers.quantization import gguf

pytestmark = pytest.mark.timeout(180)

PROMPTS = [[1, 5, 9, 22, 7, 100, 200, 300], [4, 8, 15, 16, 23, 42], [300, 2, 77, 90, 91, 92, 93, 94, 95, 96, 97]]
needs_x8 = pytest.mark.skipif(not quant.x8_available(2), reason="8-bit activations need AVX-512 VNNI or AVX2")


@pytest.fixture(autouse=True, scope="module")
def built() -> None:
    """The kernels must build where a compiler exists (test_quant_kernels.py checks the same)."""
    if cpu_ops.library() is None:
        pytest.skip("the CPU kernels are not built: there is no operator to run the stack")


def engine(checkpoint, quantization: str, activations: str = "float32", kv: str = "auto", **options) -> LLM:
    return LLM(checkpoint, device="cpu", dtype="float32", quantization=quantization,
               quantized_activations=activations, kv_cache_dtype=kv, num_kv_blocks=64, max_model_len=128, **options)


def both_paths(make: Callable[[], LLM], monkeypatch, prompts=PROMPTS, max_tokens: int = 10) -> tuple[list, list, int]:
    """(outputs with the stack, outputs layer by layer, steps the stack ran): greedy, with logprobs,
    each pass on a fresh engine from `make` (so that neither starts from the other's prefix cache or
    suffix cache, which would change its batch shapes)."""
    calls = []
    run = DecoderStack.__call__
    monkeypatch.setattr(DecoderStack, "__call__", lambda self, *args: calls.append(1) or run(self, *args))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=3)
    outputs = {}
    for enabled in (True, False):
        llm = make()
        assert llm.runner.model.decoder_stack is not None
        if not enabled:  # the layers alone
            llm.runner.model.decoder_stack = None
        outputs[enabled] = [(out.token_ids, [sorted(step.items()) for step in out.logprobs])
                            for out in llm.generate(prompts, params)]
    return outputs[True], outputs[False], len(calls)


@pytest.mark.parametrize("quantization, activations, kv", [
    ("q8_0", "float32", "auto"), ("q4_0", "float32", "bfloat16"),
    pytest.param("q4_0", "int8", "auto", marks=needs_x8), pytest.param("q8_0", "int8", "bfloat16", marks=needs_x8)])
def test_the_stack_gives_the_layers_tokens_and_logprobs_to_the_bit(tiny_checkpoint, monkeypatch, quantization,
                                                                     activations, kv):
    fused, layered, calls = both_paths(lambda: engine(tiny_checkpoint("llama"), quantization, activations, kv),
                                       monkeypatch)
    assert fused == layered
    assert calls >= 9  # every decode step of the first pass (three rows, then fewer)


def test_a_sliding_window_reads_only_its_keys_in_the_stack_too(tiny_checkpoint, tmp_path, monkeypatch):
    """A window of 4 keys, crossed many times by the prompts and outputs: the windowed metadata is
    what the stack attends with (full attention would give other tokens)."""
    checkpoint = tmp_path / "mistral-window"
    shutil.copytree(tiny_checkpoint("mistral"), checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(config | {"sliding_window": 4}))
    assert engine(checkpoint, "q8_0").runner.model.decoder_stack.key_sets == [(0, 4)]
    fused, layered, calls = both_paths(lambda: engine(checkpoint, "q8_0"), monkeypatch, max_tokens=12)
    assert fused == layered and calls >= 11
    full, _, _ = both_paths(lambda: engine(tiny_checkpoint("mistral"), "q8_0"), monkeypatch, max_tokens=12)
    assert [tokens for tokens, _ in full] != [tokens for tokens, _ in fused]


@pytest.mark.parametrize("file_of, prompts_of, activations", [
    (smollm2_gguf, smollm2_prompts, "float32"), pytest.param(smollm2_gguf, smollm2_prompts, "int8", marks=needs_x8),
    (gemma3_gguf, gemma3_prompts, "float32"), pytest.param(gemma3_gguf, gemma3_prompts, "int8", marks=needs_x8)],
    ids=["smollm2-float32", "smollm2-int8", "gemma3-float32", "gemma3-int8"])
def test_the_real_files_decode_the_same_through_the_stack(monkeypatch, file_of, prompts_of, activations):
    """The default model's Q4_1 layers; Gemma 3's Q5_0, Q8_0, Q4_K and Q6_K ones (q, k and v held
    apart where v is of another type), its local and global layers and GeGLU; their real prompts
    decoding at once (one of 300 tokens, one past Gemma's window)."""
    def make() -> LLM:
        return LLM(str(file_of()), device="cpu", dtype="float32", quantized_activations=activations,
                   max_model_len=1024, num_kv_blocks=1024 // 16 * 4)

    fused, layered, calls = both_paths(make, monkeypatch, prompts=prompts_of(), max_tokens=4)
    assert fused == layered and calls >= 3


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_per_head_norms_sandwich_norms_and_geglu_go_through_the_stack_too(tiny_checkpoint, monkeypatch, arch):
    """Qwen3's per-head q/k norms; Gemma 3's four norms a layer, GeGLU, and local layers (their own
    window, rotary base and KV group) beside global ones, the prompts crossing the window."""
    fused, layered, calls = both_paths(lambda: engine(tiny_checkpoint(arch), "q8_0"), monkeypatch, max_tokens=12)
    assert fused == layered and calls >= 11


def test_the_stack_is_made_only_for_layers_it_runs(tiny_checkpoint):
    """Dense weights and q/k/v biases (Qwen2) keep the layer-by-layer forward; the log line of what
    the model runs in (and `pipeline status`) says which."""
    dense = engine(tiny_checkpoint("llama"), "none").runner
    assert dense.model.decoder_stack is None and "one CPU operator" not in dense.runs_in
    assert engine(tiny_checkpoint("llama"), "q8_0").runner.runs_in.endswith(
        "; decode steps: every layer in one CPU operator")
    assert engine(tiny_checkpoint("qwen2"), "q8_0").runner.model.decoder_stack is None


def test_many_rows_take_the_tiled_products_and_a_prefill_the_layers(tiny_checkpoint, monkeypatch):
    """Ten rows decoding at once: past the fused products' rows, the stack multiplies by the tiled
    kernel, as the layers do; prefill steps (and steps with more tokens than the tiled kernel
    takes) go through the layers. The same tokens either way."""
    stack = engine(tiny_checkpoint("llama"), "q8_0").runner.model.decoder_stack
    layout = stack.layout(10)
    assert set(layout[1:14:2]) == {0, gguf.TILED}  # (type, kernel) of 7 slots: k, v and up unused (merged)
    assert stack.layout(gguf.TILED_ROWS + 1) is None
    many = [[7 + i, 9, 11 + i] for i in range(10)]
    fused, layered, calls = both_paths(lambda: engine(tiny_checkpoint("llama"), "q8_0"), monkeypatch, prompts=many,
                                       max_tokens=3)
    assert fused == layered
    assert calls == 2  # the two decode steps; the prefill ran layer by layer


@pytest.mark.parametrize("method", [{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
                                    {"method": "suffix", "num_speculative_tokens": 3}], ids=["ngram", "suffix"])
def test_rows_verifying_drafts_go_through_the_stack_with_the_same_tokens(tiny_checkpoint, monkeypatch, method):
    """Verify steps (rows of the last token and its drafts, and decode rows beside them) run in the
    stack too, each token reading its own row's keys up to itself."""
    repeated = [11, 12, 13, 14, 15, 16, 17] * 4
    prompts = [repeated, [300 + i for i in range(13)], [7, 7, 8, 9, 7, 7, 8, 9, 7, 7]]
    seen = []
    keys = decoder_stack.attended_keys
    monkeypatch.setattr(decoder_stack, "attended_keys", lambda meta, n: seen.append(bool(meta.verify)) or keys(meta, n))
    fused, layered, calls = both_paths(lambda: engine(tiny_checkpoint("llama"), "q8_0", speculative_config=method),
                                       monkeypatch, prompts=prompts, max_tokens=24)
    assert fused == layered
    assert calls == len(seen) and sum(seen) >= 3  # steps with rows verifying went through the stack


def test_keys_of_a_mixed_step_are_each_tokens_rows():
    """A decode row and a row verifying two drafts, in token order: each token gets its row's slots and mask."""
    decode = DecodeBatch(token_idx=torch.tensor([3]), key_slots=torch.tensor([[5, 6]]),
                         mask=torch.tensor([True, True]).view(1, 1, 1, 2), rows=torch.tensor([1]),
                         context=torch.tensor([2]), max_context=2)
    verify = VerifyBatch(token_idx=torch.tensor([0, 1, 2]), key_slots=torch.tensor([[8, 9, 10, 11]]),
                         mask=torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool).view(1, 1, 3, 4),
                         rows=torch.tensor([0]), start=torch.tensor([1]), num_queries=3, max_context=4)
    meta = AttentionMetadata(slot_mapping=torch.tensor([9, 10, 11, 6]), decode=decode, prefills=[],
                             block_table=torch.zeros(2, 1, dtype=torch.int32), block_size=16, max_context=4,
                             verify=[verify])
    queries, slots, mask = decoder_stack.attended_keys(meta, 4)
    assert queries == 1
    assert slots.tolist() == [[8, 9, 10, 11]] * 3 + [[5, 6, 0, 0]]
    assert mask.view(4, 4).int().tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
    one_group = AttentionMetadata(slot_mapping=torch.tensor([9, 10, 11]), decode=None, prefills=[],
                                  block_table=torch.zeros(1, 1, dtype=torch.int32), block_size=16, max_context=4,
                                  verify=[verify])
    queries, slots, mask = decoder_stack.attended_keys(one_group, 3)
    assert queries == 3 and slots is verify.key_slots and mask is verify.mask


def stack_arguments(llm: LLM) -> dict:
    stack = llm.runner.model.decoder_stack
    caches = llm.runner._kv_storage
    head_dim = caches[0].shape[-1]
    hidden = stack.weights[0].numel()
    return dict(x=torch.zeros(1, hidden), weights=stack.weights, layout=stack.layout(1), caches=caches,
                cos=[torch.ones(1, 1, head_dim)], sin=[torch.zeros(1, 1, head_dim)],
                slot_mappings=[torch.tensor([3])], key_slots=[torch.tensor([[0, 1, 2, 3]])],
                masks=[torch.ones(1, 1, 4, dtype=torch.bool)], queries=[1], heads=stack.heads,
                kv_heads=stack.kv_heads, scale=0.1, eps=1e-6, unit_offset=False, gelu=False)


def test_the_operator_checks_its_arguments(tiny_checkpoint):
    llm = engine(tiny_checkpoint("llama"), "q8_0")
    args = stack_arguments(llm)
    run = cpu_ops.operators().decoder_layers
    assert run(**args).shape == args["x"].shape
    cache = llm.runner._kv_storage[1]
    num_slots = cache[0].numel() // (cache.shape[-1] * cache.shape[-2])
    with pytest.raises(IndexError, match=f"slot {num_slots} .key set 0. is outside layer 0's cache of {num_slots}"):
        run(**args | {"slot_mappings": [torch.tensor([num_slots])]})
    with pytest.raises(IndexError, match="key slot -1 .row 0, key 2. is negative"):
        run(**args | {"key_slots": [torch.tensor([[0, 1, -1, 3]])]})
    masked = torch.tensor([[[True, True, False, True]]])
    run(**args | {"key_slots": [torch.tensor([[0, 1, -1, 3]])], "masks": [masked]})  # a key no query sees is not read
    with pytest.raises(ValueError, match="x must be float32, not bfloat16"):
        run(**args | {"x": args["x"].bfloat16()})
    with pytest.raises(ValueError, match="layer 0's qkv must have"):
        run(**args | {"heads": args["heads"] * 2})
    with pytest.raises(ValueError, match="need 13 weights and 16 numbers a layer"):
        run(**args | {"weights": args["weights"][:-1]})
    with pytest.raises(ValueError, match="layer 0's input norm is missing"):
        run(**args | {"weights": [None] + args["weights"][1:]})
    with pytest.raises(ValueError, match="qkv's kernel must be 0 .fused., 1 .8-bit activations. or 2 .tiled., not 7"):
        run(**args | {"layout": [args["layout"][0], 7] + args["layout"][2:]})
    with pytest.raises(IndexError, match="layer 0's key set 1 and rotary table 0 must be below 1 and 1"):
        run(**args | {"layout": args["layout"][:14] + [1] + args["layout"][15:]})
    with pytest.raises(ValueError, match="1 tokens are not rows of 2 queries"):
        run(**args | {"queries": [2]})
    with pytest.raises(ValueError, match="cos and sin must be contiguous"):
        run(**args | {"cos": [torch.ones(2, 1, 7)]})
