"""Which replica takes a request: prefix-aware with bounded load, round-robin, or least-load.

`prefix`: a request whose prompt has a full leading block goes where its KV most likely is: the
replica that served the longest prefix of it the router remembers (a block hash of the key, see
prefix.py), else the key's replica on the consistent-hash ring; either only while it holds no
more than ceil((1 + epsilon) x the mean) outstanding requests, this one counted, or fewer than
MIN_LOAD_BOUND (ring.py) (else the next on the ring). Remembering where each prefix went keeps a
conversation whose turn once spilled over on the replica that now holds its history, and the
longest one tells apart conversations that share their first blocks. A prompt with no full block
goes to the replica with the fewest outstanding requests. `round-robin` and `least-load` ignore
the prompt; they exist to compare against.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from enum import Enum

from pipeline.router.prefix import RouteKey
from pipeline.router.replicas import Replica, Replicas
from pipeline.router.ring import HashRing, load_bound

MAX_REMEMBERED_BLOCKS = 1 << 18  # block hashes whose last replica is remembered, least recently used forgotten first


class Policy(Enum):
    PREFIX = "prefix"
    ROUND_ROBIN = "round-robin"
    LEAST_LOAD = "least-load"


class Route(Enum):
    """How a request's replica was chosen, as the metrics count it."""

    PREFIX_OWNER = "prefix_owner"  # where the key's KV is: the replica that served its longest prefix, or its ring owner
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
        self._last_replica: OrderedDict[bytes, str] = OrderedDict()  # block hash -> the replica that served it last

    def on_change(self, url: str, healthy: bool) -> None:
        if healthy:
            self.ring.add(url)
        else:
            self.ring.remove(url)

    def choose(self, key: RouteKey | None, exclude: Collection[str] = ()) -> tuple[Replica, Route] | None:
        """A healthy replica not in `exclude`, and how it was chosen; None when there is none."""
        candidates = [r for r in self.replicas.healthy() if r.url not in exclude]
        if not candidates:
            return None
        if self.policy is Policy.ROUND_ROBIN:
            self._next += 1
            return candidates[self._next % len(candidates)], Route.ROUND_ROBIN
        if self.policy is Policy.PREFIX and key is not None:
            chosen = self._by_prefix(key, candidates)
            if chosen is not None:
                remembered = self._last_replica
                for block in key.blocks:  # this prompt's every prefix now lives there
                    remembered[block] = chosen[0].url
                    remembered.move_to_end(block)
                while len(remembered) > MAX_REMEMBERED_BLOCKS:
                    remembered.popitem(last=False)
                return chosen
        return min(candidates, key=lambda r: (r.outstanding, r.num_requests)), Route.LEAST_LOAD

    def _by_prefix(self, key: RouteKey, candidates: list[Replica]) -> tuple[Replica, Route] | None:
        by_url = self.replicas.by_url
        allowed = {r.url for r in candidates}
        last = next((url for block in reversed(key.blocks) if (url := self._last_replica.get(block)) is not None),
                    None)  # where the longest prefix the router remembers went
        if last in allowed and by_url[last].outstanding + 1 <= load_bound([r.outstanding for r in candidates],
                                                                          self.epsilon):
            return by_url[last], Route.PREFIX_OWNER
        url = self.ring.choose(key.ring, lambda u: by_url[u].outstanding, self.epsilon, allowed.__contains__)
        if url is None:
            return None
        owner = next((u for u in self.ring.walk(key.ring) if u in allowed), None)
        return by_url[url], Route.PREFIX_OWNER if url == owner else Route.PREFIX_SPILL
