"""Where the serving benchmark sends its load: this daemon's Unix socket, or any OpenAI-compatible
HTTP server (ours, vLLM, SGLang), through the same workload and the same per-request record.

Each target also says what it knows of the model it serves (vocabulary size, special token ids,
max_model_len), so random prompts are drawn from ordinary tokens of that model, and its speculative
decoding totals: the daemon's stats, or a server's /metrics (ours, or vLLM's names).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from pipeline.bench.metrics import RequestRecord
from pipeline.bench.workload import BenchRequest
from pipeline.client import AsyncClient
from pipeline.errors import PipelineError
from pipeline.protocol import SpeculativeCounts
from stages.contracts.params import SamplingParams

ENDPOINTS = ("completions", "chat")
_DATA = b"data: "
_DONE = b"[DONE]"
# /metrics counters (after the name's "prefix:") -> the SpeculativeCounts field; vLLM's
# `num_drafts` counts what ours calls verifications
_SPEC_DECODE_SERIES = {"spec_decode_num_draft_tokens_total": "num_draft_tokens",
                  "spec_decode_num_accepted_tokens_total": "num_accepted_tokens",
                  "spec_decode_num_verifications_total": "num_verifications",
                  "spec_decode_num_drafts_total": "num_verifications"}


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None  # completions
    delta: _Delta | None = None  # chat


class _Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int


class _Chunk(msgspec.Struct):
    """What the load generator reads of a stream chunk (other fields are skipped unread)."""

    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: dict | None = None


_chunk_decoder = msgspec.json.Decoder(_Chunk)


@dataclass(slots=True)
class ModelInfo:
    name: str | None = None
    vocab_size: int | None = None  # None: the target does not say
    max_model_len: int | None = None
    special_token_ids: list[int] = field(default_factory=list)


class Target(Protocol):
    async def model_info(self) -> ModelInfo: ...

    async def send(self, request: BenchRequest, params: SamplingParams, run_start_s: float) -> RequestRecord: ...

    async def speculative_counts(self) -> SpeculativeCounts:
        """The target's totals so far; all 0 when it does not say."""

    async def close(self) -> None: ...


class _Timing:
    """The clock of one streamed request: when it was sent, and when each token-bearing chunk came."""

    def __init__(self, run_start_s: float) -> None:
        self.run_start_s = run_start_s
        self.sent_s = time.perf_counter()
        self.last_s = self.sent_s
        self.ttft_ms: float | None = None
        self.itl_ms: list[float] = []
        self.chunk_tokens: list[int] = []

    def chunk(self, num_tokens: int) -> None:
        now_s = time.perf_counter()
        if self.ttft_ms is None:
            self.ttft_ms = (now_s - self.sent_s) * 1e3
        else:
            self.itl_ms.append((now_s - self.last_s) * 1e3)
        self.last_s = now_s
        self.chunk_tokens.append(num_tokens)

    def record(self, prompt_len: int, output_len: int) -> RequestRecord:
        return RequestRecord(prompt_len, output_len, self.sent_s - self.run_start_s, self.ttft_ms, self.itl_ms,
                             self.chunk_tokens, (time.perf_counter() - self.sent_s) * 1e3, True)

    def failure(self, prompt_len: int, exc: BaseException) -> RequestRecord:
        return RequestRecord(prompt_len, sum(self.chunk_tokens), self.sent_s - self.run_start_s, self.ttft_ms,
                             self.itl_ms, self.chunk_tokens, None, False, f"{type(exc).__name__}: {exc}")


class SocketTarget:
    """The daemon's Unix socket, through the client library."""

    def __init__(self, socket_path: Path | str | None) -> None:
        self.client = AsyncClient(socket_path)

    async def model_info(self) -> ModelInfo:
        stats = await self.client.stats()
        return ModelInfo(stats.model, stats.vocab_size or None, stats.max_model_len or None,
                         list(stats.special_token_ids))

    async def send(self, request: BenchRequest, params: SamplingParams, run_start_s: float) -> RequestRecord:
        timing = _Timing(run_start_s)
        try:
            stream = self.client.stream(request.prompt, params)
            async for delta in stream:
                if delta.token_ids:
                    timing.chunk(len(delta.token_ids))
            completion = stream.completion
            if completion is None:  # the loop ends only on Done or an error, so this is a daemon bug
                raise PipelineError("stream ended without a Done reply")
        except (PipelineError, OSError) as exc:  # OSError: the connection broke below the protocol
            return timing.failure(request.prompt_len or 0, exc)
        return timing.record(completion.usage.prompt_tokens, completion.usage.completion_tokens)

    async def speculative_counts(self) -> SpeculativeCounts:
        try:
            stats = await self.client.stats()
        except (PipelineError, OSError):  # the run's records stand without them
            return SpeculativeCounts()
        return stats.speculative

    async def close(self) -> None:
        await self.client.close()


class HttpTarget:
    """An OpenAI-compatible server at `base_url`, streamed with `stream_options.include_usage`
    (the usage chunk gives the token counts; each content chunk counts as one token until then)."""

    def __init__(self, base_url: str, endpoint: str = "completions", *, model: str | None = None,
                 api_key: str | None = None) -> None:
        import aiohttp  # only the HTTP target needs it

        if endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {endpoint!r}")
        self.base_url = base_url.rstrip("/")
        self.endpoint = endpoint
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None),
                                              connector=aiohttp.TCPConnector(limit=0))
        self._errors = (aiohttp.ClientError, OSError, ValueError, msgspec.DecodeError)

    async def model_info(self) -> ModelInfo:
        async with self._session.get(f"{self.base_url}/v1/models") as response:
            if response.status != 200:
                raise PipelineError(f"GET {self.base_url}/v1/models answered {response.status}: "
                                    f"{(await response.text())[:200]}")
            models = msgspec.json.decode(await response.read()).get("data") or []
        card = next((m for m in models if self.model is None or m.get("id") == self.model), None)
        if card is None:
            raise PipelineError(f"{self.base_url} serves {[m.get('id') for m in models]}, not {self.model!r}")
        self.model = card.get("id")
        return ModelInfo(self.model, card.get("vocab_size"), card.get("max_model_len"),
                         list(card.get("special_token_ids") or []))

    def _body(self, request: BenchRequest, params: SamplingParams) -> dict:
        body: dict = {"model": self.model, "max_tokens": params.max_tokens, "temperature": params.temperature,
                      "top_p": params.top_p, "stream": True, "stream_options": {"include_usage": True}}
        if params.top_k > 0:
            body["top_k"] = params.top_k
        if params.ignore_eos:
            body["ignore_eos"] = True
        if self.endpoint == "chat":
            if not isinstance(request.prompt, str):
                raise ValueError("the chat endpoint needs text prompts (random prompts are words then)")
            body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt
        return body

    async def send(self, request: BenchRequest, params: SamplingParams, run_start_s: float) -> RequestRecord:
        timing = _Timing(run_start_s)
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        usage = None
        try:
            async with self._session.post(self.base_url + path, json=self._body(request, params)) as response:
                if response.status != 200:
                    raise PipelineError(f"HTTP {response.status}: {(await response.text())[:300]}")
                async for line in response.content:
                    if not line.startswith(_DATA):
                        continue
                    data = line[len(_DATA):].strip()
                    if data == _DONE:
                        break
                    chunk = _chunk_decoder.decode(data)
                    if chunk.error is not None:
                        raise PipelineError(f"error in the stream: {chunk.error}")
                    usage = chunk.usage or usage
                    for choice in chunk.choices:
                        text = choice.text if choice.delta is None else choice.delta.content
                        if text:
                            timing.chunk(1)
        except (PipelineError, *self._errors) as exc:
            return timing.failure(request.prompt_len or 0, exc)
        if usage is None:
            return timing.failure(request.prompt_len or 0, PipelineError("the stream ended without a usage chunk"))
        return timing.record(usage.prompt_tokens, usage.completion_tokens)

    async def speculative_counts(self) -> SpeculativeCounts:
        try:
            async with self._session.get(f"{self.base_url}/metrics") as response:
                return speculative_counts_of(await response.text()) if response.status == 200 else SpeculativeCounts()
        except self._errors:  # a server without /metrics, or one that does not parse: nothing said
            return SpeculativeCounts()

    async def close(self) -> None:
        await self._session.close()


def speculative_counts_of(exposition: str) -> SpeculativeCounts:
    """The speculative decoding counters of a Prometheus text exposition, summed over their labels."""
    totals = dict.fromkeys(("num_draft_tokens", "num_accepted_tokens", "num_verifications"), 0.0)
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            field_name = _SPEC_DECODE_SERIES.get(sample.name.rpartition(":")[2])
            if field_name is not None:
                totals[field_name] += sample.value
    return SpeculativeCounts(**{name: int(total) for name, total in totals.items()})
