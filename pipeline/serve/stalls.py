"""Whether a live stage is hung: judged against its progress and the pace the stages have shown.

Death is a fact, not a guess: a stage that exited is known by its exit status or its pid
(pipeline/engine/supervision.py), and only that restarts stages or counts for the poison guard.
Time only judges a stage that lives: it is hung when its loop has not gone round (its heartbeat
on the status board) for longer than the stages' own recent pace allows. The pace is the longest
gap between two beats of any stage seen in the last PACE_WINDOW_S; the limit is PACE_FACTOR times
that, and never less than the daemon's --stall-seconds (a floor: on a quiet machine the idle
stages beat every IDLE_TICK_S and the floor decides). On a busy machine every stage beats late,
the gaps grow, and the limit grows with them, so a slow stage is not taken for a hung one; a
stage that stops going round while the others keep their pace is.

A stall verdict is reported (health says degraded, the verdicts are counted apart from deaths,
and each is logged with the pace expected and the pace seen); it restarts nothing and is no
crash for the guard. The supervisor's thread looks every LIVENESS_CHECK_S, health when asked.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable

from pipeline.engine.backend import StageHealth

log = logging.getLogger("pipeline.serve.stalls")

PACE_FACTOR = 2.0  # a live stage may take this many times the slowest recent beat gap
PACE_WINDOW_S = 60.0  # the gaps the pace is taken from: a busy spell long past no longer counts


class StallJudge:
    """Takes a live stage for hung past its pace-adapted limit; counts and logs each verdict.
    `observe` may be called from any thread."""

    def __init__(self, floor_s: float, factor: float = PACE_FACTOR, window_s: float = PACE_WINDOW_S) -> None:
        self.floor_s = floor_s
        self._factor = factor
        self._window_s = window_s
        self._lock = threading.Lock()
        self._longest_age: dict[tuple[str, int], float] = {}  # (stage, pid) -> its longest age since its last beat
        self._gaps: deque[tuple[float, float]] = deque()  # (seen at, gap between beats), the last window_s
        self._hung: dict[tuple[str, int], str] = {}  # (stage, pid) -> why it is taken for hung
        self.num_verdicts = 0

    def pace_s(self, now_s: float) -> float:
        """The longest gap between two beats of a stage seen in the last window (0: none seen)."""
        while self._gaps and now_s - self._gaps[0][0] > self._window_s:
            self._gaps.popleft()
        return max((gap for _, gap in self._gaps), default=0.0)

    def limit_s(self, now_s: float) -> float:
        """How long a live stage may go without a beat before it is taken for hung."""
        return max(self.floor_s, self._factor * self.pace_s(now_s))

    def observe(self, stages: Iterable[StageHealth], now_s: float | None = None) -> dict[str, str]:
        """Looks at the stages' heartbeats: learns the pace from those that beat again, gives a
        verdict on a live stage past the limit (counted once per hang). Returns the stages taken
        for hung now, each with why."""
        now_s = time.monotonic() if now_s is None else now_s
        with self._lock:
            current = set()
            for stage in stages:
                key = (stage.name, stage.pid)
                current.add(key)
                if not stage.alive or stage.heartbeat_age_s == float("inf"):
                    self._hung.pop(key, None)  # dead is not hung (the supervisor knows it), nor is a stage not begun
                    continue
                longest = self._longest_age.get(key, 0.0)
                if stage.heartbeat_age_s < longest:  # it beat since: the gap was at least `longest`
                    self._gaps.append((now_s, longest))
                    if (why := self._hung.pop(key, None)) is not None:
                        log.warning("stage %r went round again after %.1f s: slow, not dead (was: %s)",
                                    stage.name, longest, why)
                self._longest_age[key] = stage.heartbeat_age_s
                self._judge(key, stage.heartbeat_age_s, now_s)
            for key in set(self._longest_age) - current:  # restarted or gone: its pid is another's now
                self._longest_age.pop(key)
                self._hung.pop(key, None)
            return {name: why for (name, _), why in self._hung.items()}

    def _judge(self, key: tuple[str, int], age_s: float, now_s: float) -> None:
        limit_s = self.limit_s(now_s)
        if age_s <= limit_s or key in self._hung:
            return
        pace_s = self.pace_s(now_s)
        why = (f"stage {key[0]!r} has not gone round its loop for {age_s:.1f} s (stall limit {limit_s:.3g} s: "
               f"{self._factor:g} x the slowest gap between beats in the last {self._window_s:g} s, {pace_s:.2f} s, "
               f"at least --stall-seconds {self.floor_s:g} s)")
        self._hung[key] = why
        self.num_verdicts += 1
        log.warning("stall verdict on stage %r: expected pace: a beat at least every %.2f s (the slowest gap lately "
                    "%.2f s x %g, floor %g s); seen: no beat for %.1f s. The stage lives: nothing restarts",
                    key[0], limit_s, pace_s, self._factor, self.floor_s, age_s)
