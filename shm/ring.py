"""A shared-memory ring's record format and its one writer, RingWriter; its readers, one per reader
index, are RingReaders (shm/ring_reader.py).

A record is `[u32 length | u32 kind | payload | pad to 8]` and is never split: when it does not
fit before the end of the data area, the writer marks the tail as skipped (a header whose
length is WRAP_LENGTH) and starts again at offset 0. Publishing is one int64 store of the write cursor after
the payload; consuming is one int64 store of the read cursor after the payload has been read.
With several readers (broadcast) every reader sees every record and the writer waits for the
slowest one.

Waiting spins for `spin_s`, then sleeps on a doorbell after raising a "sleeping" flag; the peer
rings only when it sees the flag. Every sleep is at most WAKE_S, after which the sleeper checks
that its peer is still alive, so a dead peer raises PeerDied instead of hanging.
"""
from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from typing import TypeVar

from shm.fence import PUBLISH_NEEDS_FENCE, full_fence, heavy_fence
from shm.segment import (
    READ_CURSOR, READER_CLOSED, READER_PID, READER_SLEEPING, WRITE_CURSOR, WRITER_CLOSED,
    WRITER_PID, WRITER_SLEEPING, RingSegment, reader_slot,
)

WRAP_LENGTH = 0xFFFF_FFFF  # never a payload length: segment capacity is at most 2 GiB
MAX_KIND = 0xFFFF_FFFF
RECORD_HEADER = struct.Struct("<II")  # payload length in bytes, kind
SPIN_S = 50e-6  # spin this long before sleeping: about one round trip's worth of work
WAKE_S = 0.25  # the longest single sleep: bounds how late a dead peer is noticed (and idle wake-ups)
_UNSET = -1.0


class RingTimeout(TimeoutError):
    """A write found the ring full for its whole timeout."""


class RecordTooLarge(ValueError):
    """A record can never fit in the ring, however empty."""


class RingClosed(EOFError):
    """The writer closed and every record was read, or (for the writer) every reader closed."""


@dataclass(slots=True)
class Record:
    """One record. `payload` views the ring itself: valid until the reader's next read or release."""

    kind: int
    payload: memoryview


def _nbytes(part: object) -> int:
    return len(part) if type(part) is bytes else memoryview(part).nbytes


def _check_kind(kind: int) -> None:
    if not 0 <= kind <= MAX_KIND:
        raise ValueError(f"record kind must be in [0, {MAX_KIND}], got {kind}")


def _now() -> float:
    return time.monotonic()


End = TypeVar("End", bound="RingEnd")


class RingEnd:
    """What either end of a ring holds of its segment, and how it is closed by `with`."""

    def __init__(self, segment: RingSegment, spin_s: float) -> None:
        self._seg = segment
        self._mm = segment.mm
        self._slots = segment.slots
        self._data = segment.data
        self._cap = segment.capacity_bytes
        self._base = segment.data_offset
        self._spin_s = spin_s

    @property
    def name(self) -> str:
        return self._seg.name

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: End) -> End:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RingWriter(RingEnd):
    """The one writer of a ring. `write` copies parts in; `reserve`/`commit` fill in place."""

    def __init__(self, segment: RingSegment, *, spin_s: float = SPIN_S, replaceable: bool = False) -> None:
        segment.claim(WRITER_PID, "writer", replaceable=replaceable)
        super().__init__(segment, spin_s)
        self._pack = RECORD_HEADER.pack_into
        self._w = self._slots[WRITE_CURSOR]
        self._end = self._w  # cursor after the claimed record, published by _publish
        self._reserved = False
        self._readers = [(reader_slot(i, READ_CURSOR), reader_slot(i, READER_CLOSED), reader_slot(i, READER_PID))
                         for i in range(segment.num_readers)]
        self._wakeups = [(reader_slot(i, READER_SLEEPING), bell) for i, bell in enumerate(segment.data_bells)]
        self._one_reader = segment.num_readers == 1
        self._flag_slot, self._bell = self._wakeups[0]
        self._limit = 0
        self._refresh_limit()

    @classmethod
    def attach(cls, name: str, *, spin_s: float = SPIN_S, replaceable: bool = False) -> RingWriter:
        """Open ring `name` (made by RingSegment.create, maybe in another process) as its writer;
        `replaceable`: see shm/segment.py."""
        segment = RingSegment.open(name)
        try:
            return cls(segment, spin_s=spin_s, replaceable=replaceable)
        except BaseException:
            segment.close()
            raise

    @property
    def capacity_bytes(self) -> int:
        return self._cap

    @property
    def max_payload_bytes(self) -> int:
        return self._cap - RECORD_HEADER.size

    def write(self, kind: int, *parts: object, timeout: float | None = None) -> None:
        """Append one record whose payload is `parts` (bytes-like, C-contiguous) back to back.

        Blocks while the ring is full, up to `timeout` seconds (None: as long as the readers
        live); raises RingTimeout, PeerDied, RecordTooLarge or RingClosed.
        """
        if len(parts) != 1 or self._reserved:
            self._write_parts(kind, parts, timeout)
            return
        # The one-part case is the hot path: _claim and _publish are inlined by hand.
        part = parts[0]
        num_bytes = len(part) if type(part) is bytes else memoryview(part).nbytes
        need = (num_bytes + 15) & -8  # 8-byte header plus the payload padded to 8
        w = self._w
        pos = w % self._cap
        if need > self._cap - pos or w + need > self._limit:
            pos = self._make_room(need, timeout)
            w = self._w
        mm = self._mm
        offset = self._base + pos
        try:
            self._pack(mm, offset, num_bytes, kind)
        except struct.error:
            _check_kind(kind)
            raise
        mm[offset + 8:offset + 8 + num_bytes] = part
        w += need
        self._w = w
        slots = self._slots
        slots[WRITE_CURSOR] = w  # the publishing store: payload bytes are already there
        if PUBLISH_NEEDS_FENCE:
            full_fence()  # see shm/fence.py
        if self._one_reader:
            if slots[self._flag_slot]:
                self._bell.ring()
        else:
            self._wake_readers()

    def _write_parts(self, kind: int, parts: tuple[object, ...], timeout: float | None) -> None:
        if self._reserved:
            raise RuntimeError(f"ring {self._seg.name!r}: commit() the reserved record before writing another")
        num_bytes = 0
        for part in parts:
            num_bytes += _nbytes(part)
        offset = self._claim(kind, num_bytes, timeout)
        mm = self._mm
        for part in parts:
            part_bytes = _nbytes(part)
            mm[offset:offset + part_bytes] = part
            offset += part_bytes
        self._publish()

    def reserve(self, kind: int, num_bytes: int, timeout: float | None = None) -> memoryview:
        """Claim room for a `num_bytes` payload and return a writable view of it; the record is
        invisible to readers until commit(). Blocks and raises like write()."""
        if self._reserved:
            raise RuntimeError(f"ring {self._seg.name!r}: commit() the reserved record before reserving another")
        if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes < 0:
            raise ValueError(f"num_bytes must be a non-negative int, got {num_bytes!r}")
        offset = self._claim(kind, num_bytes, timeout)
        self._reserved = True
        return self._data[offset:offset + num_bytes]

    def abort(self) -> None:
        """Drop the record returned by the last reserve(); readers never see it."""
        self._reserved = False

    def commit(self) -> None:
        """Publish the record returned by the last reserve()."""
        if not self._reserved:
            raise RuntimeError(f"ring {self._seg.name!r}: commit() without reserve()")
        self._reserved = False
        self._publish()

    def _claim(self, kind: int, num_bytes: int, timeout: float | None) -> int:
        """Make room for a record, write its header; return the payload's offset in the mapping."""
        _check_kind(kind)
        need = (num_bytes + 15) & -8  # 8-byte header plus the payload padded to 8
        w = self._w
        pos = w % self._cap
        if need > self._cap - pos or w + need > self._limit:
            pos = self._make_room(need, timeout)
            w = self._w
        self._pack(self._mm, self._base + pos, num_bytes, kind)
        self._end = w + need
        return self._base + pos + 8

    def _publish(self) -> None:
        slots = self._slots
        self._w = self._end
        slots[WRITE_CURSOR] = self._end  # the publishing store: payload bytes are already there
        if PUBLISH_NEEDS_FENCE:
            full_fence()  # see shm/fence.py
        self._wake_readers()

    def _wake_readers(self) -> None:
        slots = self._slots
        for flag_slot, bell in self._wakeups:
            if slots[flag_slot]:
                bell.ring()

    def _make_room(self, need: int, timeout: float | None) -> int:
        """Slow path of _claim: wrap at the end of the data area and wait for free space."""
        cap = self._cap
        w = self._w
        pos = w % cap
        tail = cap - pos
        deadline = _UNSET
        if need > tail:
            if need > cap:
                raise RecordTooLarge(
                    f"record payload of {need - 8} bytes (padded) exceeds ring {self._seg.name!r}: "
                    f"at most {self.max_payload_bytes} bytes fit in its {cap}-byte data area"
                )
            deadline = self._wait_space(w + tail, timeout, deadline)
            self._pack(self._mm, self._base + pos, WRAP_LENGTH, 0)
            self._end = w + tail
            self._publish()  # so readers free the tail while we wait for room at the start
            w = self._w
            pos = 0
        if w + need > self._limit:
            self._wait_space(w + need, timeout, deadline)
        return pos

    def _refresh_limit(self) -> int:
        """Reload the read cursors: the writer may fill up to the slowest open reader + capacity."""
        slots = self._slots
        slowest = None
        for cursor_slot, closed_slot, _ in self._readers:
            if not slots[closed_slot]:
                r = slots[cursor_slot]
                if slowest is None or r < slowest:
                    slowest = r
        if slowest is None:
            raise RingClosed(f"ring {self._seg.name!r}: every reader closed")
        self._limit = slowest + self._cap
        return self._limit

    def _check_readers(self) -> None:
        for index, (_, closed_slot, pid_slot) in enumerate(self._readers):
            if not self._slots[closed_slot]:
                self._seg.check_peer(pid_slot, f"reader {index}")

    def _wait_space(self, end: int, timeout: float | None, deadline: float) -> float:
        """Wait until the cursor may advance to `end`; return the deadline for a later wait."""
        if self._refresh_limit() >= end:
            return deadline
        if deadline == _UNSET:
            deadline = float("inf") if timeout is None else _now() + timeout
        spin_end = min(_now() + self._spin_s, deadline)
        while _now() < spin_end:
            if self._refresh_limit() >= end:
                return deadline
        slots = self._slots
        while True:
            slots[WRITER_SLEEPING] = 1
            heavy_fence()  # readers see our flag, or we see their cursors (shm/fence.py)
            if self._refresh_limit() >= end:
                slots[WRITER_SLEEPING] = 0
                return deadline
            left = deadline - _now()
            if left <= 0:
                slots[WRITER_SLEEPING] = 0
                raise RingTimeout(f"ring {self._seg.name!r} stayed full for {timeout} s")
            rung = self._seg.space_bell.wait(min(WAKE_S, left))
            slots[WRITER_SLEEPING] = 0
            if self._refresh_limit() >= end:
                return deadline
            if not rung:
                self._check_readers()

    def close(self) -> None:
        """Tell readers no record follows (they drain, then get RingClosed) and unmap."""
        slots = self._slots
        slots[WRITER_CLOSED] = 1
        if PUBLISH_NEEDS_FENCE:
            full_fence()
        self._wake_readers()
        self._seg.close()

