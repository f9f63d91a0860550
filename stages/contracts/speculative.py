"""Speculative decoding settings, with vLLM's keys: how drafts are proposed and how many per step.

    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    {"method": "draft_model", "model": "DIR_OR_GGUF", "num_speculative_tokens": 3}

`disable_by_batch_size`: a step with more rows that could draft than this verifies no drafts;
None (the default): no such limit, each row's drafts are weighed against what verifying costs on
the device, as the runner measured it at start-up (the scheduler's speculation.py).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
         "disable_by_batch_size")


class SpeculativeConfigError(ValueError):
    """A speculative config that cannot be used; the message names the key."""


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    model: str = ""  # the draft checkpoint (draft_model only)
    disable_by_batch_size: int | None = None

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
        lookup_min = _int(values, "prompt_lookup_min", 1, 64, 1)
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
        return cls(method, k, lookup_min, lookup_max, model, disable)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _int(values: dict, key: str, lo: int, hi: int, default: int | None = None) -> int:
    value = values.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise SpeculativeConfigError(f"speculative_config.{key} must be an integer in [{lo}, {hi}], got {value!r}")
    return value
