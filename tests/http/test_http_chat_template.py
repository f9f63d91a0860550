"""Chat templates render as transformers' apply_chat_template does, from the checkpoint's files,
and every way a template or the messages can fail is a 400 that says why."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pipeline.serve.openai.chat import ChatTemplate
from pipeline.serve.openai.errors import OpenAIError
from pipeline.serve.openai.schemas import ChatMessage, ContentPart
from pipeline.models.tiny_model import BOS_TOKEN, CHAT_TEMPLATE, EOS_TOKEN, make_tiny_model

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello <b>there</b> & \"friends\""},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "Über naïve 日本語?"},
]

# A template in the style of Llama's and Mistral's: BOS, a system message folded into the first
# user turn, role alternation enforced with raise_exception, and Hub helpers (tojson, loop controls).
STRICT_TEMPLATE = """{{ bos_token }}
{% if messages[0]['role'] == 'system' %}
{% set system = messages[0]['content'] %}{% set rest = messages[1:] %}
{% else %}{% set system = '' %}{% set rest = messages %}{% endif %}
{% for message in rest %}
{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{% endif %}
{% if message['role'] == 'user' %}
[INST] {% if loop.first and system %}{{ system }} {% endif %}{{ message['content'] | tojson }} [/INST]
{% else %}
 {{ message['content'] }}{{ eos_token }}
{% endif %}
{% if loop.index > 10 %}{% break %}{% endif %}
{% endfor %}
"""


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("http-tiny-llama"), "llama", seed=0)


def checkpoint_with(base: Path, target: Path, **config_changes: object) -> Path:
    """A copy of the checkpoint's tokenizer files with tokenizer_config.json changed."""
    target.mkdir()
    for name in ("tokenizer.json", "special_tokens_map.json", "config.json"):
        shutil.copy(base / name, target / name)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.update(config_changes)
    for key in [k for k, v in config.items() if v is None]:
        del config[key]
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


def as_messages(conversation: list[dict[str, str]]) -> list[ChatMessage]:
    return [ChatMessage(m["role"], m["content"]) for m in conversation]


def refused(template: ChatTemplate, messages: list[ChatMessage]) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        template.render(messages)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_tiny_models_chatml_template_renders_as_transformers_does(tiny_checkpoint, add_generation_prompt):
    template = ChatTemplate.from_checkpoint(tiny_checkpoint)
    assert template.available
    ours = template.render(as_messages(CONVERSATION), add_generation_prompt=add_generation_prompt)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    theirs = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert ours.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_the_tiny_model_keeps_its_tokenizer_and_names_its_special_tokens(tiny_checkpoint):
    config = json.loads((tiny_checkpoint / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    assert (config["bos_token"], config["eos_token"]) == (BOS_TOKEN, EOS_TOKEN)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    assert tokenizer.convert_tokens_to_ids([BOS_TOKEN, EOS_TOKEN]) == [0, 1]


def test_a_template_with_bos_eos_raise_exception_and_tojson_matches_transformers(tiny_checkpoint, tmp_path):
    # bos/eos as an AddedToken dict, as older checkpoints store them.
    model = checkpoint_with(tiny_checkpoint, tmp_path / "strict", chat_template=STRICT_TEMPLATE,
                            bos_token={"__type": "AddedToken", "content": BOS_TOKEN, "special": True})
    template = ChatTemplate.from_checkpoint(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    ours = template.render(as_messages(CONVERSATION))
    assert ours == tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert ours.startswith(BOS_TOKEN) and EOS_TOKEN in ours
    assert '"Hello <b>there</b> & \\"friends\\""' in ours  # tojson keeps HTML characters as they are

    error = refused(template, as_messages([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]))
    assert "Conversation roles must alternate" in error.message and error.param == "messages"


def test_named_templates_use_the_default_one(tiny_checkpoint, tmp_path):
    model = checkpoint_with(tiny_checkpoint, tmp_path / "named", chat_template=[
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}"},
    ])
    assert ChatTemplate.from_checkpoint(model).render(as_messages(CONVERSATION[:2])) == (
        "system=You are terse.;user=Hello <b>there</b> & \"friends\";"
    )
    no_default = checkpoint_with(tiny_checkpoint, tmp_path / "no-default", chat_template=[{"name": "tool_use", "template": "T"}])
    error = refused(ChatTemplate.from_checkpoint(no_default), as_messages(CONVERSATION))
    assert "'tool_use'" in error.message and "'default'" in error.message


def test_a_chat_template_jinja_file_wins_over_tokenizer_config_as_in_transformers(tiny_checkpoint, tmp_path):
    model = checkpoint_with(tiny_checkpoint, tmp_path / "file")
    (model / "chat_template.jinja").write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    ours = ChatTemplate.from_checkpoint(model).render(as_messages(CONVERSATION[:2]))
    theirs = AutoTokenizer.from_pretrained(model).apply_chat_template(CONVERSATION[:2], tokenize=False)
    assert ours == theirs == '<system>You are terse.<user>Hello <b>there</b> & "friends"'


def test_no_template_is_a_400_naming_where_it_was_looked_for(tiny_checkpoint, tmp_path):
    model = checkpoint_with(tiny_checkpoint, tmp_path / "plain", chat_template=None)
    template = ChatTemplate.from_checkpoint(model)
    assert not template.available
    error = refused(template, as_messages(CONVERSATION))
    assert "no chat template" in error.message
    assert str(model / "chat_template.jinja") in error.message
    assert str(model / "tokenizer_config.json") in error.message


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__ }}",
    "{{ messages.__class__.__base__ }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{{ messages.pop() }}",
])
def test_a_template_reaching_for_python_internals_is_refused_with_400(source):
    error = refused(ChatTemplate(source, origin="test"), as_messages(CONVERSATION))
    assert "unsafe" in error.message


def test_template_failures_are_400s_never_500s():
    assert "does not compile" in refused(ChatTemplate("{% for m in messages %}", origin="x"), as_messages(CONVERSATION)).message
    assert "division by zero" in refused(ChatTemplate("{{ 1 / 0 }}", origin="x"), as_messages(CONVERSATION)).message
    assert "Range too big" in refused(ChatTemplate("{{ range(10**9) | list }}", origin="x"), as_messages(CONVERSATION)).message


def test_a_broken_tokenizer_config_is_a_start_up_error_naming_the_file(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
        ChatTemplate.from_checkpoint(tmp_path)


def test_text_parts_are_joined_and_names_are_passed_to_the_template():
    template = ChatTemplate("{% for m in messages %}{{ m.name }}:{{ m.content }}|{% endfor %}", origin="x")
    messages = [
        ChatMessage("user", [ContentPart("text", "one"), ContentPart("text", "two")], name="ann"),
        ChatMessage("assistant", None),
    ]
    assert template.render(messages) == "ann:one\ntwo|:|"


@pytest.mark.parametrize("messages, param, words", [
    ([], "messages", "at least one message"),
    ([ChatMessage("wizard", "hi")], "messages[0].role", "'wizard'"),
    ([ChatMessage("user", "hi"), ChatMessage("user", None)], "messages[1].content", "required for role 'user'"),
    ([ChatMessage("user", [ContentPart("image_url")])], "messages[0].content[0].type", "an image ('image_url') cannot be served"),
    ([ChatMessage("user", [ContentPart("audio")])], "messages[0].content[0].type", "only 'text' parts"),
    ([ChatMessage("user", [ContentPart("text")])], "messages[0].content[0].text", "required"),
])
def test_malformed_messages_are_400s_naming_the_message(messages, param, words):
    error = refused(ChatTemplate("{{ messages }}", origin="x"), messages)
    assert error.param == param and error.message.startswith(param + ":") and words in error.message
