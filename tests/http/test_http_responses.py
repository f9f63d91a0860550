"""Response bodies and Server-Sent-Event frames: byte-exact, and read back by the openai SDK."""
from __future__ import annotations

import httpx
import openai

from pipeline.protocol import TokenLogprobs
from pipeline.serve.openai.responses import (
    FinishedChoice,
    chat_completion_body,
    completion_body,
    count_usage,
)
from pipeline.serve.openai.sse import DONE, ChatStream, CompletionStream

CREATED = 1700000000
TOKENS = {5: " Hello", 6: " world", 7: "!", 8: " there"}


def token_text(token_id: int) -> str:
    return TOKENS[token_id]


def sdk_client(body: bytes, content_type: str) -> openai.OpenAI:
    """An SDK client whose every request is answered with `body`."""
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": content_type})

    transport = httpx.MockTransport(answer)
    return openai.OpenAI(api_key="unused", base_url="http://test/v1", max_retries=0, http_client=httpx.Client(transport=transport))


def test_completion_stream_frames_are_byte_exact():
    stream = CompletionStream("cmpl-1", "tiny", CREATED, token_text, include_usage=False)
    assert stream.chunk(0, " Hello") == (
        b'data: {"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"tiny",'
        b'"choices":[{"text":" Hello","index":0,"logprobs":null,"finish_reason":null}]}\n\n'
    )
    assert stream.chunk(1, "", finish_reason="length") == (
        b'data: {"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"tiny",'
        b'"choices":[{"text":"","index":1,"logprobs":null,"finish_reason":"length"}]}\n\n'
    )
    assert DONE == b"data: [DONE]\n\n"


def test_chat_stream_opens_each_choice_with_the_role_and_ends_with_usage():
    stream = ChatStream("chatcmpl-1", "tiny", CREATED, token_text, include_usage=True)
    head = b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"tiny",'
    assert stream.chunk(0, "") == head + (
        b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
        b'"usage":null}\n\n'
    )
    assert stream.chunk(1, " Hi") == head + (
        b'"choices":[{"index":1,"delta":{"role":"assistant","content":" Hi"},"logprobs":null,"finish_reason":null}],'
        b'"usage":null}\n\n'
    )
    assert stream.chunk(0, " Hello") == head + (
        b'"choices":[{"index":0,"delta":{"content":" Hello"},"logprobs":null,"finish_reason":null}],"usage":null}\n\n'
    )
    assert stream.chunk(0, "", finish_reason="stop") == head + (
        b'"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}],"usage":null}\n\n'
    )
    assert stream.usage_chunk(4, 3) == head + (
        b'"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":3,"total_tokens":7}}\n\n'
    )


def test_completion_logprobs_hold_the_sampled_token_and_offsets_run_on_across_chunks():
    stream = CompletionStream("cmpl-1", "tiny", CREATED, token_text, include_usage=False)
    stream.chunk(0, "Say:")  # an echoed prompt: no logprobs, but it moves the offsets
    frame = stream.chunk(0, " Hello world", logprobs=[
        TokenLogprobs(5, -0.25, [5, 8], [-0.25, -0.5]),  # the sampled token among the alternatives
        TokenLogprobs(6, -1.5, [7], [float("-inf")]),  # sampled outside them: added; -inf is not JSON
    ])
    assert b'"logprobs":{"tokens":[" Hello"," world"],"token_logprobs":[-0.25,-1.5],' in frame
    assert b'"top_logprobs":[{" Hello":-0.25," there":-0.5},{"!":-9999.0," world":-1.5}],' in frame
    assert b'"text_offset":[4,10]}' in frame


def test_chat_logprobs_carry_utf8_bytes_and_the_top_alternatives():
    def text(token_id: int) -> str:
        return {1: "é", 2: "e"}[token_id]

    frame = ChatStream("c", "tiny", CREATED, text, include_usage=False).chunk(
        0, "é", logprobs=[TokenLogprobs(1, -0.1, [1, 2], [-0.1, -2.5])]
    )
    assert b'"logprobs":{"content":[{"token":"\xc3\xa9","logprob":-0.1,"bytes":[195,169],"top_logprobs":' \
           b'[{"token":"\xc3\xa9","logprob":-0.1,"bytes":[195,169]},{"token":"e","logprob":-2.5,"bytes":[101]}]}]}' in frame


def test_a_non_streamed_completion_is_byte_exact_and_the_sdk_reads_it():
    body = completion_body("cmpl-9", "tiny", CREATED, [
        FinishedChoice(" Hello world", "length"),
        FinishedChoice("!", "stop", [TokenLogprobs(7, -0.5, [7], [-0.5])]),
    ], count_usage(3, 3), token_text)
    assert body.startswith(
        b'{"id":"cmpl-9","object":"text_completion","created":1700000000,"model":"tiny","choices":['
        b'{"text":" Hello world","index":0,"logprobs":null,"finish_reason":"length"},'
    )
    assert body.endswith(b'"usage":{"prompt_tokens":3,"completion_tokens":3,"total_tokens":6}}')
    result = sdk_client(body, "application/json").completions.create(model="tiny", prompt="x")
    assert [c.text for c in result.choices] == [" Hello world", "!"]
    assert [c.finish_reason for c in result.choices] == ["length", "stop"]
    assert result.choices[1].logprobs.tokens == ["!"] and result.choices[1].logprobs.text_offset == [0]
    assert result.usage.total_tokens == 6


def test_the_sdk_reads_a_non_streamed_chat_completion_with_logprobs():
    body = chat_completion_body("chatcmpl-9", "tiny", CREATED, [
        FinishedChoice(" Hello!", "stop", [TokenLogprobs(5, -0.2, [5, 8], [-0.2, -1.8]), TokenLogprobs(7, -0.1, [], [])]),
    ], count_usage(10, 2), token_text)
    assert b'"message":{"role":"assistant","content":" Hello!"}' in body
    result = sdk_client(body, "application/json").chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}]
    )
    [choice] = result.choices
    assert result.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == " Hello!" and choice.finish_reason == "stop"
    assert [t.token for t in choice.logprobs.content] == [" Hello", "!"]
    assert [t.token for t in choice.logprobs.content[0].top_logprobs] == [" Hello", " there"]
    assert result.usage.prompt_tokens == 10 and result.usage.completion_tokens == 2


def test_the_sdk_streams_chat_chunks_and_the_usage_chunk():
    stream = ChatStream("chatcmpl-2", "tiny", CREATED, token_text, include_usage=True)
    frames = [
        stream.chunk(0, ""), stream.chunk(1, ""), stream.chunk(0, " Hello"), stream.chunk(1, " Hi"),
        stream.chunk(0, " world", finish_reason="length"), stream.chunk(1, "", finish_reason="stop"),
        stream.usage_chunk(5, 3), DONE,
    ]
    chunks = list(sdk_client(b"".join(frames), "text/event-stream").chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True, stream_options={"include_usage": True},
    ))
    assert len(chunks) == 7 and all(c.object == "chat.completion.chunk" for c in chunks)
    texts, finish = {0: "", 1: ""}, {}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finish[choice.index] = choice.finish_reason
    assert texts == {0: " Hello world", 1: " Hi"} and finish == {0: "length", 1: "stop"}
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 8


def test_the_sdk_streams_completion_chunks():
    stream = CompletionStream("cmpl-3", "tiny", CREATED, token_text, include_usage=False)
    frames = [stream.chunk(0, " Hello"), stream.chunk(0, " world", finish_reason="stop"), DONE]
    chunks = list(sdk_client(b"".join(frames), "text/event-stream").completions.create(model="tiny", prompt="x", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == " Hello world"
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].usage is None
