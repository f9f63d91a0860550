"""Which replica takes a request: prefix-aware with bounded load, round-robin, or least-load.

`prefix`: a request whose prompt has a full leading block goes to its key's replica on the
consistent-hash ring, unless that one has more than (1 + epsilon) times the mean outstanding
requests (then the next on the ring); a prompt with no full block goes to the replica with the
fewest outstanding requests. `round-robin` and `least-load` ignore the prompt; they exist to
compare against.
"""
from __future__ import annotations

from collections.abc import Collection
from enum import Enum

from pipeline.router.replicas import Replica, Replicas
from pipeline.router.ring import HashRing


class Policy(Enum):
    PREFIX = "prefix"
    ROUND_ROBIN = "round-robin"
    LEAST_LOAD = "least-load"


class Route(Enum):
    """How a request's replica was chosen, as the metrics count it."""

    PREFIX_OWNER = "prefix_owner"  # the key's own replica on the ring
    PREFIX_SPILL = "prefix_spill"  # the key's replica was over the load bound: the next one
    LEAST_LOAD = "least_load"
    ROUND_ROBIN = "round_robin"


class Router:
    """Chooses among the healthy replicas; the ring follows their health (`on_change`)."""

    def __init__(self, replicas: Replicas, policy: Policy, epsilon: float) -> None:
        if epsilon < 0:
            raise ValueError(f"the load bound's epsilon must be >= 0, got {epsilon}")
        self.replicas = replicas
        self.policy = policy
        self.epsilon = epsilon
        self.ring = HashRing()
        self._next = 0

    def on_change(self, url: str, healthy: bool) -> None:
        if healthy:
            self.ring.add(url)
        else:
            self.ring.remove(url)

    def choose(self, key: bytes | None, exclude: Collection[str] = ()) -> tuple[Replica, Route] | None:
        """A healthy replica not in `exclude`, and how it was chosen; None when there is none."""
        candidates = [r for r in self.replicas.healthy() if r.url not in exclude]
        if not candidates:
            return None
        if self.policy is Policy.ROUND_ROBIN:
            self._next += 1
            return candidates[self._next % len(candidates)], Route.ROUND_ROBIN
        if self.policy is Policy.PREFIX and key is not None:
            by_url = self.replicas.by_url
            allowed = {r.url for r in candidates}
            url = self.ring.choose(key, lambda u: by_url[u].outstanding, self.epsilon, allowed.__contains__)
            if url is not None:
                owner = next((u for u in self.ring.walk(key) if u in allowed), None)
                return by_url[url], Route.PREFIX_OWNER if url == owner else Route.PREFIX_SPILL
        return min(candidates, key=lambda r: (r.outstanding, r.num_requests)), Route.LEAST_LOAD
