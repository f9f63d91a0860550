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

Streamed (`ToolStream`), a named function's arguments go out as they come; each call of
"required" goes out whole once its array element closes; with "auto" the text is content until a
`<tool_call>` starts, and the block is held back until it closes, then sent as a call (or as
content, when it does not hold one). A call already sent stays sent when max_tokens cuts the rest.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from pipeline.serve.openai.errors import OpenAIError
from pipeline.serve.openai.schemas import (
    ChatCompletionRequest,
    FunctionCall,
    FunctionCallDelta,
    NamedToolChoice,
    ToolCall,
    ToolCallDelta,
)

ANY_OBJECT = {"type": "object"}  # a function that declares no parameters takes any object
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
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
        calls = [call for call in map(_tagged_call, _TAGGED_CALL.findall(text)) if call is not None]
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


class ToolStream:
    """One streamed choice's output read as its plan's tool calls: `feed` each text delta, then
    `finish`; each gives the content to send and the tool call pieces (ToolCallDelta)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.num_calls = 0
        self._held = ""  # text read but not yet sent: an open "auto" block, or "required"'s array
        self._in_block = False  # "auto": _held starts with CALL_OPEN
        self._scan = _ElementScanner()

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self.plan.mode == "named":
            if self.num_calls:
                return "", [ToolCallDelta(0, FunctionCallDelta(arguments=text))] if text else []
            return "", [self._start_call(self.plan.function_name, text)]
        if self.plan.mode == "required":
            self._held += text
            return "", [self._start_call(item["name"], json.dumps(item["parameters"]))
                        for item in self._scan.elements(self._held)]
        return self._feed_auto(text)

    def finish(self, finish_reason: str) -> tuple[str, list[ToolCallDelta], str]:
        """What is left to send when the output ended with `finish_reason`, and the reason to send."""
        content, calls = "", []
        if self.plan.mode == "named" and not self.num_calls and finish_reason == "stop":
            calls.append(self._start_call(self.plan.function_name, ""))
        elif self.plan.mode == "required" and not self.num_calls:
            content = self._held  # cut before its first call closed: the text, as unstreamed
        elif self.plan.mode == "auto":
            content = self._held  # a block that never closed is text
        self._held = ""
        if self.num_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return content, calls, finish_reason

    def _feed_auto(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        held = self._held + text
        content, calls = [], []
        while True:
            if not self._in_block:
                start = held.find(CALL_OPEN)
                if start < 0:
                    keep = _partial_suffix(held, CALL_OPEN)
                    content.append(held[:len(held) - keep])
                    held = held[len(held) - keep:]
                    break
                content.append(held[:start])
                held, self._in_block = held[start:], True
            end = held.find(CALL_CLOSE)
            if end < 0:
                break
            block, held = held[:end + len(CALL_CLOSE)], held[end + len(CALL_CLOSE):]
            self._in_block = False
            call = _tagged_call(block[len(CALL_OPEN):-len(CALL_CLOSE)].strip())
            if call is None:
                content.append(block)
            else:
                calls.append(self._start_call(call.function.name, call.function.arguments))
        self._held = held
        return "".join(content), calls

    def _start_call(self, name: str, arguments: str) -> ToolCallDelta:
        index, self.num_calls = self.num_calls, self.num_calls + 1
        return ToolCallDelta(index, FunctionCallDelta(name, arguments), _call_id(), "function")


class _ElementScanner:
    """Finds the objects of a JSON array as its text grows (strings and nesting respected)."""

    def __init__(self) -> None:
        self._pos = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._start = 0

    def elements(self, text: str) -> list:
        """The array's elements that closed in text[previous end:], parsed."""
        found = []
        for i in range(self._pos, len(text)):
            char = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._start = i
            elif char in "]}":
                self._depth -= 1
                if self._depth == 1:
                    found.append(json.loads(text[self._start:i + 1]))
        self._pos = len(text)
        return found


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (it may be the marker's start)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _tagged_call(body: str) -> ToolCall | None:
    """The call a `<tool_call>` block's body holds, or None when it holds none."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if isinstance(parsed, dict) and isinstance(parsed.get("name"), str):
        return _call(parsed["name"], json.dumps(parsed.get("arguments", {})))
    return None


def _call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(_call_id(), FunctionCall(name, arguments))


def template_tools(request: ChatCompletionRequest) -> list[dict] | None:
    """The tools as a chat template reads them (transformers passes them as `tools`)."""
    if not request.tools:
        return None
    return [{"type": tool.type, "function": {"name": tool.function.name, "description": tool.function.description,
                                             "parameters": tool.function.parameters or ANY_OBJECT}}
            for tool in request.tools]
