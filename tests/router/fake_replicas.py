"""Fake replicas for the router's in-process tests: aiohttp servers that speak the daemon's SSE with
token ids, and, as a shared script tells each request in turn, die mid-stream, stop (silent, their
/health too, as a SIGSTOPped process), or pause while their /health answers (a slow machine)."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import pytest
from aiohttp import web

from pipeline.models.tiny_model import make_tiny_model
from pipeline.router.app import RouterApi
from pipeline.router.metrics import RouterMetrics
from pipeline.router.policy import Policy, Router
from pipeline.router.prefix import PrefixKeyer
from pipeline.router.replicas import Replicas
from pipeline.serve.http import HttpListener, bind


@dataclass(slots=True)
class Stop:
    """After `after` chunks, silent with the connection open, /health unanswered, until woken."""

    after: int


@dataclass(slots=True)
class Pause:
    """After `after` chunks, silent for `seconds` (or until woken) while /health answers, then the rest."""

    after: int
    seconds: float


Fault = int | Stop | Pause | None  # an int: die (the connection closed) after that many chunks


def replicas_and_router(urls: list[str]) -> tuple[Replicas, Router]:
    holder: list[Router] = []
    replicas = Replicas(urls, lambda url, healthy: holder[0].on_change(url, healthy), interval_s=0.1, timeout_s=1)
    router = Router(replicas, Policy.PREFIX, 0.25)
    holder.append(router)
    return replicas, router


class FakeReplica:
    """Streams tokens `len(resume_token_ids)` .. max_tokens - 1, one per chunk, each token t as
    text "t<t> " with its id; each request takes the next fault of the shared `script`."""

    def __init__(self, script: list[Fault], bodies: list[dict], health_body: bytes = b'{"status": "ok"}') -> None:
        self.script, self.bodies, self.health_body = script, bodies, health_body
        self.stopped = asyncio.Event()
        self.wake = asyncio.Event()  # ends a stop

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def health(self, request: web.Request) -> web.Response:
        if self.stopped.is_set():
            await self.wake.wait()
        return web.Response(body=self.health_body, content_type="application/json")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        fault = self.script.pop(0) if self.script else None
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        n = body.get("n", 1)
        start = len(body.get("resume_token_ids") or [])
        sent = 0
        for t in range(start, body["max_tokens"]):
            for index in range(n):
                if isinstance(fault, Pause) and sent == fault.after:
                    try:
                        await asyncio.wait_for(self.wake.wait(), fault.seconds)
                    except TimeoutError:
                        pass
                elif isinstance(fault, Stop) and sent == fault.after:
                    self.stopped.set()
                    await self.wake.wait()
                    request.transport.close()
                    return response
                elif isinstance(fault, int) and sent == fault:
                    request.transport.close()
                    return response
                last = t == body["max_tokens"] - 1
                chunk = {"id": "cmpl-fake", "object": "text_completion", "created": 1, "model": "default",
                         "choices": [{"text": f"t{t} ", "index": index, "logprobs": None,
                                      "finish_reason": "length" if last else None, "token_ids": [t]}]}
                await response.write(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")
                sent += 1
            await asyncio.sleep(0.001)
        await response.write(b"data: [DONE]\n\n")
        return response


async def serve_fleet(model: Path, fakes: list[FakeReplica], scenario: Callable,
                      stall_timeout_s: float | None = None) -> None:
    """Runs `scenario(router_url, replicas, urls, metrics)` against a router in front of `fakes`;
    every fake is woken at the end."""
    runners = []
    urls = []
    for fake in fakes:
        runner = web.AppRunner(fake.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
    replicas, router = replicas_and_router(urls)
    metrics = RouterMetrics(urls)
    async with aiohttp.ClientSession() as session:
        await replicas.check_all(session)
        api = RouterApi(session, router, PrefixKeyer(model, 16, 4), metrics, stall_timeout_s)
        listener = HttpListener(api.app(), bind("127.0.0.1", 0))
        await listener.start()
        try:
            await scenario(listener.url, replicas, urls, metrics)
        finally:
            for fake in fakes:
                fake.wake.set()
            await listener.stop()
            for runner in runners:
                await runner.cleanup()


async def stream(url: str, request: dict) -> tuple[dict[int, str], list[str], list[int]]:
    """A streamed completion through `url`: each choice's text, the error frames, the token ids."""
    texts: dict[int, str] = {}
    errors: list[str] = []
    ids: list[int] = []
    async with httpx.AsyncClient(timeout=20) as client:
        async with client.stream("POST", f"{url}/v1/completions", json={**request, "stream": True}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errors.append(chunk["error"]["message"])
                    continue
                assert chunk["id"] == "cmpl-fake"
                for choice in chunk["choices"]:
                    texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                    ids.extend(choice.get("token_ids", []))
    return texts, errors, ids


def counted(metrics: RouterMetrics, name: str, url: str) -> float:
    """A per-backend counter's value, as /metrics shows it."""
    return metrics.registry.get_sample_value(f"{name}_total", {"backend": url}) or 0.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("router-fakes"), "llama", seed=3)
