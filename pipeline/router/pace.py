"""A replica's observed pace, and the deadlines it gives a silent stream from it (stall.py).

A replica's pace is the mean gap between two frames of one of its streams, learned from every
frame the router reads from it (an exponentially weighted mean, so a machine that gets busy
teaches it a slower pace within a few frames). Its deadline is `gaps` expected gaps, never less
than the floor (`--stall-timeout-s`): a replica under a silent stream must show a sign of life
within it. A stream silent for `limit` deadlines is taken for hung whatever the replica says.
"""
from __future__ import annotations

from dataclasses import dataclass

GAP_WEIGHT = 0.2  # a new gap's weight in the mean: about the last ten gaps count
DEADLINE_GAPS = 10.0  # a silence of this many expected gaps is worth a check
LIMIT_DEADLINES = 10.0  # a silence of this many deadlines is hung even while /health answers


@dataclass(slots=True)
class Pace:
    """The expected gap between two frames of one stream from a replica (None: none seen yet)."""

    gap_s: float | None = None

    def observe(self, gap_s: float) -> None:
        self.gap_s = gap_s if self.gap_s is None else self.gap_s + GAP_WEIGHT * (gap_s - self.gap_s)


@dataclass(frozen=True, slots=True)
class StallRule:
    floor_s: float  # no deadline is shorter
    gaps: float = DEADLINE_GAPS
    limit: float = LIMIT_DEADLINES

    def __post_init__(self) -> None:
        if not self.floor_s > 0:
            raise ValueError(f"the stall timeout must be a positive number of seconds, got {self.floor_s!r}")

    def deadline_s(self, pace: Pace) -> float:
        """How long a replica at `pace` may show no sign of life under a silent stream."""
        return self.floor_s if pace.gap_s is None else max(self.floor_s, self.gaps * pace.gap_s)

    def limit_s(self, pace: Pace) -> float:
        """How long a stream at `pace` may be silent at most, its replica alive or not."""
        return self.limit * self.deadline_s(pace)

    def describe(self, pace: Pace) -> str:
        """The expected pace and the deadline it gives, for a log line."""
        expected = "no frame seen yet" if pace.gap_s is None else f"a frame every {pace.gap_s:.3f} s"
        return (f"expected {expected}, so a deadline of {self.deadline_s(pace):.1f} s (the larger of "
                f"{self.floor_s:g} s and {self.gaps:g} gaps)")
