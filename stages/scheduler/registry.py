"""Which requests the scheduler stage holds, which ended lately, and aborts that came early.

An abort may overtake its request (the request still in a tokenizer worker): it is kept and
applied when the request arrives. An abort may also come late, for a request that just ended
here but whose end the daemon has not seen yet: recently ended ids are remembered so such an
abort is recognised as late, not early, and dropped.
"""
from __future__ import annotations

from collections import deque

RECENTLY_ENDED = 4096  # ended requests remembered: far more than can end while an abort is in flight


class RequestRegistry:
    def __init__(self, recently_ended: int = RECENTLY_ENDED) -> None:
        self.live: set[int] = set()
        self._recently_ended: deque[int] = deque()
        self._recently_ended_set: set[int] = set()
        self._limit = recently_ended
        self.early_aborts: set[int] = set()

    def admit(self, req_id: int) -> bool:
        """A request arrived: True to run it, False if an early abort already ended it."""
        if req_id in self.early_aborts:
            self.early_aborts.discard(req_id)
            self.ended(req_id)
            return False
        self.live.add(req_id)
        return True

    def abort(self, req_id: int) -> bool:
        """An abort arrived: True if the request is live and must end now. Otherwise it is kept
        for the request's arrival, unless the request has ended already."""
        if req_id in self.live:
            self.ended(req_id)
            return True
        if req_id not in self._recently_ended_set:
            self.early_aborts.add(req_id)
        return False

    def ended(self, req_id: int) -> None:
        self.live.discard(req_id)
        self._recently_ended.append(req_id)
        self._recently_ended_set.add(req_id)
        if len(self._recently_ended) > self._limit:
            self._recently_ended_set.discard(self._recently_ended.popleft())
