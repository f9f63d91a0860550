"""Scheduler limits, validated where they are made."""
from __future__ import annotations

from dataclasses import dataclass


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # batch rows: requests holding KV at once
    max_num_batched_tokens: int = 8192  # tokens computed per step, all rows together
    max_model_len: int = 2048  # prompt + outputs of one request
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _check_positive_int("max_num_seqs", self.max_num_seqs)
        _check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _check_positive_int("max_model_len", self.max_model_len)
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must leave room for a prompt token and an output, got {self.max_model_len}")
