"""The simulated device of the benchmarks: each step's tokens are ready exactly T ms after the
step starts, steps run one after another, waiting for them burns no CPU, the tokens name their
step and are never EOS, and the timeline file records what happened."""
from __future__ import annotations

import time

import numpy as np
import pytest

from runner_plans import PlannedRequest, PlanMaker, run_requests
from stages.contracts.config import EngineConfig
from stages.contracts.params import SamplingParams
from stages.gpu_runner.build import build_runner
from stages.gpu_runner.simulated.device import SimulatedDeviceRunner
from stages.gpu_runner.simulated.steps import SimulatedTokens, read_timeline

pytestmark = pytest.mark.timeout(60)


def make_simulated(model_dir: object, device_ms: float, **options: object) -> SimulatedDeviceRunner:
    options.setdefault("device", "cpu")
    options.setdefault("max_model_len", 256)
    options.setdefault("num_kv_blocks", 256)
    runner = build_runner(EngineConfig(model=str(model_dir), simulated_device_ms=device_ms, **options))
    assert isinstance(runner, SimulatedDeviceRunner)
    return runner


def plans(runner: SimulatedDeviceRunner, num_requests: int, max_tokens: int) -> PlanMaker:
    requests = [PlannedRequest(prompt=[5 + i, 6, 7], max_tokens=max_tokens) for i in range(num_requests)]
    return PlanMaker(runner, requests, token_budget=256)


def test_back_to_back_steps_are_ready_exactly_t_apart_after_the_first_starts(tiny_checkpoint):
    runner = make_simulated(tiny_checkpoint("llama"), device_ms=40.0)
    maker = plans(runner, 2, 8)
    before_ns = time.monotonic_ns()
    outputs = [runner.execute(maker.schedule()) for _ in range(3)]  # launched well within 40 ms
    first_ready = outputs[0].ready_at_ns
    assert before_ns + 40_000_000 <= first_ready <= time.monotonic_ns() + 40_000_000
    assert [o.ready_at_ns - first_ready for o in outputs] == [0, 40_000_000, 80_000_000]


def test_a_step_launched_on_an_idle_device_starts_at_its_launch(tiny_checkpoint, tmp_path):
    trace = tmp_path / "timeline.npy"
    runner = make_simulated(tiny_checkpoint("llama"), device_ms=5.0, simulated_device_trace=str(trace))
    maker = plans(runner, 1, 8)
    first = runner.execute(maker.schedule())
    first.to_host()
    time.sleep(0.02)  # the device idles after step 0
    runner.execute(maker.schedule()).to_host()
    timeline = read_timeline(trace)
    assert timeline["step"].tolist() == [0, 1]
    assert timeline["start_ns"][1] == timeline["launch_ns"][1] >= timeline["ready_ns"][0] + 20_000_000
    assert (timeline["ready_ns"] - timeline["start_ns"]).tolist() == [5_000_000, 5_000_000]
    assert np.all(timeline["plan_ns"] <= timeline["launch_ns"]) and timeline["num_sampled"].tolist() == [1, 1]


def test_tokens_are_not_on_the_host_before_their_ready_time_and_waiting_burns_no_cpu(tiny_checkpoint):
    runner = make_simulated(tiny_checkpoint("llama"), device_ms=200.0)
    output = runner.execute(plans(runner, 4, 8).schedule())
    cpu_before_s = time.thread_time()
    host = output.to_host()
    assert time.monotonic_ns() >= output.ready_at_ns
    assert time.thread_time() - cpu_before_s < 0.05  # a sleep, not a spin, for about 0.2 s
    assert host.token_ids.tolist() == [runner.tokens.for_step(0)] * 4


def test_tokens_name_their_step_skip_eos_and_follow_the_plan_order(tiny_checkpoint):
    tokens = SimulatedTokens(vocab_size=8, eos_token_ids=[1, 4])
    assert tokens.ids.tolist() == [2, 3, 5, 6, 7] and tokens.period == 5
    assert [tokens.for_step(s) for s in range(7)] == [2, 3, 5, 6, 7, 2, 3]
    assert [tokens.step_residue(tokens.for_step(s)) for s in range(7)] == [0, 1, 2, 3, 4, 0, 1]
    with pytest.raises(ValueError, match="leaves no token"):
        SimulatedTokens(vocab_size=3, eos_token_ids=[2])

    for async_mode in (False, True):
        runner = make_simulated(tiny_checkpoint("llama"), device_ms=0.5)
        requests = [PlannedRequest(prompt=[9, 8, 7, 6, 5], max_tokens=6) for _ in range(3)]
        outputs = run_requests(runner, requests, token_budget=8, async_mode=async_mode)
        assert all(len(o) == 6 and not set(o) & set(runner.eos_token_ids) for o in outputs)
        for output in outputs:
            steps = [runner.tokens.step_residue(token) for token in output]
            assert steps == list(range(steps[0], steps[0] + 6))  # one token per step, in step order


def test_sampled_tokens_land_in_the_token_table_like_the_models(tiny_checkpoint):
    runner = make_simulated(tiny_checkpoint("llama"), device_ms=0.5)
    maker = plans(runner, 1, 4)
    for step in range(3):
        runner.execute(maker.schedule()).to_host()
    row = maker.requests[0].row
    assert runner.batch.token_table[row, :6].tolist() == [5, 6, 7] + [runner.tokens.for_step(s) for s in range(3)]


def test_config_refuses_a_bad_simulated_device(tmp_path):
    with pytest.raises(ValueError, match="simulated_device_ms must be a number of ms"):
        EngineConfig(simulated_device_ms=0)
    with pytest.raises(ValueError, match="simulated_device_trace must be a file path, given with simulated_device_ms"):
        EngineConfig(simulated_device_trace=str(tmp_path / "t.npy"))


def test_grammar_rows_take_allowed_tokens_and_their_masks_wait_for_the_previous_step(tiny_checkpoint, tmp_path):
    """A constrained row's tokens follow its grammar; free rows keep their step-named tokens."""
    import re

    from tokenizers import Tokenizer

    trace = tmp_path / "timeline.npy"
    runner = make_simulated(tiny_checkpoint("llama"), device_ms=2.0, simulated_device_trace=str(trace))
    regex = r"[a-z]{4}-[0-9]{3}"
    requests = [PlannedRequest([5, 6, 7], 9, params=SamplingParams(max_tokens=9, regex=regex)),
                PlannedRequest([8, 9], 9, params=SamplingParams(max_tokens=9, json_object=True)),
                PlannedRequest([10, 11], 9)]
    outputs = run_requests(runner, requests, token_budget=64, async_mode=True)
    tokenizer = Tokenizer.from_file(str(runner.tokenizer_path))
    eos = runner.eos_token_ids[0]
    regex_text = tokenizer.decode([t for t in outputs[0] if t != eos])
    assert re.fullmatch(regex, regex_text) and outputs[0][-1] == eos, regex_text  # then only EOS is allowed
    assert tokenizer.decode(outputs[1]).startswith("{")
    residues = [runner.tokens.step_residue(t) for t in outputs[2]]  # one step after another
    assert residues == list(range(residues[0], residues[0] + 9))


def test_pick_allowed_takes_only_allowed_tokens():
    from stages.gpu_runner.simulated.device import pick_allowed

    rng = np.random.default_rng(0)
    bitmask = np.zeros((50, 32), np.int32)
    for row in range(50):
        for token in rng.choice(1024, size=1 + row % 5, replace=False):
            bitmask[row, token // 32] |= np.int32(np.uint32(1 << (token % 32)).view(np.int32))
    for step in range(5):
        picked = pick_allowed(bitmask, step)
        words = bitmask[np.arange(50), picked // 32].astype(np.int64) & 0xFFFFFFFF
        assert np.all((words >> (picked % 32)) & 1)
