"""Output constraints the structured-output tests share: one per kind, each with the check its text must pass.

Every constraint is bounded (lengths, item counts, number ranges), so a random tiny model sampling
at temperature 1.0 ends each one well within MAX_TOKENS: any output that does not validate is a
constraint the engine failed to enforce, never an output cut short. `json_object` alone is
unbounded (a random model's strings rarely close), so its case also biases the closing tokens
(`"`, `}`, `]`) with logit_bias: the object may still be anything, and it ends.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable

import jsonschema

MAX_TOKENS = 96

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "active": {"type": "boolean"}},
            "required": ["zip", "active"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{2,3}\.(com|org)"
CHOICES = ["positive", "negative", "neutral"]
GRAMMAR = 'start: greeting " " name "!"\ngreeting: "hello" | "hi" | "hey"\nname: /[a-z]{2,6}/\n'
GRAMMAR_TEXT = re.compile(r"(hello|hi|hey) [a-z]{2,6}!")
# Tools for the tool-call cases: the arguments are constrained by the function's parameters.
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def check_json_schema(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)


def check_regex(text: str) -> None:
    assert re.fullmatch(REGEX, text), text


def check_choice(text: str) -> None:
    assert text in CHOICES, text


def check_grammar(text: str) -> None:
    assert GRAMMAR_TEXT.fullmatch(text), text


def check_json_object(text: str) -> None:
    assert isinstance(json.loads(text), dict), text


def closing_bias(token_to_id: Callable[[str], int | None]) -> dict[int, float]:
    """logit_bias favouring the tokens that close a JSON string, object or array."""
    return {token_to_id(t): 6.0 for t in ('"', "}", "]") if token_to_id(t) is not None}


# kind -> (SamplingParams fields, check of a finished output's text); json_object's fields need
# closing_bias of the model's tokenizer added.
CASES: dict[str, tuple[dict, Callable[[str], None]]] = {
    "json_object": ({"json_object": True}, check_json_object),
    "json_schema": ({"json_schema": json.dumps(PERSON_SCHEMA)}, check_json_schema),
    "regex": ({"regex": REGEX}, check_regex),
    "choice": ({"choice": CHOICES}, check_choice),
    "grammar": ({"grammar": GRAMMAR}, check_grammar),
}
