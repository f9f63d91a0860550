"""Overload against a live daemon: admission stops at max_num_seqs + max_waiting with an
immediate `overloaded`, a full request ring is refused without ever blocking the event loop, and
1,000 concurrent connections each get a correct completion or Overloaded, in bounded memory."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from live_daemon import (
    REAL_BACKEND,
    AsyncRawConnection,
    LiveDaemon,
    memory_kib,
    short_dir,
    start_daemon,
    wait_idle,
)

from pipeline.client import AsyncClient, Client
from pipeline.serve.daemon import raise_open_file_limit
from pipeline.errors import Overloaded, PromptTooLong
from pipeline.protocol import (
    Accepted,
    Done,
    Error,
    Generate,
    Health,
    HealthReply,
    StatsReply,
    WireSamplingParams,
)

pytestmark = [pytest.mark.timeout(90),
              pytest.mark.skipif(not REAL_BACKEND, reason="the stage-process daemon takes the overload options")]

MAX_NUM_SEQS, MAX_WAITING = 4, 12
LIMIT = MAX_NUM_SEQS + MAX_WAITING
NUM_CONNECTIONS = 1000
QUICK = dict(max_tokens=4, ignore_eos=True, temperature=0.0)
LONG = dict(max_tokens=1500, ignore_eos=True, temperature=0.0)  # runs until the test lets go of it
RING_FILLER_CHARS = 300_000  # 14 of these overflow a 4 MiB request ring before the admission limit
MAX_RSS_GROWTH_BYTES = 64 << 20


@pytest.fixture(scope="module")
def daemon(daemon_model: Path) -> Iterator[LiveDaemon]:
    directory = short_dir()
    daemon = start_daemon(daemon_model, directory,
                          ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting", str(MAX_WAITING)])
    try:
        yield daemon
    finally:
        daemon.stop()
        shutil.rmtree(directory.parent, ignore_errors=True)


def _stats(socket_path: Path) -> StatsReply:
    with Client(socket_path, timeout_s=5) as client:
        return client.stats()


def _soft_open_file_limit(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as limits:
        for line in limits:
            if line.startswith("Max open files"):
                soft, hard = line.split()[3:5]
                return int(soft), int(hard) if hard.isdigit() else -1
    raise RuntimeError(f"no open-file limit for pid {pid}")


def test_requests_beyond_the_admission_limit_are_refused_at_once(daemon: LiveDaemon) -> None:
    async def scenario() -> float:
        client = AsyncClient(daemon.socket_path)
        holders = [client.stream(f"holding a place {i}", LONG) for i in range(LIMIT)]
        try:
            await asyncio.wait_for(asyncio.gather(*(stream.start() for stream in holders)), 20)
            asked_at = time.monotonic()
            with pytest.raises(Overloaded, match=f"limit of {LIMIT} requests in flight "
                                                 rf"\(max_num_seqs {MAX_NUM_SEQS} \+ max_waiting {MAX_WAITING}\)"):
                await client.generate("one too many", QUICK)
            return time.monotonic() - asked_at
        finally:
            await client.close()

    refused_after_s = asyncio.run(scenario())
    assert refused_after_s < 1.0
    stats = _stats(daemon.socket_path)
    assert stats.num_overloaded_requests >= 1 and stats.max_in_flight_requests == LIMIT
    wait_idle(daemon.socket_path, timeout_s=20.0)  # the holders' disconnects freed their places
    with Client(daemon.socket_path) as client:
        assert client.generate("room again", QUICK).usage.completion_tokens == 4


def test_a_full_request_ring_is_refused_without_blocking_the_daemon(daemon: LiveDaemon) -> None:
    with Client(daemon.socket_path) as client:
        tokenizer_pid = client.health().stage_pids["tokenizer0"]
    filler = "word " * (RING_FILLER_CHARS // 5)

    async def scenario() -> tuple[list[AsyncRawConnection], Error, float]:
        wires: list[AsyncRawConnection] = []
        slowest_reply_s = 0.0
        os.kill(tokenizer_pid, signal.SIGSTOP)  # nothing drains the ring now
        try:
            for _ in range(LIMIT):
                wire = await AsyncRawConnection.open(daemon.socket_path)
                asked_at = time.monotonic()
                wire.send(Generate(prompt=filler))
                reply = await asyncio.wait_for(wire.receive(), 5)
                wire.send(Health())  # the event loop still answers at once
                assert isinstance(await asyncio.wait_for(wire.receive(), 5), HealthReply)
                slowest_reply_s = max(slowest_reply_s, time.monotonic() - asked_at)
                if isinstance(reply, Error):
                    wire.close()
                    return wires, reply, slowest_reply_s
                assert isinstance(reply, Accepted)
                wires.append(wire)
            pytest.fail(f"{LIMIT} prompts of {len(filler)} characters did not fill the request ring")
        finally:
            os.kill(tokenizer_pid, signal.SIGCONT)

    async def finals(wires: list[AsyncRawConnection]) -> list[Done | Error]:
        try:
            return await asyncio.wait_for(asyncio.gather(*(wire.final() for wire in wires)), 30)
        finally:
            for wire in wires:
                wire.close()

    async def run() -> tuple[int, Error, float, list[Done | Error]]:
        wires, refusal, slowest_reply_s = await scenario()
        return len(wires), refusal, slowest_reply_s, await finals(wires)

    num_queued, refusal, slowest_reply_s, ends = asyncio.run(run())
    assert refusal.code == "overloaded" and "the request ring of tokenizer0 is full" in refusal.message
    assert 0 < num_queued < LIMIT - 1  # the ring, not the admission limit, refused it
    assert slowest_reply_s < 1.0, f"a reply took {slowest_reply_s:.2f} s while the ring was full"
    # Once the tokenizer runs again, the queued prompts are judged (far over max_model_len).
    assert all(isinstance(end, Error) and end.code == PromptTooLong.code.value for end in ends), ends
    wait_idle(daemon.socket_path, timeout_s=20.0)


def test_a_thousand_concurrent_connections_get_a_completion_or_overloaded(daemon: LiveDaemon) -> None:
    if raise_open_file_limit() < NUM_CONNECTIONS + 64:
        pytest.skip(f"the hard limit on open files ({raise_open_file_limit()}) is below {NUM_CONNECTIONS + 64}")
    daemon_soft, daemon_hard = _soft_open_file_limit(daemon.process.pid)
    assert daemon_soft == daemon_hard or daemon_hard == -1, "the daemon did not raise its open-file limit"
    prompts = [f"Overload prompt {i}" for i in range(8)]
    with Client(daemon.socket_path) as client:
        expected = {prompt: client.generate(prompt, QUICK).text for prompt in prompts}
    overloaded_before = _stats(daemon.socket_path).num_overloaded_requests
    rss_before = memory_kib(daemon.process.pid)[0] * 1024

    async def burst() -> list[tuple[str, Done | Error, float]]:
        opened = 0
        all_open = asyncio.Event()

        async def one(index: int) -> tuple[str, Done | Error, float]:
            nonlocal opened
            prompt = prompts[index % len(prompts)]
            wire = await AsyncRawConnection.open(daemon.socket_path)
            try:
                opened += 1
                if opened == NUM_CONNECTIONS:
                    all_open.set()
                await all_open.wait()  # every connection is open before any request goes out
                sent_at = time.monotonic()
                wire.send(Generate(prompt=prompt, params=WireSamplingParams(**QUICK)))
                end = await wire.final()
                return prompt, end, time.monotonic() - sent_at
            finally:
                wire.close()

        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(NUM_CONNECTIONS))), 60)

    results = asyncio.run(burst())
    rss_growth = memory_kib(daemon.process.pid)[0] * 1024 - rss_before
    done = [(prompt, end) for prompt, end, _ in results if isinstance(end, Done)]
    refused = [(end, after_s) for _, end, after_s in results if isinstance(end, Error)]
    assert all(end.code == "overloaded" and f"limit of {LIMIT} requests in flight" in end.message
               for end, _ in refused), {end.message for end, _ in refused}
    assert len(done) >= LIMIT and refused, (len(done), len(refused))
    for prompt, end in done:
        assert end.text == expected[prompt] and end.usage.completion_tokens == 4
    refusal_times_s = [after_s for _, after_s in refused]
    print(f"{NUM_CONNECTIONS} connections: {len(done)} completed, {len(refused)} overloaded "
          f"(refused after {statistics.median(refusal_times_s) * 1000:.0f} ms median, "
          f"{max(refusal_times_s) * 1000:.0f} ms max); daemon RSS {rss_before / 2**20:.1f} MiB, "
          f"{rss_growth / 2**20:+.1f} MiB after the burst")
    assert max(refusal_times_s) < 5.0
    assert rss_growth < MAX_RSS_GROWTH_BYTES
    assert _stats(daemon.socket_path).num_overloaded_requests - overloaded_before == len(refused)
    wait_idle(daemon.socket_path, timeout_s=20.0)
