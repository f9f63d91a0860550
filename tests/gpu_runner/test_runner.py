"""The runner's API: sizes it exposes, tokens in its table, the KV connector hook, sampling
options passed through, refusal of bad plans, and no device reads inside execute."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from stages.contracts.params import SamplingParams
from runner_plans import PlannedRequest, make_runner, run_requests
from stages.contracts.plan import NewRequest, StepPlan
from stages.gpu_runner.attention.kv_cache import kv_block_bytes

pytestmark = pytest.mark.timeout(30)


def one_request_plan(prompt: list[int], *, row: int = 0, blocks=(0,), sample: bool = True,
                     params: SamplingParams | None = None, meta: object = None) -> StepPlan:
    return StepPlan(
        step=0,
        new_requests=[NewRequest(req_id=0, row=row, token_ids=np.asarray(prompt, np.int32),
                                 num_prompt_tokens=len(prompt), params=params or SamplingParams(temperature=0.0))],
        rows=np.asarray([row], np.int32), num_computed_tokens=np.zeros(1, np.int32),
        num_scheduled_tokens=np.asarray([len(prompt)], np.int32), sample=np.asarray([sample]),
        num_new_blocks=np.asarray([len(blocks)], np.int32), new_block_ids=np.asarray(blocks, np.int32),
        connector_meta=meta)


def test_sizes_and_cache_layout(tiny_checkpoint):
    model_dir = tiny_checkpoint("llama")
    runner = make_runner(model_dir, block_size=8, kv_cache_memory_bytes=1 << 20, max_model_len=512, max_num_seqs=8)
    block_bytes = kv_block_bytes(runner.config, 8, torch.float32)
    assert runner.num_kv_blocks == (1 << 20) // block_bytes
    assert len(runner.kv_caches) == runner.config.num_layers == 2
    assert runner.kv_caches[0].shape == (2, runner.num_kv_blocks, 8, 2, 32)  # [k/v, block, offset, kv head, head_dim]
    assert runner.token_table.shape == (8, 512) and runner.token_table.dtype == torch.int32
    assert runner.max_model_len == 512 and runner.vocab_size == 1024


def test_sampled_tokens_are_written_to_the_token_table_and_kv_to_the_rows_blocks(tiny_checkpoint):
    runner = make_runner(tiny_checkpoint("qwen3"), num_kv_blocks=16, block_size=4)
    prompt = [5, 6, 7, 8, 9, 10]
    out = runner.execute(one_request_plan(prompt, row=3, blocks=(9, 2))).to_host()
    assert out.rows.tolist() == [3] and out.logprobs is None
    assert runner.token_table[3, :7].tolist() == prompt + out.token_ids.tolist()
    keys = runner.kv_caches[0][0]
    assert keys[9].abs().sum() > 0 and keys[2, :2].abs().sum() > 0  # positions 0-3, then 4-5
    assert keys[2, 2:].abs().sum() == 0 and keys[0].abs().sum() == 0  # nothing written elsewhere


def test_a_partial_prefill_chunk_samples_nothing(tiny_checkpoint):
    runner = make_runner(tiny_checkpoint("qwen2"), num_kv_blocks=16)
    out = runner.execute(one_request_plan([5, 6, 7], sample=False)).to_host()
    assert out.rows.size == 0 and out.token_ids.size == 0


def test_logprobs_come_back_with_the_tokens(tiny_checkpoint):
    runner = make_runner(tiny_checkpoint("mistral"), num_kv_blocks=16)
    out = runner.execute(one_request_plan([5, 6, 7], params=SamplingParams(temperature=0.0, logprobs=2))).to_host()
    assert out.logprobs.shape == (1, 3) and out.logprob_token_ids.shape == (1, 3)
    assert out.logprob_token_ids[0, 0] == out.token_ids[0] == out.logprob_token_ids[0, 1]  # greedy = top 1
    assert np.all(out.logprobs <= 0) and out.logprobs[0, 1] >= out.logprobs[0, 2]


@pytest.mark.parametrize("budget", [7, 300])
def test_seeded_sampling_ignores_chunking_and_async_mode(tiny_checkpoint, budget):
    def tokens(token_budget: int, async_mode: bool) -> list[list[int]]:
        runner = make_runner(tiny_checkpoint("llama"), num_kv_blocks=64, max_num_seqs=4)
        requests = [PlannedRequest(list(range(10, 10 + n)), 10,
                                   params=SamplingParams(temperature=1.0, seed=seed, max_tokens=10, ignore_eos=True))
                    for n, seed in ((40, 1), (3, 2), (70, 3))]
        return run_requests(runner, requests, token_budget=token_budget, async_mode=async_mode)

    reference = tokens(64, async_mode=False)
    assert tokens(budget, async_mode=True) == reference
    assert reference[0] != reference[2][: len(reference[0])]


class RecordingConnector:
    """Records hook calls and what the cache held at each: load must precede the step's KV
    writes and save must follow them."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object, float]] = []
        self.kv_caches: list[torch.Tensor] | None = None

    def bind(self, kv_caches: list[torch.Tensor], block_size: int) -> None:
        self.kv_caches = kv_caches
        self.calls.append(("bind", block_size, 0.0))

    def load(self, meta: object) -> None:
        self.calls.append(("load", meta, float(self.kv_caches[0].abs().sum())))

    def save(self, meta: object) -> None:
        self.calls.append(("save", meta, float(self.kv_caches[0].abs().sum())))


def test_kv_connector_is_bound_once_then_loads_before_and_saves_after_the_forward(tiny_checkpoint):
    connector = RecordingConnector()
    runner = make_runner(tiny_checkpoint("qwen3"), num_kv_blocks=16, block_size=4, kv_connector=connector)
    assert connector.calls == [("bind", 4, 0.0)] and connector.kv_caches is runner.kv_caches
    runner.execute(one_request_plan([5, 6, 7], meta="step-0"))
    (name1, meta1, before), (name2, meta2, after) = connector.calls[1:]
    assert (name1, meta1, before) == ("load", "step-0", 0.0)
    assert (name2, meta2) == ("save", "step-0") and after > 0
    runner.execute(StepPlan(step=1, new_requests=[], rows=np.zeros(0, np.int32),
                            num_computed_tokens=np.zeros(0, np.int32), num_scheduled_tokens=np.zeros(0, np.int32),
                            sample=np.zeros(0, bool), num_new_blocks=np.zeros(0, np.int32),
                            new_block_ids=np.zeros(0, np.int32), freed_rows=np.asarray([0], np.int32)))
    assert len(connector.calls) == 3  # no meta, no calls


def test_bad_plans_are_refused_naming_the_problem(tiny_checkpoint):
    runner = make_runner(tiny_checkpoint("qwen2"), num_kv_blocks=16, block_size=4, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="schedules 40 tokens, more than max_num_batched_tokens 32"):
        runner.execute(one_request_plan(list(range(2, 42)), blocks=tuple(range(10))))
    with pytest.raises(ValueError, match="row 1 schedules tokens beyond its 1 allocated blocks"):
        runner.execute(one_request_plan(list(range(2, 12)), row=1, blocks=(0,)))
    plan = one_request_plan([5], row=2)
    plan.new_requests = []
    with pytest.raises(ValueError, match=r"samples rows \[2\] that hold no request"):
        runner.execute(plan)


@pytest.mark.parametrize("static_decode", [False, True])
def test_execute_never_reads_a_device_tensor(tiny_checkpoint, monkeypatch, static_decode):
    """On CPU nothing would stall, so catch the calls that would sync on an accelerator; on both
    the dynamic path and the static decode path (greedy steps sample inside its forward)."""
    runner = make_runner(tiny_checkpoint("qwen3"), num_kv_blocks=64, max_num_seqs=4, static_decode=static_decode)
    outputs = []
    original_execute = runner.execute
    static_steps = []  # per static step: whether it called the sampler after the forward
    if static_decode:
        original_static, original_sampler = runner._execute_static_decode, runner.sampler
        sampler_calls = []
        runner.sampler = lambda logits, meta, constrain=None: (sampler_calls.append(1)
                                                                or original_sampler(logits, meta, constrain))

        def counted_static(plan):
            before = len(sampler_calls)
            output = original_static(plan)
            static_steps.append(len(sampler_calls) > before)
            return output

        runner._execute_static_decode = counted_static

    def guarded_execute(plan):
        def forbidden(*args, **kwargs):
            raise AssertionError("execute read a tensor's value on the host")

        with monkeypatch.context() as m:
            for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
                m.setattr(torch.Tensor, name, forbidden)
            output = original_execute(plan)
        outputs.append(output)
        return output

    runner.execute = guarded_execute
    requests = [PlannedRequest(list(range(2, 2 + n)), k,
                               params=SamplingParams(temperature=t, top_p=0.9, top_k=20, seed=3, max_tokens=k,
                                                     repetition_penalty=1.2 if t else 1.0, logprobs=2 if t else None,
                                                     ignore_eos=True))
                for n, t, k in ((45, 0.0, 10), (20, 0.8, 6), (1, 1.0, 6))]
    got = run_requests(runner, requests, token_budget=16, async_mode=True)
    assert [len(t) for t in got] == [10, 6, 6] and len(outputs) > 6
    if static_decode:  # steps sampled after the forward, and the greedy row alone sampled inside it
        assert True in static_steps and False in static_steps
    else:
        assert not static_steps


def test_input_batch_benchmark_prints_one_json_object():
    import json
    import subprocess
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parents[2] / "tools" / "micro" / "bench_input_batch.py"
    done = subprocess.run([sys.executable, str(tool), "--json", "--quick"], capture_output=True, text=True,
                          timeout=60, check=True)
    result = json.loads(done.stdout)
    assert result["ours_ms"] > 0 and result["full_row_ms"] > 0 and result["prefix_ms"] > 0
    assert result["speedup"] == pytest.approx(result["full_row_ms"] / result["ours_ms"], rel=0.05)


def test_offload_connector_restores_a_prefix_into_other_blocks(tiny_checkpoint):
    """Blocks saved to host after one request are loaded into fresh blocks for a second request
    that starts past that prefix: its tokens equal a run that computes everything."""
    from stages.gpu_runner.attention.kv_offload import OffloadConnectorWorker
    from stages.contracts.plan import KVCopyMeta

    model_dir = tiny_checkpoint("qwen2")
    prompt = list(range(40, 88)) + [7, 9, 11, 13, 15]  # 3 full blocks of 16, then 5 tokens
    i32 = lambda values: np.asarray(values, np.int32)  # noqa: E731
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def plan(step, new, rows, computed, scheduled, blocks, freed=(), meta=None) -> StepPlan:
        return StepPlan(step=step, new_requests=new, rows=i32(rows), num_computed_tokens=i32(computed),
                        num_scheduled_tokens=i32(scheduled), sample=np.ones(len(rows), bool),
                        num_new_blocks=i32([len(b) for b in blocks]),
                        new_block_ids=i32([x for b in blocks for x in b]), freed_rows=i32(freed), connector_meta=meta)

    def decode_rest(runner, first_token, row, position, step) -> list[int]:
        tokens = [first_token]
        for i in range(3):
            tokens.append(int(runner.execute(plan(step + i, [], [row], [position + i], [1], [[]])).to_host().token_ids[0]))
        return tokens

    full = make_runner(model_dir, num_kv_blocks=16)
    req = NewRequest(req_id=0, row=0, token_ids=i32(prompt), num_prompt_tokens=len(prompt), params=greedy)
    first = int(full.execute(plan(0, [req], [0], [0], [len(prompt)], [[0, 1, 2, 3]])).to_host().token_ids[0])
    expected = decode_rest(full, first, 0, len(prompt), 1)

    connector = OffloadConnectorWorker(num_host_blocks=4)
    runner = make_runner(model_dir, num_kv_blocks=16, kv_connector=connector)
    save = KVCopyMeta(load_host_slots=i32([]), load_block_ids=i32([]), save_block_ids=i32([0, 1, 2]),
                      save_host_slots=i32([2, 0, 1]))
    owner = NewRequest(req_id=0, row=0, token_ids=i32(prompt[:48]), num_prompt_tokens=48, params=greedy)
    runner.execute(plan(0, [owner], [0], [0], [48], [[0, 1, 2]], meta=save)).to_host()
    load = KVCopyMeta(load_host_slots=i32([2, 0, 1]), load_block_ids=i32([9, 10, 11]), save_block_ids=i32([]),
                      save_host_slots=i32([]))
    req = NewRequest(req_id=1, row=1, token_ids=i32(prompt), num_prompt_tokens=len(prompt), params=greedy)
    out = runner.execute(plan(1, [req], [1], [48], [len(prompt) - 48], [[9, 10, 11, 12]], freed=[0], meta=load))
    assert decode_rest(runner, int(out.to_host().token_ids[0]), 1, len(prompt), 2) == expected
