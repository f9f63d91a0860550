"""Structured-output request fields -> SamplingParams, tool plans, and tool calls in response bodies."""
from __future__ import annotations

import json

import msgspec
import pytest

from pipeline.serve.openai.errors import OpenAIError
from pipeline.serve.openai.params import chat_params, completion_requests
from pipeline.serve.openai.responses import FinishedChoice, chat_completion_body, count_usage
from pipeline.serve.openai.schemas import decode_chat_request, decode_completion_request
from pipeline.serve.openai.tools import tool_plan

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
OTHER_TOOL = {"type": "function", "function": {"name": "no_args"}}


def completion_params(**fields: object):
    body = json.dumps({"prompt": "Hello", **fields}).encode()
    [choice] = completion_requests(decode_completion_request(body))
    return choice.params


def chat_body(**fields: object):
    return decode_chat_request(json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields}).encode())


def refused(call) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        call()
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(("fields", "expected"), [
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     {"json_schema": json.dumps(SCHEMA)}),
    ({"response_format": {"type": "text"}}, {}),
    ({"guided_json": SCHEMA}, {"json_schema": json.dumps(SCHEMA)}),
    ({"guided_json": json.dumps(SCHEMA)}, {"json_schema": json.dumps(SCHEMA)}),
    ({"guided_regex": "[a-z]+"}, {"regex": "[a-z]+"}),
    ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
    ({"guided_grammar": 'start: "x"'}, {"grammar": 'start: "x"'}),
    ({"logit_bias": {"7": 2.5, "9": -100}}, {"logit_bias": {7: 2.5, 9: -100.0}}),
])
def test_constraint_fields_map_to_sampling_params(fields: dict, expected: dict) -> None:
    params = completion_params(**fields)
    for name in ("json_object", "json_schema", "regex", "choice", "grammar", "logit_bias"):
        assert getattr(params, name) == expected.get(name, getattr(type(params)(), name)), name


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({"guided_json": {"type": "objectx"}}, "guided_json", "objectx"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "nope"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "required"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "'yaml'"),
    ({"guided_grammar": 'start: a\na: "x" b'}, "guided_grammar", "unknown name"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one of"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "only one of"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"3": 101}}, "logit_bias[3]", "-100.0, 100.0"),
])
def test_bad_constraints_are_400s_naming_the_request_field(fields: dict, param: str, words: str) -> None:
    error = refused(lambda: completion_params(**fields))
    assert error.param == param and words in error.message


def test_a_named_tool_constrains_the_output_to_its_parameters_and_answers_tool_calls() -> None:
    body = chat_body(tools=[TOOL, OTHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    plan = tool_plan(body)
    [params] = chat_params(body, default_max_tokens=50, tool_schema=plan.schema)
    assert json.loads(params.json_schema) == SCHEMA
    content, calls, reason = plan.message('{"a": 3}', "stop")
    assert content is None and reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments), c.type) for c in calls] == [("get_weather", {"a": 3}, "function")]
    assert plan.message('{"a": ', "length") == ('{"a": ', None, "length")


def test_required_asks_for_a_list_of_calls_to_the_tools() -> None:
    plan = tool_plan(chat_body(tools=[TOOL, OTHER_TOOL], tool_choice="required"))
    assert plan.schema["type"] == "array" and plan.schema["minItems"] == 1
    assert [item["properties"]["name"]["enum"] for item in plan.schema["items"]["anyOf"]] == [["get_weather"], ["no_args"]]
    _, calls, reason = plan.message('[{"name": "no_args", "parameters": {}}, {"name": "get_weather", "parameters": {"a": 1}}]',
                                    "stop")
    assert reason == "tool_calls" and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("no_args", {}), ("get_weather", {"a": 1})]


def test_auto_reads_tagged_tool_calls_and_leaves_plain_text_alone() -> None:
    plan = tool_plan(chat_body(tools=[TOOL]))
    assert plan.mode == "auto" and plan.schema is None
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"a": 2}}\n</tool_call>'
    content, calls, reason = plan.message(text, "stop")
    assert (content, reason) == ("Let me look.", "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"a": 2})]
    assert plan.message("no calls here", "stop") == ("no calls here", None, "stop")
    assert plan.message("<tool_call>not json</tool_call>", "stop")[1] is None
    assert tool_plan(chat_body(tools=[TOOL], tool_choice="none")) is None
    assert tool_plan(chat_body()) is None


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type"),
])
def test_bad_tool_requests_are_400s(fields: dict, param: str) -> None:
    assert refused(lambda: tool_plan(chat_body(**fields))).param == param


def test_a_forced_call_cannot_be_combined_with_another_constraint() -> None:
    body = chat_body(tools=[TOOL], tool_choice="required", guided_regex="a")
    error = refused(lambda: chat_params(body, default_max_tokens=5, tool_schema=tool_plan(body).schema))
    assert error.param == "tool_choice"


def test_a_chat_body_with_tool_calls_has_openais_shape() -> None:
    plan = tool_plan(chat_body(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    body = msgspec.json.decode(chat_completion_body("id", "m", 1, [FinishedChoice('{"a": 1}', "stop")],
                                                    count_usage(3, 4), str, plan))
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["role"] == "assistant" and message["content"] is None
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"a": 1}'}
    plain = msgspec.json.decode(chat_completion_body("id", "m", 1, [FinishedChoice("hi", "stop")], count_usage(3, 4), str))
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "hi"}


def test_a_template_that_shows_tools_gets_them() -> None:
    from pipeline.serve.openai.chat import ChatTemplate
    from pipeline.serve.openai.tools import template_tools

    template = ChatTemplate("{% for tool in tools or [] %}[{{ tool.function.name }}: {{ tool.function.parameters | tojson }}]"
                            "{% endfor %}{{ messages[0].content }}")
    body = chat_body(tools=[TOOL, OTHER_TOOL])
    assert template.render(body.messages, tools=template_tools(body)) == (
        f'[get_weather: {json.dumps(SCHEMA)}][no_args: {{"type": "object"}}]hi')
    assert template.render(body.messages) == "hi"


def _streamed(plan, pieces: list[str], finish_reason: str = "stop") -> tuple[str, dict[int, list[str]], str]:
    """Feeds `pieces` to a ToolStream: (content sent, call index -> [name, arguments], finish_reason)."""
    from pipeline.serve.openai.tools import ToolStream

    tool_stream = ToolStream(plan)
    content, calls = [], {}

    def take(text, deltas):
        content.append(text)
        for delta in deltas:
            if delta.id is not msgspec.UNSET:
                assert delta.index not in calls and delta.type == "function" and delta.id.startswith("call_")
                calls[delta.index] = [delta.function.name, ""]
            calls[delta.index][1] += delta.function.arguments

    for piece in pieces:
        take(*tool_stream.feed(piece))
    text, deltas, reason = tool_stream.finish(finish_reason)
    take(text, deltas)
    return "".join(content), calls, reason


def _pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 3, 100])
def test_a_streamed_named_call_sends_its_arguments_as_they_come(size: int) -> None:
    plan = tool_plan(chat_body(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert _streamed(plan, _pieces('{"a": 1}', size)) == ("", {0: ["get_weather", '{"a": 1}']}, "tool_calls")
    assert _streamed(plan, _pieces('{"a', size), "length") == ("", {0: ["get_weather", '{"a']}, "length")


@pytest.mark.parametrize("size", [1, 4, 200])
def test_streamed_required_calls_go_out_as_each_element_closes(size: int) -> None:
    plan = tool_plan(chat_body(tools=[TOOL, OTHER_TOOL], tool_choice="required"))
    text = '[{"name": "get_weather", "parameters": {"a": 1}}, {"name": "no_args", "parameters": {"s": "}]\\"{["}}]'
    expected = {0: ["get_weather", '{"a": 1}'], 1: ["no_args", json.dumps({"s": '}]"{['})]}
    assert _streamed(plan, _pieces(text, size)) == ("", expected, "tool_calls")
    content, calls, reason = _streamed(plan, _pieces(text[:30], size), "length")
    assert (content, calls, reason) == (text[:30], {}, "length")  # nothing closed: the text, as unstreamed
    whole = chat_completion_body("id", "m", 0, [FinishedChoice(text, "stop")], count_usage(1, 1), str, plan)
    sent = msgspec.json.decode(whole)["choices"][0]["message"]["tool_calls"]
    assert {i: [c["function"]["name"], c["function"]["arguments"]] for i, c in enumerate(sent)} == expected


@pytest.mark.parametrize("size", [1, 2, 5, 300])
def test_streamed_auto_holds_a_tool_call_block_until_it_closes(size: int) -> None:
    plan = tool_plan(chat_body(tools=[TOOL]))
    text = ('Let me look <tool_call>{"name": "get_weather", "arguments": {"a": 2}}</tool_call> and '
            '<tool_call>not json</tool_call> done <tool_')
    content, calls, reason = _streamed(plan, _pieces(text, size))
    assert calls == {0: ["get_weather", '{"a": 2}']} and reason == "tool_calls"
    assert content == "Let me look  and <tool_call>not json</tool_call> done <tool_"
    assert _streamed(plan, _pieces("no calls < here", size)) == ("no calls < here", {}, "stop")


def test_a_tool_chunk_carries_the_call_pieces_as_openai_sends_them() -> None:
    from pipeline.serve.openai.schemas import FunctionCallDelta, ToolCallDelta
    from pipeline.serve.openai.sse import ChatStream

    stream = ChatStream("chatcmpl-1", "m", 0, str, include_usage=False)
    stream.chunk(0, "")  # the choice's opening frame, with the role
    first = ToolCallDelta(0, FunctionCallDelta("get_weather", '{"a"'), "call_x", "function")
    delta = msgspec.json.decode(stream.tool_chunk(0, "", [first])[len(b"data: "):])["choices"][0]["delta"]
    assert delta == {"tool_calls": [{"index": 0, "id": "call_x", "type": "function",
                                     "function": {"name": "get_weather", "arguments": '{"a"'}}]}
    last = msgspec.json.decode(stream.tool_chunk(0, "", [ToolCallDelta(0, FunctionCallDelta(arguments=": 1}"))],
                                                 finish_reason="tool_calls")[len(b"data: "):])["choices"][0]
    assert last["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}
    assert last["finish_reason"] == "tool_calls"
