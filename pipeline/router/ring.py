"""Consistent hashing with bounded loads: a key's replica is the first one clockwise on the ring
whose outstanding requests are within (1 + epsilon) times the mean (or below MIN_LOAD_BOUND).

Each replica holds `VNODES` points on a 64-bit ring, so a replica that leaves or joins moves only
its own share of the keys, and every router that knows the same replicas maps a key alike.
"""
from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Iterable

VNODES = 64  # points per replica: keeps the shares within a few percent of each other
# A member holding fewer requests than this is never passed over for load: near idle, the mean
# bound alone is 1 until the fleet holds two requests, so a key's second concurrent request
# would leave the replica that has its prefix (a lost cache hit, and no balance worth having).
MIN_LOAD_BOUND = 2


def point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """The ring of the replicas now in it, by name."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._points: list[int] = []
        self._owners: list[str] = []
        self._members: set[str] = set()
        for name in names:
            self.add(name)

    @property
    def members(self) -> set[str]:
        return set(self._members)

    def add(self, name: str) -> None:
        if name in self._members:
            return
        self._members.add(name)
        for i in range(VNODES):
            at = point(f"{name}#{i}".encode())
            index = bisect.bisect(self._points, at)
            self._points.insert(index, at)
            self._owners.insert(index, name)

    def remove(self, name: str) -> None:
        if name not in self._members:
            return
        self._members.discard(name)
        kept = [(p, o) for p, o in zip(self._points, self._owners) if o != name]
        self._points = [p for p, _ in kept]
        self._owners = [o for _, o in kept]

    def walk(self, key: bytes) -> list[str]:
        """Every member once, in ring order from the key's point."""
        if not self._points:
            return []
        start = bisect.bisect(self._points, point(key))
        order: list[str] = []
        for i in range(len(self._points)):
            owner = self._owners[(start + i) % len(self._points)]
            if owner not in order:
                order.append(owner)
                if len(order) == len(self._members):
                    break
        return order

    def choose(self, key: bytes, load: Callable[[str], int], epsilon: float,
               allowed: Callable[[str], bool] = lambda name: True) -> str | None:
        """The first allowed member from the key's point whose load, with this request added,
        stays within ceil((1 + epsilon) * mean load); None when no member is allowed."""
        members = [name for name in self.walk(key) if allowed(name)]
        if not members:
            return None
        bound = load_bound([load(name) for name in members], epsilon)
        for name in members:
            if load(name) + 1 <= bound:
                return name
        return min(members, key=load)  # not reached with epsilon >= 0: the least loaded is within the bound


def load_bound(loads: list[int], epsilon: float) -> int:
    """The most requests a member may hold with one more request placed: ceil((1 + epsilon) x the
    mean, this request counted), and never fewer than MIN_LOAD_BOUND."""
    return max(MIN_LOAD_BOUND, math.ceil((1 + epsilon) * (sum(loads) + 1) / len(loads)))
