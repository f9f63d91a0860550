"""Request bodies -> one SamplingParams per choice, with OpenAI's defaults and this server's limits.

A request makes `n` choices per prompt; a completion request may hold a batch of prompts, and
choice `prompt_index * n + i` is prompt `prompt_index`'s i-th (vLLM's numbering). With a `seed`,
choice i samples with `derive_seed(seed, i)`, so the n choices differ from each other and a
repeated request repeats every one of them. Every range error is a 400 naming the field, as
the request spells it, and its allowed range.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from stages.contracts.params import MAX_SEED, MAX_TOKEN_ID, InvalidParams, SamplingParams
from stages.grammar import check_guided
from pipeline.serve.openai.errors import OpenAIError
from pipeline.serve.openai.schemas import ChatCompletionRequest, CompletionRequest, SamplingRequest

MAX_N = 128  # choices per prompt: each is a full request to the engine
MAX_CHOICES = 256  # choices per HTTP request, over all its prompts (prompts x n)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# Fields with the same name and meaning in a request and in SamplingParams; a request's None
# leaves SamplingParams' default.
_SHARED_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
    "include_stop_str_in_output", "speculative",
)


@dataclass(slots=True)
class ChoiceRequest:
    """One engine request of a completion request: the choice it fills, its prompt, its params."""

    index: int
    prompt: str | list[int]  # text, or token ids that skip the tokenizer
    params: SamplingParams
    resume_token_ids: list[int] = dataclasses.field(default_factory=list)  # outputs it continues after


def derive_seed(seed: int, choice: int) -> int:
    """Choice `choice`'s seed: `seed` itself for choice 0, else a hash of both (the same on
    every run and machine, and in [0, MAX_SEED])."""
    if choice == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{choice}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & MAX_SEED


def completion_requests(request: CompletionRequest) -> list[ChoiceRequest]:
    """The engine requests of a `/v1/completions` body, in choice-index order."""
    prompts = _prompts(request.prompt)
    n = _num_choices(request, len(prompts))
    if request.echo and request.logprobs is not None:
        raise OpenAIError.bad_request(
            "echo: echo with logprobs needs the prompt's logprobs, which this server does not compute", "echo"
        )
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if request.max_tokens is None else request.max_tokens
    choice_params = _choice_params(request, n, max_tokens=max_tokens, logprobs=request.logprobs, renames={})
    resumed = resume_token_ids(request, len(prompts) * n)
    return [
        ChoiceRequest(prompt_index * n + i, prompt, params, resumed)
        for prompt_index, prompt in enumerate(prompts)
        for i, params in enumerate(choice_params)
    ]


def chat_params(request: ChatCompletionRequest, *, default_max_tokens: int,
                tool_schema: dict | None = None) -> list[SamplingParams]:
    """The params of each of a `/v1/chat/completions` body's n choices, in index order.

    `default_max_tokens` applies when the body sets neither max_completion_tokens nor
    max_tokens (OpenAI's default is "up to the context length": max_model_len - prompt tokens).
    `tool_schema` constrains the output to a forced tool call (tools.py).
    """
    n = _num_choices(request, 1)
    renames = {"logprobs": "top_logprobs"}
    if request.max_completion_tokens is not None:
        max_tokens = request.max_completion_tokens
        renames["max_tokens"] = "max_completion_tokens"
    else:
        max_tokens = default_max_tokens if request.max_tokens is None else request.max_tokens
    if request.top_logprobs is not None and not request.logprobs:
        raise OpenAIError.bad_request("top_logprobs: needs logprobs set to true", "top_logprobs")
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    extra = {}
    if tool_schema is not None:
        if request.response_format is not None or _guided_names(request):
            raise OpenAIError.bad_request("tool_choice: a forced tool call cannot be combined with response_format or "
                                          "guided_* fields", "tool_choice")
        extra["json_schema"] = json.dumps(tool_schema)
        renames["json_schema"] = "tools"
    return _choice_params(request, n, max_tokens=max_tokens, logprobs=logprobs, renames=renames, extra=extra)


def resume_token_ids(request: SamplingRequest, num_choices: int) -> list[int]:
    """The engine extension `resume_token_ids`: outputs already delivered that the request
    continues after, as the daemon resumes a request after a crash (same params, the output
    position carried, so seeded sampling goes on exactly). One choice only."""
    token_ids = request.resume_token_ids
    if not token_ids:
        return []
    if num_choices != 1:
        raise OpenAIError.bad_request(
            f"resume_token_ids: continues one choice only, this request makes {num_choices}", "resume_token_ids")
    if request.echo if isinstance(request, CompletionRequest) else False:
        raise OpenAIError.bad_request("resume_token_ids: cannot be combined with echo", "resume_token_ids")
    _check_token_ids("resume_token_ids", token_ids)
    return list(token_ids)


def stream_usage(request: SamplingRequest) -> bool:
    """Whether a streamed response ends with a usage chunk (`stream_options.include_usage`)."""
    return bool(request.stream and request.stream_options is not None and request.stream_options.include_usage)


def _choice_params(
    request: SamplingRequest, n: int, *, max_tokens: int, logprobs: int | None, renames: dict[str, str],
    extra: dict | None = None,
) -> list[SamplingParams]:
    values = {name: getattr(request, name) for name in _SHARED_FIELDS if getattr(request, name) is not None}
    values.update(_constraint_values(request, renames))
    values.update(extra or {})
    try:
        params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **values)
        check_guided(params)
    except InvalidParams as exc:
        raise OpenAIError.from_invalid_params(exc, renames.get(exc.field)) from None
    if params.seed is None:
        return [params] + [dataclasses.replace(params) for _ in range(n - 1)]
    return [dataclasses.replace(params, seed=derive_seed(params.seed, i)) for i in range(n)]


# vLLM's guided_* request fields -> the SamplingParams field each sets
_GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def _guided_names(request: SamplingRequest) -> list[str]:
    return [name for name in _GUIDED_FIELDS if getattr(request, name) is not None]


def _constraint_values(request: SamplingRequest, renames: dict[str, str]) -> dict:
    """SamplingParams values of response_format, guided_* and logit_bias; `renames` learns how the
    request spells each field it sets, for errors."""
    values: dict = {}
    given: list[str] = []
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            values["json_object"] = True
            renames["json_object"] = "response_format"
        elif response_format.type == "json_schema":
            if response_format.json_schema is None or response_format.json_schema.schema is None:
                raise OpenAIError.bad_request("response_format.json_schema.schema: required with type 'json_schema'",
                                              "response_format.json_schema.schema")
            values["json_schema"] = json.dumps(response_format.json_schema.schema)
            renames["json_schema"] = "response_format.json_schema.schema"
        else:
            raise OpenAIError.bad_request(f"response_format.type: must be 'text', 'json_object' or 'json_schema', "
                                          f"got {response_format.type!r}", "response_format.type")
        given.append("response_format")
    for name in _guided_names(request):
        value = getattr(request, name)
        if name == "guided_json" and not isinstance(value, str):
            value = json.dumps(value)
        values[_GUIDED_FIELDS[name]] = value
        renames[_GUIDED_FIELDS[name]] = name
        given.append(name)
    if len(given) > 1:
        raise OpenAIError.bad_request(f"{given[1]}: only one of response_format and the guided_* fields may be set, "
                                      f"got {given}", given[1])
    if request.logit_bias:
        bias = {}
        for key, value in request.logit_bias.items():
            if not key.isdigit():
                raise OpenAIError.bad_request(f"logit_bias: keys must be token ids, got {key!r}", "logit_bias")
            bias[int(key)] = value
        values["logit_bias"] = bias
    return values


def _num_choices(request: SamplingRequest, num_prompts: int) -> int:
    n = 1 if request.n is None else request.n
    if not 1 <= n <= MAX_N:
        raise OpenAIError.bad_request(f"n: must be in [1, {MAX_N}], got {n}", "n")
    if num_prompts * n > MAX_CHOICES:
        raise OpenAIError.bad_request(
            f"prompt: {num_prompts} prompts with n={n} make {num_prompts * n} choices, more than the "
            f"{MAX_CHOICES} one request may ask for",
            "prompt",
        )
    return n


def _prompts(prompt: str | list[str | int | list[int]]) -> list[str | list[int]]:
    """A completion body's prompt as a batch: one string or token-id list per prompt."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError.bad_request("prompt: must not be an empty list", "prompt")
    if all(isinstance(item, int) for item in prompt):
        _check_token_ids("prompt", prompt)
        return [prompt]
    if all(isinstance(item, str) for item in prompt):
        return list(prompt)
    if all(isinstance(item, list) for item in prompt):
        for i, token_ids in enumerate(prompt):
            if not token_ids:
                raise OpenAIError.bad_request(f"prompt[{i}]: must hold at least one token id", f"prompt[{i}]")
            _check_token_ids(f"prompt[{i}]", token_ids)
        return list(prompt)
    raise OpenAIError.bad_request(
        "prompt: must be a string, a list of token ids, a list of strings or a list of token-id lists, "
        "not a list that mixes them",
        "prompt",
    )


def _check_token_ids(name: str, token_ids: list[int]) -> None:
    for i, token_id in enumerate(token_ids):
        if not 0 <= token_id <= MAX_TOKEN_ID:
            raise OpenAIError.bad_request(
                f"{name}[{i}]: a token id must be in [0, {MAX_TOKEN_ID}], got {token_id}", f"{name}[{i}]"
            )
