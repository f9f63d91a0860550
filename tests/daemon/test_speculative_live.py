"""Speculative decoding in a live daemon: its streams equal the offline engine's without speculation,
also when the runner is killed mid-speculation and every request resumes after the restart."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from device_choice import engine_device, engine_dtype
from live_daemon import REAL_BACKEND, short_dir, start_daemon, wait_for_health

from pipeline import LLM, SamplingParams
from pipeline.client import AsyncClient, Client, Completion
from pipeline.models.tiny_model import make_tiny_model

PROMPTS = [f"{i}: one two three, one two three, one two three, one two" for i in range(6)]
TOKENS = 160


@pytest.mark.skipif(not REAL_BACKEND, reason="the runner is killed in real stage processes")
@pytest.mark.timeout(180)
def test_speculating_streams_equal_the_offline_engine_across_a_runner_kill(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    model = make_tiny_model(tmp_path_factory.mktemp("spec-live-llama"), "llama", seed=3)
    params = [SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True) for _ in PROMPTS]
    params[-1] = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, speculative=False)
    llm = LLM(model, device=engine_device(), dtype=engine_dtype(engine_device()),
              max_model_len=2048, num_kv_blocks=512, block_size=16)
    expected = llm.generate(PROMPTS, params)
    # The draft is the target itself: every draft is accepted whatever the batch's timing, so the
    # streams are mid-speculation when the runner dies and the acceptance check cannot depend on when
    # a row's back-off ends (an n-gram row's drafts on this random model sometimes never pay).
    oracle = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}
    directory = short_dir()
    daemon = start_daemon(model, directory, ["--speculative-config", json.dumps(oracle), "--stall-seconds", "1"])
    try:
        socket_path = daemon.socket_path
        with Client(socket_path) as client:  # unbroken first
            assert client.generate(PROMPTS[0], params[0]).token_ids == expected[0].token_ids
        results = asyncio.run(_kill_runner_mid_stream(socket_path, params))
        for index, (got, want) in enumerate(zip(results, expected)):
            assert isinstance(got, Completion), f"request {index}: {got!r}"
            assert (got.token_ids, got.text) == (want.token_ids, want.text), f"request {index}"
        health = wait_for_health(socket_path, lambda h: h.status == "ok", 30)
        assert health.num_restarts == 1
        with Client(socket_path) as client:  # drafting was on after the restart too
            stats = client.stats()
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
        assert stats.speculative.draft_acceptance_rate == 1.0, stats.speculative
    finally:
        daemon.stop()
        shutil.rmtree(directory.parent, ignore_errors=True)


async def _kill_runner_mid_stream(socket_path: Path, params: list[SamplingParams]) -> list:
    client = AsyncClient(socket_path)
    streams = [client.stream(prompt, p) for prompt, p in zip(PROMPTS, params)]
    try:
        iterators = [stream.__aiter__() for stream in streams]

        async def started(deltas) -> None:
            num_tokens = 0
            while num_tokens < 16:
                num_tokens += len((await deltas.__anext__()).token_ids)

        await asyncio.wait_for(asyncio.gather(*(started(deltas) for deltas in iterators)), 60)
        health = await client.health()
        os.kill(health.stage_pids["runner"], signal.SIGKILL)

        async def finish(deltas) -> BaseException | None:
            try:
                async for _ in deltas:
                    pass
            except Exception as exc:  # noqa: BLE001 - reported per request
                return exc
            return None

        errors = await asyncio.wait_for(asyncio.gather(*(finish(deltas) for deltas in iterators)), 120)
    finally:
        await client.close()
    return [stream.completion if error is None else error for stream, error in zip(streams, errors)]
