"""The static decode path (bucketed persistent buffers, the inputs a CUDA graph replays) on the
CPU: the same tokens as the dynamic path, inputs read from the device token table."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from runner_plans import PlannedRequest, make_runner, run_requests
from stages.contracts.params import SamplingParams
from stages.contracts.plan import StepPlan
from stages.gpu_runner.inputs.static_decode import decode_buckets

pytestmark = pytest.mark.timeout(60)


def test_buckets_are_powers_of_two_to_16_then_steps_of_16_up_to_max_num_seqs():
    assert decode_buckets(1) == [1]
    assert decode_buckets(4) == [1, 2, 4]
    assert decode_buckets(16) == [1, 2, 4, 8, 16]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_a_step_takes_the_smallest_bucket_that_holds_it(tiny_checkpoint):
    runner = make_runner(tiny_checkpoint("llama"), num_kv_blocks=16, max_num_seqs=40, static_decode=True)
    assert [runner.static.bucket(n) for n in (1, 2, 3, 5, 9, 16, 17, 33, 40)] == [1, 2, 4, 8, 16, 16, 32, 40, 40]
    with pytest.raises(ValueError, match="41 rows does not fit a bucket of at most 40"):
        runner.static.bucket(41)


def mixed_requests() -> list[PlannedRequest]:
    """Requests that join and leave at different steps, share a prefix, and mix greedy rows with
    penalties, seeded sampling, min_tokens and logprobs."""
    greedy = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=9,
                               ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=5, presence_penalty=0.4, max_tokens=11,
                            ignore_eos=True, logprobs=2)
    min_tokens = SamplingParams(temperature=0.0, min_tokens=6, max_tokens=8, stop_token_ids=[7, 8, 9])
    prompt = list(range(30, 70))
    return [
        PlannedRequest(prompt, 14, params=greedy),
        PlannedRequest([5, 6, 7], 9, params=penalised),
        PlannedRequest(prompt[:32] + [900, 901, 902], 11, prefix_from=(0, 2), params=seeded),
        PlannedRequest(list(range(200, 221)), 8, params=min_tokens),
        PlannedRequest([3], 14, params=greedy),
        PlannedRequest(list(range(400, 405)), 6, params=penalised),
    ]


def count_static_steps(runner) -> list[int]:
    calls = []
    original = runner._execute_static_decode

    def counted(plan: StepPlan):
        calls.append(plan.num_rows)
        return original(plan)

    runner._execute_static_decode = counted
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_static_path_gives_the_dynamic_paths_tokens_over_many_async_steps(tiny_checkpoint, arch):
    model_dir = tiny_checkpoint(arch)
    dynamic = run_requests(make_runner(model_dir, num_kv_blocks=64, max_num_seqs=4, block_size=8, static_decode=False),
                           mixed_requests(), token_budget=24, async_mode=True)
    runner = make_runner(model_dir, num_kv_blocks=64, max_num_seqs=4, block_size=8, static_decode=True)
    static_steps = count_static_steps(runner)
    static = run_requests(runner, mixed_requests(), token_budget=24, async_mode=True)
    assert static == dynamic
    assert [len(t) for t in static] == [14, 9, 11, 8, 14, 6]
    # Decode steps of 1 to 4 rows ran on the static path, padded to buckets 1, 2 and 4.
    assert len(static_steps) > 10 and {1, 2, 3, 4} <= set(static_steps)


def test_padding_rows_touch_only_the_scratch_row_and_block(tiny_checkpoint):
    """A 3-row step runs in the 4-row bucket: the padding row writes the token table's scratch row
    and the KV scratch block, nothing a request owns."""
    runner = make_runner(tiny_checkpoint("llama"), num_kv_blocks=32, max_num_seqs=4, block_size=8, static_decode=True)
    requests = [PlannedRequest(list(range(10, 10 + n)), 5) for n in (3, 9, 12)]
    run_requests(runner, requests, token_budget=64)
    scratch = runner.batch.scratch_row
    assert runner.batch.padded_token_table[scratch, 1] != 0  # a padding row's sampled token went there
    scratch_block = runner._kv_storage[0][:, runner.num_kv_blocks]
    assert scratch_block.abs().sum() > 0
    used_blocks = sum(len(r.block_ids) for r in requests)
    assert runner.kv_caches[0][:, used_blocks:].abs().sum() == 0  # no padding KV in the pool


def test_decode_inputs_are_read_from_the_device_token_table(tiny_checkpoint):
    """The static step's input id is whatever the device token table holds at the row's last
    position: rewriting it there changes the next token exactly as on the dynamic path."""
    model_dir = tiny_checkpoint("mistral")

    def next_token(static_decode: bool, rewrite: int | None) -> int:
        runner = make_runner(model_dir, num_kv_blocks=16, max_num_seqs=2, static_decode=static_decode)
        maker_requests = [PlannedRequest(list(range(20, 28)), 2)]
        from runner_plans import PlanMaker

        maker = PlanMaker(runner, maker_requests, token_budget=64)
        runner.execute(maker.schedule())  # prefill; its sampled token lands at position 8
        if rewrite is not None:
            runner.token_table[0, 8] = rewrite
        return int(runner.execute(maker.schedule()).to_host().token_ids[0])

    assert next_token(True, None) == next_token(False, None)
    assert next_token(True, 77) == next_token(False, 77)
    assert next_token(True, 77) != next_token(True, None) or next_token(True, 300) != next_token(True, None)



def test_decode_graphs_need_a_cuda_device_to_capture():
    from stages.gpu_runner.inputs.decode_graphs import DecodeGraphs

    calls = []
    graphs = DecodeGraphs(lambda rows, context: calls.append((rows, context)) or (), [1, 2], torch.device("cpu"),
                          capture=False)
    graphs.run(2, 17)
    assert calls == [(2, 17)] and not graphs.captured  # eager: the forward runs at every step
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device, got cpu"):
        DecodeGraphs(lambda rows, context: (), [1], torch.device("cpu"), capture=True)


def test_auto_attention_backend_is_triton_on_cuda_and_torch_on_cpu(tiny_checkpoint):
    from stages.gpu_runner.attention.selector import resolve_attention_backend

    assert resolve_attention_backend("auto", torch.device("cuda"), 16) == "triton"
    assert resolve_attention_backend("auto", torch.device("cuda"), 64) == "triton"
    # blocks the Triton kernels cannot tile: auto falls back to torch (triton, asked for, refuses them)
    assert resolve_attention_backend("auto", torch.device("cuda"), 4) == "torch"
    assert resolve_attention_backend("auto", torch.device("cuda"), 24) == "torch"
    assert resolve_attention_backend("auto", torch.device("cpu"), 16) == "torch"
    assert resolve_attention_backend("triton", torch.device("cpu"), 16) == "triton"
    assert make_runner(tiny_checkpoint("llama"), num_kv_blocks=16).attention_backend.name == "torch"
    with pytest.raises(ValueError, match="needs a block_size that is a power of two >= 16, got 8"):
        make_runner(tiny_checkpoint("llama"), num_kv_blocks=16, block_size=8, attention_backend="triton")


def test_static_steps_extend_a_draft_models_kv_as_a_fresh_prefill_would(tiny_checkpoint):
    """Decode steps on the static path verify no drafts, yet the draft model must see their tokens:
    after many of them its KV of every computed position equals a fresh prefill of the same tokens."""
    target, draft = tiny_checkpoint("llama"), tiny_checkpoint("llama", num_layers=1, rope_scaling_llama3=False)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    runner = make_runner(target, num_kv_blocks=32, max_num_seqs=4, block_size=8, static_decode=True,
                         speculative_config=spec)
    static_steps = count_static_steps(runner)
    requests = [PlannedRequest(list(range(10, 10 + n)), m) for n, m in ((5, 12), (11, 9), (3, 14))]
    run_requests(runner, requests, token_budget=32, async_mode=True)
    assert len(static_steps) > 8  # the decode steps took the static path

    fresh = make_runner(draft, num_kv_blocks=32, max_num_seqs=4, block_size=8, static_decode=False)
    # Every token whose KV was computed: the prompt and each output but the last.
    replay = [PlannedRequest(r.prompt + r.outputs[:-1], 1) for r in requests]
    run_requests(fresh, replay, token_budget=64)
    for served, prefilled in zip(requests, replay):
        length = len(served.prompt) + len(served.outputs) - 1
        blocks = torch.tensor(served.block_ids)
        for observed, expected in zip(runner.speculator.draft.kv_caches, fresh.kv_caches):
            got = observed[:, blocks].flatten(1, 2)[:, :length]
            want = expected[:, torch.tensor(prefilled.block_ids)].flatten(1, 2)[:, :length]
            assert got.abs().sum(dim=(0, 2, 3)).min() > 0  # no hole: every position was written
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_speculative_engine_on_the_static_path_gives_the_plain_engines_tokens(tiny_checkpoint):
    """Decode steps between verifications take the static path, whose padding rows read their
    input id from the scratch row: what verification throws away there (the -1 of a rejected
    draft) must not be what they read (an embedding index out of range, a device assert on CUDA)."""
    from pipeline import LLM
    from stages.contracts.config import EngineConfig
    from stages.gpu_runner.runner import ModelRunner

    model_dir = tiny_checkpoint("llama")
    # Prompt lookup drafts for some steps only (a draft model drafts at every one: no static step).
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    prompts = [[11, 12, 13, 14] * 6, list(range(100, 140)), [5, 6, 5, 6, 5]]  # 3 rows: bucket 4 pads one
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=3, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.2, ignore_eos=True)]
    options = dict(num_kv_blocks=64, max_num_seqs=4, block_size=16, max_model_len=256)
    plain = LLM(model_dir, device="cpu", dtype="float32", **options).generate(prompts, params)  # as the runner
    runner = ModelRunner(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", speculative_config=spec,
                                      **options), static_decode=True)
    static_steps = count_static_steps(runner)
    llm = LLM(runner=runner, speculative_config=spec, **options)
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got][0::2] == [o.token_ids for o in plain][0::2]
    assert llm.scheduler.stats().speculative.num_draft_tokens > 0
    assert 3 in static_steps  # a padded bucket ran after verifications
