"""Counters, one dataclass per concern, defined once and carried whole from where they are counted
to the status board, the stats reply and /metrics.

Every field is an int or another counters dataclass (nested). The helpers below walk the fields,
so whatever stores or sends a counters struct (the status board's int64 slots, the stats reply's
fields) handles a field added here without a change of its own.
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

Counts = TypeVar("Counts")


@dataclass(slots=True)
class PrefixCacheCounts:
    """The prefix cache's totals over admitted requests, each admission counted."""

    num_queried_tokens: int = 0  # tokens of admitted requests
    num_hit_tokens: int = 0  # of those, found in the prefix cache (not computed again)

    @property
    def hit_rate(self) -> float:
        """The share of admitted requests' tokens found in the prefix cache (0 before any)."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


@dataclass(slots=True)
class SpeculativeCounts:
    """Speculative decoding's totals: drafts verified, drafts accepted, and (request, step) pairs
    that verified drafts. All 0 where nothing speculates."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verifications: int = 0
    # Decoding steps of rows that could have drafted and did not, by reason: the step's batch made
    # drafts dearer than the row's rate of acceptance pays for; the rate is too low at any batch
    # (backed off); its logit_bias (grammar rows draft); no earlier occurrence of its last tokens (n-gram).
    num_rows_off_batch: int = 0
    num_rows_off_backoff: int = 0
    num_rows_off_logit_bias: int = 0
    num_rows_off_no_match: int = 0
    num_revivals: int = 0  # backed-off rows seen copying on the host and drafting again

    def since(self, before: SpeculativeCounts) -> SpeculativeCounts:
        """What was counted between `before` and these (a count that fell started again from 0)."""
        return counts_since(self, before)

    @property
    def draft_acceptance_rate(self) -> float:
        """The share of verified drafts accepted (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying step gives a request on average: its accepted drafts and the one
        token the target samples after them (0 before any)."""
        return 1 + self.num_accepted_tokens / self.num_verifications if self.num_verifications else 0.0


@dataclass(slots=True)
class SchedulerCounters:
    """What the scheduler reports of itself: queue lengths and KV blocks now, totals since it started."""

    num_waiting: int = 0
    num_running: int = 0
    num_draining: int = 0  # finished or preempted, a step still in flight: each still holds its row
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0  # holding a prefix cache entry, in use or free
    tokens_generated: int = 0  # output tokens of processed steps
    num_preemptions: int = 0
    prefix: PrefixCacheCounts = field(default_factory=PrefixCacheCounts)
    speculative: SpeculativeCounts = field(default_factory=SpeculativeCounts)

    @property
    def num_holding_rows(self) -> int:
        """Requests that hold a row: running, and draining."""
        return self.num_running + self.num_draining


@functools.cache
def _nested(cls: type) -> tuple[tuple[str, type | None], ...]:
    """Each field's name, with its counters type where it nests one (None for an int)."""
    types = typing.get_type_hints(cls)
    return tuple((f.name, types[f.name] if dataclasses.is_dataclass(types[f.name]) else None)
                 for f in dataclasses.fields(cls))


def num_counts(cls: type) -> int:
    """How many ints a counters struct of type `cls` holds, its nested ones included."""
    return sum(1 if nested is None else num_counts(nested) for _, nested in _nested(cls))


def to_ints(counts: object) -> list[int]:
    """The struct's ints in field order, nested structs flattened in place."""
    values: list[int] = []
    for name, nested in _nested(type(counts)):
        value = getattr(counts, name)
        values.extend([int(value)] if nested is None else to_ints(value))
    return values


def from_ints(cls: type[Counts], values: Sequence[int]) -> Counts:
    """The struct `to_ints` flattened into `values` (num_counts(cls) of them)."""
    if len(values) != num_counts(cls):
        raise ValueError(f"{cls.__name__} holds {num_counts(cls)} counts, got {len(values)}")
    fields, start = {}, 0
    for name, nested in _nested(cls):
        size = 1 if nested is None else num_counts(nested)
        fields[name] = int(values[start]) if nested is None else from_ints(nested, values[start:start + size])
        start += size
    return cls(**fields)


def counts_since(now: Counts, before: Counts) -> Counts:
    """What was counted between `before` and `now`, field by field (a count that fell started again from 0)."""
    rises = [value - then if value >= then else value for value, then in zip(to_ints(now), to_ints(before))]
    return from_ints(type(now), rises)
