"""The router's parts in one process: the ring and its load bound, the policies, health verdicts,
and stream failover against fake replicas (fake_replicas.py)."""
from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from fake_replicas import (FakeReplica, Stop, counted, replicas_and_router, serve_fleet, stream,  # noqa: F401 - a fixture
                           tiny_model)

from pipeline.models.tiny_model import make_tiny_model
from pipeline.router.metrics import RouterMetrics
from pipeline.router.policy import Policy, Route
from pipeline.router.prefix import PrefixKeyer, RouteKey
from pipeline.router.replicas import Replicas, health_verdict
from pipeline.router.ring import MIN_LOAD_BOUND, HashRing
from pipeline.serve.openai.params import derive_seed
from stages.scheduler.block_manager import hash_block

pytestmark = pytest.mark.timeout(60)


# ---- ring, policy, health


def test_the_ring_moves_only_a_leaving_members_keys_and_bounds_load() -> None:
    ring = HashRing(["a", "b", "c"])
    keys = [f"key{i}".encode() for i in range(300)]
    owners = {key: ring.walk(key)[0] for key in keys}
    assert {owner for owner in owners.values()} == {"a", "b", "c"}
    ring.remove("b")
    assert all(ring.walk(key)[0] == owner for key, owner in owners.items() if owner != "b")
    ring.add("b")
    assert {key: ring.walk(key)[0] for key in keys} == owners
    key = keys[0]
    owner = owners[key]
    others = 3 * MIN_LOAD_BOUND
    load = {"a": others, "b": others, "c": others}
    load[owner] = 5 * MIN_LOAD_BOUND  # mean with this request: (11 x 2 + 1) / 3 = 7.7, bound 10
    chosen = ring.choose(key, load.__getitem__, 0.25)
    assert chosen != owner and chosen == next(name for name in ring.walk(key) if name != owner)
    load[owner] = others  # bound ceil(1.25 * 19 / 3) = 8: the owner may take one more
    assert ring.choose(key, load.__getitem__, 0.25) == owner
    load = {"a": 0, "b": 0, "c": 0}
    load[owner] = MIN_LOAD_BOUND - 1  # far over the mean, but near idle: it still takes the key
    assert ring.choose(key, load.__getitem__, 0.25) == owner
    load[owner] = MIN_LOAD_BOUND
    assert ring.choose(key, load.__getitem__, 0.25) != owner


def test_the_prefix_key_is_the_engines_chained_block_hash(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", "llama", seed=3)
    keyer = PrefixKeyer(model, block_size=4, num_blocks=2)
    ids = list(range(10, 30))
    first = hash_block(None, np.array(ids[:4]))
    want = hash_block(first, np.array(ids[4:8]))
    key = keyer.key_of_tokens(ids)
    assert key.ring == want  # the ring places a prompt by its leading blocks only
    assert key.blocks[:2] == (first, want) and len(key.blocks) == 5  # every full block, to find the longest prefix
    assert keyer.key_of_tokens(ids[:8] + [99]) == RouteKey(want, (first, want))
    assert keyer.key_of_tokens(ids[:6]) == RouteKey(first, (first,))  # one full block: the ring uses it
    assert keyer.key_of_tokens(ids[:3]) is None  # no full block: no key
    text = "The same system prompt, then a question of its own"
    assert keyer.key_of_text(text) == keyer.key_of_tokens(keyer.tokenizer.encode(text, add_special_tokens=False).ids)
    with pytest.raises(ValueError, match="block_size"):
        PrefixKeyer(model, block_size=0, num_blocks=2)


def one_block(block: bytes) -> RouteKey:
    """The key of a prompt of one full block."""
    return RouteKey(block, (block,))


def test_policies_choose_among_healthy_replicas_only() -> None:
    replicas, router = replicas_and_router(["http://a:1", "http://b:1", "http://c:1"])
    assert router.choose(one_block(b"k")) is None  # none checked healthy yet
    for url in replicas.by_url:
        replicas.mark(url, True, "ok")
    replica, route = router.choose(one_block(b"k"))
    assert route is Route.PREFIX_OWNER
    replicas.mark(replica.url, False, "gone")
    other, _ = router.choose(one_block(b"k"))
    assert other.url != replica.url
    # A key passed over for load goes on to where it went, which now holds its KV.
    for url in replicas.by_url:
        replicas.mark(url, True, "ok")
    owner, _ = router.choose(one_block(b"conversation"))
    owner.outstanding = 1
    assert router.choose(one_block(b"conversation")) == (owner, Route.PREFIX_OWNER)  # near idle: no spill for balance
    owner.outstanding = MIN_LOAD_BOUND
    spill, route = router.choose(one_block(b"conversation"))
    assert route is Route.PREFIX_SPILL and spill.url != owner.url
    owner.outstanding = 0
    assert router.choose(one_block(b"conversation")) == (spill, Route.PREFIX_OWNER)
    replicas.mark(spill.url, False, "gone")
    assert router.choose(one_block(b"conversation")) == (owner, Route.PREFIX_OWNER)
    replicas.mark(spill.url, True, "ok")
    for replica in replicas.by_url.values():
        replica.outstanding = 0
    replicas.mark("http://c:1", False, "gone")
    replicas.by_url["http://a:1"].outstanding = 3
    assert router.choose(None)[1] is Route.LEAST_LOAD and router.choose(None)[0].url != "http://a:1"
    router.policy = Policy.ROUND_ROBIN
    assert len({router.choose(one_block(b"k"))[0].url for _ in range(4)}) == 2  # the two healthy ones, in turn
    with pytest.raises(ValueError, match="http://host:port"):
        Replicas(["ftp://x"], lambda u, h: None, interval_s=1, timeout_s=1)


def test_conversations_that_share_their_first_blocks_each_go_where_their_own_history_went() -> None:
    replicas, router = replicas_and_router(["http://a:1", "http://b:1", "http://c:1"])
    for url in replicas.by_url:
        replicas.mark(url, True, "ok")
    system = [b"system-1", b"system-2"]  # a long shared system prompt: the same ring key for both
    one, two = RouteKey(system[1], (*system, b"one-1")), RouteKey(system[1], (*system, b"two-1"))
    first, _ = router.choose(one)
    first.outstanding = MIN_LOAD_BOUND  # busy: the second conversation spills elsewhere
    spilled, route = router.choose(two)
    assert route is Route.PREFIX_SPILL and spilled is not first
    first.outstanding = 0
    # Each one's next turn (its prompt grown by a turn) goes back to its own history, not to where
    # the shared blocks went last.
    assert router.choose(RouteKey(system[1], (*system, b"one-1", b"one-2")))[0] is first
    assert router.choose(RouteKey(system[1], (*system, b"two-1", b"two-2")))[0] is spilled


@pytest.mark.parametrize(("status", "body", "healthy"), [
    (200, b'{"status": "ok"}', True),
    (503, b'{"status": "degraded", "reason": "stages are restarting"}', False),
    (200, b"<html>hello</html>", False),
    (200, b'{"status": 3}', False),
    (200, b'{"status": "fine"}', False),
])
def test_a_health_answer_that_is_not_the_daemons_is_not_trusted(status: int, body: bytes, healthy: bool) -> None:
    verdict, why = health_verdict(status, body)
    assert verdict is healthy and (why == "ok" if healthy else why)


# ---- failover against fake replicas


def test_a_stream_whose_replica_dies_goes_on_elsewhere_with_every_token_once(tiny_model: Path) -> None:
    bodies: list[dict] = []
    deaths = [5]  # the first request dies after 5 chunks (choice 0 has 3 tokens, choice 1 has 2); the rest live
    fakes = [FakeReplica(deaths, bodies), FakeReplica(deaths, bodies)]

    async def scenario(url: str, replicas: Replicas, urls: list[str], metrics: RouterMetrics) -> None:
        texts, errors, ids = await stream(url, {"prompt": "hello", "max_tokens": 6, "n": 2, "seed": 11})
        want = "".join(f"t{t} " for t in range(6))
        assert errors == [] and texts == {0: want, 1: want} and ids == []  # token ids only when asked
        first_url = next(u for u in urls if not replicas.by_url[u].healthy)  # left the ring when it broke
        assert counted(metrics, "pipeline:router_backend_deaths", first_url) == 1
        assert counted(metrics, "pipeline:router_backend_stall_verdicts", first_url) == 0
        resumed = sorted(bodies[1:], key=lambda b: len(b["resume_token_ids"]))
        assert [b["resume_token_ids"] for b in resumed] == [[0, 1], [0, 1, 2]]
        assert all(b["n"] == 1 and b["return_token_ids"] is True for b in resumed)
        assert sorted(b["seed"] for b in resumed) == sorted([11, derive_seed(11, 1)])

    asyncio.run(serve_fleet(tiny_model, fakes, scenario))


def test_a_stream_whose_replica_stalls_goes_on_elsewhere_after_the_stall_timeout(tiny_model: Path) -> None:
    bodies: list[dict] = []
    script = [Stop(3)]  # the first request's replica stops after 3 chunks, its connection open; the rest live
    fakes = [FakeReplica(script, bodies), FakeReplica(script, bodies)]
    stall_timeout_s = 0.3

    async def scenario(url: str, replicas: Replicas, urls: list[str], metrics: RouterMetrics) -> None:
        try:
            texts, errors, _ = await stream(url, {"prompt": "hello", "max_tokens": 6, "seed": 5})
        finally:
            for fake in fakes:
                fake.wake.set()
        # The stream ended while the stalled replica was still silent: the router did not wait for it.
        assert errors == [] and texts == {0: "".join(f"t{t} " for t in range(6))}
        stalled = next(fake for fake in fakes if fake.stopped.is_set())
        stalled_url = urls[fakes.index(stalled)]
        assert not replicas.by_url[stalled_url].healthy
        reason = replicas.by_url[stalled_url].reason
        assert reason.startswith("a stream from it sent nothing for ") and "/health did not answer" in reason, reason
        # A stall verdict, counted apart from deaths.
        assert counted(metrics, "pipeline:router_backend_stall_verdicts", stalled_url) == 1
        assert counted(metrics, "pipeline:router_backend_deaths", stalled_url) == 0
        assert [b.get("resume_token_ids") for b in bodies] == [None, [0, 1, 2]] and bodies[1]["seed"] == 5

    asyncio.run(serve_fleet(tiny_model, fakes, scenario, stall_timeout_s))


def test_a_choice_in_flight_on_two_replicas_that_die_fails_clearly(tiny_model: Path) -> None:
    bodies: list[dict] = []
    deaths = [2, 1]  # the first request dies after 2 chunks, its resubmission after 1
    fakes = [FakeReplica(deaths, bodies), FakeReplica(deaths, bodies), FakeReplica(deaths, bodies)]

    async def scenario(url: str, replicas: Replicas, urls: list[str], metrics: RouterMetrics) -> None:
        texts, errors, _ = await stream(url, {"prompt": "hello", "max_tokens": 6})
        assert texts == {0: "t0 t1 t2 "}  # two tokens, then one more from the second replica
        assert len(errors) == 1 and "in flight on 2 replicas that died in a row" in errors[0]
        assert len(bodies) == 2  # not sent to the third

    asyncio.run(serve_fleet(tiny_model, fakes, scenario))


def test_a_replica_answering_garbage_health_gets_no_request(tiny_model: Path) -> None:
    bodies_good: list[dict] = []
    bodies_bad: list[dict] = []
    fakes = [FakeReplica([], bodies_good), FakeReplica([], bodies_bad, health_body=b"I am not a daemon")]

    async def scenario(url: str, replicas: Replicas, urls: list[str], metrics: RouterMetrics) -> None:
        assert [r.healthy for r in replicas.by_url.values()] == [True, False]
        assert "not the daemon's health JSON" in replicas.by_url[urls[1]].reason
        for _ in range(4):
            texts, errors, _ = await stream(url, {"prompt": "hello", "max_tokens": 2})
            assert texts == {0: "t0 t1 "} and errors == []
        assert len(bodies_good) == 4 and bodies_bad == []

    asyncio.run(serve_fleet(tiny_model, fakes, scenario))
