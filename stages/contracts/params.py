"""Sampling parameters of one request and their limits, validated where a request enters."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields

# Limits on what one request may ask for. Each bounds work or memory a client could otherwise
# make the daemon spend, and each value must fit the stages' binary layouts (int32 token ids).
MAX_TOKEN_ID = 2**31 - 1  # token ids are int32 on every ring and on the device
MAX_MAX_TOKENS = 2**31 - 1  # the model's max_model_len caps output far below this anyway
MAX_TOP_K = 2**31 - 1  # larger than any vocabulary: the same as top_k 0
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256  # at most 1 KiB of UTF-8: the detokenizer holds back up to one stop string's text
MAX_STOP_TOKEN_IDS = 256
MAX_GRAMMAR_CHARS = 65536  # a schema, regex or grammar: compiled per distinct spec in the runner
MAX_GUIDED_CHOICES = 256
MAX_LOGIT_BIAS = 1024  # entries; each value in [-100, 100] as OpenAI allows
GUIDED_FIELDS = ("json_object", "json_schema", "regex", "choice", "grammar")  # at most one per request


class InvalidParams(ValueError):
    """A sampling parameter is out of its allowed range; `field` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


def _check_range(name: str, value: float, lo: float, hi: float, *, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParams(name, f"must be a number, got {type(value).__name__}")
    if math.isnan(value) or value > hi or value < lo or (lo_open and value == lo):
        left = "(" if lo_open else "["
        raise InvalidParams(name, f"must be in {left}{lo}, {hi}], got {value}")


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What a request's output must match: `kind` is "json_schema", "regex", "choice" (text: a
    JSON list of strings) or "lark" (a Lark grammar); equal specs share one compiled grammar."""

    kind: str
    text: str
    field: str  # the SamplingParams field it came from, to name it in an error


def _check_int(name: str, value: int, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParams(name, f"must be an integer, got {type(value).__name__}")
    if value < lo or (hi is not None and value > hi):
        upper = "" if hi is None else f", {hi}"
        raise InvalidParams(name, f"must be in [{lo}{upper}], got {value}")


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 is greedy. top_k 0 (or -1) and top_p 1 disable those filters.
    seed makes the request's samples independent of the batch it runs in.
    logprobs=n returns the sampled token's logprob plus the n most likely (n <= 20).
    At most one of json_object, json_schema (a JSON schema, as JSON text; a dict is serialised),
    regex, choice and grammar (Lark, as llguidance reads it; GBNF is converted) constrains the
    output; logit_bias adds to the logits of the token ids it names.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    json_object: bool = False
    json_schema: str = ""
    regex: str = ""
    choice: list[str] = field(default_factory=list)
    grammar: str = ""
    logit_bias: dict[int, float] = field(default_factory=dict)
    speculative: bool = True  # verify drafts for this request when the engine speculates

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def trusted(cls, **values: object) -> SamplingParams:
        """Params that were validated where the request entered (the daemon or `LLM`), rebuilt
        inside the engine from a ring record: every field given, nothing checked again."""
        params = object.__new__(cls)
        for name in _FIELD_NAMES:
            setattr(params, name, values[name])
        return params

    def validate(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1, MAX_MAX_TOKENS)
        _check_range("temperature", self.temperature, 0.0, 100.0)
        _check_range("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_int("top_k", self.top_k, -1, MAX_TOP_K)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, 10.0, lo_open=True)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidParams("stop", "must be a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidParams("stop", f"at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        longest = max(map(len, self.stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise InvalidParams("stop", f"each string at most {MAX_STOP_STRING_CHARS} characters, got one of {longest}")
        if not isinstance(self.stop_token_ids, list):
            raise InvalidParams("stop_token_ids", "must be a list of integers")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidParams("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, 0, MAX_TOKEN_ID)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        self._validate_guided()
        if not isinstance(self.speculative, bool):
            raise InvalidParams("speculative", f"must be true or false, got {type(self.speculative).__name__}")
        if not isinstance(self.logit_bias, dict):
            raise InvalidParams("logit_bias", "must be a map of token id to bias")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidParams("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for token_id, bias in self.logit_bias.items():
            _check_int("logit_bias", token_id, 0, MAX_TOKEN_ID)
            _check_range(f"logit_bias[{token_id}]", bias, -100.0, 100.0)

    def check_vocab(self, vocab_size: int) -> None:
        """InvalidParams naming the first logit_bias token id outside the model's `vocab_size` ids
        (validate knows no model; where a request meets one, this runs too)."""
        outside = sorted(token_id for token_id in self.logit_bias if token_id >= vocab_size)
        if outside:
            raise InvalidParams(f"logit_bias[{outside[0]}]", f"token id {outside[0]} is outside the model's "
                                f"vocabulary of {vocab_size} tokens (ids 0 to {vocab_size - 1})")

    def _validate_guided(self) -> None:
        if not isinstance(self.json_schema, str):
            if not isinstance(self.json_schema, dict):
                raise InvalidParams("json_schema", f"must be a JSON schema object, got {type(self.json_schema).__name__}")
            self.json_schema = json.dumps(self.json_schema)
        if not isinstance(self.json_object, bool):
            raise InvalidParams("json_object", f"must be true or false, got {type(self.json_object).__name__}")
        for name in ("json_schema", "regex", "grammar"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise InvalidParams(name, f"must be a string, got {type(value).__name__}")
            if len(value) > MAX_GRAMMAR_CHARS:
                raise InvalidParams(name, f"at most {MAX_GRAMMAR_CHARS} characters, got {len(value)}")
        if not isinstance(self.choice, list) or not all(isinstance(c, str) and c for c in self.choice):
            raise InvalidParams("choice", "must be a list of non-empty strings")
        if len(self.choice) > MAX_GUIDED_CHOICES:
            raise InvalidParams("choice", f"at most {MAX_GUIDED_CHOICES} strings, got {len(self.choice)}")
        if sum(len(c) for c in self.choice) > MAX_GRAMMAR_CHARS:
            raise InvalidParams("choice", f"at most {MAX_GRAMMAR_CHARS} characters in all")
        given = [name for name in GUIDED_FIELDS if getattr(self, name)]
        if len(given) > 1:
            raise InvalidParams(given[1], f"only one of {', '.join(GUIDED_FIELDS)} may be set, got {given}")
        if self.json_schema:
            try:
                schema = json.loads(self.json_schema)
            except ValueError as exc:
                raise InvalidParams("json_schema", f"is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidParams("json_schema", f"must be a JSON object, got {type(schema).__name__}")

    @property
    def guided(self) -> GrammarSpec | None:
        """The output constraint, or None when the output is free."""
        if self.json_schema:
            return GrammarSpec("json_schema", self.json_schema, "json_schema")
        if self.json_object:
            return GrammarSpec("json_schema", '{"type": "object"}', "json_object")
        if self.regex:
            return GrammarSpec("regex", self.regex, "regex")
        if self.choice:
            return GrammarSpec("choice", json.dumps(self.choice), "choice")
        if self.grammar:
            return GrammarSpec("lark", self.grammar, "grammar")
        return None

    @property
    def is_guided(self) -> bool:
        return bool(self.json_schema or self.json_object or self.regex or self.choice or self.grammar)

    # A grammar decides where the output ends: once it is complete EOS is the one token it allows,
    # so min_tokens barring EOS would leave nothing to sample, and ignore_eos would run on to
    # max_tokens on EOS alone. Under a grammar EOS always stops the request; these say so.
    @property
    def min_tokens_held(self) -> int:
        """min_tokens as the engine holds it: 0 under a grammar."""
        return 0 if self.is_guided else self.min_tokens

    @property
    def eos_ignored(self) -> bool:
        """ignore_eos as the engine holds it: False under a grammar."""
        return self.ignore_eos and not self.is_guided

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


_FIELD_NAMES = tuple(f.name for f in fields(SamplingParams))
