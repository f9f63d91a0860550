"""The stage processes through StageBackend: same tokens as the one-process LLM, aborts, stop strings,
rejected prompts, clean shutdown, and a dead stage reported as StageFailed."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from backend_helpers import SMALL, MakeBackend, assert_cleaned_up, collect, generate, wait_for
from device_choice import engine_device
from stage_procs import run_backend_then_hang

from pipeline import LLM
from pipeline.engine.multiprocess import StageBackend
from stages.contracts.config import EngineConfig
from pipeline.errors import ErrorCode, StageFailed
from stages.contracts.params import SamplingParams
from shm.naming import list_entries, new_instance_id, pid_alive, unlink_instance


def mixed_requests() -> tuple[list, list[SamplingParams]]:
    """16 requests: text and id prompts, a shared prefix, different lengths and max_tokens."""
    rng = np.random.default_rng(5)
    shared = rng.integers(3, 1000, 9).tolist()
    prompts: list = []
    params: list[SamplingParams] = []
    for i in range(16):
        if i % 4 == 0:
            prompts.append(["the quick brown fox", "shared memory ring", "a token mailbox", "decode step"][i // 4])
        elif i % 4 == 1:
            prompts.append(shared + rng.integers(3, 1000, i).tolist())
        else:
            prompts.append(rng.integers(3, 1000, 2 + 3 * i).tolist())
        params.append(SamplingParams(max_tokens=4 + (i * 5) % 17, temperature=0, ignore_eos=i % 3 == 0))
    return prompts, params


def llm_reference(model: Path, prompts: list, params: list[SamplingParams], **options: object) -> list:
    llm = LLM(model=model, **{"device": engine_device(), **SMALL, **options})
    return llm.generate(prompts, params)


@pytest.fixture(scope="module")
def greedy_reference(stage_model: Path) -> list:
    prompts, params = mixed_requests()
    return llm_reference(stage_model, prompts, params)


@pytest.mark.timeout(60)
def test_greedy_async_matches_llm(shared_backend: StageBackend, greedy_reference: list) -> None:
    prompts, params = mixed_requests()
    results = generate(shared_backend, 1000, prompts, params)
    for result, expected in zip(results, greedy_reference):
        assert result.token_ids == expected.token_ids
        assert result.text == expected.text
        assert result.finish_reason == expected.finish_reason
        assert result.prompt_token_ids == expected.prompt_token_ids


@pytest.mark.timeout(60)
def test_greedy_sync_matches_llm_and_close_cleans_up(make_backend: MakeBackend, greedy_reference: list) -> None:
    backend = make_backend(async_scheduling=False, num_tokenizers=2)
    prompts, params = mixed_requests()
    results = generate(backend, 0, prompts, params)
    assert [r.token_ids for r in results] == [e.token_ids for e in greedy_reference]
    assert [r.text for r in results] == [e.text for e in greedy_reference]
    # close() mid-generation: every stage stops when asked, nothing is left behind.
    backend.submit(100, "the quick brown fox", SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    backend.read_events(1.0)
    start = time.monotonic()
    backend.close()
    assert time.monotonic() - start < 5.0
    assert [process.exitcode for _, process in backend.processes.procs] == [0] * 5
    assert_cleaned_up(backend)


@pytest.mark.timeout(60)
def test_seeded_sampling_repeats_and_matches_llm(shared_backend: StageBackend, stage_model: Path) -> None:
    prompts = ["the quick brown fox", [5, 6, 7, 8, 9], "a token mailbox ring"]
    params = [SamplingParams(max_tokens=10, temperature=1.0, top_k=50, seed=100 + i, ignore_eos=True, logprobs=2)
              for i in range(3)]
    first = generate(shared_backend, 2000, prompts, params)
    again = generate(shared_backend, 2100, prompts, params)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    expected = llm_reference(stage_model, prompts, params)
    assert [r.token_ids for r in first] == [e.token_ids for e in expected]
    for result, reference in zip(first, expected):
        logprobs = np.concatenate(result.logprobs)
        assert logprobs.shape == (10, 3)
        assert np.allclose(logprobs[:, 0], [lp[t] for lp, t in zip(reference.logprobs, reference.token_ids)],
                           atol=1e-5)


@pytest.mark.timeout(60)
def test_stop_strings_end_the_text_like_llm(shared_backend: StageBackend, stage_model: Path) -> None:
    probe = generate(shared_backend, 3000, ["the quick brown fox"],
                     [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)])[0]
    stop = probe.text[len(probe.text) // 2:][:3]
    assert stop.strip(), f"no usable stop string in {probe.text!r}"
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    result = generate(shared_backend, 3001, ["the quick brown fox"], [params])[0]
    expected = llm_reference(stage_model, ["the quick brown fox"], [params])[0]
    assert result.finish_reason == "stop" == expected.finish_reason
    assert result.text == expected.text == probe.text[:probe.text.index(stop)]
    assert len(result.token_ids) < 24


@pytest.mark.timeout(60)
def test_a_request_resumed_with_its_delivered_outputs_goes_on_as_before(shared_backend: StageBackend) -> None:
    """What the daemon sends after a stage restart: prompt ids and the outputs already delivered
    pass the tokenizer untouched, and the rest comes exactly as the uninterrupted run's."""
    probe = generate(shared_backend, 3500, ["a token mailbox"], [SamplingParams(max_tokens=30, temperature=0,
                                                                                ignore_eos=True)])[0]
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.9, top_k=40, seed=8, frequency_penalty=0.7, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[probe.text[-10:][:3]])]
    whole = generate(shared_backend, 3510, ["a token mailbox"] * 3, params)
    delivered = 9
    for offset, (request_params, result) in enumerate(zip(params, whole)):
        shared_backend.submit(3520 + offset, result.prompt_token_ids, request_params, result.token_ids[:delivered])
    resumed = collect(shared_backend, [3520, 3521, 3522])
    for offset, result in enumerate(whole):
        again = resumed[3520 + offset]
        assert again.token_ids == result.token_ids[delivered:]
        assert again.finish_reason == result.finish_reason and again.prompt_token_ids == result.prompt_token_ids
        assert result.text.endswith(again.text) and len(again.text) < len(result.text)
    assert whole[2].finish_reason == "stop" and len(whole[2].token_ids) < 30


@pytest.mark.timeout(60)
def test_abort_mid_generation_frees_the_request(shared_backend: StageBackend) -> None:
    long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    shared_backend.submit(4000, "a token mailbox", long)
    shared_backend.submit(4001, [7, 8, 9, 10], long)
    num_tokens = {4000: 0, 4001: 0}
    deadline = time.monotonic() + 20
    while not all(num_tokens.values()):
        assert time.monotonic() < deadline
        for event in shared_backend.read_events(0.5):
            assert event.finish_reason is None
            num_tokens[event.req_id] += len(event.token_ids)
    shared_backend.abort(4000)
    shared_backend.abort(4001)
    results = collect(shared_backend, [4000, 4001])
    for req_id, result in results.items():
        assert result.finish_reason == "abort"
        assert num_tokens[req_id] + len(result.token_ids) < 100
    total = SMALL["num_kv_blocks"]
    wait_for(lambda: (s := shared_backend.stats().scheduler).num_holding_rows == 0 and s.num_waiting == 0
             and s.kv_blocks_free == total, what="no running request and every KV block free")


@pytest.mark.timeout(60)
def test_abort_right_after_submit_ends_the_request(shared_backend: StageBackend) -> None:
    """The abort may overtake its request (separate rings): it is applied when the request arrives."""
    long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    ids = list(range(7000, 7008))
    for req_id in ids:
        shared_backend.submit(req_id, [3 + req_id % 50, 4, 5], long)
        shared_backend.abort(req_id)
    results = collect(shared_backend, ids)
    assert all(r.finish_reason == "abort" and len(r.token_ids) < 100 for r in results.values())
    wait_for(lambda: shared_backend.stats().scheduler.num_holding_rows == 0, what="no running request")


@pytest.mark.timeout(60)
def test_rejected_prompts_get_an_error_event(shared_backend: StageBackend) -> None:
    params = SamplingParams(max_tokens=4, temperature=0)
    shared_backend.submit(5000, [], params)
    shared_backend.submit(5001, [1, 2, 5000], params)
    shared_backend.submit(5002, list(range(3, 3 + SMALL["max_model_len"])), params)
    shared_backend.submit(5003, [4, 5, 6], params)  # a good one among them still runs
    results = collect(shared_backend, [5000, 5001, 5002, 5003])
    empty, bad_id, too_long, good = (results[i] for i in (5000, 5001, 5002, 5003))
    assert empty.error.error_code == ErrorCode.INVALID_PARAMS.value and "empty" in empty.error.error_message
    assert bad_id.error.error_code == ErrorCode.INVALID_PARAMS.value
    assert "outside the vocabulary" in bad_id.error.error_message and "5000" in bad_id.error.error_message
    assert too_long.error.error_code == ErrorCode.PROMPT_TOO_LONG.value
    assert "max_model_len 128" in too_long.error.error_message
    assert all(r.token_ids == [] and r.finish_reason is None for r in (empty, bad_id, too_long))
    assert good.error is None and len(good.token_ids) >= 1


@pytest.mark.timeout(30)
def test_abort_of_unknown_request_and_duplicate_ids_are_harmless(shared_backend: StageBackend) -> None:
    shared_backend.abort(999_999)
    shared_backend.submit(5999, [3, 4, 5], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    with pytest.raises(ValueError, match="req_id 5999 is already running"):
        shared_backend.submit(5999, [3, 4, 5], SamplingParams(max_tokens=3))
    assert len(collect(shared_backend, [5999])[5999].token_ids) == 50
    result = generate(shared_backend, 6000, [[3, 4, 5]], [SamplingParams(max_tokens=3, temperature=0)])[0]
    shared_backend.abort(6000)
    assert len(result.token_ids) == 3 and result.finish_reason == "length"
    assert {h.name for h in shared_backend.health() if h.alive} == {"runner", "scheduler", "detokenizer", "tokenizer0"}
    assert all(h.heartbeat_age_s < 2.0 for h in shared_backend.health())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("victim", ["runner", "detokenizer"])
def test_killed_stage_raises_stage_failed_naming_it(make_backend: MakeBackend, victim: str) -> None:
    backend = make_backend()
    backend.submit(1, "the quick brown fox", SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    pid = next(h.pid for h in backend.health() if h.name == victim)
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(StageFailed, match=f"stage '{victim}' was killed by signal 9"):
        while time.monotonic() - start < 5:
            backend.read_events(0.2)
    assert time.monotonic() - start < 2.0
    backend.close(timeout_s=2.0)
    assert_cleaned_up(backend)


@pytest.mark.timeout(60)
def test_model_load_error_surfaces_with_its_message(tmp_path: Path, stage_model: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_bytes((stage_model / "tokenizer.json").read_bytes())
    (broken / "config.json").write_text("{}")
    instance = new_instance_id()
    with pytest.raises(StageFailed, match=r"stage 'runner' exited with code 1 while starting: runner: .*config"):
        StageBackend(EngineConfig(model=str(broken), device="cpu"), instance)
    assert not [e for e in list_entries() if instance in e]


def test_config_errors_name_the_bad_value(stage_model: Path) -> None:
    with pytest.raises(ValueError, match="num_tokenizers must be a positive integer, got 0"):
        StageBackend(EngineConfig(model=str(stage_model), num_tokenizers=0), new_instance_id())
    with pytest.raises(ValueError, match="mailbox_slots must be at least 3"):
        StageBackend(EngineConfig(model=str(stage_model), mailbox_slots=2), new_instance_id())


@pytest.mark.timeout(60)
def test_stages_exit_when_the_daemon_dies(stage_model: Path) -> None:
    ctx = mp.get_context("spawn")
    pids = ctx.Array("q", 4)
    instance = ctx.Array("c", 64)
    daemon = ctx.Process(target=run_backend_then_hang, args=(str(stage_model), pids, instance))
    daemon.start()
    try:
        deadline = time.monotonic() + 40
        while not all(pids[:]) or not instance.value:
            assert time.monotonic() < deadline and daemon.is_alive(), "the stand-in daemon did not start its stages"
            time.sleep(0.05)
        names = [e for e in list_entries() if instance.value.decode() in e]
        assert names  # the status board and the mailbox, kept for restarted stages
        daemon.kill()
        daemon.join(5)
        start = time.monotonic()
        while any(pid_alive(pid) for pid in pids[:]):
            assert time.monotonic() - start < 2.0, "a stage outlived the daemon by 2 s"
            time.sleep(0.02)
        # The stages removed them on their way out: no one is left to, and no start may come.
        assert not [e for e in list_entries() if instance.value.decode() in e]
    finally:
        for pid in pids[:]:
            if pid and pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        if daemon.exitcode is None:
            daemon.kill()
        daemon.join(5)
        if instance.value:
            unlink_instance(instance.value.decode())


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.timeout(120)
def test_greedy_on_cuda_matches_llm(make_backend: MakeBackend, stage_model: Path) -> None:
    """The device mailbox path: slots in one device allocation, IPC events, consumers in other processes."""
    prompts, params = mixed_requests()
    for param in params:
        param.logprobs = 1
    expected = llm_reference(stage_model, prompts, params, device="cuda")
    backend = make_backend(device="cuda")
    results = generate(backend, 0, prompts, params)
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    assert [r.text for r in results] == [e.text for e in expected]
    for result in results:
        assert np.concatenate(result.logprobs).shape == (len(result.token_ids), 2)


def test_every_stage_process_carries_its_title(shared_backend: StageBackend) -> None:
    for stage in shared_backend.health():
        with open(f"/proc/{stage.pid}/cmdline", "rb") as cmdline:
            title = cmdline.read().split(b"\0")[0].decode()
        with open(f"/proc/{stage.pid}/comm") as comm:
            name = comm.read().strip()
        assert title == f"pipeline: {stage.name}"
        assert name == f"pipeline: {stage.name}"[:15]  # what top and ps -o comm show


def test_a_cpu_runner_lets_its_threads_spin_briefly(shared_backend: StageBackend) -> None:
    """The runner's OpenMP threads sleep soon after a parallel region (RUNNER_SPIN_ENV) unless the
    user set the variable: a spinning thread takes the CPU its preempted peer is waiting for. Read
    from the server the runner was forked from (the runner's title overwrites its own copy)."""
    from pipeline.engine.supervision import RUNNER_SPIN_ENV

    if engine_device() != "cpu":
        pytest.skip("the spin count is set for runners on the CPU only (--device cuda)")
    runner = next(stage for stage in shared_backend.health() if stage.name == "runner")
    with open(f"/proc/{runner.pid}/stat", "rb") as stat:
        server = int(stat.read().rsplit(b")", 1)[1].split()[1])
    with open(f"/proc/{server}/environ", "rb") as environ:
        variables = dict(entry.split(b"=", 1) for entry in environ.read().split(b"\0") if b"=" in entry)
    for key, value in RUNNER_SPIN_ENV.items():
        assert variables[key.encode()] == os.environ.get(key, value).encode()
