"""Structured output through a live daemon: the openai SDK's response_format, guided_* and tools calls,
the socket client's constraint fields, and bad constraints refused with a 400 before queueing."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from live_daemon import REAL_BACKEND, LiveDaemon, serving, wait_idle
from structured_cases import CHOICES, PERSON_SCHEMA, REGEX, WEATHER_TOOL, check_json_schema, check_regex

from pipeline.client import Client
from pipeline.errors import InvalidRequest

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not REAL_BACKEND, reason="starts `pipeline start --port` itself")]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NUM_CHOICES = 10


@pytest.fixture(scope="module")
def daemon(daemon_model: Path) -> Iterator[LiveDaemon]:
    with serving(daemon_model, ["--port", "0", "--max-num-seqs", "16", "--served-model-name", "default"]) as live:
        yield live


@pytest.fixture(scope="module")
def sdk(daemon: LiveDaemon) -> openai.OpenAI:
    with Client(daemon.socket_path) as client:
        url = client.health().http_url
    return openai.OpenAI(api_key="unused", base_url=f"{url}/v1", max_retries=0)


def test_response_format_json_schema_choices_all_validate(sdk: openai.OpenAI) -> None:
    response = sdk.chat.completions.create(
        model="default", messages=MESSAGES, n=NUM_CHOICES, seed=11, temperature=1.0, max_tokens=96,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}})
    assert len(response.choices) == NUM_CHOICES
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        check_json_schema(choice.message.content)


def test_named_tool_choice_answers_tool_calls_with_valid_arguments(sdk: openai.OpenAI) -> None:
    response = sdk.chat.completions.create(
        model="default", messages=MESSAGES, n=NUM_CHOICES, seed=5, temperature=1.0, max_tokens=64,
        tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])


def test_required_tool_choice_answers_one_or_more_calls(sdk: openai.OpenAI) -> None:
    response = sdk.chat.completions.create(
        model="default", messages=MESSAGES, n=4, seed=9, temperature=1.0, max_tokens=200,
        tools=[WEATHER_TOOL], tool_choice="required")
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        assert len(choice.message.tool_calls) >= 1
        for call in choice.message.tool_calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required",
                                         "auto"])
def test_streamed_tool_calls_accumulate_to_the_unstreamed_answer(sdk: openai.OpenAI, tool_choice: object) -> None:
    request = dict(model="default", messages=MESSAGES, seed=7, temperature=1.0, max_tokens=400, tools=[WEATHER_TOOL],
                   tool_choice=tool_choice)
    whole = sdk.chat.completions.create(**request).choices[0]
    state = ChatCompletionStreamState()
    chunks = list(sdk.chat.completions.create(**request, stream=True))
    for chunk in chunks:
        state.handle_chunk(chunk)
    streamed = state.current_completion_snapshot.choices[0]  # the SDK's accumulation
    assert streamed.finish_reason == whole.finish_reason == chunks[-1].choices[0].finish_reason
    calls = [(call.function.name, call.function.arguments) for call in streamed.message.tool_calls or []]
    assert calls == [(call.function.name, call.function.arguments) for call in whole.message.tool_calls or []]
    if tool_choice == "auto":  # the tiny model writes no <tool_call> block: plain text, as unstreamed
        assert streamed.message.content == whole.message.content and not calls
        return
    assert whole.finish_reason == "tool_calls" and calls
    firsts = [delta for chunk in chunks for delta in chunk.choices[0].delta.tool_calls or [] if delta.id]
    assert [(d.index, d.type, d.function.name) for d in firsts] == [(i, "function", "get_weather")
                                                                   for i in range(len(calls))]


def test_guided_fields_stream_and_a_cut_grammar_ends_with_length(sdk: openai.OpenAI) -> None:
    chunks = list(sdk.completions.create(model="default", prompt="a domain:", max_tokens=32, seed=2, stream=True,
                                         extra_body={"guided_regex": REGEX}))
    check_regex("".join(c.choices[0].text for c in chunks if c.choices))
    assert chunks[-1].choices[0].finish_reason == "stop"
    choice = sdk.completions.create(model="default", prompt="pick", max_tokens=8, temperature=0,
                                    extra_body={"guided_choice": CHOICES}).choices[0]
    assert choice.text in CHOICES and choice.finish_reason == "stop"
    cut = sdk.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=3,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}).choices[0]
    assert cut.finish_reason == "length" and cut.message.content.startswith("{")


@pytest.mark.parametrize(("extra", "param"), [
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
    ({"logit_bias": {"5": 1.0, "900000": 2.0}}, "logit_bias[900000]"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias[5]"),
])
def test_bad_constraints_are_400s_and_nothing_is_queued(daemon: LiveDaemon, sdk: openai.OpenAI, extra: dict,
                                                        param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="default", messages=MESSAGES, max_tokens=8, extra_body=extra)
    assert info.value.body["param"] == param
    stats = wait_idle(daemon.socket_path)
    assert stats.num_running_requests == 0 and stats.num_waiting_requests == 0


def test_the_socket_client_takes_the_same_fields(daemon: LiveDaemon) -> None:
    with Client(daemon.socket_path) as client:
        done = client.generate("json please", {"max_tokens": 96, "seed": 4, "json_schema": json.dumps(PERSON_SCHEMA)})
        check_json_schema(done.text)
        assert client.generate("x", {"max_tokens": 4, "temperature": 0, "logit_bias": {77: 100.0}}).token_ids == [77] * 4
        with pytest.raises(InvalidRequest) as info:
            client.generate("x", {"max_tokens": 4, "regex": "a(b"})
        assert info.value.field == "regex"
        with pytest.raises(InvalidRequest, match="outside the model's vocabulary") as info:
            client.generate("x", {"max_tokens": 4, "logit_bias": {900_000: 1.0}})
        assert info.value.field == "logit_bias[900000]"
