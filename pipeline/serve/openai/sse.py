"""Server-Sent-Event frames of a streamed response, byte for byte as OpenAI's API sends them.

Each chunk is one frame, `data: {json}\\n\\n`, holding one choice; the stream ends with
`data: [DONE]\\n\\n`. A chat choice's first chunk carries `role: "assistant"` in its delta, and
its last carries `finish_reason`. With `stream_options.include_usage` every chunk has
`"usage": null` and the last one before [DONE] has empty `choices` and the request's usage.
A stream object keeps only what the next chunk needs (where each choice's text has reached),
so building a frame costs one small encode; a chunk of text alone (`text_frame`, the bulk of a
stream) is a per-choice byte template around the JSON-escaped text.
"""
from __future__ import annotations

from collections.abc import Sequence

from msgspec import UNSET, UnsetType

from pipeline.protocol import TokenLogprobs
from pipeline.serve.openai.asgi import CHUNK_END
from pipeline.serve.openai.responses import TokenText, chat_logprobs, completion_logprobs, count_usage, encoder
from pipeline.serve.openai.schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
    ToolCallDelta,
    Usage,
)

DONE = b"data: [DONE]\n\n"
SSE_CONTENT_TYPE = "text/event-stream"
_DATA = b"data: "
_END = b"\n\n"
# Stands for the text in a template frame; no response id or model name holds it.
_TEXT_MARK = "\x00text-of-the-chunk\x00"


class _Stream:
    """What both streams share: the response's identity, chunk framing and the usage chunk."""

    _chunk_type: type[Completion] | type[ChatCompletionChunk]

    def __init__(self, response_id: str, model: str, created: int, token_text: TokenText, *, include_usage: bool) -> None:
        self.response_id = response_id
        self.created = created
        self.include_usage = include_usage
        self._model = model
        self._token_text = token_text
        self._usage = None if include_usage else UNSET
        self._chars_streamed: dict[int, int] = {}  # choice index -> characters of text sent so far
        # choice index -> its text frame's bytes before and after the text, the latter again with
        # an HTTP chunk's end, and the frame's size without the text
        self._text_templates: dict[int, tuple[bytes, bytes, bytes, int]] = {}

    def is_open(self, index: int) -> bool:
        """Whether choice `index` has had a frame."""
        return index in self._chars_streamed

    def chunk(
        self,
        index: int,
        text: str,
        *,
        logprobs: Sequence[TokenLogprobs] | None = None,
        finish_reason: str | None = None,
        token_ids: list[int] | None = None,
    ) -> bytes:
        """The frame of choice `index`'s next text (and its tokens' logprobs, when asked for);
        the choice's last frame gives `finish_reason`. `token_ids` (the `return_token_ids`
        extension) are the ids of the text's tokens."""
        return self._frame([self._next_choice(index, text, logprobs, finish_reason, token_ids)], self._usage)

    def text_frame(self, index: int, text: str) -> bytes:
        """`chunk(index, text)` when only text is sent (no logprobs, finish or token ids), made
        from a template; b"" when that would show nothing (no text, and the choice is open)."""
        offset = self._chars_streamed.get(index)
        if offset is None:
            return self.chunk(index, text)
        if not text:
            return b""
        template = self._text_templates.get(index)
        if template is None:
            frame = self._frame([self._choice(index, _TEXT_MARK, None, None, offset)], self._usage)
            parts = frame.split(encoder.encode(_TEXT_MARK))
            if len(parts) != 2:  # cannot happen unless the mark shows elsewhere: encode in full then
                return self.chunk(index, text)
            before, after = parts
            template = self._text_templates[index] = (before, after, after + CHUNK_END, len(before) + len(after))
        self._chars_streamed[index] = offset + len(text)
        return template[0] + encoder.encode(text) + template[1]

    def chunk_template(self, index: int) -> tuple[bytes, bytes, int] | None:
        """Choice `index`'s text frame as one chunk of a chunked HTTP/1.1 body around its
        JSON-encoded text, once `text_frame` has made its template (None before): the bytes
        before the text (not the chunk's head, which holds the size), the bytes after it with
        the chunk's end, and the frame's size without the text. A chunk made from it does not
        move where the choice's text has reached, which only logprobs' offsets need."""
        template = self._text_templates.get(index)
        return None if template is None else (template[0], template[2], template[3])

    def _next_choice(self, index: int, text: str, logprobs: Sequence[TokenLogprobs] | None,
                     finish_reason: str | None, token_ids: list[int] | None) -> CompletionChoice | ChatChunkChoice:
        """`chunk`'s choice; the choice's text moves on by `text`."""
        offset = self._chars_streamed.get(index)
        self._chars_streamed[index] = (offset or 0) + len(text)
        choice = self._choice(index, text, logprobs, finish_reason, offset)
        if token_ids is not None:
            choice.token_ids = token_ids
        return choice

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """The last frame before DONE when the request set `stream_options.include_usage`."""
        return self._frame([], count_usage(prompt_tokens, completion_tokens))

    def _choice(self, index: int, text: str, logprobs: Sequence[TokenLogprobs] | None, finish_reason: str | None,
                offset: int | None) -> CompletionChoice | ChatChunkChoice:
        """The chunk's choice; `offset` is where `text` starts in the choice's text, None for
        the choice's first chunk."""
        raise NotImplementedError

    def _frame(self, choices: list, usage: Usage | None | UnsetType) -> bytes:
        chunk = self._chunk_type(id=self.response_id, created=self.created, model=self._model, choices=choices,
                                 usage=usage)
        return _DATA + encoder.encode(chunk) + _END


class CompletionStream(_Stream):
    """The frames of one streamed `/v1/completions` response (`object: "text_completion"`).
    An echoed prompt is sent as a choice's first chunk; logprobs' `text_offset` counts it."""

    _chunk_type = Completion

    def _choice(self, index: int, text: str, logprobs: Sequence[TokenLogprobs] | None, finish_reason: str | None,
                offset: int | None) -> CompletionChoice:
        choice_logprobs = None if logprobs is None else completion_logprobs(logprobs, self._token_text, offset or 0)
        return CompletionChoice(text, index, choice_logprobs, finish_reason)


class ChatStream(_Stream):
    """The frames of one streamed `/v1/chat/completions` response (`chat.completion.chunk`).

    A choice's first frame carries the role (`chunk(i, "")` opens a choice before any text);
    a frame that only finishes a choice has an empty delta, as OpenAI's last chunk does.
    """

    _chunk_type = ChatCompletionChunk

    def _choice(self, index: int, text: str, logprobs: Sequence[TokenLogprobs] | None, finish_reason: str | None,
                offset: int | None) -> ChatChunkChoice:
        if offset is None:
            delta = ChatDelta(role="assistant", content=text)
        else:
            delta = ChatDelta(content=text) if text else ChatDelta()
        choice_logprobs = None if logprobs is None else chat_logprobs(logprobs, self._token_text)
        return ChatChunkChoice(index, delta, choice_logprobs, finish_reason)

    def tool_chunk(
        self,
        index: int,
        text: str,
        tool_calls: list[ToolCallDelta],
        *,
        logprobs: Sequence[TokenLogprobs] | None = None,
        finish_reason: str | None = None,
        token_ids: list[int] | None = None,
    ) -> bytes:
        """`chunk`, with pieces of tool calls in the delta beside (or instead of) content."""
        choice = self._next_choice(index, text, logprobs, finish_reason, token_ids)
        if tool_calls:
            choice.delta.tool_calls = tool_calls
        return self._frame([choice], self._usage)
