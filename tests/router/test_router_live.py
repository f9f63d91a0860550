"""Three daemons on the tiny model behind `pipeline router`: outputs through the router equal a
direct request's (greedy and seeded, streamed or not, n, stop strings), errors pass through as a
daemon gives them, prefix routing comes near perfect routing's hit rate, and a replica SIGKILLed
or SIGSTOPped under live streams costs no stream a token (a killed one leaves no process and no
/dev/shm name behind), and only it is counted dead or hung, on a quiet machine and on one whose
CPU is oversubscribed (the `contention` tests)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import httpx
import openai
import pytest
from contention import cpu_contention, runs
from fleet import RouterProcess, restart_replica, start_replica, start_router, stop_replica, wait_healthy
from live_daemon import REAL_BACKEND, daemon_model, process_tree, wait_nothing_left  # noqa: F401 - a fixture

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not REAL_BACKEND, reason="starts `pipeline start --port` daemons itself")]

from pipeline.bench.multiturn import fleet_prefix_hit_tokens, run_workload, scrape_metric
from pipeline.router.affinity import affinity_hit_rate
from pipeline.router.prefix import PrefixKeyer

NUM_REPLICAS = 3


@pytest.fixture(scope="module")
def fleet(daemon_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list, RouterProcess]]:
    replicas = []
    router = None
    try:
        for _ in range(NUM_REPLICAS):
            replicas.append(start_replica(daemon_model))
        router = start_router(daemon_model, [r.url for r in replicas],
                              tmp_path_factory.mktemp("router") / "router.log")
        yield replicas, router
    finally:
        if router is not None:
            router.stop()
        for replica in replicas:
            stop_replica(replica)


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(api_key="unused", base_url=f"{url}/v1", max_retries=0)


def streamed_text(client: openai.OpenAI, **request: object) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in client.completions.create(stream=True, **request):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return texts


def test_outputs_through_the_router_equal_a_direct_request(fleet) -> None:
    replicas, router = fleet
    direct, routed = sdk(replicas[0].url), sdk(router.url)
    for request in ({"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0},
                    {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 1.0, "seed": 7, "n": 3},
                    {"prompt": "abc abc abc", "max_tokens": 16, "temperature": 0, "stop": ["e"]}):
        want = direct.completions.create(model="default", **request)
        got = routed.completions.create(model="default", **request)
        assert [c.text for c in got.choices] == [c.text for c in want.choices]
        assert [c.finish_reason for c in got.choices] == [c.finish_reason for c in want.choices]
        assert got.usage == want.usage
        assert streamed_text(routed, model="default", **request) == {c.index: c.text for c in want.choices}
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    want = direct.chat.completions.create(model="default", messages=messages, max_tokens=8, temperature=0)
    got = routed.chat.completions.create(model="default", messages=messages, max_tokens=8, temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content
    chunks = list(routed.chat.completions.create(model="default", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == want.usage.prompt_tokens


def test_bad_input_gets_the_daemons_errors(fleet) -> None:
    replicas, router = fleet
    for path, body, headers in (
        ("/v1/completions", b"{not json", {"content-type": "application/json"}),
        ("/v1/completions", json.dumps({"prompt": "x", "n": 0}).encode(), {}),
        ("/v1/completions", json.dumps({"prompt": "x", "temperature": -1}).encode(), {}),
        ("/v1/completions", json.dumps({"prompt": "x", "model": "nope"}).encode(), {}),
        ("/v1/chat/completions", json.dumps({"messages": "x"}).encode(), {}),
        ("/v1/completions", b"{}", {"content-type": "text/plain"}),
        ("/v1/nothing", b"{}", {}),
    ):
        want = httpx.post(replicas[1].url + path, content=body, headers=headers)
        got = httpx.post(router.url + path, content=body, headers=headers)
        assert (got.status_code, got.json()) == (want.status_code, want.json()), path
        assert 400 <= got.status_code < 500
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        sdk(router.url).completions.create(model="default", prompt="x", max_tokens=0)


def test_prefix_routing_raises_the_fleets_hit_rate_within_the_load_bound(fleet, daemon_model: Path,
                                                                         tmp_path: Path) -> None:
    replicas, _ = fleet
    urls = [r.url for r in replicas]
    hit_rates, requests_per_replica, affinity = {}, {}, {}
    for seed, policy in enumerate(("round-robin", "prefix")):
        router = start_router(daemon_model, urls, tmp_path / f"{policy}.log", "--policy", policy)
        try:
            hits_before, total_before = fleet_prefix_hit_tokens(urls)
            # 18 conversations (72 turns): with 9, one replica's luck in the hash and the order of
            # a wave of turns moved every figure below by a tenth from run to run.
            result = asyncio.run(run_workload(router.url, num_conversations=18, seed=seed))
            hits, total = fleet_prefix_hit_tokens(urls)
            hit_rates[policy] = (hits - hits_before) / (total - total_before)
            affinity[policy] = affinity_hit_rate(result.turns, PrefixKeyer(daemon_model, 16, 1))
            requests_per_replica[policy] = [scrape_metric(router.url, f'pipeline:router_backend_requests_total{{backend="{url}"}}')
                                            for url in urls]
        finally:
            router.stop()
    print(f"fleet prefix-cache hit rate: {hit_rates}; with perfect routing: {affinity}; requests per replica "
          f"with prefix routing: {requests_per_replica['prefix']}")
    # What perfect routing would get on the same turns (one replica, a cache that never evicts):
    # prefix routing comes near it; round-robin gets about half. Near: a turn that spills within
    # the load bound leaves its history behind once (runs measured 0.92 to 0.99 of perfect).
    assert hit_rates["prefix"] >= 0.85 * affinity["prefix"], (hit_rates, affinity)
    # Three replicas bound the gain: round-robin finds a conversation's history on its replica one
    # time in three, and the shared system prompts everywhere. Runs on this workload measured
    # 1.76 to 2.24 (round-robin's rate varies with how the conversations interleave).
    assert hit_rates["prefix"] >= 1.5 * hit_rates["round-robin"], hit_rates
    counts = requests_per_replica["prefix"]
    assert max(counts) <= 1.5 * sum(counts) / len(counts), counts  # runs measured up to 1.33


async def stream_completion(client: httpx.AsyncClient, url: str, request: dict, started: asyncio.Event,
                            num_started: list[int], total: int) -> tuple[str, str | None, list[str]]:
    """A streamed completion's text, finish reason and any error frames."""
    text, finish, errors, counted = "", None, [], False
    async with client.stream("POST", f"{url}/v1/completions", json={**request, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                errors.append(chunk["error"]["message"])
                continue
            text += chunk["choices"][0]["text"]
            finish = chunk["choices"][0]["finish_reason"] or finish
            if text and not counted:
                counted = True
                num_started[0] += 1
                if num_started[0] == total:
                    started.set()
    return text, finish, errors


async def streams_with_a_signal(url: str, requests: list[dict], pid: int, signum: int
                                ) -> list[tuple[str, str | None, list[str]]]:
    """Streams `requests` through `url`, sends `signum` to `pid` once every stream has had text,
    and returns each stream's text, finish reason and error frames."""
    started, num_started = asyncio.Event(), [0]
    async with httpx.AsyncClient(timeout=60) as client:
        streams = [asyncio.ensure_future(stream_completion(client, url, request, started, num_started, len(requests)))
                   for request in requests]
        await asyncio.wait_for(started.wait(), 60)
        os.kill(pid, signum)
        return await asyncio.gather(*streams)


def complete(url: str, request: dict) -> str:
    response = httpx.post(f"{url}/v1/completions", json=request, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def complete_all(url: str, requests: list[dict]) -> list[str]:
    """The texts of non-streamed completions sent all at once."""
    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as client:
            responses = await asyncio.gather(*(client.post(f"{url}/v1/completions", json=r) for r in requests))
        assert all(response.status_code == 200 for response in responses), [r.text for r in responses]
        return [response.json()["choices"][0]["text"] for response in responses]

    return asyncio.run(run())


@pytest.fixture(scope="module")
def references() -> dict[str, list[str]]:
    """complete_all's texts by their requests, asked once per module (greedy or seeded: the same on
    every replica), so that a test run many times does not ask again each time."""
    return {}


def reference_texts(references: dict[str, list[str]], url: str, requests: list[dict]) -> list[str]:
    key = json.dumps(requests, sort_keys=True)
    if key not in references:
        references[key] = complete_all(url, requests)
    return references[key]


def verdicts(router_url: str, urls: list[str]) -> dict[str, tuple[float, float]]:
    """Each backend's (deaths, stall verdicts) as the router's /metrics counts them."""
    return {url: (scrape_metric(router_url, f'pipeline:router_backend_deaths_total{{backend="{url}"}}'),
                  scrape_metric(router_url, f'pipeline:router_backend_stall_verdicts_total{{backend="{url}"}}'))
            for url in urls}


def stopped_replica_failover(fleet, references: dict, daemon_model: Path, tmp_path: Path,
                             load: AbstractContextManager) -> None:
    """SIGSTOP one replica under 9 streams: its streams go on elsewhere, every token once, and
    only it is taken for hung."""
    replicas, main_router = fleet
    # Long enough that the victim's streams are still running when every stream has had text,
    # however unevenly a loaded machine starts them (with 32 tokens they could all have ended).
    requests = [{"model": "default", "prompt": f"Stalled stream {i} says", "max_tokens": 96, "ignore_eos": True,
                 **({"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "seed": 200 + i})} for i in range(9)]
    reference = reference_texts(references, replicas[1].url, requests)
    urls = [r.url for r in replicas]
    router = start_router(daemon_model, urls, tmp_path / "stall.log", "--stall-timeout-s", "2")
    victim = replicas[2]

    try:
        with load:
            # SIGSTOP: alive, its connections open, silent.
            results = asyncio.run(streams_with_a_signal(router.url, requests, victim.daemon.process.pid,
                                                        signal.SIGSTOP))
        failovers = scrape_metric(router.url, "pipeline:router_failovers_total")
        counts = verdicts(router.url, urls)
        health = httpx.get(f"{router.url}/health").json()["backends"]
    finally:
        os.kill(victim.daemon.process.pid, signal.SIGCONT)
        router.stop()
    for (text, finish, errors), want in zip(results, reference):
        assert errors == []
        assert (text, finish) == (want, "length")
    assert failovers > 0  # the prompts have no full block: least-load spread them, a third on the victim
    assert health[victim.url]["healthy"] is False
    assert counts[victim.url][1] > 0 and counts[victim.url][0] == 0  # hung, not dead
    assert all(counts[url] == (0, 0) for url in urls if url != victim.url), (counts, router.log_path.read_text())
    assert all(health[url]["healthy"] for url in urls if url != victim.url), health
    wait_healthy(main_router, NUM_REPLICAS)  # the woken replica serves the module's router again


def killed_replica_failover(fleet, references: dict, load: AbstractContextManager) -> None:
    """SIGKILL one replica under 16 streams: its streams go on elsewhere, every token once, it
    leaves nothing behind, and only it is counted dead."""
    replicas, router = fleet
    requests = [{"model": "default", "prompt": f"Stream number {i} says", "max_tokens": 32, "ignore_eos": True,
                 **({"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "seed": 100 + i})} for i in range(16)]
    reference = reference_texts(references, replicas[1].url, requests)
    urls = [r.url for r in replicas]
    failovers_before = scrape_metric(router.url, "pipeline:router_failovers_total")
    counts_before = verdicts(router.url, urls)
    victim = replicas[0]
    tree = process_tree(victim.daemon.process.pid)

    try:
        with load:
            results = asyncio.run(streams_with_a_signal(router.url, requests, victim.daemon.process.pid,
                                                        signal.SIGKILL))
        victim.daemon.process.wait(timeout=10)
        wait_nothing_left(victim.daemon, tree, time.monotonic())  # no start on its socket needed
        for (text, finish, errors), want in zip(results, reference):
            assert errors == []
            assert (text, finish) == (want, "length")
        assert scrape_metric(router.url, "pipeline:router_failovers_total") > failovers_before  # some were on it
        counts = verdicts(router.url, urls)
        assert counts[victim.url][0] > counts_before[victim.url][0]  # its deaths, as a fact
        assert all(counts[url] == counts_before[url] for url in urls if url != victim.url), counts
        health = httpx.get(f"{router.url}/health").json()
        assert health["backends"][victim.url]["healthy"] is False
        assert all(health["backends"][url]["healthy"] for url in urls if url != victim.url), health
    finally:
        if victim.daemon.process.poll() is not None:  # killed: the module's fleet gets it back either way
            replicas[0] = restart_replica(victim)
    wait_healthy(router, NUM_REPLICAS)
    assert complete(router.url, requests[0]) == reference[0]


def test_a_replica_stopped_under_streams_is_failed_over_after_the_stall_timeout(fleet, references, daemon_model: Path,
                                                                               tmp_path: Path) -> None:
    stopped_replica_failover(fleet, references, daemon_model, tmp_path, nullcontext())


def test_a_replica_killed_under_16_streams_costs_no_stream_a_token(fleet, references) -> None:
    killed_replica_failover(fleet, references, nullcontext())


# ---- the same on a busy machine: slow replicas are not taken for dead (make test-contention)


@pytest.mark.contention
@pytest.mark.timeout(400)
@pytest.mark.parametrize("run", runs())
def test_failover_of_a_stopped_replica_under_cpu_contention_fails_no_healthy_request(
        fleet, references, daemon_model: Path, tmp_path: Path, run: int) -> None:
    stopped_replica_failover(fleet, references, daemon_model, tmp_path, cpu_contention())


@pytest.mark.contention
@pytest.mark.timeout(400)
@pytest.mark.parametrize("run", runs())
def test_failover_of_a_killed_replica_under_cpu_contention_fails_no_healthy_request(fleet, references,
                                                                                   run: int) -> None:
    killed_replica_failover(fleet, references, cpu_contention())
