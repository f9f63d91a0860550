"""The non-streamed response bodies, and logprobs in OpenAI's two shapes.

The engine reports each output token as a `TokenLogprobs`: the sampled token's id and logprob
and the most likely alternatives (ids and logprobs). `token_text` turns an id into the text a
client sees for it. Completions carry `tokens`, `token_logprobs`, `top_logprobs` (one
text -> logprob dict per token, holding the sampled token too, as vLLM's do) and `text_offset`;
chat carries `content`: one {token, logprob, bytes, top_logprobs} per token.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from pipeline.protocol import TokenLogprobs
from pipeline.serve.openai.tools import ToolPlan
from pipeline.serve.openai.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatLogprobs,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    TopLogprob,
    Usage,
)

TokenText = Callable[[int], str]
# JSON has no -inf (a token the sampler masked); OpenAI's API sends this floor instead.
MIN_LOGPROB = -9999.0

encoder = msgspec.json.Encoder()


@dataclass(slots=True)
class FinishedChoice:
    """One choice of a finished request, as the engine reported it."""

    text: str
    finish_reason: str  # "stop", "length" or "abort"
    logprobs: Sequence[TokenLogprobs] | None = None  # one per output token, when asked for


def count_usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    """A request's usage: its prompt counted once, the tokens of all its choices summed."""
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


def completion_body(
    response_id: str, model: str, created: int, choices: Sequence[FinishedChoice], usage: Usage, token_text: TokenText
) -> bytes:
    """A `text_completion` body; choice i of `choices` gets index i."""
    return encoder.encode(Completion(
        id=response_id,
        created=created,
        model=model,
        choices=[
            CompletionChoice(
                choice.text,
                index,
                None if choice.logprobs is None else completion_logprobs(choice.logprobs, token_text),
                choice.finish_reason,
            )
            for index, choice in enumerate(choices)
        ],
        usage=usage,
    ))


def chat_completion_body(
    response_id: str, model: str, created: int, choices: Sequence[FinishedChoice], usage: Usage, token_text: TokenText,
    tools: ToolPlan | None = None,
) -> bytes:
    """A `chat.completion` body; choice i of `choices` gets index i. With `tools`, a choice's output
    is read as the tool calls they asked for (tools.py)."""
    body_choices = []
    for index, choice in enumerate(choices):
        content, tool_calls, finish_reason = choice.text, None, choice.finish_reason
        if tools is not None:
            content, tool_calls, finish_reason = tools.message(choice.text, choice.finish_reason)
        message = AssistantMessage(content=content) if tool_calls is None else AssistantMessage(
            content=content, tool_calls=tool_calls)
        body_choices.append(ChatChoice(index, message,
                                       None if choice.logprobs is None else chat_logprobs(choice.logprobs, token_text),
                                       finish_reason))
    return encoder.encode(ChatCompletion(id=response_id, created=created, model=model, choices=body_choices,
                                         usage=usage))


def completion_logprobs(entries: Sequence[TokenLogprobs], token_text: TokenText, text_offset: int = 0) -> CompletionLogprobs:
    """Completion-shaped logprobs; `text_offset` is where the first token's text starts in the
    choice's text, and each next token starts where the previous one's text ends."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in entries:
        text = token_text(entry.token_id)
        tokens.append(text)
        token_logprobs.append(_finite(entry.logprob))
        top = {token_text(token_id): _finite(logprob) for token_id, logprob in zip(entry.top_token_ids, entry.top_logprobs)}
        top.setdefault(text, _finite(entry.logprob))
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return CompletionLogprobs(tokens, token_logprobs, top_logprobs, offsets)


def chat_logprobs(entries: Sequence[TokenLogprobs], token_text: TokenText) -> ChatLogprobs:
    """Chat-shaped logprobs. `bytes` is the UTF-8 of the token's text as `token_text` gives it."""
    content = []
    for entry in entries:
        text = token_text(entry.token_id)
        top = []
        for token_id, logprob in zip(entry.top_token_ids, entry.top_logprobs):
            alternative = token_text(token_id)
            top.append(TopLogprob(alternative, _finite(logprob), list(alternative.encode())))
        content.append(ChatTokenLogprob(text, _finite(entry.logprob), list(text.encode()), top))
    return ChatLogprobs(content)


def _finite(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # NaN fails the test too
