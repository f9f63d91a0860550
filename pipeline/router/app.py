"""The router's HTTP API: the daemon's OpenAI routes, forwarded to the replicas.

A body is decoded and checked as the daemon checks it (the same 400s, 413, 415), so bad input is
answered by the router without touching a replica; what only a replica can judge (the model's
name, an API key, the prompt's length) comes back from it as it answered. A non-streamed request
whose replica dies is sent whole to another one (nothing reached the client yet); a stream goes
on through relay.py.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import msgspec

from pipeline.router.metrics import RouterMetrics
from pipeline.router.pace import StallRule
from pipeline.router.policy import Router
from pipeline.router.prefix import PrefixKeyer, RouteKey
from pipeline.router.relay import MAX_REPLICA_DEATHS, ChoiceState, StreamRelay
from pipeline.router.stall import StallWatch
from pipeline.router.upstream import UNREACHABLE, Refused, Sender, error_json
from pipeline.serve.config import version
from pipeline.serve.openai.app import error_response, json_response, openai_router, read_json_body
from pipeline.serve.openai.asgi import HttpRequest, Response, Router as AsgiRouter, StreamResponse
from pipeline.serve.openai.errors import OpenAIError
from pipeline.serve.openai.params import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    chat_params,
    completion_requests,
    derive_seed,
    stream_usage,
)
from pipeline.serve.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_chat_request,
    decode_completion_request,
)
from pipeline.serve.openai.sse import SSE_CONTENT_TYPE

FORWARDED_HEADERS = ("authorization",)


@dataclass(slots=True)
class RouterApi:
    session: aiohttp.ClientSession
    router: Router
    keyer: PrefixKeyer
    metrics: RouterMetrics
    stall_timeout_s: float | None = None  # the floor of the stall rule (pace.py); None: a silent stream is waited for
    watch: StallWatch | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.stall_timeout_s is not None:
            self.watch = StallWatch(StallRule(self.stall_timeout_s), self.session, self.router.replicas, self.metrics)

    def app(self) -> AsgiRouter:
        return openai_router(completions=self.completions, chat_completions=self.chat_completions,
                             models=self.models, health=self.health, version=self.version, metrics=self.metrics_page)

    # ---- generation

    async def completions(self, request: HttpRequest) -> Response | StreamResponse:
        self.metrics.requests.labels("completions").inc()
        try:
            raw = await read_json_body(request)
            body = decode_completion_request(raw)
            choices = completion_requests(body)
            key = self.keyer.key_of_prompt(choices[0].prompt)
        except OpenAIError as error:
            return error_response(error)
        sender = self._sender(request, "/v1/completions", key)
        if not body.stream:
            return await self._whole(sender, raw)
        n = body.n or 1
        states = [ChoiceState(c.index, {"n": 1, "prompt": c.prompt, **_seed(body.seed, c.index % n)})
                  for c in choices]
        prompts = {c.index: c.prompt for c in choices}

        def count_prompt_tokens() -> int:
            distinct = {p if isinstance(p, str) else tuple(p) for p in prompts.values()}
            return sum(len(self.keyer.tokenizer.encode(p, add_special_tokens=False).ids) if isinstance(p, str)
                       else len(p) for p in distinct)

        return await self._stream(sender, msgspec.json.decode(raw), states, body, DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens,
                                  count_prompt_tokens)

    async def chat_completions(self, request: HttpRequest) -> Response | StreamResponse:
        self.metrics.requests.labels("chat").inc()
        try:
            raw = await read_json_body(request)
            body = decode_chat_request(raw)
            params = chat_params(body, default_max_tokens=1)
            prompt = self.keyer.chat_template.render(body.messages)
            key = self.keyer.key_of_text(prompt)
        except OpenAIError as error:
            return error_response(error)
        sender = self._sender(request, "/v1/chat/completions", key)
        if not body.stream:
            return await self._whole(sender, raw)
        states = [ChoiceState(i, {"n": 1, **_seed(body.seed, i)}) for i in range(len(params))]
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens

        def count_prompt_tokens() -> int:
            return len(self.keyer.tokenizer.encode(prompt, add_special_tokens=False).ids)

        return await self._stream(sender, msgspec.json.decode(raw), states, body, max_tokens, count_prompt_tokens)

    def _sender(self, request: HttpRequest, path: str, key: RouteKey | None) -> Sender:
        headers = {"content-type": "application/json"}
        headers.update({name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers})
        return Sender(self.session, self.router, self.metrics, path, headers, key, self.watch)

    async def _stream(self, sender: Sender, body: dict, states: list[ChoiceState],
                      parsed: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                      count_prompt_tokens: Callable[[], int]) -> Response | StreamResponse:
        relay = StreamRelay(sender, body, states, client_wants_ids=bool(parsed.return_token_ids),
                            include_usage=stream_usage(parsed), max_tokens=max_tokens,
                            count_prompt_tokens=count_prompt_tokens,
                            on_failover=self.metrics.failovers.inc,
                            on_failed=lambda reason: self.metrics.failed.labels(reason).inc())
        refused = await relay.open()
        if refused is not None:
            self.metrics.failed.labels("refused").inc()
            return Response(refused.body, refused.status, refused.content_type)
        frames = relay.frames()
        return StreamResponse(frames, lambda: None, SSE_CONTENT_TYPE, [(b"cache-control", b"no-cache")])

    async def _whole(self, sender: Sender, raw: bytes) -> Response:
        """A non-streamed request: the first whole answer; a replica that dies before answering
        counts against the request as for a stream."""
        deaths = 0
        while True:
            opened = await sender.open(raw)
            if isinstance(opened, Refused):
                self.metrics.failed.labels("refused").inc()
                return Response(opened.body, opened.status, opened.content_type)
            try:
                body = await opened.response.read()
                return Response(body, opened.response.status,
                                opened.response.headers.get("content-type", "application/json"))
            except UNREACHABLE:
                opened.response.close()
                sender.died(opened.replica, "it died while answering a request")
                deaths += 1
                if deaths >= MAX_REPLICA_DEATHS:
                    self.metrics.failed.labels("replica_deaths").inc()
                    return Response(error_json(503, f"the request was in flight on {deaths} replicas that died in a "
                                                    "row; it is not resubmitted again: it may be what kills them",
                                               "stage_failed"), 503)
                self.metrics.failovers.inc()
            finally:
                opened.response.release()
                sender.end(opened.replica)

    # ---- the rest

    async def models(self, request: HttpRequest) -> Response:
        sender = self._sender(request, "/v1/models", None)
        for replica in self.router.replicas.healthy():
            try:
                async with self.session.get(replica.url + "/v1/models", headers=sender.headers) as response:
                    return Response(await response.read(), response.status,
                                    response.headers.get("content-type", "application/json"))
            except UNREACHABLE:
                continue
        return Response(error_json(503, "no healthy backend to ask for its models", "no_backend"), 503)

    async def health(self, request: HttpRequest) -> Response:
        healthy = self.router.replicas.healthy()
        replicas = {r.url: {"healthy": r.healthy, "reason": r.reason, "outstanding": r.outstanding}
                    for r in self.router.replicas.by_url.values()}
        if healthy:
            return json_response(msgspec.json.encode({"status": "ok", "backends": replicas}))
        return json_response(msgspec.json.encode({"status": "unavailable", "reason": "no healthy backend",
                                                  "backends": replicas}), 503)

    async def version(self, request: HttpRequest) -> Response:
        return json_response(msgspec.json.encode({"version": version()}))

    async def metrics_page(self, request: HttpRequest) -> Response:
        for replica in self.router.replicas.by_url.values():
            self.metrics.healthy.labels(replica.url).set(1 if replica.healthy else 0)
        body, content_type = self.metrics.render()
        return Response(body, 200, content_type)


def _seed(seed: int | None, choice_of_prompt: int) -> dict:
    """A resumed choice's own seed: the one the daemon derived for it from the request's."""
    return {} if seed is None else {"seed": derive_seed(seed, choice_of_prompt)}
