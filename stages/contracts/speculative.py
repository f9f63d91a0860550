"""Speculative decoding settings, with vLLM's keys: how drafts are proposed and how many per step.

    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    {"method": "draft_model", "model": "DIR_OR_GGUF", "num_speculative_tokens": 3}
    {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 24,
     "suffix_decoding_max_cached_tokens": 32768, "suffix_decoding_max_spec_factor": 1.0,
     "suffix_decoding_min_token_prob": 0.1}

Suffix decoding (stages/gpu_runner/speculative/suffix.py) matches the row's latest tokens in a
trie of its own text and one of recent requests' outputs: `max_tree_depth` bounds the matched
words plus their drafts, `max_cached_tokens` the outputs kept, `max_spec_factor` the drafts per
matched token, `min_token_prob` the probability a draft's continuation must keep.

`disable_by_batch_size`: a step with more rows that could draft than this verifies no drafts;
None (the default): no such limit, each row's drafts are weighed against what verifying costs on
the device, as the runner measured it at start-up (the scheduler's speculation.py).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

METHODS = ("ngram", "draft_model", "suffix")
MAX_SPECULATIVE_TOKENS = 16
# n-gram's shortest match: one token matches by chance too often (tools/bench/bench_spec.py, grounded
# tasks: the same speed as 1, more of the drafts accepted)
PROMPT_LOOKUP_MIN = 2
_SUFFIX_KEYS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_tokens",
                "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
         "disable_by_batch_size", *_SUFFIX_KEYS)


class SpeculativeConfigError(ValueError):
    """A speculative config that cannot be used; the message names the key."""


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = PROMPT_LOOKUP_MIN
    prompt_lookup_max: int = 3
    model: str = ""  # the draft checkpoint (draft_model only)
    disable_by_batch_size: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_tokens: int = 32768
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    @classmethod
    def from_dict(cls, values: object) -> SpeculativeConfig:
        """Check a JSON object's keys and values; each problem is a SpeculativeConfigError naming its key."""
        if not isinstance(values, dict):
            raise SpeculativeConfigError(f"speculative_config must be a JSON object, got {type(values).__name__}")
        unknown = sorted(set(values) - set(_KEYS))
        if unknown:
            raise SpeculativeConfigError(f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(_KEYS)})")
        method = values.get("method")
        if method not in METHODS:
            raise SpeculativeConfigError(f"speculative_config.method must be one of {list(METHODS)}, got {method!r}")
        if "num_speculative_tokens" not in values:
            raise SpeculativeConfigError("speculative_config.num_speculative_tokens is required")
        k = _int(values, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        lookup_min = _int(values, "prompt_lookup_min", 1, 64, PROMPT_LOOKUP_MIN)
        lookup_max = _int(values, "prompt_lookup_max", 1, 64, max(3, lookup_min))
        if lookup_min > lookup_max:
            raise SpeculativeConfigError(f"speculative_config.prompt_lookup_min {lookup_min} exceeds "
                                         f"prompt_lookup_max {lookup_max}")
        model = values.get("model", "")
        if method == "draft_model":
            if not isinstance(model, str) or not model:
                raise SpeculativeConfigError("speculative_config.model must name the draft checkpoint "
                                             "(a directory or a .gguf file) for method 'draft_model'")
        elif model:
            raise SpeculativeConfigError(f"speculative_config.model is only read by method 'draft_model', "
                                         f"not {method!r}")
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if key in values and method != "ngram":
                raise SpeculativeConfigError(f"speculative_config.{key} is only read by method 'ngram'")
        disable = values.get("disable_by_batch_size")
        disable = None if disable is None else _int(values, "disable_by_batch_size", 1, 1 << 20)
        for key in _SUFFIX_KEYS:
            if key in values and method != "suffix":
                raise SpeculativeConfigError(f"speculative_config.{key} is only read by method 'suffix'")
        depth = _int(values, "suffix_decoding_max_tree_depth", 2, 256, 24)
        if method == "suffix" and depth <= k:
            raise SpeculativeConfigError(f"speculative_config.suffix_decoding_max_tree_depth {depth} must exceed "
                                         f"num_speculative_tokens {k}: a match and its drafts share the depth")
        return cls(method, k, lookup_min, lookup_max, model, disable, depth,
                   _int(values, "suffix_decoding_max_cached_tokens", 0, 1 << 24, 32768),
                   _float(values, "suffix_decoding_max_spec_factor", 0.0, 64.0, 1.0),
                   _float(values, "suffix_decoding_min_token_prob", 0.0, 1.0, 0.1))

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _int(values: dict, key: str, lo: int, hi: int, default: int | None = None) -> int:
    value = values.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise SpeculativeConfigError(f"speculative_config.{key} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _float(values: dict, key: str, lo: float, hi: float, default: float) -> float:
    value = values.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise SpeculativeConfigError(f"speculative_config.{key} must be a number in [{lo}, {hi}], got {value!r}")
    return float(value)
