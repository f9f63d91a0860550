"""The JSON bodies of `POST /v1/completions` and `POST /v1/chat/completions`, as msgspec Structs.

Requests: msgspec checks each field's type while decoding; ranges are checked where the
sampling parameters are made (`params.py`), so each error is found once. Unknown fields are
ignored, because OpenAI clients send fields this server has no use for (`parallel_tool_calls`,
`store`, ...). Every optional field also accepts JSON null, as OpenAI's API does.

Responses and stream chunks have OpenAI's field names and order. A field that is `UNSET` is
left out of the JSON: a chunk has no `usage` key unless `stream_options.include_usage`.
"""
from __future__ import annotations

import re
from typing import TypeVar

import msgspec
from msgspec import UNSET, Struct, UnsetType

from pipeline.serve.openai.errors import OpenAIError

# --- requests ---


class StreamOptions(Struct):
    include_usage: bool | None = None


class JsonSchemaFormat(Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict | None = None
    strict: bool | None = None


class ResponseFormat(Struct, kw_only=True):
    type: str  # "text", "json_object" or "json_schema"
    json_schema: JsonSchemaFormat | None = None


class SamplingRequest(Struct, kw_only=True):
    """The fields both endpoints share."""

    model: str | None = None  # None: the served model
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # structured output: OpenAI's response_format and logit_bias (token id as a string -> bias),
    # and vLLM's guided_* fields
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # engine extensions: each streamed chunk carries its tokens' ids; a request that continues
    # outputs already delivered (one choice only), as the daemon resumes one after a crash;
    # false turns speculative decoding off for this request
    return_token_ids: bool | None = None
    resume_token_ids: list[int] | None = None
    speculative: bool | None = None


class CompletionRequest(SamplingRequest, kw_only=True):
    # A string, token ids, a list of strings, or a list of token-id lists: msgspec allows one
    # array type in a union, so the list's shape is checked in params.py.
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = None
    logprobs: int | None = None  # how many alternatives per token
    echo: bool | None = None


class ContentPart(Struct):
    type: str
    text: str | None = None


class ChatMessage(Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class FunctionDefinition(Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict | None = None


class Tool(Struct, kw_only=True):
    type: str  # "function"
    function: FunctionDefinition


class NamedFunction(Struct, kw_only=True):
    name: str


class NamedToolChoice(Struct, kw_only=True):
    type: str  # "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest, kw_only=True):
    messages: list[ChatMessage]
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None  # "none", "auto", "required" or a named function
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None  # how many alternatives per token, with logprobs


R = TypeVar("R", "CompletionRequest", "ChatCompletionRequest")
_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)


def decode_completion_request(body: bytes) -> CompletionRequest:
    """The request, or a 400 OpenAIError whose message and `param` name the bad field."""
    return _decode(_completion_decoder, body)


def decode_chat_request(body: bytes) -> ChatCompletionRequest:
    """The request, or a 400 OpenAIError whose message and `param` name the bad field."""
    return _decode(_chat_decoder, body)


# msgspec's messages end in " - at `$.path`" (absent for the body itself) and name a missing
# field inside the message; the error's `param` is that path without the "$.".
_AT_PATH = re.compile(r"^(?P<problem>.*?)(?: - at `\$\.?(?P<path>[^`]*)`)?$", re.DOTALL)
_MISSING_FIELD = re.compile(r"^Object missing required field `(?P<name>[^`]*)`$")


def _decode(decoder: msgspec.json.Decoder[R], body: bytes) -> R:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise _field_error(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise OpenAIError.bad_request(f"the request body is not valid JSON: {exc}") from None


def _field_error(message: str) -> OpenAIError:
    match = _AT_PATH.match(message)
    problem, path = match["problem"], match["path"] or ""
    missing = _MISSING_FIELD.match(problem)
    if missing:
        path = f"{path}.{missing['name']}" if path else missing["name"]
        problem = "this field is required"
    elif problem:
        problem = problem[0].lower() + problem[1:]
    if not path:
        return OpenAIError.bad_request(f"the request body: {problem}")
    return OpenAIError.bad_request(f"{path}: {problem}", param=path)


# --- responses ---


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]  # per token: alternative text -> logprob
    text_offset: list[int]  # per token: where its text starts in the choice's text


class CompletionChoice(Struct):
    text: str
    index: int
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    token_ids: list[int] | UnsetType = UNSET  # with `return_token_ids`, in stream chunks


class _ResponseHead(Struct, kw_only=True):
    """The fields every body and chunk starts with; each kind sets its `object`."""

    id: str
    object: str
    created: int  # Unix time, seconds
    model: str


class Completion(_ResponseHead, kw_only=True):
    """A `text_completion` body, and also each streamed chunk of one (same shape)."""

    object: str = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None | UnsetType = UNSET


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob]


class FunctionCall(Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class AssistantMessage(Struct, kw_only=True):
    role: str = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | UnsetType = UNSET  # when the model called tools


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(_ResponseHead, kw_only=True):
    object: str = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(Struct):
    name: str | UnsetType = UNSET  # in a call's first chunk
    arguments: str = ""  # the next piece of the arguments' JSON text


class ToolCallDelta(Struct):
    """A piece of a streamed tool call: its first carries id, type and the function's name."""

    index: int  # which call of the choice
    function: FunctionCallDelta
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET


class ChatDelta(Struct):
    role: str | UnsetType = UNSET  # only in a choice's first chunk
    content: str | UnsetType = UNSET  # absent in a chunk that only finishes the choice
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    token_ids: list[int] | UnsetType = UNSET  # with `return_token_ids`


class ChatCompletionChunk(_ResponseHead, kw_only=True):
    object: str = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None | UnsetType = UNSET
