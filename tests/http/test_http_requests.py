"""OpenAI request bodies: decoding, the errors a client sees, and the per-choice sampling params."""
from __future__ import annotations

import json

import pytest

from stages.contracts.params import MAX_SEED, SamplingParams
from pipeline.serve.openai.errors import OpenAIError
from pipeline.serve.openai.params import (
    MAX_CHOICES,
    MAX_N,
    chat_params,
    completion_requests,
    derive_seed,
    stream_usage,
)
from pipeline.serve.openai.schemas import decode_chat_request, decode_completion_request


def completion(**fields: object) -> bytes:
    return json.dumps({"model": "default", "prompt": "Hello", **fields}).encode()


def chat(**fields: object) -> bytes:
    return json.dumps({"model": "default", "messages": [{"role": "user", "content": "Hi"}], **fields}).encode()


def refused(fn, *args, **kwargs) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        fn(*args, **kwargs)
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value


def test_a_full_completion_body_maps_every_field_to_sampling_params():
    body = completion(
        max_tokens=7, temperature=0.5, top_p=0.9, stop=["\n\n", "END"], seed=3, logprobs=2,
        presence_penalty=0.5, frequency_penalty=-0.5, user="someone", top_k=40, min_p=0.1,
        repetition_penalty=1.2, min_tokens=2, ignore_eos=True, stop_token_ids=[5, 9],
        skip_special_tokens=False, include_stop_str_in_output=True,
        logit_bias={"50256": -100}, suffix=None, best_of=1,  # suffix and best_of are ignored
    )
    [choice] = completion_requests(decode_completion_request(body))
    assert choice.index == 0 and choice.prompt == "Hello"
    assert choice.params == SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, stop=["\n\n", "END"], seed=3, logprobs=2,
        presence_penalty=0.5, frequency_penalty=-0.5, top_k=40, min_p=0.1, repetition_penalty=1.2,
        min_tokens=2, ignore_eos=True, stop_token_ids=[5, 9], skip_special_tokens=False,
        include_stop_str_in_output=True, logit_bias={50256: -100.0},
    )


def test_defaults_are_openais_and_nulls_mean_default():
    [choice] = completion_requests(decode_completion_request(completion(temperature=None, stop=None, n=None)))
    assert choice.params == SamplingParams(max_tokens=16)
    [params] = chat_params(decode_chat_request(chat(max_tokens=None)), default_max_tokens=100)
    assert params == SamplingParams(max_tokens=100)


def test_stop_may_be_one_string():
    [choice] = completion_requests(decode_completion_request(completion(stop="\n")))
    assert choice.params.stop == ["\n"]


@pytest.mark.parametrize("prompt, expected", [
    ("text", ["text"]),
    ([1, 2, 3], [[1, 2, 3]]),
    (["a", "b"], ["a", "b"]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_every_prompt_shape_becomes_a_batch(prompt, expected):
    choices = completion_requests(decode_completion_request(completion(prompt=prompt)))
    assert [c.prompt for c in choices] == expected
    assert [c.index for c in choices] == list(range(len(expected)))


def test_choices_of_a_prompt_batch_are_numbered_prompt_major():
    choices = completion_requests(decode_completion_request(completion(prompt=["a", "b"], n=3)))
    assert [(c.index, c.prompt) for c in choices] == [(0, "a"), (1, "a"), (2, "a"), (3, "b"), (4, "b"), (5, "b")]


def test_n_choices_with_a_seed_get_distinct_seeds_that_a_repeat_reproduces():
    body = completion(n=4, seed=1234, temperature=1.0)
    seeds = [c.params.seed for c in completion_requests(decode_completion_request(body))]
    again = [c.params.seed for c in completion_requests(decode_completion_request(body))]
    assert seeds == again
    assert seeds[0] == 1234 and len(set(seeds)) == 4
    assert all(0 <= s <= MAX_SEED for s in seeds)
    # The same derivation in chat, and from the function itself (stable across processes:
    # a hash of the values, not Python's randomized hash()).
    assert [p.seed for p in chat_params(decode_chat_request(chat(n=4, seed=1234)), default_max_tokens=8)] == seeds
    assert derive_seed(1234, 2) == seeds[2] == derive_seed(1234, 2)
    assert derive_seed(1234, 1) != derive_seed(1235, 1)


def test_n_choices_without_a_seed_are_unseeded_and_independent_objects():
    choices = completion_requests(decode_completion_request(completion(n=3)))
    assert [c.params.seed for c in choices] == [None, None, None]
    assert len({id(c.params) for c in choices}) == 3


def test_chat_maps_max_completion_tokens_logprobs_and_top_logprobs():
    [params] = chat_params(decode_chat_request(chat(max_completion_tokens=5, max_tokens=99, logprobs=True,
                                                    top_logprobs=3)), default_max_tokens=100)
    assert params.max_tokens == 5 and params.logprobs == 3
    [params] = chat_params(decode_chat_request(chat(logprobs=True)), default_max_tokens=100)
    assert params.logprobs == 0  # the sampled token's logprob, no alternatives
    [params] = chat_params(decode_chat_request(chat(logprobs=False)), default_max_tokens=100)
    assert params.logprobs is None


def test_stream_usage_needs_stream_and_include_usage():
    assert stream_usage(decode_completion_request(completion(stream=True, stream_options={"include_usage": True})))
    assert not stream_usage(decode_completion_request(completion(stream=True)))
    assert not stream_usage(decode_completion_request(completion(stream=False, stream_options={"include_usage": True})))


@pytest.mark.parametrize("body, param, words", [
    (b'{"prompt": "a"', None, "not valid JSON"),
    (b'[1, 2]', None, "expected `object`"),
    (b'{"model": "m"}', "prompt", "required"),
    (completion(prompt=3), "prompt", "got `int`"),
    (completion(prompt=[1, [2, "x"]]), "prompt[1][1]", "expected `int`"),
    (completion(max_tokens="10"), "max_tokens", "expected `int | null`, got `str`"),
    (completion(temperature=[1]), "temperature", "expected `float | null`"),
    (completion(stream_options={"include_usage": "yes"}), "stream_options.include_usage", "expected `bool"),
])
def test_completion_bodies_of_the_wrong_shape_name_the_field(body, param, words):
    error = refused(decode_completion_request, body)
    assert error.param == param
    assert words in error.message
    if param is not None:
        assert error.message.startswith(param + ":")


@pytest.mark.parametrize("body, param, words", [
    (b'{"model": "m"}', "messages", "required"),
    (chat(messages=[{"content": "hi"}]), "messages[0].role", "required"),
    (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", "got `int`"),
    (chat(logprobs=3), "logprobs", "expected `bool | null`"),
])
def test_chat_bodies_of_the_wrong_shape_name_the_field(body, param, words):
    error = refused(decode_chat_request, body)
    assert error.param == param and words in error.message


@pytest.mark.parametrize("fields, param, words", [
    ({"temperature": 150}, "temperature", "[0.0, 100.0], got 150"),
    ({"top_p": 0}, "top_p", "(0.0, 1.0], got 0"),
    ({"max_tokens": 0}, "max_tokens", "[1, 2147483647], got 0"),
    ({"logprobs": 21}, "logprobs", "[0, 20], got 21"),
    ({"seed": -1}, "seed", "got -1"),
    ({"n": 0}, "n", f"[1, {MAX_N}], got 0"),
    ({"n": MAX_N + 1}, "n", f"[1, {MAX_N}]"),
    ({"prompt": ["x"] * 3, "n": 100}, "prompt", f"300 choices, more than the {MAX_CHOICES}"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [[1], []]}, "prompt[1]", "at least one token id"),
    ({"prompt": [1, "a"]}, "prompt", "mixes"),
    ({"prompt": [3, -1]}, "prompt[1]", "[0, 2147483647], got -1"),
    ({"stop": ["ok", ""]}, "stop", "non-empty"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", "[0, 10], got 20"),
    ({"echo": True, "logprobs": 1}, "echo", "prompt's logprobs"),
])
def test_out_of_range_completion_values_name_the_field_and_its_range(fields, param, words):
    error = refused(completion_requests, decode_completion_request(completion(**fields)))
    assert error.param == param
    assert error.message.startswith(param + ":") and words in error.message


@pytest.mark.parametrize("fields, param, words", [
    ({"max_completion_tokens": 0}, "max_completion_tokens", "[1, 2147483647], got 0"),
    ({"max_tokens": -5}, "max_tokens", "got -5"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20], got 21"),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs set to true"),
    ({"n": 500}, "n", f"[1, {MAX_N}], got 500"),
    ({"frequency_penalty": 3}, "frequency_penalty", "[-2.0, 2.0], got 3"),
])
def test_out_of_range_chat_values_name_the_field_as_the_request_spells_it(fields, param, words):
    error = refused(chat_params, decode_chat_request(chat(**fields)), default_max_tokens=100)
    assert error.param == param
    assert error.message.startswith(param + ":") and words in error.message


def test_resume_token_ids_continue_one_choice_and_are_checked() -> None:
    (choice,) = completion_requests(decode_completion_request(completion(resume_token_ids=[5, 6], seed=4)))
    assert choice.resume_token_ids == [5, 6] and choice.params.seed == 4
    assert completion_requests(decode_completion_request(completion()))[0].resume_token_ids == []
    assert refused(completion_requests, decode_completion_request(completion(resume_token_ids=[5], n=2))).param == \
        "resume_token_ids"
    assert "echo" in refused(completion_requests, decode_completion_request(
        completion(resume_token_ids=[5], echo=True))).message
    assert refused(completion_requests, decode_completion_request(
        completion(resume_token_ids=[5, -1]))).param == "resume_token_ids[1]"


def test_speculative_false_turns_speculation_off_for_every_choice_of_both_endpoints() -> None:
    choices = completion_requests(decode_completion_request(completion(prompt=["a", "b"], n=2, speculative=False)))
    assert [c.params.speculative for c in choices] == [False] * 4
    assert completion_requests(decode_completion_request(completion(speculative=None)))[0].params.speculative
    assert completion_requests(decode_completion_request(completion()))[0].params.speculative
    [params] = chat_params(decode_chat_request(chat(speculative=False)), default_max_tokens=100)
    assert params.speculative is False
    [params] = chat_params(decode_chat_request(chat(speculative=True)), default_max_tokens=100)
    assert params.speculative is True


@pytest.mark.parametrize("value", ["false", 0, 1, [False]])
def test_a_speculative_field_that_is_not_a_bool_is_a_400_naming_it(value: object) -> None:
    for decode, body in ((decode_completion_request, completion(speculative=value)),
                         (decode_chat_request, chat(speculative=value))):
        error = refused(decode, body)
        assert error.param == "speculative" and error.message.startswith("speculative: expected `bool | null`")
