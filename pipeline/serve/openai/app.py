"""The OpenAI-compatible HTTP API of the daemon, as an ASGI app (asgi.py) on the daemon's loop.

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`,
`GET /version`, `GET /metrics`. Bodies are decoded and encoded with msgspec; every error is
OpenAI's `{"error": {...}}` with the status the `openai` SDK maps to its exception classes.
Requests go through the same `DaemonServer` as the Unix socket's (openai/call.py); a client that
disconnects aborts its requests.
"""
from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator
from typing import Any

from pipeline.errors import PipelineError
from pipeline.protocol import new_request_id
from pipeline.serve.config import version
from pipeline.serve.openai.asgi import (
    BodyTooLarge,
    ClientGone,
    Handler,
    HttpRequest,
    Response,
    Router,
    StreamResponse,
    until_disconnect,
)
from pipeline.serve.openai.call import Choice, HttpCall, Reply, all_finished, token_usage
from pipeline.serve.openai.errors import OpenAIError, error_body, from_pipeline_error
from pipeline.serve.openai.params import (
    ChoiceRequest,
    chat_params,
    completion_requests,
    resume_token_ids,
    stream_usage,
)
from pipeline.serve.openai.responses import FinishedChoice, chat_completion_body, completion_body, count_usage, encoder
from pipeline.serve.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_chat_request,
    decode_completion_request,
)
from pipeline.serve.openai.sse import DONE, SSE_CONTENT_TYPE, ChatStream, CompletionStream
from pipeline.serve.openai.tools import ToolPlan, ToolStream, template_tools, tool_plan
from pipeline.serve.server import DaemonServer

MAX_BODY_BYTES = 16 * 1024 * 1024  # as the socket's frame limit: far above any max_model_len's prompt
JSON = "application/json"


def json_response(body: bytes, status: int = 200) -> Response:
    return Response(body, status, JSON)


def error_response(error: OpenAIError) -> Response:
    return json_response(error_body(error), error.status)


class OpenAIApi:
    """The handlers; `server` does the routing to the engine, `server.model` says what it serves."""

    def __init__(self, server: DaemonServer, api_key: str | None = None) -> None:
        self.server = server
        self.model = server.model
        self.api_key = api_key
        self.created = int(time.time())

    def app(self) -> Router:
        return openai_router(completions=self.completions, chat_completions=self.chat_completions,
                             models=self.models, health=self.health, version=self.version, metrics=self.metrics)

    # ---- the API

    async def completions(self, request: HttpRequest) -> Response:
        try:
            self._check_key(request)
            body = decode_completion_request(await self._body(request))
            self._check_model(body.model)
            call = self._start(completion_requests(body), body)
        except OpenAIError as error:
            return error_response(error)
        stream = CompletionStream(f"cmpl-{new_request_id()}", self.model.name, int(time.time()), self.model.token_text,
                                  include_usage=stream_usage(body))
        if body.stream:
            return self._streaming(call, stream, echo=bool(body.echo), with_ids=bool(body.return_token_ids))
        return await self._finished(request, call, lambda choices, usage: completion_body(
            stream.response_id, self.model.name, stream.created, choices, usage, self.model.token_text),
            echo=bool(body.echo))

    async def chat_completions(self, request: HttpRequest) -> Response:
        try:
            self._check_key(request)
            body = decode_chat_request(await self._body(request))
            self._check_model(body.model)
            tools = tool_plan(body)
            prompt = self.model.chat_template.render(body.messages, tools=template_tools(body))
            params = chat_params(body, default_max_tokens=self.model.max_model_len,
                                 tool_schema=None if tools is None else tools.schema)
            resumed = resume_token_ids(body, len(params))
            call = self._start([ChoiceRequest(i, prompt, p, resumed) for i, p in enumerate(params)], body)
        except OpenAIError as error:
            return error_response(error)
        stream = ChatStream(f"chatcmpl-{new_request_id()}", self.model.name, int(time.time()), self.model.token_text,
                            include_usage=stream_usage(body))
        if body.stream:
            return self._streaming(call, stream, echo=False, with_ids=bool(body.return_token_ids), tools=tools)
        return await self._finished(request, call, lambda choices, usage: chat_completion_body(
            stream.response_id, self.model.name, stream.created, choices, usage, self.model.token_text, tools),
            echo=False)

    async def models(self, request: HttpRequest) -> Response:
        try:
            self._check_key(request)
        except OpenAIError as error:
            return error_response(error)
        model = self.model
        card = {"id": model.name, "object": "model", "created": self.created, "owned_by": "pipeline",
                "root": model.path, "parent": None, "max_model_len": model.max_model_len,
                "vocab_size": model.vocab_size, "special_token_ids": model.special_token_ids}
        return json_response(encoder.encode({"object": "list", "data": [card]}))

    async def health(self, request: HttpRequest) -> Response:
        reply = self.server.health()
        if reply.status == "ok":
            return json_response(encoder.encode({"status": "ok"}))
        return json_response(encoder.encode({"status": reply.status, "reason": reply.reason}), 503)

    async def version(self, request: HttpRequest) -> Response:
        return json_response(encoder.encode({"version": version()}))

    async def metrics(self, request: HttpRequest) -> Response:
        self.server.metrics.set_stats(self.server.stats())
        body, content_type = self.server.metrics.render()
        return Response(body, 200, content_type)

    # ---- the parts every call shares

    def _check_key(self, request: HttpRequest) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise OpenAIError(401, "this server needs an API key: send the header `Authorization: Bearer <key>`",
                              code="invalid_api_key")

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model.name:
            raise OpenAIError(404, f"model {name!r} is not served here; this server serves {self.model.name!r}",
                              param="model", code="model_not_found")

    async def _body(self, request: HttpRequest) -> bytes:
        return await read_json_body(request)

    def _start(self, choices: list[ChoiceRequest], body: CompletionRequest | ChatCompletionRequest) -> HttpCall:
        keep_logprobs = not body.stream
        call = HttpCall(self.server, choices, keep_logprobs=keep_logprobs,
                        stream_interval=self.server.config.stream_interval)
        try:
            call.start()
        except PipelineError as exc:
            raise from_pipeline_error(exc) from None
        return call

    def _streaming(self, call: HttpCall, stream: CompletionStream | ChatStream, *, echo: bool,
                   with_ids: bool = False, tools: ToolPlan | None = None) -> StreamResponse:
        """The response's frames; with `tools` each choice's text is read as tool calls (tools.py),
        so no frame is made from the text alone."""
        try:
            if isinstance(stream, ChatStream):  # each choice opens with the assistant's role
                call.queue_frame(b"".join(stream.chunk(choice.index, "") for choice in call.choices))
            if echo:
                call.queue_frame(b"".join(stream.chunk(choice.index, self._prompt_text(choice))
                                          for choice in call.choices))
        except BaseException:
            call.close()  # no response will run to close it
            raise
        tool_streams = {} if tools is None else {choice.index: ToolStream(tools) for choice in call.choices}
        if tools is None and not with_ids and all(choice.request.params.logprobs is None for choice in call.choices):
            call.frame_text(stream)  # plain text deltas: their frames are made at once

        async def frames() -> AsyncIterator[bytes]:
            try:
                while replies := await call.next_replies():
                    out = []
                    for reply in replies:
                        if isinstance(reply, bytes):
                            out.append(reply)
                        elif reply.error is not None:
                            out.append(_error_frame(from_pipeline_error(reply.error)))
                        elif tool_streams:
                            out.append(_tool_frame(stream, tool_streams[reply.choice.index], reply, with_ids))
                        elif (reply.text or reply.logprobs or reply.finish_reason
                              or not stream.is_open(reply.choice.index) or (with_ids and reply.token_ids)):
                            out.append(stream.chunk(reply.choice.index, reply.text, logprobs=reply.logprobs,
                                                    finish_reason=reply.finish_reason,
                                                    token_ids=reply.token_ids or [] if with_ids else None))
                    yield b"".join(out)
                if stream.include_usage:
                    yield stream.usage_chunk(*token_usage(call.choices))
                yield DONE
            finally:
                call.close()

        return StreamResponse(frames(), call.close, SSE_CONTENT_TYPE, [(b"cache-control", b"no-cache")],
                              on_started=call.attach_writer)

    async def _finished(self, request: HttpRequest, call: HttpCall, body: Any, *, echo: bool) -> Response:
        watcher = asyncio.ensure_future(until_disconnect(request.receive, call.close))
        try:
            await call.wait_finished()
        finally:
            watcher.cancel()
            call.close()
        if not all_finished(call.choices):  # the client went away: nobody reads this answer
            return error_response(OpenAIError(400, "the client closed the connection before the response"))
        failed = next((choice.error for choice in call.choices if choice.error is not None), None)
        if failed is not None:
            return error_response(from_pipeline_error(failed))
        choices = [FinishedChoice((self._prompt_text(choice) if echo else "") + "".join(choice.text),
                                  choice.done.finish_reason, choice.logprobs) for choice in call.choices]
        usage = count_usage(*token_usage(call.choices))
        return json_response(body(choices, usage))

    def _prompt_text(self, choice: Choice) -> str:
        if isinstance(choice.prompt, str):
            return choice.prompt
        return self.model.decode(list(choice.prompt))


def openai_router(*, completions: Handler, chat_completions: Handler, models: Handler, health: Handler,
                  version: Handler, metrics: Handler) -> Router:
    """An ASGI app of the API's routes (the daemon's and the router's: one table, so the two
    serve the same paths) that answers an unknown path (404) or method (405) as OpenAI does."""
    routes = {
        ("/v1/completions", "POST"): completions,
        ("/v1/chat/completions", "POST"): chat_completions,
        ("/v1/models", "GET"): models,
        ("/health", "GET"): health,
        ("/version", "GET"): version,
        ("/metrics", "GET"): metrics,
    }

    def unknown(request: HttpRequest, status: int) -> Response:
        what = "no such route" if status == 404 else "this route does not take that method"
        return error_response(OpenAIError(status, f"{request.method} {request.path}: {what}"))

    return Router(routes, unknown)


async def read_json_body(request: HttpRequest) -> bytes:
    """A request's JSON body; 415 when it says it is something else, 413 past MAX_BODY_BYTES."""
    content_type = request.headers.get("content-type")
    if content_type is not None and content_type.split(";")[0].strip().lower() != JSON:
        raise OpenAIError(415, f"the request body must be JSON (Content-Type: {JSON}), got {content_type!r}",
                          type="invalid_request_error")
    try:
        return await request.body(MAX_BODY_BYTES)
    except BodyTooLarge as exc:
        raise OpenAIError(413, f"the request body of {exc.num_bytes} bytes is over this server's limit of "
                               f"{MAX_BODY_BYTES} bytes") from None
    except ClientGone:
        raise OpenAIError(400, "the client closed the connection before sending the whole body") from None


def _tool_frame(stream: ChatStream, tool_stream: ToolStream, reply: Reply, with_ids: bool) -> bytes:
    """The frame of `reply` of a choice read as tool calls; b"" when it shows nothing yet."""
    finish_reason = reply.finish_reason
    if finish_reason is None:
        text, calls = tool_stream.feed(reply.text)
    else:
        text, calls, finish_reason = tool_stream.finish(finish_reason)
    token_ids = reply.token_ids or [] if with_ids else None
    if not (text or calls or reply.logprobs or finish_reason or token_ids):
        return b""
    return stream.tool_chunk(reply.choice.index, text, calls, logprobs=reply.logprobs, finish_reason=finish_reason,
                             token_ids=token_ids)


def _error_frame(error: OpenAIError) -> bytes:
    """An error in the middle of a stream, whose status was sent long ago (as vLLM sends it)."""
    return b"data: " + error_body(error) + b"\n\n"
