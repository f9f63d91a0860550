"""Chat tools: the output constraint a `tool_choice` makes, and the tool calls read back from the output.

- A named function (`{"type": "function", "function": {"name": ...}}`): the output is that
  function's arguments, constrained by its `parameters` schema.
- `"required"`: the output is a JSON array of one or more `{"name": ..., "parameters": {...}}`,
  each constrained by its function's schema (vLLM's form).
- `"auto"` (the default when tools are given): the output is free; tool calls the model wrote in
  the Hermes/Qwen template form, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, are
  read back from it. `"none"`: tools are only shown to the template.

A call whose output ended normally comes back as `tool_calls` with finish_reason `tool_calls`;
one cut by max_tokens keeps its text as content and finish_reason `length`.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from pipeline.serve.openai.errors import OpenAIError
from pipeline.serve.openai.schemas import ChatCompletionRequest, FunctionCall, NamedToolChoice, ToolCall

ANY_OBJECT = {"type": "object"}  # a function that declares no parameters takes any object
_TAGGED_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(slots=True)
class ToolPlan:
    mode: str  # "named", "required" or "auto"
    schema: dict | None  # what the output must match when the call is forced
    function_name: str = ""  # the named function

    def message(self, text: str, finish_reason: str) -> tuple[str | None, list[ToolCall] | None, str]:
        """(content, tool_calls, finish_reason) of a finished choice whose output is `text`."""
        if finish_reason != "stop":
            return text, None, finish_reason
        if self.mode == "named":
            return None, [_call(self.function_name, text)], "tool_calls"
        if self.mode == "required":
            calls = [_call(item["name"], json.dumps(item["parameters"])) for item in json.loads(text)]
            return None, calls, "tool_calls"
        calls = []
        for body in _TAGGED_CALL.findall(text):
            try:
                parsed = json.loads(body)
            except ValueError:
                continue
            if isinstance(parsed, dict) and isinstance(parsed.get("name"), str):
                calls.append(_call(parsed["name"], json.dumps(parsed.get("arguments", {}))))
        if not calls:
            return text, None, finish_reason
        content = _TAGGED_CALL.sub("", text).strip()
        return content or None, calls, "tool_calls"


def tool_plan(request: ChatCompletionRequest) -> ToolPlan | None:
    """What the request's tools and tool_choice ask of its output; None when nothing (no tools,
    or tool_choice "none"). A 400 names a malformed tool or a choice that names no tool."""
    tools = request.tools or []
    parameters: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise OpenAIError.bad_request(f"tools[{i}].type: only 'function' tools are supported, got {tool.type!r}",
                                          f"tools[{i}].type")
        parameters[tool.function.name] = tool.function.parameters or ANY_OBJECT
    choice = request.tool_choice if request.tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in parameters:
            raise OpenAIError.bad_request(f"tool_choice.function.name: {name!r} is not one of the request's tools "
                                          f"{sorted(parameters)}", "tool_choice.function.name")
        return ToolPlan("named", parameters[name], name)
    if choice == "none":
        return None
    if choice not in ("auto", "required"):
        raise OpenAIError.bad_request(f"tool_choice: must be 'none', 'auto', 'required' or a named function, "
                                      f"got {choice!r}", "tool_choice")
    if not tools:
        if choice == "required":
            raise OpenAIError.bad_request("tool_choice: 'required' needs at least one tool in `tools`", "tool_choice")
        return None
    if choice == "auto":
        return ToolPlan("auto", None)
    items = [{"type": "object", "properties": {"name": {"enum": [name]}, "parameters": schema},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, schema in parameters.items()]
    return ToolPlan("required", {"type": "array", "minItems": 1, "items": {"anyOf": items}})


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(f"call_{secrets.token_hex(12)}", FunctionCall(name, arguments))


def template_tools(request: ChatCompletionRequest) -> list[dict] | None:
    """The tools as a chat template reads them (transformers passes them as `tools`)."""
    if not request.tools:
        return None
    return [{"type": tool.type, "function": {"name": tool.function.name, "description": tool.function.description,
                                             "parameters": tool.function.parameters or ANY_OBJECT}}
            for tool in request.tools]
