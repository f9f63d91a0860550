"""The model the daemon serves, as clients see it: its name, limits, special tokens, tokenizer, chat template.

The daemon loads the checkpoint's tokenizer itself (no model weights: the `tokenizers` library
only), for what the HTTP API shows per token (logprobs' token text, echoed token prompts) and to
tell clients which ids are special, so a load generator can draw prompts of ordinary tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from pipeline.errors import InvalidRequest
from pipeline.models.checkpoints import model_display_name
from pipeline.protocol import ChatTurn
from pipeline.serve.openai.chat import ChatTemplate
from pipeline.serve.openai.errors import OpenAIError
from pipeline.serve.openai.schemas import ChatMessage
from stages.contracts.config import EngineConfig, ModelLimits

DEFAULT_MODEL_NAME = "default"  # the embedded default model's name


@dataclass(slots=True)
class ServedModel:
    name: str
    path: str
    max_model_len: int
    vocab_size: int
    special_token_ids: list[int]
    tokenizer: Tokenizer | None = None
    chat_template: ChatTemplate = field(default_factory=lambda: ChatTemplate(None, origin="none was loaded"))
    runs_in: str = ""  # what the runner holds each part in (ModelLimits.runs_in)
    _texts: dict[int, str] = field(default_factory=dict, repr=False)

    @classmethod
    def load(cls, config: EngineConfig, limits: ModelLimits, name: str | None, *, default: bool = False) -> ServedModel:
        """The model of `config` with the limits its runner published; `name` None takes the
        checkpoint directory's name (`default` for the embedded default model)."""
        if name is None:
            name = DEFAULT_MODEL_NAME if default else model_display_name(config.model)
        tokenizer = Tokenizer.from_file(str(config.tokenizer_path))
        special = sorted(token_id for token_id, token in tokenizer.get_added_tokens_decoder().items() if token.special)
        return cls(name, config.model, limits.max_model_len, limits.vocab_size, special, tokenizer,
                   ChatTemplate.from_checkpoint(config.model), limits.runs_in)

    def token_text(self, token_id: int) -> str:
        """A token's own text (special tokens included), as the API shows it per token."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.decode([token_id])
        return text

    def decode(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=False)


def chat_prompt(model: ServedModel | None, turns: list[ChatTurn]) -> str:
    """The prompt text of a socket `Chat` request: its turns rendered by the model's chat template,
    the assistant's turn opened; InvalidRequest (field `messages`) when it has none or it fails."""
    if model is None:
        raise InvalidRequest("messages", "this daemon has no model description to render a chat with")
    try:
        return model.chat_template.render([ChatMessage(turn.role, turn.content) for turn in turns])
    except OpenAIError as exc:
        raise InvalidRequest("messages", exc.message) from None
