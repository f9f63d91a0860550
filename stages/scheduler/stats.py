"""What the scheduler reports of itself: queue lengths, KV blocks, prefix hits, speculation."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerStats:
    num_waiting: int
    num_running: int
    num_draining: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_preemptions: int
    num_prefix_queried_tokens: int = 0  # tokens of admitted requests, each admission counted
    num_prefix_hit_tokens: int = 0  # of those, found in the prefix cache (not computed again)
    num_draft_tokens: int = 0  # speculative decoding: drafts verified
    num_accepted_tokens: int = 0  # of those, accepted
    num_verifications: int = 0  # (request, step) pairs that verified drafts

    @property
    def prefix_cache_hit_rate(self) -> float:
        """The share of admitted requests' tokens found in the prefix cache (0 before any)."""
        return self.num_prefix_hit_tokens / self.num_prefix_queried_tokens if self.num_prefix_queried_tokens else 0.0
