"""End to end through a live daemon: many clients at once, outputs equal to the offline engine's,
aborts and disconnects that free the request, stop strings, errors, and socket permissions."""
from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from device_choice import engine_device, engine_dtype
from live_daemon import REAL_BACKEND, LiveDaemon, RawConnection, process_tree, wait_idle

from pipeline import LLM, SamplingParams
from pipeline.client import AsyncClient, Client, Completion
from pipeline.errors import PromptTooLong
from pipeline.protocol import (
    Abort,
    Aborted,
    Accepted,
    Delta,
    Error,
    Generate,
    WireSamplingParams,
)
from pipeline.models.tiny_model import corpus
from stages.gpu_runner import cpu_ops

pytestmark = pytest.mark.timeout(60)

LONG = dict(max_tokens=2000, ignore_eos=True, temperature=0.0)  # runs seconds unless aborted


@pytest.fixture(scope="module")
def offline(daemon_model: Path) -> LLM:
    return LLM(daemon_model, device=engine_device(), dtype=engine_dtype(engine_device()),
               max_model_len=2048, num_kv_blocks=512, block_size=16)


def text_prompts(count: int, seed: int) -> list[str]:
    lines = corpus(seed, count)
    return [f"{line} {i}" for i, line in enumerate(lines)]


def test_64_concurrent_clients_match_the_offline_engine(live_daemon: LiveDaemon, offline: LLM) -> None:
    prompts = text_prompts(16, seed=1)
    token_prompts = np.random.default_rng(5).integers(2, 1000, (8, 12)).tolist()
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    seeded = [SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, top_k=50, seed=100 + i) for i in range(8)]
    sampled = SamplingParams(max_tokens=20, temperature=1.0, top_k=20, min_p=0.05)

    async def collect_stream(client: AsyncClient, prompt: str | list[int], params: SamplingParams
                             ) -> tuple[Completion, list[str]]:
        deltas = []
        stream = client.stream(prompt, params)
        async for delta in stream:
            deltas.append(delta.text)
        assert stream.completion is not None
        return stream.completion, deltas

    async def run_all() -> tuple[list, list, list, list, list]:
        client = AsyncClient(live_daemon.socket_path)
        plain = [client.generate(p, greedy) for p in prompts]  # 16
        streamed = [collect_stream(client, p, greedy) for p in prompts]  # 16
        by_ids = [client.generate(p, greedy) for p in token_prompts]  # 8
        seeded_runs = [client.generate(token_prompts[i], seeded[i]) for i in range(8)]  # 8
        seeded_streams = [collect_stream(client, token_prompts[i], seeded[i]) for i in range(8)]  # 8
        random_runs = [client.generate(p, sampled) for p in prompts[:8]]  # 8
        results = await asyncio.gather(*plain, *streamed, *by_ids, *seeded_runs, *seeded_streams, *random_runs)
        cut = np.cumsum([16, 16, 8, 8, 8]).tolist()
        return results[:cut[0]], results[cut[0]:cut[1]], results[cut[1]:cut[2]], results[cut[2]:cut[3]], \
            results[cut[3]:cut[4]]

    plain, streamed, by_ids, seeded_runs, seeded_streams = asyncio.run(run_all())
    expected = offline.generate(prompts, greedy)
    assert [c.token_ids for c in plain] == [o.token_ids for o in expected]
    assert [c.text for c in plain] == [o.text for o in expected]
    assert [c.prompt_token_ids for c in plain] == [o.prompt_token_ids for o in expected]
    assert [c.finish_reason for c in plain] == [o.finish_reason for o in expected]
    # Streamed: the deltas, joined, are exactly the text the offline engine produced.
    assert ["".join(deltas) for _, deltas in streamed] == [o.text for o in expected]
    assert [c.token_ids for c, _ in streamed] == [o.token_ids for o in expected]
    assert all(c.usage.completion_tokens == len(c.token_ids) for c in plain)
    assert [c.token_ids for c in by_ids] == [o.token_ids for o in offline.generate(token_prompts, greedy)]
    # Seeded sampling repeats exactly: across runs, streamed or not, and in the offline engine.
    assert [c.token_ids for c in seeded_runs] == [c.token_ids for c, _ in seeded_streams]
    assert [c.token_ids for c in seeded_runs] == [o.token_ids for o in offline.generate(token_prompts, seeded)]
    assert len({tuple(c.token_ids) for c in seeded_runs}) > 1
    wait_idle(live_daemon.socket_path)


def test_abort_and_disconnect_free_the_request(live_daemon: LiveDaemon) -> None:
    prompt = "The scheduler runs every step"

    async def abandon_stream(client: AsyncClient) -> int:
        received = 0
        async for delta in client.stream(prompt, LONG):
            received += len(delta.token_ids)
            if received >= 3:
                break  # leaving the loop closes the connection: the daemon aborts the request
        return received

    async def cancel_generate(client: AsyncClient) -> None:
        task = asyncio.ensure_future(client.generate(prompt + " again", LONG))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def abort_from_elsewhere(client: AsyncClient) -> bool:
        stream = client.stream(prompt + " elsewhere", LONG)
        await stream.start()
        assert stream.request_id is not None
        aborted = await AsyncClient(live_daemon.socket_path).abort(stream.request_id)  # not its request
        stream.close()
        return aborted

    async def run() -> tuple[int, bool]:
        client = AsyncClient(live_daemon.socket_path)
        received, _, aborted = await asyncio.gather(abandon_stream(client), cancel_generate(client),
                                                    abort_from_elsewhere(client))
        return received, aborted

    received, aborted_elsewhere = asyncio.run(run())
    assert received >= 3
    assert aborted_elsewhere is False
    wait_idle(live_daemon.socket_path)

    # Abort on the connection that owns the request: the request ends with Error(aborted).
    raw = RawConnection(live_daemon.socket_path)
    try:
        raw.send(Generate(prompt, WireSamplingParams(**LONG), stream=True))
        accepted = raw.receive()
        assert isinstance(accepted, Accepted)
        assert isinstance(raw.receive(), Delta)
        raw.send(Abort(accepted.request_id))
        replies = []
        while not any(isinstance(m, Aborted) for m in replies):
            replies.append(raw.receive())
        errors = [m for m in replies if isinstance(m, Error)]
        assert [(e.code, e.request_id) for e in errors] == [("aborted", accepted.request_id)]
        raw.send(Abort(accepted.request_id))  # no longer running
        assert (lambda m: (m.code, m.request_id))(raw.receive()) == ("not_found", accepted.request_id)
    finally:
        raw.close()
    wait_idle(live_daemon.socket_path)


def test_stop_strings_across_token_boundaries_and_multibyte_characters(live_daemon: LiveDaemon,
                                                                        offline: LLM) -> None:
    tokenizer = offline.tokenizer
    prompts = text_prompts(24, seed=7)
    free = offline.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    # A stop string that starts in one token and ends in the next.
    straddling = None
    for prompt, output in zip(prompts, free):
        ends = [len(tokenizer.decode(output.token_ids[:k])) for k in range(1, len(output.token_ids))]
        for end in ends[2:]:
            stop = output.text[end - 2:end + 2]
            if len(stop) == 4 and stop.isascii() and output.text.find(stop) == end - 2 and stop.strip() == stop:
                straddling = (prompt, stop, output.text[:end - 2])
                break
        if straddling:
            break
    assert straddling is not None
    # A multi-byte character the model spells with more than one byte-level token.
    multibyte = next((prompt, char) for prompt, output in zip(prompts, free) for char in output.text
                     if len(char.encode()) > 1 and char != "\ufffd")

    with Client(live_daemon.socket_path) as client:
        prompt, stop, before = straddling
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
        completion = client.generate(prompt, params)
        assert (completion.text, completion.finish_reason, completion.stop_reason) == (before, "stop", stop)
        reference = offline.generate(prompt, params)[0]
        assert completion.token_ids == reference.token_ids
        # A stop token id ends the request with that id as its stop reason, in both paths.
        stop_id = reference.token_ids[3]
        by_token = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id])
        completion = client.generate(prompt, by_token)
        assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_id)
        assert completion.token_ids == offline.generate(prompt, by_token)[0].token_ids
        with client.stream(prompt, by_token) as stream:
            list(stream)
        assert stream.completion.stop_reason == stop_id
        with client.stream(prompt, params) as stream:
            assert "".join(d.text for d in stream) == before

        prompt, char = multibyte
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        with client.stream(prompt, params) as stream:
            deltas = [d.text for d in stream]
        assert any(char in d for d in deltas)  # whole, never split over two deltas
        assert "".join(deltas) == offline.generate(prompt, params)[0].text
        params.stop = [char]
        completion = client.generate(prompt, params)
        expected = offline.generate(prompt, params)[0]
        assert (completion.text, completion.finish_reason) == (expected.text, "stop")
        assert char not in completion.text


def test_errors_reach_the_client(live_daemon: LiveDaemon) -> None:
    with Client(live_daemon.socket_path) as client:
        with pytest.raises(PromptTooLong):
            client.generate(list(range(2, 1000)) * 3, {"max_tokens": 4})
        raw = RawConnection(live_daemon.socket_path)  # past the client's own validation
        try:
            raw.send(Generate("hi", WireSamplingParams(temperature=-1.0)))
            reply = raw.receive()
        finally:
            raw.close()
        assert isinstance(reply, Error)
        assert (reply.code, reply.field, reply.request_id) == ("invalid_params", "temperature", None)
        assert client.generate("still serving", {"max_tokens": 2}).usage.completion_tokens >= 1
    raw = RawConnection(live_daemon.socket_path)
    try:
        raw.sock.sendall(b"\x00\x00\x00\x03\xc1\xc1\xc1")  # 0xc1 is never valid msgpack
        reply = raw.receive()
        assert isinstance(reply, Error) and reply.code == "protocol"
        with pytest.raises(ConnectionError):
            raw.receive()
    finally:
        raw.close()


def test_a_client_that_stops_reading_does_not_stall_others(live_daemon: LiveDaemon) -> None:
    raw = RawConnection(live_daemon.socket_path)
    try:
        # Never read: ~150 KB of deltas (with 20 logprobs each) per request, more than the
        # socket buffers hold, so a daemon that waited for this reader would stall everyone.
        for i in range(4):
            raw.send(Generate(f"a slow reader {i}", WireSamplingParams(**LONG, logprobs=20), stream=True))

        async def others() -> list[Completion]:
            client = AsyncClient(live_daemon.socket_path)
            return await asyncio.gather(*(client.generate(p, {"max_tokens": 8, "temperature": 0.0})
                                          for p in text_prompts(8, seed=11)))

        assert all(c.finish_reason in ("stop", "length") for c in asyncio.run(others()))
    finally:
        raw.close()
    wait_idle(live_daemon.socket_path)


def test_socket_directory_and_socket_are_private(live_daemon: LiveDaemon) -> None:
    assert stat.S_IMODE(os.stat(live_daemon.socket_path.parent).st_mode) == 0o700
    info = os.lstat(live_daemon.socket_path)
    assert stat.S_ISSOCK(info.st_mode)
    assert stat.S_IMODE(info.st_mode) == 0o600


def test_a_repeated_prompt_raises_the_prefix_cache_hit_rate(live_daemon: LiveDaemon) -> None:
    prompt = np.random.default_rng(77).integers(2, 1000, 100).tolist()
    params = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    with Client(live_daemon.socket_path) as client:
        client.generate(prompt, params)
        after_first = client.stats().prefix_cache_hit_rate
        client.generate(prompt, params)  # its first 96 tokens (6 full blocks) are cached now
        after_second = client.stats().prefix_cache_hit_rate
    assert 0.0 <= after_first < after_second <= 1.0
    status = subprocess.run([sys.executable, "-m", "pipeline.cli", "status", "--socket", str(live_daemon.socket_path)],
                            capture_output=True, text=True, timeout=30)
    assert f"prefix cache hits {after_second:.1%} of admitted tokens" in status.stdout, status.stdout
    if engine_device() == "cpu":  # the runner's own line, as this machine builds the kernels
        assert f"CPU kernels: {cpu_ops.describe()}\n" in status.stdout, status.stdout
    else:
        assert "CPU kernels" not in status.stdout, status.stdout


def test_the_token_rate_shows_a_stream_and_falls_to_zero_once_idle(live_daemon: LiveDaemon) -> None:
    params = {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
    with Client(live_daemon.socket_path) as client:
        rates = []
        with client.stream("the rate", params) as stream:  # type: ignore[arg-type]
            for i, _ in enumerate(stream):
                if i % 40 == 39:
                    rates.append(client.stats().generated_tokens_per_s)
        assert max(rates) > 0, rates  # measured over windows of at least 0.5 s while tokens came
        deadline = time.monotonic() + 5.0
        while client.stats().generated_tokens_per_s != 0.0:  # no events read now: the watch updates it
            assert time.monotonic() < deadline, "the token rate stayed up while the daemon was idle"
            time.sleep(0.1)


def test_only_the_detokenizer_yields_the_cpu_to_the_stages_the_device_waits_on(live_daemon: LiveDaemon) -> None:
    with Client(live_daemon.socket_path, timeout_s=10) as client:
        pids = client.health().stage_pids

    def nice(pid: int) -> int:
        return int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[16])

    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert {name: nice(pid) - own for name, pid in pids.items()} == {
        "runner": 0, "scheduler": 0, "detokenizer": 5, "tokenizer0": 0}


@pytest.mark.skipif(not REAL_BACKEND, reason="the stage processes' own test")
def test_only_the_runner_loads_torch(live_daemon: LiveDaemon) -> None:
    """The processes that hold no tensors (the daemon, the tokenizer, detokenizer and scheduler on a CPU
    device, where the token mailbox is host memory) never map torch's libraries; the runner and the
    server it forks from do."""
    if os.environ.get("PIPELINE_TEST_DEVICE", "cpu") != "cpu":
        pytest.skip("on CUDA the mailbox's readers open its device slots with torch")
    with Client(live_daemon.socket_path, timeout_s=10) as client:
        pids = dict(client.health().stage_pids)
    pids["daemon"] = live_daemon.process.pid
    pids |= {"forkserver": pid for pid in process_tree(live_daemon.process.pid)
             if b"multiprocessing.forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes()}
    loaded = {name: "/torch/lib/" in Path(f"/proc/{pid}/maps").read_text() for name, pid in pids.items()}
    assert loaded == {"runner": True, "scheduler": False, "detokenizer": False, "tokenizer0": False,
                      "daemon": False, "forkserver": True}
