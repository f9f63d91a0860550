"""Error bodies have OpenAI's exact shape, and the openai SDK raises the exception each status means."""
from __future__ import annotations

import httpx
import openai
import pytest

from pipeline.errors import InvalidRequest, Overloaded, PromptTooLong, RequestNotFound, StageFailed
from pipeline.serve.openai.errors import OpenAIError, error_body, from_pipeline_error


def raised_by_sdk(error: OpenAIError) -> openai.APIStatusError:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(error.status, content=error_body(error), headers={"content-type": "application/json"})

    client = openai.OpenAI(api_key="unused", base_url="http://test/v1", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(answer)))
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="tiny", prompt="x")
    return info.value


def test_the_body_holds_exactly_message_type_param_and_code():
    assert error_body(OpenAIError(400, "n: must be in [1, 128], got 0", param="n")) == (
        b'{"error":{"message":"n: must be in [1, 128], got 0","type":"invalid_request_error","param":"n","code":null}}'
    )
    assert error_body(OpenAIError(503, "busy", code="overloaded")) == (
        b'{"error":{"message":"busy","type":"service_unavailable_error","param":null,"code":"overloaded"}}'
    )


@pytest.mark.parametrize("status, exception", [
    (400, openai.BadRequestError),
    (401, openai.AuthenticationError),
    (404, openai.NotFoundError),
    (413, openai.APIStatusError),
    (429, openai.RateLimitError),
    (500, openai.InternalServerError),
    (503, openai.InternalServerError),
])
def test_the_sdk_raises_the_exception_of_each_status_with_our_fields(status, exception):
    raised = raised_by_sdk(OpenAIError(status, "what went wrong", param="prompt", code="some_code"))
    assert type(raised) is exception and raised.status_code == status
    assert raised.message.endswith("what went wrong")
    assert raised.param == "prompt" and raised.code == "some_code"


def test_daemon_errors_map_to_the_status_a_client_expects():
    invalid = from_pipeline_error(InvalidRequest("temperature", "must be in [0.0, 100.0], got 300.0"))
    assert (invalid.status, invalid.param, invalid.message) == (400, "temperature", "temperature: must be in [0.0, 100.0], got 300.0")
    too_long = from_pipeline_error(PromptTooLong("prompt of 5000 tokens exceeds max_model_len 2048"))
    assert (too_long.status, too_long.code) == (400, "context_length_exceeded")
    assert from_pipeline_error(Overloaded("no room")).status == 503
    assert from_pipeline_error(RequestNotFound("no such request")).status == 404
    failed = from_pipeline_error(StageFailed("the runner died"))
    assert (failed.status, failed.type, failed.code) == (503, "service_unavailable_error", "stage_failed")


def test_an_error_status_outside_4xx_and_5xx_is_refused():
    with pytest.raises(ValueError, match="got 200"):
        OpenAIError(200, "fine")
