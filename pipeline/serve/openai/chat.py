"""Chat templates: a checkpoint's Jinja template turning `messages` into one prompt string.

Rendering follows transformers' `apply_chat_template`: a sandboxed Jinja environment with
`trim_blocks` and `lstrip_blocks`, the variables `messages`, `bos_token`, `eos_token` and
`add_generation_prompt`, and the globals `raise_exception` and `strftime_now` and the `tojson`
filter that templates on the Hub use. The template comes from `chat_template.jinja` in the
checkpoint, else `chat_template` in `tokenizer_config.json` (where transformers looks, and in its
order). A template is code from the checkpoint; the sandbox refuses attribute access that could
reach Python internals, and every failure of the template is the client's 400, never a 500.
The rendered text already holds the special tokens the template places (BOS among them), so
it is tokenized without adding special tokens.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pipeline.serve.openai.errors import OpenAIError
from pipeline.serve.openai.schemas import ChatMessage

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
DEFAULT_TEMPLATE_NAME = "default"  # the one used from a list of named templates
ROLES = ("system", "developer", "user", "assistant", "tool")


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's sandbox turns an unsafe attribute into an undefined value that fails only when
    used; this one refuses the access itself, so `{{ x.__class__ }}` fails too."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        raise jinja2.exceptions.SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which a prompt must keep as they are.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


class ChatTemplate:
    """One checkpoint's chat template, compiled once and rendered per request.

    A checkpoint without a usable template still gives a ChatTemplate: `render` then answers
    400 saying why (none found, where it looked; or its syntax error), so a daemon serves
    completions for such a model and refuses only chat.
    """

    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "", origin: str = "") -> None:
        self.origin = origin  # where the template came from, or where it was looked for
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template: jinja2.Template | None = None
        self._unusable = ""  # why render refuses, when there is no template
        if source is None:
            self._unusable = f"this model has no chat template ({origin}); use /v1/completions with a prompt"
            return
        environment = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = _strftime_now
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateError as exc:
            self._unusable = f"the chat template from {origin} does not compile: {exc}"

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path) -> ChatTemplate:
        """The template of the checkpoint in `model_dir`; ValueError if its tokenizer_config.json
        is not valid JSON (a broken checkpoint, found at start-up)."""
        model_dir = Path(model_dir)
        config_path = model_dir / TOKENIZER_CONFIG_FILE
        template_path = model_dir / CHAT_TEMPLATE_FILE
        config: dict[str, Any] = {}
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"{config_path} is not valid JSON: {exc}") from None
            if not isinstance(config, dict):
                raise ValueError(f"{config_path} must hold a JSON object, got {type(config).__name__}")
        tokens = {"bos_token": _token_text(config.get("bos_token")), "eos_token": _token_text(config.get("eos_token"))}
        if template_path.is_file():
            return cls(template_path.read_text(encoding="utf-8"), origin=str(template_path), **tokens)
        source = config.get("chat_template")
        if isinstance(source, str):
            return cls(source, origin=f"`chat_template` in {config_path}", **tokens)
        if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}, ...]
            named = {entry.get("name"): entry.get("template") for entry in source if isinstance(entry, dict)}
            default = named.get(DEFAULT_TEMPLATE_NAME)
            if isinstance(default, str):
                return cls(default, origin=f"`chat_template` {DEFAULT_TEMPLATE_NAME!r} in {config_path}", **tokens)
            names = ", ".join(repr(name) for name in named)
            return cls(None, origin=f"{config_path} names chat templates {names}, none {DEFAULT_TEMPLATE_NAME!r}", **tokens)
        return cls(None, origin=f"looked for {template_path} and `chat_template` in {config_path}", **tokens)

    @property
    def available(self) -> bool:
        return self._template is not None

    def render(self, messages: list[ChatMessage], *, add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> str:
        """The prompt text for `messages` (and `tools`, for a template that shows them); a 400
        OpenAIError when the messages are malformed or the template fails (its syntax,
        `raise_exception`, a sandbox violation, a type error)."""
        if self._template is None:
            raise OpenAIError.bad_request(self._unusable, "messages")
        conversation = message_dicts(messages)
        try:
            return self._template.render(
                messages=conversation,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
            )
        # Whatever the template raises comes from the template or the messages it was given,
        # not from this server: a Python error in it (a TypeError, a ZeroDivisionError) is as
        # much the request's problem as a raise_exception.
        except Exception as exc:  # noqa: BLE001
            raise OpenAIError.bad_request(f"the chat template failed on these messages: {exc}", "messages") from None


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The messages as a template sees them: `role`, `content` (text parts joined with "\\n",
    as vLLM joins them) and `name` when given; a 400 naming the first malformed one."""
    if not messages:
        raise OpenAIError.bad_request("messages: must hold at least one message", "messages")
    conversation = []
    for i, message in enumerate(messages):
        if message.role not in ROLES:
            raise OpenAIError.bad_request(
                f"messages[{i}].role: must be one of {', '.join(ROLES)}, got {message.role!r}", f"messages[{i}].role"
            )
        entry = {"role": message.role, "content": _content_text(message, i)}
        if message.name is not None:
            entry["name"] = message.name
        conversation.append(entry)
    return conversation


_IMAGE_PARTS = ("image_url", "image", "input_image")


def _content_text(message: ChatMessage, i: int) -> str:
    content = message.content
    if content is None:
        if message.role == "assistant":  # an assistant turn that only called tools
            return ""
        raise OpenAIError.bad_request(f"messages[{i}].content: required for role {message.role!r}", f"messages[{i}].content")
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        param = f"messages[{i}].content[{j}]"
        if part.type in _IMAGE_PARTS:
            raise OpenAIError.bad_request(f"{param}.type: an image ({part.type!r}) cannot be served: this engine runs "
                                          f"the language model alone (text parts only)", f"{param}.type")
        if part.type != "text":
            raise OpenAIError.bad_request(f"{param}.type: only 'text' parts are supported, got {part.type!r}", f"{param}.type")
        if part.text is None:
            raise OpenAIError.bad_request(f"{param}.text: required for a 'text' part", f"{param}.text")
        texts.append(part.text)
    return "\n".join(texts)


def _token_text(token: object) -> str:
    """A special token as tokenizer_config.json holds it: a string, or an AddedToken's dict."""
    if isinstance(token, str):
        return token
    if isinstance(token, dict) and isinstance(token.get("content"), str):
        return token["content"]
    return ""
