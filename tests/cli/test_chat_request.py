"""The daemon's side of a socket `Chat` request: its messages rendered by the model's chat template,
and an invalid_params error for `messages` when they cannot be."""
from __future__ import annotations

import msgspec
import pytest

from pipeline.errors import InvalidRequest
from pipeline.models.tiny_model import CHAT_TEMPLATE
from pipeline.protocol import Chat, ChatTurn, ClientMessage, encode_frame
from pipeline.serve.model import ServedModel, chat_prompt
from pipeline.serve.openai.chat import ChatTemplate


def served(template: ChatTemplate) -> ServedModel:
    return ServedModel("tiny", "/nowhere", 2048, 1024, [], chat_template=template)


def test_chat_renders_with_the_template() -> None:
    turns = [ChatTurn("system", "Be brief."), ChatTurn("user", "Hi")]
    assert chat_prompt(served(ChatTemplate(CHAT_TEMPLATE)), turns) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(("model", "turns", "says"), [
    (served(ChatTemplate(None, origin="looked nowhere")), [ChatTurn("user", "Hi")], "no chat template"),
    (served(ChatTemplate(CHAT_TEMPLATE)), [ChatTurn("robot", "Hi")], "role"),
    (served(ChatTemplate(CHAT_TEMPLATE)), [], "at least one message"),
    (None, [ChatTurn("user", "Hi")], "no model"),
])
def test_what_cannot_be_rendered_is_invalid_messages(model: ServedModel | None, turns: list[ChatTurn],
                                                     says: str) -> None:
    with pytest.raises(InvalidRequest, match=says) as caught:
        chat_prompt(model, turns)
    assert caught.value.field == "messages"


def test_chat_is_a_client_message_that_round_trips() -> None:
    message = Chat([ChatTurn("user", "Hi")], stream=True)
    frame = encode_frame(message)
    assert msgspec.msgpack.decode(frame[4:], type=ClientMessage) == message
    with pytest.raises(msgspec.ValidationError):  # a misspelt field is refused, as in a Generate
        msgspec.msgpack.decode(msgspec.msgpack.encode({"type": "chat", "messages": [], "strem": True}),
                               type=ClientMessage)
