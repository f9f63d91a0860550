"""The OpenAI-compatible HTTP API of a live daemon, through the official `openai` SDK (sync and
async) and through raw HTTP: the same tokens as the socket API, streams, chat templates, n and
seed, every error status, disconnects that free the request, and Prometheus metrics."""
from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import openai
import pytest
from live_daemon import REAL_BACKEND, WORKLOAD, LiveDaemon, bench, serving, wait_idle
from prometheus_client.parser import text_string_to_metric_families

from pipeline.client import Client
from pipeline.models.tiny_model import make_tiny_model
from pipeline.serve.openai.chat import ChatTemplate
from pipeline.serve.openai.schemas import ChatMessage

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not REAL_BACKEND, reason="starts `pipeline start --port` itself")]

API_KEY = "sk-test-key"
MODEL = "tiny"
LIMIT_IN_FLIGHT = 16  # --max-num-seqs 8 --max-waiting 8


@pytest.fixture(scope="module")
def daemon(daemon_model: Path) -> Iterator[LiveDaemon]:
    with serving(daemon_model, ["--port", "0", "--api-key", API_KEY, "--served-model-name", MODEL,
                                "--max-num-seqs", "8", "--max-waiting", "8"]) as live:
        yield live


@pytest.fixture(scope="module")
def url(daemon: LiveDaemon) -> str:
    with Client(daemon.socket_path) as client:
        http_url = client.health().http_url
    assert http_url is not None and http_url.startswith("http://127.0.0.1:")
    return http_url


@pytest.fixture(scope="module")
def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(api_key=API_KEY, base_url=f"{url}/v1", max_retries=0)


def raw(url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None
        ) -> tuple[int, dict, bytes]:
    parts = urlparse(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def authorized(extra: dict | None = None) -> dict:
    return {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json", **(extra or {})}


def test_greedy_completion_equals_the_socket_api_token_for_token(daemon: LiveDaemon, sdk: openai.OpenAI) -> None:
    with Client(daemon.socket_path) as client:
        for prompt in ("the quick brown fox", [5, 6, 7, 8, 9, 10]):
            expected = client.generate(prompt, {"max_tokens": 16, "temperature": 0.0, "logprobs": 0})
            got = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logprobs=0)
            choice = got.choices[0]
            assert choice.text == expected.text and choice.finish_reason == expected.finish_reason
            assert choice.logprobs.token_logprobs == pytest.approx([t.logprob for t in expected.logprobs], abs=1e-5)
            assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
                expected.usage.prompt_tokens, expected.usage.completion_tokens)


def test_streamed_text_equals_the_whole_text_with_usage_last(sdk: openai.OpenAI) -> None:
    options = dict(model=MODEL, prompt="a token mailbox ring", max_tokens=24, temperature=0)
    whole = sdk.completions.create(**options).choices[0].text
    chunks = list(sdk.completions.create(**options, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_a_stream_interval_sends_the_same_text_in_fewer_events(daemon_model: Path, sdk: openai.OpenAI) -> None:
    completion = dict(model=MODEL, prompt="a token mailbox ring", max_tokens=24, temperature=0)
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_completion_tokens=24,
                temperature=0)
    whole = sdk.completions.create(**completion).choices[0].text
    whole_chat = sdk.chat.completions.create(**chat).choices[0].message.content
    with serving(daemon_model, ["--port", "0", "--served-model-name", MODEL, "--stream-interval", "4"]) as interval:
        with Client(interval.socket_path) as client:
            http_url = client.health().http_url
        held = openai.OpenAI(api_key="unused", base_url=f"{http_url}/v1", max_retries=0)
        chunks = list(held.completions.create(**completion, stream=True, stream_options={"include_usage": True}))
        chat_chunks = list(held.chat.completions.create(**chat, stream=True))
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert "".join(texts) == whole
    assert 2 <= len(texts) <= 1 + -(-23 // 4)  # the first token alone, then at most 4 tokens an event
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24
    contents = [c.choices[0].delta.content for c in chat_chunks if c.choices[0].delta.content]
    assert "".join(contents) == whole_chat and len(contents) <= 1 + -(-23 // 4)
    assert chat_chunks[0].choices[0].delta.role == "assistant"


def test_chat_renders_the_checkpoints_template(daemon: LiveDaemon, daemon_model: Path, sdk: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    rendered = ChatTemplate.from_checkpoint(daemon_model).render([ChatMessage(**m) for m in messages])
    assert "<|im_start|>user\nhello there<|im_end|>" in rendered and rendered.endswith("<|im_start|>assistant\n")
    with Client(daemon.socket_path) as client:
        expected = client.generate(rendered, {"max_tokens": 12, "temperature": 0.0})
    got = sdk.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12, temperature=0)
    assert got.choices[0].message.content == expected.text
    assert got.choices[0].message.role == "assistant" and got.usage.prompt_tokens == expected.usage.prompt_tokens


def test_async_sdk_streams_chat_with_the_role_first(url: str) -> None:
    async def run() -> list:
        client = openai.AsyncOpenAI(api_key=API_KEY, base_url=f"{url}/v1", max_retries=0)
        try:
            stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                          max_tokens=8, temperature=0, stream=True)
            return [chunk async for chunk in stream]
        finally:
            await client.close()

    chunks = asyncio.run(run())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices_with_a_seed_repeat_and_differ(daemon: LiveDaemon, sdk: openai.OpenAI) -> None:
    options = dict(model=MODEL, prompt="shared memory ring " * 8, max_tokens=12, temperature=1.0, seed=1234, n=3)
    first = [c.text for c in sdk.completions.create(**options).choices]
    again = [c.text for c in sdk.completions.create(**options).choices]
    assert first == again and len(set(first)) == 3
    with Client(daemon.socket_path) as client:  # choice 0 samples with the seed itself
        alone = client.generate(options["prompt"], {"max_tokens": 12, "temperature": 1.0, "seed": 1234})
    assert first[0] == alone.text
    with Client(daemon.socket_path) as client:
        assert client.stats().prefix_cache_hit_rate > 0  # the later choices found the prompt cached


def test_every_error_is_openai_shaped_with_the_sdk_exception(sdk: openai.OpenAI, url: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert bad.value.body["param"] == "temperature" and "[0.0, 100.0]" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=0)
    assert bad.value.body["param"] == "max_completion_tokens"
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.completions.create(model="gpt-4", prompt="x")
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(api_key="wrong", base_url=f"{url}/v1", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError) as too_long:
        sdk.completions.create(model=MODEL, prompt=list(range(2, 3000)), max_tokens=4)
    assert too_long.value.body["code"] == "context_length_exceeded"
    # More distinct prompts than the daemon admits at once: 503, and none of them stays running.
    with pytest.raises(openai.InternalServerError) as overloaded:
        sdk.completions.create(model=MODEL, prompt=[f"prompt {i}" for i in range(LIMIT_IN_FLIGHT + 1)], max_tokens=2)
    assert overloaded.value.status_code == 503 and overloaded.value.body["code"] == "overloaded"


def test_raw_http_bad_input_gets_4xx_never_500(url: str) -> None:
    cases = [
        ("POST", "/v1/completions", b"{not json", authorized(), 400),
        ("POST", "/v1/completions", b'{"prompt": 5}', authorized(), 400),
        ("POST", "/v1/completions", b'{"prompt": "x"}', authorized({"Content-Type": "text/plain"}), 415),
        ("POST", "/v1/completions", b"x" * (17 * 1024 * 1024), authorized(), 413),
        ("POST", "/v1/completions", b'{"prompt": "x"}', {"Content-Type": "application/json"}, 401),
        ("POST", "/v1/completions", b'{"prompt": "x"}', {"Authorization": "Basic abc"}, 401),
        ("GET", "/v1/nowhere", None, authorized(), 404),
        ("GET", "/v1/completions", None, authorized(), 405),
    ]
    for method, path, body, headers, status in cases:
        got, got_headers, payload = raw(url, method, path, body, headers)
        assert got == status, (path, headers, payload[:200])
        error = json.loads(payload)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_models_health_version_and_metrics(daemon: LiveDaemon, sdk: openai.OpenAI, url: str) -> None:
    (card,) = sdk.models.list().data
    assert card.id == MODEL and card.model_extra["vocab_size"] == 1024 and card.model_extra["max_model_len"] == 2048
    assert raw(url, "GET", "/health")[0] == 200 and json.loads(raw(url, "GET", "/version")[2])["version"]

    def counters() -> dict[str, float]:
        status, headers, body = raw(url, "GET", "/metrics")
        assert status == 200 and headers["content-type"].startswith("text/plain")
        samples = {}
        for family in text_string_to_metric_families(body.decode()):
            for sample in family.samples:
                if sample.labels.get("model_name") == MODEL and sample.labels.get("finished_reason") in (None, "length"):
                    samples[sample.name] = sample.value
        return samples

    before = counters()
    sdk.completions.create(model=MODEL, prompt="metrics move", max_tokens=5, temperature=0)
    with Client(daemon.socket_path) as client:  # the socket's requests count too
        client.generate("metrics move", {"max_tokens": 5, "temperature": 0.0})
    after = counters()
    assert after["pipeline:generation_tokens_total"] - before["pipeline:generation_tokens_total"] == 10
    assert after["pipeline:request_success_total"] - before["pipeline:request_success_total"] == 2
    assert after["pipeline:time_to_first_token_seconds_count"] - before["pipeline:time_to_first_token_seconds_count"] == 2
    assert after["pipeline:request_queue_time_seconds_count"] - before["pipeline:request_queue_time_seconds_count"] == 2
    for gauge in ("pipeline:num_requests_running", "pipeline:kv_cache_usage_perc", "pipeline:prefix_cache_hit_rate"):
        assert gauge in after


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_request(daemon: LiveDaemon, url: str, stream: bool) -> None:
    parts = urlparse(url)
    body = json.dumps({"model": MODEL, "prompt": "a long story", "max_tokens": 1500, "ignore_eos": True,
                       "stream": stream}).encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        if stream:
            received = b""
            while received.count(b"data: ") < 3:
                received += sock.recv(65536)
        with Client(daemon.socket_path) as client:
            deadline = time.monotonic() + 10
            while client.stats().num_running_requests != 1:
                assert time.monotonic() < deadline, "the request never ran"
                time.sleep(0.01)
    start = time.monotonic()
    wait_idle(daemon.socket_path, timeout_s=5.0)  # the request ended and gave its KV blocks back
    assert time.monotonic() - start < 5.0


def test_an_sse_client_that_stops_reading_stalls_no_one_and_later_gets_its_whole_stream(
        daemon: LiveDaemon, url: str, sdk: openai.OpenAI) -> None:
    parts = urlparse(url)
    params = {"model": MODEL, "prompt": "a slow reader", "max_tokens": 1500, "temperature": 0.0, "ignore_eos": True}
    expected = sdk.completions.create(model=MODEL, prompt="a slow reader", max_tokens=1500, temperature=0.0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    body = json.dumps({**params, "stream": True}).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the daemon's writes back up
        sock.settimeout(60)
        sock.connect((parts.hostname, parts.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        # Unread, its 1500 frames (about 300 KB) back up behind a small window: the batch loop
        # that writes every stream's frames must not wait for this one.
        for i in range(4):
            other = sdk.completions.create(model=MODEL, prompt=f"another {i}", max_tokens=8, temperature=0.0,
                                           stream=True)
            assert [chunk.choices[0].finish_reason for chunk in other][-1] in ("stop", "length")
        received = b""
        while not received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
            data = sock.recv(65536)
            assert data, "the stream ended early"
            received += data
    frames = [json.loads(frame) for frame in re.findall(rb"data: (\{.*?\})\n\n", received)]
    assert "".join(frame["choices"][0]["text"] for frame in frames) == expected
    assert frames[-1]["choices"][0]["finish_reason"] == "length"


def test_pipeline_bench_drives_the_http_api_with_either_endpoint(url: str) -> None:
    for endpoint in ("completions", "chat"):
        report = bench("--base-url", url, "--api-key", API_KEY, "--endpoint", endpoint, "--num-prompts", "6",
                       *WORKLOAD)
        assert (report["completed"], report["failed"]) == (6, 0), report["requests"]
        assert all(4 <= record["output_len"] <= 12 for record in report["requests"])


def test_bench_draws_prompts_below_the_served_vocabulary(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "small-vocab", "llama", seed=5, vocab_size=300)
    with serving(model, ["--port", "0"]) as daemon:
        with Client(daemon.socket_path) as client:
            stats, http_url = client.stats(), client.health().http_url
        assert stats.vocab_size == 300 and stats.special_token_ids == [0, 1]
        for target in (["--socket", str(daemon.socket_path)], ["--base-url", http_url]):
            report = bench(*target, "--num-prompts", "32", *WORKLOAD)
            assert (report["completed"], report["failed"]) == (32, 0)
